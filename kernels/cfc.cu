// CfC kernels. Shapes up to `large`'s (C ≤ 128, K ≤ 256) run the register tiles: a block holds its share of the
// recurrent weights in registers for the whole window, `small`'s all of them in one block and `large`'s split over a
// cluster of four that exchange each phase's outputs through distributed shared memory. Each phase is a mat-vec
// where a thread owns R rows × a slice of the inputs for all of the block's sequences: it reads the inputs from
// shared memory as float4 broadcasts, and the lanes of its group sum their partial dot products with a
// reduce-scatter of shuffles (no selects: each lane holds its rows in its own XOR order); two barriers a step. A step
// is latency- and issue-bound (about 60% of issue slots used with two warps a scheduler): splitting a block's
// sequences into halves that overlap each other's reductions measured slower, since every lane then runs a
// reduction, nonlinearity and stores per half. Larger shapes run the general kernels: three barrier-separated
// phases a step, a thread per output, weights in shared memory when they fit. Under the `tf32` precision `small`'s
// shape runs on the TF32 tensor cores instead (namespace mma below): mma's eight columns hold the block's sequences,
// repeated, and the float32 FFMA tiles stay the float32-accurate path.
#include "kernels/cfc.h"

#include <algorithm>

#include <cooperative_groups.h>

#include "kernels/common.cuh"
#include "kernels/tf32x3.cuh"

namespace perception::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr unsigned kFullMask = 0xffffffffu;

// One mat-vec phase of a tile: a thread owns kR rows × kN inputs, kG lanes share a group of rows (the group's
// inputs split over them), and input e of lane g is float e % 4 of float4 (e / 4)·kG + g: consecutive lanes read
// consecutive float4s. More rows a thread means fewer shared-memory reads per multiply-add, fewer rows means fewer
// shuffles in the reduction. The reduction leaves kW consecutive rows (a unit's four heads) together on one lane.
//
// Each lane holds its rows (and sequences) in an order of its own, the natural one XOR the index of the value the
// lane ends the reduction with (RowMask, SeqMask): then at every step of the reduce-scatter a lane keeps the first
// half of its values and sends the second, the same registers on every lane, with no selects (a lane that kept the
// upper half in the natural order now holds it first). The sums are the same as in the natural order, term for
// term. The packing puts register row r's weights of row PackedRow(tid, r) there.
template <int kThreads, int kRows, int kInputs, int kRowsPerThread, int kWidth = 1>
struct TilePhase {
  static constexpr int kR = kRowsPerThread, kW = kWidth, kG = kThreads * kR / kRows, kN = kInputs / kG;
  static constexpr int kGroups = kR / kW;  // a thread's groups of kW rows, each of which ends on one lane
  static_assert(kThreads * kR % kRows == 0 && kG <= kWarpSize && kN % 4 == 0 && kN * kG == kInputs);
  static_assert(kR % kW == 0 && kGroups <= kG);
  __host__ __device__ static constexpr int Row(int tid, int r) { return tid / kG * kR + r; }
  __host__ __device__ static constexpr int Input(int tid, int e) { return (e / 4 * kG + tid % kG) * 4 + e % 4; }
  __host__ __device__ static constexpr int RowMask(int tid) { return tid % kG / (kG / kGroups) * kW; }
  __host__ __device__ static constexpr int PackedRow(int tid, int r) { return Row(tid, r ^ RowMask(tid)); }
  template <int kSeqs>
  __host__ __device__ static constexpr int SeqMask(int tid) {
    return tid % kG / (kG / (kGroups * kSeqs)) % kSeqs;
  }
};

// Capacities C ≤ kUnits and K ≤ kBackbone (the weights are zero-padded up to them, so padded units and rows stay 0),
// rows split over kCluster blocks of kThreads, each thread holding 5·kUnits·kBackbone / (kCluster·kThreads) weights
// and up to kMaxSeqs sequences' accumulators in its registers. R, the rows a thread of each phase, balances the
// instructions issued (multiply-adds, the reduction's shuffles) against the shared-memory pipe (float4 reads,
// shuffles); picked by counting both and measuring on the H200 (small: the heads' R of 4 no faster than 8 with the
// XOR-ordered reductions; W_headsᵀ/W_cᵀ's 4/2 slower than 8/4 before them).
template <int kUnitsCap, int kBackboneCap, int kClusterSize, int kThreadsPerBlock, int kMaxSeqsPerBlock, int kRWc,
          int kRHeads, int kRHeadsT, int kRWcT>
struct CfcTile {
  static constexpr int kUnits = kUnitsCap, kBackbone = kBackboneCap, kCluster = kClusterSize;
  static constexpr int kThreads = kThreadsPerBlock, kMaxSeqs = kMaxSeqsPerBlock;
  static constexpr int kRows = kBackbone / kCluster;   // backbone rows (outputs of W_c and of W_headsᵀ) of a block
  static constexpr int kOwnUnits = kUnits / kCluster;  // units (outputs of the heads and of W_cᵀ) of a block
  // Forward: W_c, then the heads with whole units' four heads a thread (rows u·4 + head, u the unit's index).
  using Wc = TilePhase<kThreads, kRows, kUnits, kRWc>;
  using Heads = TilePhase<kThreads, 4 * kOwnUnits, kBackbone, kRHeads, 4>;
  // Backward: W_headsᵀ (inputs h·kUnits + unit), then W_cᵀ.
  using HeadsT = TilePhase<kThreads, kRows, 4 * kUnits, kRHeadsT>;
  using WcT = TilePhase<kThreads, kOwnUnits, kBackbone, kRWcT>;
  static constexpr int kForwardSlots = Wc::kR * Wc::kN + Heads::kR * Heads::kN;
  static constexpr int kBackwardSlots = HeadsT::kR * HeadsT::kN + WcT::kR * WcT::kN;
  // Packed: for each block rank, [forward slots][thread] then [backward slots][thread]; then the biases [4][kUnits].
  static constexpr size_t kBiasOffset = static_cast<size_t>(kCluster) * (kForwardSlots + kBackwardSlots) * kThreads;
  static constexpr size_t kPackedFloats = kBiasOffset + 4 * kUnits;
};
// 256 threads of 160 weights each: a step is bound by instruction issue, and twice the rows a thread of 512 threads
// halves the per-warp reductions, nonlinearities and stores (H200, `small`: forward 95.7 -> 75.4 µs, backward
// 82.7 -> 67.2 µs; `large`: 1.12 -> 0.73 ms, 1.00 -> 0.80 ms). `large` takes up to four sequences a cluster: only 30
// clusters of four fit on an H200.
using SmallTile = CfcTile<64, 128, 1, 256, 2, 4, 8, 8, 4>;
using LargeTile = CfcTile<128, 256, 4, 256, 4, 4, 8, 8, 4>;

template <typename Tile>
bool Fits(const CfcShape& s) {
  return s.units <= Tile::kUnits && s.backbone <= Tile::kBackbone;
}

template <typename Tile>
__global__ void CfcPackTileKernel(CfcWeights w, CfcShape shape, float* packed) {
  using Wc = typename Tile::Wc;
  using Heads = typename Tile::Heads;
  using HeadsT = typename Tile::HeadsT;
  using WcT = typename Tile::WcT;
  const int C = shape.units, K = shape.backbone, in = shape.d_model + C;
  auto wc = [&](int k, int unit) {
    return k < K && unit < C ? w.backbone_weight[static_cast<size_t>(k) * in + shape.d_model + unit] : 0.f;
  };
  auto head = [&](int h, int unit, int k) {
    return unit < C && k < K ? w.head_weight[h][static_cast<size_t>(unit) * K + k] : 0.f;
  };
  constexpr int kSlots = Tile::kForwardSlots + Tile::kBackwardSlots;
  constexpr int kWc = Wc::kR * Wc::kN, kHeads = Heads::kR * Heads::kN, kHeadsT = HeadsT::kR * HeadsT::kN;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < Tile::kPackedFloats;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v;
    if (i >= Tile::kBiasOffset) {
      const int j = static_cast<int>(i - Tile::kBiasOffset), unit = j % Tile::kUnits;
      v = unit < C ? w.head_bias[j / Tile::kUnits][unit] : 0.f;
    } else {
      const int tid = static_cast<int>(i % Tile::kThreads), slot = static_cast<int>(i / Tile::kThreads % kSlots);
      const int rank = static_cast<int>(i / Tile::kThreads / kSlots);
      if (slot < kWc) {
        v = wc(rank * Tile::kRows + Wc::PackedRow(tid, slot / Wc::kN), Wc::Input(tid, slot % Wc::kN));
      } else if (slot < Tile::kForwardSlots) {
        const int s = slot - kWc, r = Heads::PackedRow(tid, s / Heads::kN);
        v = head(r % 4, rank * Tile::kOwnUnits + r / 4, Heads::Input(tid, s % Heads::kN));
      } else if (slot < Tile::kForwardSlots + kHeadsT) {
        const int s = slot - Tile::kForwardSlots, j = HeadsT::Input(tid, s % HeadsT::kN);
        v = head(j / Tile::kUnits, j % Tile::kUnits, rank * Tile::kRows + HeadsT::PackedRow(tid, s / HeadsT::kN));
      } else {
        const int s = slot - Tile::kForwardSlots - kHeadsT;
        v = wc(WcT::Input(tid, s % WcT::kN), rank * Tile::kOwnUnits + WcT::PackedRow(tid, s / WcT::kN));
      }
    }
    packed[i] = v;
  }
}

// Sums v (V groups of W floats) over a group of G contiguous lanes (G a power of two, V ≤ G), each lane holding the
// groups in the order of TilePhase's masks, and leaves the total of group g / (G / V) in out: the first log2(V)
// butterfly steps each hand half of the values to the partner, so they cost (V − 1 + log2(G / V))·W shuffles
// instead of V·W·log2(G). Lanes holding the same total hold the same bits (a + b == b + a).
template <int V, int W, int G>
__device__ __forceinline__ void GroupReduceScatter(float (&v)[V * W], float (&out)[W]) {
  static_assert(V <= G && (V & (V - 1)) == 0 && (G & (G - 1)) == 0);
  if constexpr (G == 1) {
#pragma unroll
    for (int w = 0; w < W; ++w) out[w] = v[w];
  } else if constexpr (V == 1) {
#pragma unroll
    for (int w = 0; w < W; ++w) v[w] += __shfl_xor_sync(kFullMask, v[w], G / 2);
    GroupReduceScatter<1, W, G / 2>(v, out);
  } else {
    constexpr int H = V / 2 * W;
    float next[H];
#pragma unroll
    for (int i = 0; i < H; ++i) next[i] = v[i] + __shfl_xor_sync(kFullMask, v[H + i], G / 2);
    GroupReduceScatter<V / 2, W, G / 2>(next, out);
  }
}

// A phase's mat-vec for S sequences, in as rows of `stride` float4s: acc[(r / W·S + s)·W + r % W] =
// Σ_e w[r][e]·in[s ^ SeqMask][Input(e)], w[r] holding row PackedRow(r) — the groups the reduce-scatter splits, with
// the sequences as their lowest index bits so that the rows' order does not depend on S.
template <typename Phase, int S>
__device__ __forceinline__ void TileDot(const float (&w)[Phase::kR][Phase::kN], const float4* in, int stride,
                                        float (&acc)[S * Phase::kR]) {
  static_assert(S * Phase::kGroups <= Phase::kG);
  constexpr int kW = Phase::kW;
  const float4* lane_in[S];
  const int seq_mask = Phase::template SeqMask<S>(threadIdx.x);
#pragma unroll
  for (int s = 0; s < S; ++s) lane_in[s] = in + (s ^ seq_mask) * stride + threadIdx.x % Phase::kG;
#pragma unroll
  for (int i = 0; i < S * Phase::kR; ++i) acc[i] = 0.f;
#pragma unroll
  for (int q = 0; q < Phase::kN / 4; ++q) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const float4 x = lane_in[s][q * Phase::kG];
#pragma unroll
      for (int r = 0; r < Phase::kR; ++r) {
        float& a = acc[(r / kW * S + s) * kW + r % kW];
        a = fmaf(w[r][4 * q], x.x, a);
        a = fmaf(w[r][4 * q + 1], x.y, a);
        a = fmaf(w[r][4 * q + 2], x.z, a);
        a = fmaf(w[r][4 * q + 3], x.w, a);
      }
    }
  }
}

// The reduce-scatter of a phase's products.
template <typename Phase, int S>
__device__ __forceinline__ void TileReduce(float (&acc)[S * Phase::kR], float (&out)[Phase::kW]) {
  GroupReduceScatter<S * Phase::kGroups, Phase::kW, Phase::kG>(acc, out);
}

template <int kThreads, int R, int N>
__device__ __forceinline__ void LoadSlots(const float* packed, int slot0, float (&w)[R][N]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int e = 0; e < N; ++e) w[r][e] = packed[static_cast<size_t>(slot0 + r * N + e) * kThreads];
  }
}

// Where a thread's reduced total sits: sequence seq, row `row` of the phase (of this block), copy `copy` of
// `copies` lanes that hold the same bits.
struct TileValue {
  int seq, row, copy, copies;
};
template <typename Phase, int S>
__device__ __forceinline__ TileValue TileValueOf(int tid) {
  constexpr int kValues = S * Phase::kGroups, kCopies = Phase::kG / kValues;
  const int g = tid % Phase::kG, value = g / kCopies;
  return {value % S, Phase::Row(tid, value / S * Phase::kW), g % kCopies, kCopies};
}

template <int kCluster>
__device__ __forceinline__ int ClusterRank() {
  if constexpr (kCluster == 1) {
    return 0;
  } else {
    return static_cast<int>(cg::this_cluster().block_rank());
  }
}

// Every block of the cluster has finished the phase and its shared-memory stores are visible.
template <int kCluster>
__device__ __forceinline__ void PhaseBarrier() {
  if constexpr (kCluster == 1) {
    __syncthreads();
  } else {
    cg::this_cluster().sync();
  }
}

// Stores v at `at` in every block of the cluster, the stores shared by the copies of the value.
template <int kCluster>
__device__ __forceinline__ void StoreToCluster(float* at, float v, const TileValue& where) {
  if constexpr (kCluster == 1) {
    if (where.copy == 0) *at = v;
  } else {
    // 32-bit shared::cluster addresses: the generic pointers of map_shared_rank cost registers the weights need.
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(at));
    for (int r = where.copy; r < kCluster; r += where.copies) {
      unsigned remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r));
      asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
    }
  }
}

template <typename Tile, int kSeqs>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    CfcForwardTileKernel(CfcShape shape, const float* packed, const float* u, const float* dt, const float* state_in,
                         CfcActivations act, float* state_out) {
  using Wc = typename Tile::Wc;
  using Heads = typename Tile::Heads;
  constexpr int kC = Tile::kUnits, kK = Tile::kBackbone;
  __shared__ __align__(16) float c[kSeqs][kC];  // c_{t−1}, then c_t
  __shared__ __align__(16) float bb[kSeqs][kK];
  const int B = shape.batch, T = shape.window, C = shape.units, K = shape.backbone, tid = threadIdx.x;
  const int rank = ClusterRank<Tile::kCluster>(), seq0 = blockIdx.x / Tile::kCluster * kSeqs;
  const float* mine = packed + static_cast<size_t>(rank) * (Tile::kForwardSlots + Tile::kBackwardSlots) * Tile::kThreads + tid;
  float wc[Wc::kR][Wc::kN], wh[Heads::kR][Heads::kN];
  LoadSlots<Tile::kThreads>(mine, 0, wc);
  LoadSlots<Tile::kThreads>(mine, Wc::kR * Wc::kN, wh);
  // This thread ends the W_c phase with bb of sequence seq0 + at_k.seq, row k.
  const TileValue at_k = TileValueOf<Wc, kSeqs>(tid);
  const int k = rank * Tile::kRows + at_k.row, seq_k = seq0 + at_k.seq;
  const bool k_writer = k < K && seq_k < B && at_k.copy == 0;
  // It ends the heads phase with the four heads of sequence seq0 + at_i.seq, unit i.
  const TileValue at_i = TileValueOf<Heads, kSeqs>(tid);
  const int i = rank * Tile::kOwnUnits + at_i.row / 4, seq_i = seq0 + at_i.seq;
  const bool i_writer = i < C && seq_i < B && at_i.copy == 0;
  // Its rows at step 0. Loads are clamped into the tensors (a padded row or sequence reads a real one and stores
  // nothing) and a step's stores share one predicate, so no branch cuts a phase's tail into pieces.
  const size_t row_k = static_cast<size_t>(seq_k) * T, row_i = static_cast<size_t>(seq_i) * T;
  const size_t load_i = static_cast<size_t>(min(seq_i, B - 1));
  const float* u_at = u + static_cast<size_t>(min(seq_k, B - 1)) * T * K + min(k, K - 1);
  const float* dt_at = dt + load_i * T;
  float* bb_pre_at = act.bb_pre + row_k * K + k;
  float* bb_at = act.bb + row_k * K + k;
  float* gates_at = act.gates + row_i * 3 * C + i;
  float* c_prev_at = act.c_prev + row_i * C + i;
  float* c_at = act.c + row_i * act.ldc + i;
  float bias[4];
#pragma unroll
  for (int h = 0; h < 4; ++h) bias[h] = packed[Tile::kBiasOffset + h * kC + i];
  // The forward's chain (engine/cuda_model.cc): this kernel launches plain, behind a join with the stream that packs
  // its weights, and lets the product after it launch early (kernels/common.cuh).
  LetNextKernelLaunch();
  float c_own = state_in ? state_in[load_i * C + min(i, C - 1)] : 0.f;
  for (int j = tid; j < kSeqs * kC; j += Tile::kThreads) {
    const int s = j / kC, unit = j % kC;
    c[s][unit] = seq0 + s < B && unit < C && state_in ? state_in[static_cast<size_t>(seq0 + s) * C + unit] : 0.f;
  }
  float u_next = u_at[0], dt_next = dt_at[0];
  PhaseBarrier<Tile::kCluster>();  // also: every block runs before the first distributed store
  for (int t = 0; t < T; ++t) {
    const int next_t = min(t + 1, T - 1);
    {
      float acc[kSeqs * Wc::kR], pre[1];
      TileDot<Wc, kSeqs>(wc, reinterpret_cast<const float4*>(&c[0][0]), kC / 4, acc);
      TileReduce<Wc, kSeqs>(acc, pre);
      const float v_pre = pre[0] + u_next, v = LecunTanh(v_pre);
      StoreToCluster<Tile::kCluster>(&bb[at_k.seq][k], v, at_k);
      if (k_writer) {
        bb_pre_at[static_cast<size_t>(t) * K] = v_pre;
        bb_at[static_cast<size_t>(t) * K] = v;
      }
      u_next = u_at[static_cast<size_t>(next_t) * K];
    }
    PhaseBarrier<Tile::kCluster>();
    {
      float acc[kSeqs * Heads::kR], heads[4];
      TileDot<Heads, kSeqs>(wh, reinterpret_cast<const float4*>(&bb[0][0]), kK / 4, acc);
      TileReduce<Heads, kSeqs>(acc, heads);
#pragma unroll
      for (int h = 0; h < 4; ++h) heads[h] += bias[h];
      const float f1 = tanhf(heads[kCfcFf1]), f2 = tanhf(heads[kCfcFf2]);
      const float tau = Sigmoid(heads[kCfcTimeA] * dt_next + heads[kCfcTimeB]);
      const float next = f1 * (1.f - tau) + tau * f2;
      StoreToCluster<Tile::kCluster>(&c[at_i.seq][i], next, at_i);
      if (i_writer) {
        float* gates = gates_at + static_cast<size_t>(t) * 3 * C;
        gates[0] = f1;
        gates[C] = f2;
        gates[2 * C] = tau;
        c_prev_at[static_cast<size_t>(t) * C] = c_own;
        c_at[static_cast<size_t>(t) * act.ldc] = next;
      }
      c_own = next;
      dt_next = dt_at[next_t];
    }
    PhaseBarrier<Tile::kCluster>();
  }
  if (state_out && i_writer) state_out[static_cast<size_t>(seq_i) * C + i] = c_own;
}

template <typename Tile, int kSeqs>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    CfcBackwardTileKernel(CfcShape shape, const float* packed, const float* dt, const float* gates,
                          const float* bb_pre, const float* dc_head, int ld_dc_head, float* dp, float* dbb_pre,
                          float* bias_sums) {
  using HeadsT = typename Tile::HeadsT;
  using WcT = typename Tile::WcT;
  constexpr int kC = Tile::kUnits, kK = Tile::kBackbone;
  __shared__ __align__(16) float dheads[kSeqs][4 * kC];  // d of the heads' pre-activations, packed order
  __shared__ __align__(16) float dbb[kSeqs][kK];
  const int B = shape.batch, T = shape.window, C = shape.units, K = shape.backbone, tid = threadIdx.x;
  const int rank = ClusterRank<Tile::kCluster>(), seq0 = blockIdx.x / Tile::kCluster * kSeqs;
  const float* mine = packed + (static_cast<size_t>(rank) * (Tile::kForwardSlots + Tile::kBackwardSlots) +
                                Tile::kForwardSlots) * Tile::kThreads + tid;
  float wt[HeadsT::kR][HeadsT::kN], wu[WcT::kR][WcT::kN];
  LoadSlots<Tile::kThreads>(mine, 0, wt);
  LoadSlots<Tile::kThreads>(mine, HeadsT::kR * HeadsT::kN, wu);
  // This thread ends the W_headsᵀ phase with dbb of sequence seq0 + at_k.seq, row k.
  const TileValue at_k = TileValueOf<HeadsT, kSeqs>(tid);
  const int k = rank * Tile::kRows + at_k.row;
  const bool k_valid = k < K && seq0 + at_k.seq < B, k_writer = k_valid && at_k.copy == 0;
  const size_t row_k = static_cast<size_t>(seq0 + at_k.seq) * T;
  // It ends the W_cᵀ phase with d c_{t−1} of sequence seq0 + at_i.seq, unit i, then the four d heads of step t − 1.
  const TileValue at_i = TileValueOf<WcT, kSeqs>(tid);
  const int i = rank * Tile::kOwnUnits + at_i.row;
  const bool i_valid = i < C && seq0 + at_i.seq < B, i_writer = i_valid && at_i.copy == 0;
  const size_t row_i = static_cast<size_t>(seq0 + at_i.seq) * T;
  // Step t's inputs of the d heads, loaded a step ahead.
  float grad_head = 0.f, f1 = 0.f, f2 = 0.f, tau = 0.f, dt_t = 0.f;
  auto load_step = [&](int t) {
    if (!i_valid) return;
    const size_t row = row_i + t;
    grad_head = dc_head[row * ld_dc_head + i];
    const float* g = gates + row * 3 * C;
    f1 = g[i];
    f2 = g[C + i];
    tau = g[2 * C + i];
    dt_t = dt[row];
  };
  // The writers' sums over the steps of what they write (bias_sums).
  float dp_sum[4] = {0.f, 0.f, 0.f, 0.f}, dbb_sum = 0.f;
  // d heads of step t from d c_t = dc + d c_t from the head.
  auto store_dheads = [&](int t, float dc) {
    const float grad = dc + grad_head, d_tau_pre = grad * (f2 - f1) * tau * (1.f - tau);
    const float d[4] = {grad * (1.f - tau) * (1.f - f1 * f1), grad * tau * (1.f - f2 * f2), d_tau_pre * dt_t,
                        d_tau_pre};
#pragma unroll
    for (int h = 0; h < 4; ++h) StoreToCluster<Tile::kCluster>(&dheads[at_i.seq][h * kC + i], d[h], at_i);
    if (i_writer) {
      float* out = dp + (row_i + t) * 4 * C;
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        out[h * C + i] = d[h];
        dp_sum[h] += d[h];
      }
    }
  };
  PhaseBarrier<Tile::kCluster>();  // every block runs before the first distributed store
  load_step(T - 1);
  store_dheads(T - 1, 0.f);
  if (T > 1) load_step(T - 2);
  float bb_pre_t = k_valid ? bb_pre[(row_k + T - 1) * K + k] : 0.f;
  PhaseBarrier<Tile::kCluster>();
  for (int t = T - 1; t >= 0; --t) {
    {
      float acc[kSeqs * HeadsT::kR], total[1];
      TileDot<HeadsT, kSeqs>(wt, reinterpret_cast<const float4*>(&dheads[0][0]), kC, acc);
      TileReduce<HeadsT, kSeqs>(acc, total);
      const float v = total[0] * LecunTanhGrad(bb_pre_t);
      StoreToCluster<Tile::kCluster>(&dbb[at_k.seq][k], v, at_k);
      if (k_writer) {
        dbb_pre[(row_k + t) * K + k] = v;
        dbb_sum += v;
      }
      if (k_valid && t > 0) bb_pre_t = bb_pre[(row_k + t - 1) * K + k];
    }
    PhaseBarrier<Tile::kCluster>();
    if (t == 0) break;  // no gradient flows into state_in
    {
      float acc[kSeqs * WcT::kR], dc[1];
      TileDot<WcT, kSeqs>(wu, reinterpret_cast<const float4*>(&dbb[0][0]), kK / 4, acc);
      TileReduce<WcT, kSeqs>(acc, dc);
      store_dheads(t - 1, dc[0]);
      if (t > 1) load_step(t - 2);
    }
    PhaseBarrier<Tile::kCluster>();
  }
  if (bias_sums == nullptr) return;
  if (i_writer) {
    float* sums = bias_sums + static_cast<size_t>(seq0 + at_i.seq) * (4 * C + K);
#pragma unroll
    for (int h = 0; h < 4; ++h) sums[h * C + i] = dp_sum[h];
  }
  if (k_writer) bias_sums[static_cast<size_t>(seq0 + at_k.seq) * (4 * C + K) + 4 * C + k] = dbb_sum;
}

// `small`'s recurrences on the TF32 tensor cores, for the `tf32` precision (CfcShape::tf32_products): a block's
// sequences are mma.m16n8k8's eight columns (see Lanes), and each warp holds its rows' A fragments (the weights,
// rounded to TF32 when packed) in registers for the whole window, 160 a thread as the FFMA tile holds. A step's
// products are the same for 2 and for 8 sequences; the scalar work after them (the nonlinearities, the stores) grows
// with the sequences and dominates (H200, small, eight a block on 32 SMs: forward 81 µs, 410 instructions a warp a
// step; two on 128: 52 µs; the FFMA tile: 60). A
// phase's B fragments (c_{t−1}, bb, d heads or d bb, rounded to TF32 as they are stored) come from shared memory,
// and the inner index is permuted so that one 16-byte load gives a thread its B fragments of two k-tiles. Padded
// units, backbone rows and sequences read real ones (clamped) against zero weights, and store nothing.
namespace mma {

constexpr int kUnits = 64, kBackbone = 128, kThreads = 256;
// Fragment slots a thread: forward W_c (8 k-tiles), heads (2 m-tiles × 16 k-tiles); backward W_headsᵀ (32 k-tiles),
// W_cᵀ (8 k-tiles); four registers each. Then the biases [4][kUnits].
constexpr int kWcSlots = 8 * 4, kHeadsSlots = 2 * 16 * 4, kHeadsTSlots = 32 * 4, kWcTSlots = 8 * 4;
constexpr int kSlots = kWcSlots + kHeadsSlots + kHeadsTSlots + kWcTSlots;
constexpr size_t kBiasOffset = static_cast<size_t>(kSlots) * kThreads;
constexpr size_t kPackedFloats = kBiasOffset + 4 * kUnits;
// Shared-memory row strides ≡ 16 (mod 32) floats: the 16-byte B loads of a quarter warp (g = 0, 1; t = 0..3) hit
// distinct banks.
constexpr int kUnitStride = kUnits + 16, kBackboneStride = kBackbone + 16, kHeadStride = 4 * kUnits + 16;
// The W_cᵀ partial sums: 68 ≡ 4 (mod 16), so a warp's stores of sequences 2t, 2t + 1 and rows g, g + 8 spread.
constexpr int kPartialStride = kUnits + 4;

bool Fits(const CfcShape& s) { return s.tf32_products && s.units <= kUnits && s.backbone <= kBackbone; }

// The inner index that row `upper ? t + 4 : t` of k-tile `k_tile` stands for, t = lane % 4: k-tiles 2j and 2j + 1
// read inner indices 16j + 4t .. 16j + 4t + 3 as (2j: t, t + 4; 2j + 1: t, t + 4).
__host__ __device__ constexpr int Inner(int k_tile, int lane, int upper) {
  return k_tile / 2 * 16 + lane % 4 * 4 + k_tile % 2 * 2 + upper;
}

// Register `reg` of an A fragment holds row g + 8·(reg % 2) of the m-tile and the k-tile's row t + 4·(reg / 2).
struct FragmentEntry {
  int row, inner;
};
__host__ __device__ constexpr FragmentEntry FragmentAt(int row0, int k_tile, int lane, int reg) {
  return {row0 + lane / 4 + reg % 2 * 8, Inner(k_tile, lane, reg / 2)};
}

__device__ __forceinline__ float RoundTf32(float v) { return __uint_as_float(Tf32Big(v)); }

__global__ void PackKernel(CfcWeights w, CfcShape shape, float* packed) {
  const int C = shape.units, K = shape.backbone, in = shape.d_model + C;
  auto wc = [&](int k, int unit) {
    return k < K && unit < C ? w.backbone_weight[static_cast<size_t>(k) * in + shape.d_model + unit] : 0.f;
  };
  auto head = [&](int h, int unit, int k) {
    return unit < C && k < K ? w.head_weight[h][static_cast<size_t>(unit) * K + k] : 0.f;
  };
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < kPackedFloats;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v;
    if (i >= kBiasOffset) {
      const int j = static_cast<int>(i - kBiasOffset), unit = j % kUnits;
      v = unit < C ? w.head_bias[j / kUnits][unit] : 0.f;
    } else {
      const int tid = static_cast<int>(i % kThreads), slot = static_cast<int>(i / kThreads);
      const int warp = tid / kWarpSize, lane = tid % kWarpSize, reg = slot % 4;
      if (slot < kWcSlots) {  // rows: backbone k = 16·warp + ·; inner: units
        const FragmentEntry e = FragmentAt(16 * warp, slot / 4, lane, reg);
        v = wc(e.row, e.inner);
      } else if (slot < kWcSlots + kHeadsSlots) {  // m-tile j: rows 0–7 head 2j, 8–15 head 2j + 1 of units 8·warp + ·
        const int s = slot - kWcSlots, j = s / 64;
        const FragmentEntry e = FragmentAt(0, s / 4 % 16, lane, reg);
        v = head(2 * j + e.row / 8, 8 * warp + e.row % 8, e.inner);
      } else if (slot < kWcSlots + kHeadsSlots + kHeadsTSlots) {  // rows: k = 16·warp + ·; inner: h·kUnits + unit
        const FragmentEntry e = FragmentAt(16 * warp, (slot - kWcSlots - kHeadsSlots) / 4, lane, reg);
        v = head(e.inner / kUnits, e.inner % kUnits, e.row);
      } else {  // rows: units 16·(warp % 4) + ·; inner: k of the k-tiles 8·(warp / 4) + ·
        const int s = slot - kWcSlots - kHeadsSlots - kHeadsTSlots;
        const FragmentEntry e = FragmentAt(16 * (warp % 4), 8 * (warp / 4) + s / 4, lane, reg);
        v = wc(e.inner, e.row);
      }
      v = RoundTf32(v);
    }
    packed[i] = v;
  }
}

// d += a·(b0, b1) for fragments held as floats (TF32 values, as packed and as stored).
__device__ __forceinline__ void Mma(float (&d)[4], const float (&a)[4], float b0, float b1) {
  MmaTf32(d, {__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]), __float_as_uint(a[3])},
          {__float_as_uint(b0), __float_as_uint(b1)});
}

// acc[c] += A·B over the k-tiles of chain c: pair j's two k-tiles go to chains 2·(j % (kChains / 2)) and the one
// after it, kChains independent mma chains. An mma waits out the latency of the one before it in its chain, so more
// chains shorten a phase with many k-tiles. B of pair j is the 16-byte load at b + 16j (this thread's row of the
// shared tile, offset by 4t).
template <int kPairs, int kChains>
__device__ __forceinline__ void MmaPairs(const float (&a)[2 * kPairs][4], const float* b, float (&acc)[kChains][4]) {
  static_assert(kChains % 2 == 0 && kPairs % (kChains / 2) == 0);
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const float4 v = *reinterpret_cast<const float4*>(b + 16 * j);
    const int chain = 2 * (j % (kChains / 2));
    Mma(acc[chain], a[2 * j], v.x, v.y);
    Mma(acc[chain + 1], a[2 * j + 1], v.z, v.w);
  }
}

// A block runs kSeqs ∈ {2, 4, 8} sequences; column n of every B fragment is sequence n % kSeqs, so with fewer than
// eight the columns repeat and every lane holds each of its rows' values for all of the block's sequences. The
// scalar work after each product (the nonlinearities, the stores) is then split over the lanes that hold the same
// values: a lane takes the accumulator entries i = Index(t, v) (row g + 8·(i / 2), column 2t + i % 2) and, of the heads, the
// cells of column 2t + CellColumn(c). Fewer sequences a block run the same products a step (the columns are paid
// for either way) with less scalar work, and more blocks cover the device.
template <int kSeqs>
struct Lanes {
  static_assert(kSeqs == 2 || kSeqs == 4 || kSeqs == 8);
  static constexpr int kValues = kSeqs / 2;     // accumulator entries a lane takes
  static constexpr int kCells = kSeqs / 4 > 0 ? kSeqs / 4 : 1;  // cells a lane takes
  // kSeqs 8: every entry; 4: row half t / 2 (lanes t and t ^ 2 hold the same sequences); 2: entry t.
  __device__ static int Index(int t, int v) { return kSeqs == 8 ? v : kSeqs == 4 ? 2 * (t / 2) + v : t; }
  __device__ static int CellColumn(int t, int c) { return kSeqs == 8 ? c : kSeqs == 4 ? t / 2 : t % 2; }
  __device__ static int Seq(int t, int column) { return (2 * t + column) % kSeqs; }
  // kSeqs 2: lanes t and t + 2 take the same cell; the first stores it.
  __device__ static bool StoresCell(int t) { return kSeqs != 2 || t < 2; }
};

__device__ __forceinline__ float Pick(const float (&d)[4], int i) {
  return i == 0 ? d[0] : i == 1 ? d[1] : i == 2 ? d[2] : d[3];
}

// The sum of the chains' accumulators, in chain order.
template <int kChains>
__device__ __forceinline__ void SumChains(const float (&acc)[kChains][4], float (&out)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[i] = acc[0][i];
#pragma unroll
    for (int c = 1; c < kChains; ++c) out[i] += acc[c][i];
  }
}

template <int kSeqs>
__global__ void __launch_bounds__(kThreads, 1)
    ForwardKernel(CfcShape shape, const float* packed, const float* u, const float* dt, const float* state_in,
                  CfcActivations act, float* state_out) {
  using L = Lanes<kSeqs>;
  __shared__ __align__(16) float c[kSeqs][kUnitStride];       // c_{t−1}, then c_t (TF32)
  __shared__ __align__(16) float bb[kSeqs][kBackboneStride];  // lecun_tanh(bb_pre) (TF32)
  const int B = shape.batch, T = shape.window, C = shape.units, K = shape.backbone;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize, g = lane / 4, q = lane % 4;
  const int seq0 = blockIdx.x * kSeqs;
  float wc[8][4], wh[2][16][4];
  LoadSlots<kThreads>(packed + tid, 0, wc);
  LoadSlots<kThreads>(packed + tid, kWcSlots, wh[0]);
  LoadSlots<kThreads>(packed + tid, kWcSlots + 64, wh[1]);
  // The W_c phase's rows are backbone rows 16·warp + g + 8r, the heads phase's unit 8·warp + g (its four heads).
  const int unit = 8 * warp + g;
  int k_row[L::kValues], k_seq[L::kValues], h_seq[L::kCells];
  bool k_writer[L::kValues], h_writer[L::kCells];
  const float* u_at[L::kValues];
  const float* dt_at[L::kCells];
#pragma unroll
  for (int v = 0; v < L::kValues; ++v) {
    const int i = L::Index(q, v);
    k_row[v] = 16 * warp + g + 8 * (i / 2);
    k_seq[v] = seq0 + L::Seq(q, i % 2);
    k_writer[v] = k_seq[v] < B && k_row[v] < K;
    u_at[v] = u + static_cast<size_t>(min(k_seq[v], B - 1)) * T * K + min(k_row[v], K - 1);
  }
#pragma unroll
  for (int cell = 0; cell < L::kCells; ++cell) {
    h_seq[cell] = seq0 + L::Seq(q, L::CellColumn(q, cell));
    h_writer[cell] = h_seq[cell] < B && unit < C && L::StoresCell(q);
    dt_at[cell] = dt + static_cast<size_t>(min(h_seq[cell], B - 1)) * T;
  }
  float bias[4];
#pragma unroll
  for (int h = 0; h < 4; ++h) bias[h] = packed[kBiasOffset + h * kUnits + unit];
  LetNextKernelLaunch();  // (as the FFMA tile kernel)
  float c_own[L::kCells];
#pragma unroll
  for (int cell = 0; cell < L::kCells; ++cell) {
    c_own[cell] = state_in ? state_in[static_cast<size_t>(min(h_seq[cell], B - 1)) * C + min(unit, C - 1)] : 0.f;
  }
  for (int j = tid; j < kSeqs * kUnits; j += kThreads) {
    const int s = j / kUnits, i = j % kUnits;
    c[s][i] = seq0 + s < B && i < C && state_in ? RoundTf32(state_in[static_cast<size_t>(seq0 + s) * C + i]) : 0.f;
  }
  float u_next[L::kValues], dt_next[L::kCells];
#pragma unroll
  for (int v = 0; v < L::kValues; ++v) u_next[v] = u_at[v][0];
#pragma unroll
  for (int cell = 0; cell < L::kCells; ++cell) dt_next[cell] = dt_at[cell][0];
  __syncthreads();
  for (int t = 0; t < T; ++t) {
    const int next_t = min(t + 1, T - 1);
    {
      float acc[2][4] = {}, sum[4];
      MmaPairs<4>(wc, &c[g % kSeqs][4 * q], acc);
      SumChains(acc, sum);
#pragma unroll
      for (int v = 0; v < L::kValues; ++v) {
        const int i = L::Index(q, v);
        const float pre = Pick(sum, i) + u_next[v], value = LecunTanh(pre);
        bb[k_seq[v] - seq0][k_row[v]] = RoundTf32(value);
        if (k_writer[v]) {
          const size_t at = (static_cast<size_t>(k_seq[v]) * T + t) * K + k_row[v];
          act.bb_pre[at] = pre;
          act.bb[at] = value;
        }
        u_next[v] = u_at[v][static_cast<size_t>(next_t) * K];
      }
    }
    __syncthreads();
    {
      float ff[2][4] = {}, time[2][4] = {}, ffs[4], times[4];
      MmaPairs<8>(wh[0], &bb[g % kSeqs][4 * q], ff);
      MmaPairs<8>(wh[1], &bb[g % kSeqs][4 * q], time);
      SumChains(ff, ffs);
      SumChains(time, times);
#pragma unroll
      for (int cell = 0; cell < L::kCells; ++cell) {
        const int e = L::CellColumn(q, cell);
        const float f1 = tanhf(Pick(ffs, e) + bias[kCfcFf1]), f2 = tanhf(Pick(ffs, 2 + e) + bias[kCfcFf2]);
        const float ta = Pick(times, e) + bias[kCfcTimeA], tb = Pick(times, 2 + e) + bias[kCfcTimeB];
        const float tau = Sigmoid(ta * dt_next[cell] + tb);
        const float next = f1 * (1.f - tau) + tau * f2;
        c[h_seq[cell] - seq0][unit] = RoundTf32(next);
        if (h_writer[cell]) {
          const size_t row = static_cast<size_t>(h_seq[cell]) * T + t;
          float* gates = act.gates + row * 3 * C + unit;
          gates[0] = f1;
          gates[C] = f2;
          gates[2 * C] = tau;
          act.c_prev[row * C + unit] = c_own[cell];
          act.c[row * act.ldc + unit] = next;
        }
        c_own[cell] = next;
        dt_next[cell] = dt_at[cell][next_t];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int cell = 0; cell < L::kCells; ++cell) {
    if (state_out && h_writer[cell]) state_out[static_cast<size_t>(h_seq[cell]) * C + unit] = c_own[cell];
  }
}

template <int kSeqs>
__global__ void __launch_bounds__(kThreads, 1)
    BackwardKernel(CfcShape shape, const float* packed, const float* dt, const float* gates, const float* bb_pre,
                   const float* dc_head, int ld_dc_head, float* dp, float* dbb_pre, float* bias_sums) {
  using L = Lanes<kSeqs>;
  // The d heads' cells (sequence, unit): a thread's unit tid % kUnits of sequences tid / kUnits + 4d.
  constexpr int kDheadCells = kSeqs * kUnits / kThreads > 0 ? kSeqs * kUnits / kThreads : 1;
  __shared__ __align__(16) float dheads[kSeqs][kHeadStride];  // [seq][h·kUnits + unit] (TF32)
  __shared__ __align__(16) float dbb[kSeqs][kBackboneStride];  // (TF32)
  __shared__ float partial[2][kSeqs][kPartialStride];          // W_cᵀ·d bb over each half of the backbone
  const int B = shape.batch, T = shape.window, C = shape.units, K = shape.backbone;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize, g = lane / 4, q = lane % 4;
  const int seq0 = blockIdx.x * kSeqs;
  float wt[32][4], wu[8][4];
  LoadSlots<kThreads>(packed + tid, kWcSlots + kHeadsSlots, wt);
  LoadSlots<kThreads>(packed + tid, kWcSlots + kHeadsSlots + kHeadsTSlots, wu);
  // The W_headsᵀ phase's rows: backbone rows 16·warp + g + 8r; the W_cᵀ phase's: units 16·(warp % 4) + g + 8r over
  // the backbone half warp / 4.
  const int half = warp / 4;
  int k_row[L::kValues], k_seq[L::kValues], u_row[L::kValues];
  bool k_writer[L::kValues];
#pragma unroll
  for (int v = 0; v < L::kValues; ++v) {
    const int i = L::Index(q, v);
    k_row[v] = 16 * warp + g + 8 * (i / 2);
    u_row[v] = 16 * (warp % 4) + g + 8 * (i / 2);
    k_seq[v] = seq0 + L::Seq(q, i % 2);
    k_writer[v] = k_seq[v] < B && k_row[v] < K;
  }
  const int unit = tid % kUnits;
  const bool dhead_thread = tid / kUnits < kSeqs;  // kSeqs 2: the first half of the block
  int h_seq[kDheadCells];
  bool h_writer[kDheadCells];
#pragma unroll
  for (int d = 0; d < kDheadCells; ++d) {
    h_seq[d] = seq0 + tid / kUnits + 4 * d;
    h_writer[d] = dhead_thread && h_seq[d] < B && unit < C;
  }
  // Step t's inputs of the d heads, loaded a step ahead.
  float grad_head[kDheadCells], f1[kDheadCells], f2[kDheadCells], tau[kDheadCells], dt_t[kDheadCells];
  auto load_step = [&](int t) {
#pragma unroll
    for (int d = 0; d < kDheadCells; ++d) {
      const size_t row = static_cast<size_t>(min(h_seq[d], B - 1)) * T + t;
      const int i = min(unit, C - 1);
      grad_head[d] = dc_head[row * ld_dc_head + i];
      const float* gt = gates + row * 3 * C + i;
      f1[d] = gt[0];
      f2[d] = gt[C];
      tau[d] = gt[2 * C];
      dt_t[d] = dt[row];
    }
  };
  float dp_sum[kDheadCells][4] = {}, dbb_sum[L::kValues] = {};
  auto store_dheads = [&](int t, const float (&dc)[kDheadCells]) {
    if (!dhead_thread) return;
#pragma unroll
    for (int d = 0; d < kDheadCells; ++d) {
      const float grad = dc[d] + grad_head[d], d_tau_pre = grad * (f2[d] - f1[d]) * tau[d] * (1.f - tau[d]);
      const float dh[4] = {grad * (1.f - tau[d]) * (1.f - f1[d] * f1[d]), grad * tau[d] * (1.f - f2[d] * f2[d]),
                           d_tau_pre * dt_t[d], d_tau_pre};
#pragma unroll
      for (int h = 0; h < 4; ++h) dheads[h_seq[d] - seq0][h * kUnits + unit] = RoundTf32(dh[h]);
      if (h_writer[d]) {
        float* out = dp + (static_cast<size_t>(h_seq[d]) * T + t) * 4 * C + unit;
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          out[h * C] = dh[h];
          dp_sum[d][h] += dh[h];
        }
      }
    }
  };
  float bb_pre_t[L::kValues];
  auto load_bb_pre = [&](int t) {
#pragma unroll
    for (int v = 0; v < L::kValues; ++v) {
      bb_pre_t[v] = bb_pre[(static_cast<size_t>(min(k_seq[v], B - 1)) * T + t) * K + min(k_row[v], K - 1)];
    }
  };
  if (dhead_thread) {
    load_step(T - 1);
    float zero[kDheadCells] = {};
    store_dheads(T - 1, zero);
    if (T > 1) load_step(T - 2);
  }
  load_bb_pre(T - 1);
  __syncthreads();
  for (int t = T - 1; t >= 0; --t) {
    {
      // Its 32 k-tiles in four chains: in two, every mma waited out the one before it (H200, small's step: the
      // kernel 75.5 -> 69.6 µs; eight chains no faster, and the other phases' few k-tiles gained nothing).
      float acc[4][4] = {}, sum[4];
      MmaPairs<16>(wt, &dheads[g % kSeqs][4 * q], acc);
      SumChains(acc, sum);
#pragma unroll
      for (int v = 0; v < L::kValues; ++v) {
        const float value = Pick(sum, L::Index(q, v)) * LecunTanhGrad(bb_pre_t[v]);
        dbb[k_seq[v] - seq0][k_row[v]] = RoundTf32(value);
        if (k_writer[v]) {
          dbb_pre[(static_cast<size_t>(k_seq[v]) * T + t) * K + k_row[v]] = value;
          dbb_sum[v] += value;
        }
      }
      if (t > 0) load_bb_pre(t - 1);
    }
    __syncthreads();
    if (t == 0) break;  // no gradient flows into state_in
    {
      float acc[2][4] = {}, sum[4];
      MmaPairs<4>(wu, &dbb[g % kSeqs][64 * half + 4 * q], acc);
      SumChains(acc, sum);
#pragma unroll
      for (int v = 0; v < L::kValues; ++v) partial[half][k_seq[v] - seq0][u_row[v]] = Pick(sum, L::Index(q, v));
    }
    __syncthreads();
    if (dhead_thread) {
      float dc[kDheadCells];
#pragma unroll
      for (int d = 0; d < kDheadCells; ++d) {
        dc[d] = partial[0][h_seq[d] - seq0][unit] + partial[1][h_seq[d] - seq0][unit];
      }
      store_dheads(t - 1, dc);
      if (t > 1) load_step(t - 2);
    }
    __syncthreads();
  }
  if (bias_sums == nullptr) return;
#pragma unroll
  for (int d = 0; d < kDheadCells; ++d) {
    if (h_writer[d]) {
      float* sums = bias_sums + static_cast<size_t>(h_seq[d]) * (4 * C + K);
#pragma unroll
      for (int h = 0; h < 4; ++h) sums[h * C + unit] = dp_sum[d][h];
    }
  }
#pragma unroll
  for (int v = 0; v < L::kValues; ++v) {
    if (k_writer[v]) bias_sums[static_cast<size_t>(k_seq[v]) * (4 * C + K) + 4 * C + k_row[v]] = dbb_sum[v];
  }
}

// Launches kernels[p], the kernel of 2^(p+1) sequences a block, with the fewest sequences whose blocks all run at once.
template <typename Kernel, typename... Args>
cudaError_t Launch(const CfcShape& shape, const Kernel (&kernels)[3], cudaStream_t stream, Args... args) {
  int sms = 0;
  if (const cudaError_t e = MultiprocessorCount(&sms); e != cudaSuccess) return e;
  int pick = 0;
  while (pick < 2 && CeilDiv(shape.batch, 2 << pick) > sms) ++pick;
  kernels[pick]<<<CeilDiv(shape.batch, 2 << pick), kThreads, 0, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace mma

// The general kernels' packed layout, in floats: the forward's block [W_cᵀ: C×K][W_headsᵀ: K×4C][biases: 4C], then the backward's block
// [W_heads: 4C×K][W_c: K×C].
__host__ __device__ inline size_t ForwardWeightFloats(int C, int K) { return 5ull * C * K + 4ull * C; }
__host__ __device__ inline size_t BackwardWeightFloats(int C, int K) { return 5ull * C * K; }

__global__ void CfcPackGeneralKernel(CfcWeights w, CfcShape shape, float* packed) {
  const int C = shape.units, K = shape.backbone, C4 = 4 * C, in = shape.d_model + C;
  const size_t CK = static_cast<size_t>(C) * K, total = ForwardWeightFloats(C, K) + BackwardWeightFloats(C, K);
  auto wc = [&](int k, int c) { return w.backbone_weight[static_cast<size_t>(k) * in + shape.d_model + c]; };
  auto head = [&](int j, int k) { return w.head_weight[j / C][static_cast<size_t>(j % C) * K + k]; };
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v;
    if (i < CK) {
      v = wc(static_cast<int>(i % K), static_cast<int>(i / K));
    } else if (i < 5 * CK) {
      const size_t j = i - CK;
      v = head(static_cast<int>(j % C4), static_cast<int>(j / C4));
    } else if (i < 5 * CK + C4) {
      const int j = static_cast<int>(i - 5 * CK);
      v = w.head_bias[j / C][j % C];
    } else if (i < 9 * CK + C4) {
      const size_t j = i - 5 * CK - C4;
      v = head(static_cast<int>(j / K), static_cast<int>(j % K));
    } else {
      const size_t j = i - 9 * CK - C4;
      v = wc(static_cast<int>(j / C), static_cast<int>(j % C));
    }
    packed[i] = v;
  }
}

// Copies `floats` weights into shared memory when kShared; returns where the kernel reads them.
template <bool kShared>
__device__ const float* StageWeights(const float* global, size_t floats, float* shared) {
  if constexpr (kShared) {
    for (size_t i = threadIdx.x; i < floats; i += blockDim.x) shared[i] = global[i];
    return shared;
  } else {
    return global;
  }
}

template <int kSeqs, bool kShared>
__global__ void CfcForwardGeneralKernel(CfcShape shape, const float* packed, const float* u, const float* dt,
                                 const float* state_in, CfcActivations act, float* state_out) {
  LetNextKernelLaunch();  // (as the tile kernel)
  extern __shared__ float shared[];
  const int B = shape.batch, T = shape.window, C = shape.units, K = shape.backbone, C4 = 4 * C;
  const size_t weight_floats = kShared ? ForwardWeightFloats(C, K) : 0;
  const float* wc = StageWeights<kShared>(packed, ForwardWeightFloats(C, K), shared);  // [C][K]
  const float* wh = wc + static_cast<size_t>(C) * K;                                   // [K][4C]
  const float* bias = wh + static_cast<size_t>(K) * C4;                                // [4C]
  float* c = shared + weight_floats;  // [kSeqs][C]: c_{t−1}, then c_t
  float* bb = c + kSeqs * C;          // [kSeqs][K]
  float* heads = bb + kSeqs * K;      // [kSeqs][4C]
  const int seq0 = blockIdx.x * kSeqs;
  for (int i = threadIdx.x; i < kSeqs * C; i += blockDim.x) {
    const int b = seq0 + i / C;
    c[i] = (b < B && state_in) ? state_in[static_cast<size_t>(b) * C + i % C] : 0.f;
  }
  __syncthreads();
  for (int t = 0; t < T; ++t) {
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      float acc[kSeqs];
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) acc[s] = seq0 + s < B ? u[static_cast<size_t>((seq0 + s) * T + t) * K + k] : 0.f;
      for (int j = 0; j < C; ++j) {
        const float w = wc[j * K + k];
#pragma unroll
        for (int s = 0; s < kSeqs; ++s) acc[s] += w * c[s * C + j];
      }
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) {
        const float v = LecunTanh(acc[s]);
        bb[s * K + k] = v;
        if (seq0 + s < B) {
          const size_t at = static_cast<size_t>((seq0 + s) * T + t) * K + k;
          act.bb_pre[at] = acc[s];
          act.bb[at] = v;
        }
      }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < C4; j += blockDim.x) {
      float acc[kSeqs];
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) acc[s] = bias[j];
      for (int k = 0; k < K; ++k) {
        const float w = wh[static_cast<size_t>(k) * C4 + j];
#pragma unroll
        for (int s = 0; s < kSeqs; ++s) acc[s] += w * bb[s * K + k];
      }
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) heads[s * C4 + j] = acc[s];
    }
    __syncthreads();
    for (int unit = threadIdx.x; unit < C; unit += blockDim.x) {
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) {
        if (seq0 + s >= B) continue;
        const size_t row = static_cast<size_t>(seq0 + s) * T + t;
        const float* hd = heads + s * C4;
        const float f1 = tanhf(hd[unit]), f2 = tanhf(hd[C + unit]);
        const float tau = Sigmoid(hd[2 * C + unit] * dt[row] + hd[3 * C + unit]);
        const float next = f1 * (1.f - tau) + tau * f2;
        float* gates = act.gates + row * 3 * C;
        gates[unit] = f1;
        gates[C + unit] = f2;
        gates[2 * C + unit] = tau;
        act.c_prev[row * C + unit] = c[s * C + unit];
        act.c[row * act.ldc + unit] = next;
        c[s * C + unit] = next;
      }
    }
    __syncthreads();
  }
  if (state_out) {
    for (int i = threadIdx.x; i < kSeqs * C; i += blockDim.x) {
      const int b = seq0 + i / C;
      if (b < B) state_out[static_cast<size_t>(b) * C + i % C] = c[i];
    }
  }
}

template <int kSeqs, bool kShared>
__global__ void CfcBackwardGeneralKernel(CfcShape shape, const float* packed, const float* dt, const float* gates,
                                  const float* bb_pre, const float* dc_head, int ld_dc_head, float* dp,
                                  float* dbb_pre, float* bias_sums) {
  extern __shared__ float shared[];
  const int B = shape.batch, T = shape.window, C = shape.units, K = shape.backbone, C4 = 4 * C;
  const size_t weight_floats = kShared ? BackwardWeightFloats(C, K) : 0;
  const float* wh = StageWeights<kShared>(packed + ForwardWeightFloats(C, K), BackwardWeightFloats(C, K),
                                          shared);  // [4C][K]
  const float* wc = wh + static_cast<size_t>(C4) * K;  // [K][C]
  float* dc = shared + weight_floats;  // [kSeqs][C]: d loss / d c_t from the steps after t
  float* dheads = dc + kSeqs * C;      // [kSeqs][4C]
  float* dbb = dheads + kSeqs * C4;    // [kSeqs][K]
  const int seq0 = blockIdx.x * kSeqs;
  for (int i = threadIdx.x; i < kSeqs * C; i += blockDim.x) dc[i] = 0.f;
  __syncthreads();
  for (int t = T - 1; t >= 0; --t) {
    for (int unit = threadIdx.x; unit < C; unit += blockDim.x) {
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) {
        float* dh = dheads + s * C4;
        if (seq0 + s >= B) {
          dh[unit] = dh[C + unit] = dh[2 * C + unit] = dh[3 * C + unit] = 0.f;
          continue;
        }
        const size_t row = static_cast<size_t>(seq0 + s) * T + t;
        const float grad = dc[s * C + unit] + dc_head[row * ld_dc_head + unit];
        const float* g = gates + row * 3 * C;
        const float f1 = g[unit], f2 = g[C + unit], tau = g[2 * C + unit];
        const float d_tau_pre = grad * (f2 - f1) * tau * (1.f - tau);
        dh[unit] = grad * (1.f - tau) * (1.f - f1 * f1);
        dh[C + unit] = grad * tau * (1.f - f2 * f2);
        dh[2 * C + unit] = d_tau_pre * dt[row];
        dh[3 * C + unit] = d_tau_pre;
        float* out = dp + row * C4;
        for (int j = 0; j < kCfcHeads; ++j) out[j * C + unit] = dh[j * C + unit];
        if (bias_sums != nullptr) {  // the same thread owns (sequence, unit) at every step
          float* sums = bias_sums + static_cast<size_t>(seq0 + s) * (C4 + K);
          for (int j = 0; j < kCfcHeads; ++j) {
            sums[j * C + unit] = (t == T - 1 ? 0.f : sums[j * C + unit]) + dh[j * C + unit];
          }
        }
      }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      float acc[kSeqs];
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) acc[s] = 0.f;
      for (int j = 0; j < C4; ++j) {
        const float w = wh[static_cast<size_t>(j) * K + k];
#pragma unroll
        for (int s = 0; s < kSeqs; ++s) acc[s] += w * dheads[s * C4 + j];
      }
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) {
        float v = 0.f;
        if (seq0 + s < B) {
          const size_t at = static_cast<size_t>((seq0 + s) * T + t) * K + k;
          v = acc[s] * LecunTanhGrad(bb_pre[at]);
          dbb_pre[at] = v;
          if (bias_sums != nullptr) {
            float* sum = bias_sums + static_cast<size_t>(seq0 + s) * (C4 + K) + C4 + k;
            *sum = (t == T - 1 ? 0.f : *sum) + v;
          }
        }
        dbb[s * K + k] = v;
      }
    }
    __syncthreads();
    for (int unit = threadIdx.x; unit < C; unit += blockDim.x) {
      float acc[kSeqs];
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) acc[s] = 0.f;
      for (int k = 0; k < K; ++k) {
        const float w = wc[k * C + unit];
#pragma unroll
        for (int s = 0; s < kSeqs; ++s) acc[s] += w * dbb[s * K + k];
      }
#pragma unroll
      for (int s = 0; s < kSeqs; ++s) dc[s * C + unit] = acc[s];
    }
    __syncthreads();
  }
}

// How a general kernel is launched on this device: sequences per block (enough blocks to cover the multiprocessors,
// fewer than one block per sequence when the batch is larger), and whether the weights fit in shared memory.
struct CfcLaunch {
  int seqs = 1;
  bool shared_weights = false;
  int threads = 0;
  size_t shared_bytes = 0;
  int blocks = 0;
};

cudaError_t PlanCfcLaunch(const CfcShape& shape, size_t weight_floats, int per_seq_floats, CfcLaunch* plan) {
  int device = 0, sms = 0, max_shared = 0;
  if (const cudaError_t e = MultiprocessorCount(&sms); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      e != cudaSuccess) {
    return e;
  }
  plan->seqs = 1;
  while (plan->seqs < 4 && CeilDiv(shape.batch, plan->seqs) > sms) plan->seqs *= 2;
  const size_t activations = sizeof(float) * plan->seqs * per_seq_floats;
  plan->shared_weights = activations + sizeof(float) * weight_floats <= static_cast<size_t>(max_shared);
  plan->shared_bytes = activations + (plan->shared_weights ? sizeof(float) * weight_floats : 0);
  plan->threads = RoundUpToWarp(std::max(shape.backbone, 4 * shape.units));
  if (plan->threads > 1024) plan->threads = 1024;
  plan->blocks = CeilDiv(shape.batch, plan->seqs);
  return cudaSuccess;
}

// Calls launch.template operator()<kSeqs, kShared>() for the plan's choice.
template <typename Launch>
cudaError_t Dispatch(const CfcLaunch& plan, Launch launch) {
  switch (plan.seqs * 2 + (plan.shared_weights ? 1 : 0)) {
    case 2: return launch.template operator()<1, false>();
    case 3: return launch.template operator()<1, true>();
    case 4: return launch.template operator()<2, false>();
    case 5: return launch.template operator()<2, true>();
    case 8: return launch.template operator()<4, false>();
    case 9: return launch.template operator()<4, true>();
    default: return cudaErrorInvalidValue;
  }
}

// Launches kernels[p], the tile kernel for 2^p sequences per cluster, with the fewest sequences whose clusters all
// run at once (or the most a thread's registers hold): fewer sequences shorten every step, and a second wave would
// double the window's time.
template <typename Tile, typename Kernel, size_t kCount, typename... Args>
cudaError_t LaunchTile(const CfcShape& shape, Kernel (&kernels)[kCount], cudaStream_t stream, Args... args) {
  static_assert(1 << (kCount - 1) == Tile::kMaxSeqs);
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(Tile::kThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = Tile::kCluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = Tile::kCluster > 1 ? 1 : 0;
  int capacity = 0;
  if constexpr (Tile::kCluster == 1) {
    if (const cudaError_t e = MultiprocessorCount(&capacity); e != cudaSuccess) return e;
  } else {
    config.gridDim = dim3(Tile::kCluster);
    if (const cudaError_t e = cudaOccupancyMaxActiveClusters(&capacity, kernels[0], &config); e != cudaSuccess) {
      return e;
    }
  }
  int pick = 0;
  while (pick + 1 < static_cast<int>(kCount) && CeilDiv(shape.batch, 1 << pick) > capacity) ++pick;
  config.gridDim = dim3(CeilDiv(shape.batch, 1 << pick) * Tile::kCluster);
  return cudaLaunchKernelEx(&config, kernels[pick], args...);
}

bool ValidShape(const CfcShape& s) {
  return s.batch > 0 && s.window > 0 && s.d_model > 0 && s.units > 0 && s.backbone > 0;
}

}  // namespace

size_t CfcPackedFloats(const CfcShape& shape) {
  if (mma::Fits(shape)) return mma::kPackedFloats;
  if (Fits<SmallTile>(shape)) return SmallTile::kPackedFloats;
  if (Fits<LargeTile>(shape)) return LargeTile::kPackedFloats;
  return ForwardWeightFloats(shape.units, shape.backbone) + BackwardWeightFloats(shape.units, shape.backbone);
}

cudaError_t LaunchCfcPackWeights(const CfcWeights& weights, const CfcShape& shape, float* packed, cudaStream_t stream) {
  if (!ValidShape(shape)) return cudaErrorInvalidValue;
  const dim3 grid = GridFor(static_cast<long long>(CfcPackedFloats(shape)), 256);
  if (mma::Fits(shape)) {
    mma::PackKernel<<<grid, 256, 0, stream>>>(weights, shape, packed);
  } else if (Fits<SmallTile>(shape)) {
    CfcPackTileKernel<SmallTile><<<grid, 256, 0, stream>>>(weights, shape, packed);
  } else if (Fits<LargeTile>(shape)) {
    CfcPackTileKernel<LargeTile><<<grid, 256, 0, stream>>>(weights, shape, packed);
  } else {
    CfcPackGeneralKernel<<<grid, 256, 0, stream>>>(weights, shape, packed);
  }
  return cudaGetLastError();
}

cudaError_t LaunchCfcForward(const CfcShape& shape, const float* packed, const float* u, const float* dt,
                             const float* state_in, const CfcActivations& act, float* state_out, cudaStream_t stream) {
  if (!ValidShape(shape)) return cudaErrorInvalidValue;
  if (mma::Fits(shape)) {
    const decltype(&mma::ForwardKernel<2>) kernels[] = {mma::ForwardKernel<2>, mma::ForwardKernel<4>,
                                                         mma::ForwardKernel<8>};
    return mma::Launch(shape, kernels, stream, shape, packed, u, dt, state_in, act, state_out);
  }
  if (Fits<SmallTile>(shape)) {
    const decltype(&CfcForwardTileKernel<SmallTile, 1>) kernels[] = {CfcForwardTileKernel<SmallTile, 1>,
                                                                      CfcForwardTileKernel<SmallTile, 2>};
    return LaunchTile<SmallTile>(shape, kernels, stream, shape, packed, u, dt, state_in, act, state_out);
  }
  if (Fits<LargeTile>(shape)) {
    const decltype(&CfcForwardTileKernel<LargeTile, 1>) kernels[] = {
        CfcForwardTileKernel<LargeTile, 1>, CfcForwardTileKernel<LargeTile, 2>, CfcForwardTileKernel<LargeTile, 4>};
    return LaunchTile<LargeTile>(shape, kernels, stream, shape, packed, u, dt, state_in, act, state_out);
  }
  CfcLaunch plan;
  const int per_seq = shape.units + shape.backbone + 4 * shape.units;
  if (const cudaError_t e = PlanCfcLaunch(shape, ForwardWeightFloats(shape.units, shape.backbone), per_seq, &plan);
      e != cudaSuccess) {
    return e;
  }
  return Dispatch(plan, [&]<int kSeqs, bool kShared>() {
    const auto kernel = CfcForwardGeneralKernel<kSeqs, kShared>;
    if (const cudaError_t e = AllowSharedMemory(kernel, plan.shared_bytes); e != cudaSuccess) return e;
    kernel<<<plan.blocks, plan.threads, plan.shared_bytes, stream>>>(shape, packed, u, dt, state_in, act, state_out);
    return cudaGetLastError();
  });
}

cudaError_t LaunchCfcBackward(const CfcShape& shape, const float* packed, const float* dt, const float* gates,
                              const float* bb_pre, const float* dc_head, int ld_dc_head, float* dp, float* dbb_pre,
                              cudaStream_t stream, float* bias_sums) {
  if (!ValidShape(shape)) return cudaErrorInvalidValue;
  if (mma::Fits(shape)) {
    const decltype(&mma::BackwardKernel<2>) kernels[] = {mma::BackwardKernel<2>, mma::BackwardKernel<4>,
                                                          mma::BackwardKernel<8>};
    return mma::Launch(shape, kernels, stream, shape, packed, dt, gates, bb_pre, dc_head, ld_dc_head, dp, dbb_pre,
                       bias_sums);
  }
  if (Fits<SmallTile>(shape)) {
    const decltype(&CfcBackwardTileKernel<SmallTile, 1>) kernels[] = {CfcBackwardTileKernel<SmallTile, 1>,
                                                                       CfcBackwardTileKernel<SmallTile, 2>};
    return LaunchTile<SmallTile>(shape, kernels, stream, shape, packed, dt, gates, bb_pre, dc_head, ld_dc_head, dp,
                                 dbb_pre, bias_sums);
  }
  if (Fits<LargeTile>(shape)) {
    const decltype(&CfcBackwardTileKernel<LargeTile, 1>) kernels[] = {
        CfcBackwardTileKernel<LargeTile, 1>, CfcBackwardTileKernel<LargeTile, 2>, CfcBackwardTileKernel<LargeTile, 4>};
    return LaunchTile<LargeTile>(shape, kernels, stream, shape, packed, dt, gates, bb_pre, dc_head, ld_dc_head, dp,
                                 dbb_pre, bias_sums);
  }
  CfcLaunch plan;
  const int per_seq = shape.units + 4 * shape.units + shape.backbone;
  if (const cudaError_t e = PlanCfcLaunch(shape, BackwardWeightFloats(shape.units, shape.backbone), per_seq, &plan);
      e != cudaSuccess) {
    return e;
  }
  return Dispatch(plan, [&]<int kSeqs, bool kShared>() {
    const auto kernel = CfcBackwardGeneralKernel<kSeqs, kShared>;
    if (const cudaError_t e = AllowSharedMemory(kernel, plan.shared_bytes); e != cudaSuccess) return e;
    kernel<<<plan.blocks, plan.threads, plan.shared_bytes, stream>>>(shape, packed, dt, gates, bb_pre, dc_head,
                                                                     ld_dc_head, dp, dbb_pre, bias_sums);
    return cudaGetLastError();
  });
}

}  // namespace perception::kernels
