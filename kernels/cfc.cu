// CfC kernels. Shapes up to `large`'s (C ≤ 128, K ≤ 256) run the register tiles: a block of kTileThreads holds its
// share of the recurrent weights in registers for the whole window (80 floats a thread), `small`'s all of them in one
// block and `large`'s split over a cluster of four that exchange each phase's outputs through distributed shared
// memory. Each phase is a mat-vec where a thread owns R rows × a slice of the inputs for all of the block's sequences:
// it reads the inputs from shared memory as float4 broadcasts, and the lanes of its group sum their partial dot
// products with a reduce-scatter of shuffles; two barriers a step. Larger shapes run the general kernels: three
// barrier-separated phases a step, a thread per output, weights in shared memory when they fit.
#include "kernels/cfc.h"

#include <algorithm>

#include <cooperative_groups.h>

#include "kernels/common.cuh"

namespace perception::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kTileThreads = 512;
constexpr unsigned kFullMask = 0xffffffffu;

// Capacities C ≤ kUnits and K ≤ kBackbone (the weights are zero-padded up to them, so padded units and rows stay 0),
// rows split over kCluster blocks.
template <int kUnitsCap, int kBackboneCap, int kClusterSize>
struct CfcTile {
  static constexpr int kUnits = kUnitsCap, kBackbone = kBackboneCap, kCluster = kClusterSize;
  static constexpr int kRows = kBackbone / kCluster;   // backbone rows (outputs of W_c and of W_headsᵀ) of a block
  static constexpr int kOwnUnits = kUnits / kCluster;  // units (outputs of the heads and of W_cᵀ) of a block
  // Forward: W_c one row a thread (groups of kGc lanes), the heads a unit's four rows a thread (groups of kGh).
  static constexpr int kGc = kTileThreads / kRows, kWc = kUnits / kGc;
  static constexpr int kGh = kTileThreads / kOwnUnits, kWh = kBackbone / kGh;
  // Backward: W_headsᵀ four backbone rows a thread (groups of kGt), W_cᵀ one unit a thread (groups of kGu).
  static constexpr int kGt = kTileThreads / (kRows / 4), kWt = 4 * kUnits / kGt;
  static constexpr int kGu = kTileThreads / kOwnUnits, kWu = kBackbone / kGu;
  static constexpr int kForwardSlots = kWc + 4 * kWh, kBackwardSlots = 4 * kWt + kWu;
  // Packed: for each block rank, [forward slots][thread] then [backward slots][thread]; then the biases [4][kUnits].
  static constexpr size_t kBiasOffset = static_cast<size_t>(kCluster) * (kForwardSlots + kBackwardSlots) * kTileThreads;
  static constexpr size_t kPackedFloats = kBiasOffset + 4 * kUnits;
  static_assert(kTileThreads % kRows == 0 && kRows % 4 == 0 && kTileThreads % kOwnUnits == 0);
  static_assert(kGc <= kWarpSize && kGh <= kWarpSize && kGt <= kWarpSize && kGu <= kWarpSize);
  static_assert(kWc % 4 == 0 && kWh % 4 == 0 && kWt % 4 == 0 && kWu % 4 == 0);
};
using SmallTile = CfcTile<64, 128, 1>;
using LargeTile = CfcTile<128, 256, 4>;

template <typename Tile>
bool Fits(const CfcShape& s) {
  return s.units <= Tile::kUnits && s.backbone <= Tile::kBackbone;
}

template <typename Tile>
__global__ void CfcPackTileKernel(CfcWeights w, CfcShape shape, float* packed) {
  const int C = shape.units, K = shape.backbone, in = shape.d_model + C;
  auto wc = [&](int k, int unit) {
    return k < K && unit < C ? w.backbone_weight[static_cast<size_t>(k) * in + shape.d_model + unit] : 0.f;
  };
  auto head = [&](int h, int unit, int k) {
    return unit < C && k < K ? w.head_weight[h][static_cast<size_t>(unit) * K + k] : 0.f;
  };
  // Input e of a thread in lane group g of width G reads float4 (e/4)·G + g: consecutive lanes, consecutive float4s.
  auto input = [](int e, int g, int G) { return (e / 4 * G + g) * 4 + e % 4; };
  constexpr int kSlots = Tile::kForwardSlots + Tile::kBackwardSlots;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < Tile::kPackedFloats;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float v;
    if (i >= Tile::kBiasOffset) {
      const int j = static_cast<int>(i - Tile::kBiasOffset), unit = j % Tile::kUnits;
      v = unit < C ? w.head_bias[j / Tile::kUnits][unit] : 0.f;
    } else {
      const int tid = static_cast<int>(i % kTileThreads), slot = static_cast<int>(i / kTileThreads % kSlots);
      const int rank = static_cast<int>(i / kTileThreads / kSlots);
      if (slot < Tile::kWc) {
        v = wc(rank * Tile::kRows + tid / Tile::kGc, input(slot, tid % Tile::kGc, Tile::kGc));
      } else if (slot < Tile::kForwardSlots) {
        const int s = slot - Tile::kWc;
        v = head(s / Tile::kWh, rank * Tile::kOwnUnits + tid / Tile::kGh, input(s % Tile::kWh, tid % Tile::kGh, Tile::kGh));
      } else if (slot < Tile::kForwardSlots + 4 * Tile::kWt) {
        const int s = slot - Tile::kForwardSlots;
        const int j = input(s % Tile::kWt, tid % Tile::kGt, Tile::kGt);  // d heads, packed [4][kUnits]
        v = head(j / Tile::kUnits, j % Tile::kUnits, rank * Tile::kRows + tid / Tile::kGt * 4 + s / Tile::kWt);
      } else {
        const int e = slot - Tile::kForwardSlots - 4 * Tile::kWt;
        v = wc(input(e, tid % Tile::kGu, Tile::kGu), rank * Tile::kOwnUnits + tid / Tile::kGu);
      }
    }
    packed[i] = v;
  }
}

// Sums v over a group of G contiguous lanes (G a power of two, V ≤ G) and leaves the total of value g / (G / V) in
// out: the first log2(V) butterfly steps each hand half of the values to the partner, so V·W values cost (V − 1 +
// log2(G / V))·W shuffles instead of V·W·log2(G). Lanes holding the same value hold the same bits (a + b == b + a).
template <int V, int W, int G>
__device__ __forceinline__ void GroupReduceScatter(float (&v)[V][W], int g, float (&out)[W]) {
  static_assert(V <= G && (V & (V - 1)) == 0 && (G & (G - 1)) == 0);
  if constexpr (G == 1) {
#pragma unroll
    for (int w = 0; w < W; ++w) out[w] = v[0][w];
  } else if constexpr (V == 1) {
#pragma unroll
    for (int w = 0; w < W; ++w) v[0][w] += __shfl_xor_sync(kFullMask, v[0][w], G / 2);
    GroupReduceScatter<1, W, G / 2>(v, g, out);
  } else {
    constexpr int H = V / 2;
    const bool upper = (g & (G / 2)) != 0;
    float next[H][W];
#pragma unroll
    for (int i = 0; i < H; ++i) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float keep = upper ? v[H + i][w] : v[i][w], send = upper ? v[i][w] : v[H + i][w];
        next[i][w] = keep + __shfl_xor_sync(kFullMask, send, G / 2);
      }
    }
    GroupReduceScatter<H, W, G / 2>(next, g, out);
  }
}

// acc[s][r] += Σ_e w[r][e]·in[s][input e of lane group g], in as float4 rows of `stride` float4s.
template <int S, int R, int N, int G>
__device__ __forceinline__ void TileDot(const float (&w)[R][N], const float4* in, int stride, int g, float (&acc)[S][R]) {
#pragma unroll
  for (int q = 0; q < N / 4; ++q) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const float4 x = in[s * stride + q * G + g];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[s][r] = fmaf(w[r][4 * q], x.x, acc[s][r]);
        acc[s][r] = fmaf(w[r][4 * q + 1], x.y, acc[s][r]);
        acc[s][r] = fmaf(w[r][4 * q + 2], x.z, acc[s][r]);
        acc[s][r] = fmaf(w[r][4 * q + 3], x.w, acc[s][r]);
      }
    }
  }
}

template <int S, int R>
__device__ __forceinline__ void Zero(float (&acc)[S][R]) {
#pragma unroll
  for (int s = 0; s < S; ++s) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[s][r] = 0.f;
  }
}

template <int R, int N>
__device__ __forceinline__ void LoadSlots(const float* packed, int slot0, float (&w)[R][N]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int e = 0; e < N; ++e) w[r][e] = packed[static_cast<size_t>(slot0 + r * N + e) * kTileThreads];
  }
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

// Stores v at `at` in every block of the cluster; the `copies` lanes holding the same value (copy index `copy`) share
// the stores.
template <int kCluster>
__device__ __forceinline__ void StoreToCluster(float* at, float v, int copy, int copies) {
  if constexpr (kCluster == 1) {
    if (copy == 0) *at = v;
  } else {
    for (int r = copy; r < kCluster; r += copies) *cg::this_cluster().map_shared_rank(at, r) = v;
  }
}

template <typename Tile, int kSeqs>
__global__ void __launch_bounds__(kTileThreads, 1)
    CfcForwardTileKernel(CfcShape shape, const float* packed, const float* u, const float* dt, const float* state_in,
                         CfcActivations act, float* state_out) {
  constexpr int kC = Tile::kUnits, kK = Tile::kBackbone, kGc = Tile::kGc, kGh = Tile::kGh;
  __shared__ __align__(16) float c[kSeqs][kC];  // c_{t−1}, then c_t
  __shared__ __align__(16) float bb[kSeqs][kK];
  const int B = shape.batch, T = shape.window, C = shape.units, K = shape.backbone, tid = threadIdx.x;
  const int rank = ClusterRank<Tile::kCluster>(), seq0 = blockIdx.x / Tile::kCluster * kSeqs;
  const float* mine = packed + static_cast<size_t>(rank) * (Tile::kForwardSlots + Tile::kBackwardSlots) * kTileThreads + tid;
  float wc[1][Tile::kWc], wh[4][Tile::kWh];
  LoadSlots(mine, 0, wc);
  LoadSlots(mine, Tile::kWc, wh);
  // Backbone phase: this thread ends with bb of sequence sc, row k.
  const int gc = tid % kGc, k = rank * Tile::kRows + tid / kGc, sc = gc / (kGc / kSeqs), copy_c = gc % (kGc / kSeqs);
  const bool k_valid = k < K && seq0 + sc < B, k_writer = k_valid && copy_c == 0;
  const size_t row_c = static_cast<size_t>(seq0 + sc) * T;
  // Heads phase: this thread ends with the four heads of sequence sh, unit i.
  const int gh = tid % kGh, i = rank * Tile::kOwnUnits + tid / kGh, sh = gh / (kGh / kSeqs), copy_h = gh % (kGh / kSeqs);
  const bool i_valid = i < C && seq0 + sh < B, i_writer = i_valid && copy_h == 0;
  const size_t row_h = static_cast<size_t>(seq0 + sh) * T;
  float bias[4];
#pragma unroll
  for (int h = 0; h < 4; ++h) bias[h] = packed[Tile::kBiasOffset + h * kC + i];
  float c_own = i_valid && state_in ? state_in[static_cast<size_t>(seq0 + sh) * C + i] : 0.f;
  for (int j = tid; j < kSeqs * kC; j += kTileThreads) {
    const int s = j / kC, unit = j % kC;
    c[s][unit] = seq0 + s < B && unit < C && state_in ? state_in[static_cast<size_t>(seq0 + s) * C + unit] : 0.f;
  }
  float u_next = k_valid ? u[row_c * K + k] : 0.f, dt_next = i_valid ? dt[row_h] : 0.f;
  PhaseBarrier<Tile::kCluster>();  // also: every block runs before the first distributed store
  for (int t = 0; t < T; ++t) {
    {
      float acc[kSeqs][1], pre[1];
      Zero(acc);
      TileDot<kSeqs, 1, Tile::kWc, kGc>(wc, reinterpret_cast<const float4*>(&c[0][0]), kC / 4, gc, acc);
      GroupReduceScatter<kSeqs, 1, kGc>(acc, gc, pre);
      const float v_pre = pre[0] + u_next, v = LecunTanh(v_pre);
      StoreToCluster<Tile::kCluster>(&bb[sc][k], v, copy_c, kGc / kSeqs);
      if (k_writer) {
        const size_t at = (row_c + t) * K + k;
        act.bb_pre[at] = v_pre;
        act.bb[at] = v;
      }
      if (k_valid && t + 1 < T) u_next = u[(row_c + t + 1) * K + k];
    }
    PhaseBarrier<Tile::kCluster>();
    {
      float acc[kSeqs][4], heads[4];
      Zero(acc);
      TileDot<kSeqs, 4, Tile::kWh, kGh>(wh, reinterpret_cast<const float4*>(&bb[0][0]), kK / 4, gh, acc);
      GroupReduceScatter<kSeqs, 4, kGh>(acc, gh, heads);
#pragma unroll
      for (int h = 0; h < 4; ++h) heads[h] += bias[h];
      const float f1 = tanhf(heads[kCfcFf1]), f2 = tanhf(heads[kCfcFf2]);
      const float tau = Sigmoid(heads[kCfcTimeA] * dt_next + heads[kCfcTimeB]);
      const float next = f1 * (1.f - tau) + tau * f2;
      StoreToCluster<Tile::kCluster>(&c[sh][i], next, copy_h, kGh / kSeqs);
      if (i_writer) {
        const size_t row = row_h + t;
        float* gates = act.gates + row * 3 * C;
        gates[i] = f1;
        gates[C + i] = f2;
        gates[2 * C + i] = tau;
        act.c_prev[row * C + i] = c_own;
        act.c[row * act.ldc + i] = next;
      }
      c_own = next;
      if (i_valid && t + 1 < T) dt_next = dt[row_h + t + 1];
    }
    PhaseBarrier<Tile::kCluster>();
  }
  if (state_out && i_writer) state_out[static_cast<size_t>(seq0 + sh) * C + i] = c_own;
}

template <typename Tile, int kSeqs>
__global__ void __launch_bounds__(kTileThreads, 1)
    CfcBackwardTileKernel(CfcShape shape, const float* packed, const float* dt, const float* gates,
                          const float* bb_pre, const float* dc_head, int ld_dc_head, float* dp, float* dbb_pre) {
  constexpr int kC = Tile::kUnits, kK = Tile::kBackbone, kGt = Tile::kGt, kGu = Tile::kGu;
  __shared__ __align__(16) float dheads[kSeqs][4 * kC];  // d of the heads' pre-activations, packed order
  __shared__ __align__(16) float dbb[kSeqs][kK];
  const int B = shape.batch, T = shape.window, C = shape.units, K = shape.backbone, tid = threadIdx.x;
  const int rank = ClusterRank<Tile::kCluster>(), seq0 = blockIdx.x / Tile::kCluster * kSeqs;
  const float* mine = packed + (static_cast<size_t>(rank) * (Tile::kForwardSlots + Tile::kBackwardSlots) +
                                Tile::kForwardSlots) * kTileThreads + tid;
  float wt[4][Tile::kWt], wu[1][Tile::kWu];
  LoadSlots(mine, 0, wt);
  LoadSlots(mine, 4 * Tile::kWt, wu);
  // W_headsᵀ phase: this thread ends with dbb of sequence sk, row k (its group's rows are 4·(tid / kGt) + 0..3).
  constexpr int kCopiesK = kGt / (4 * kSeqs);
  const int gt = tid % kGt, value = gt / kCopiesK, sk = value / 4, copy_k = gt % kCopiesK;
  const int k = rank * Tile::kRows + tid / kGt * 4 + value % 4;
  const bool k_valid = k < K && seq0 + sk < B, k_writer = k_valid && copy_k == 0;
  const size_t row_k = static_cast<size_t>(seq0 + sk) * T;
  // W_cᵀ phase: this thread ends with d c_{t−1} of sequence si, unit i, then the four d heads of step t − 1.
  constexpr int kCopiesI = kGu / kSeqs;
  const int gu = tid % kGu, i = rank * Tile::kOwnUnits + tid / kGu, si = gu / kCopiesI, copy_i = gu % kCopiesI;
  const bool i_valid = i < C && seq0 + si < B, i_writer = i_valid && copy_i == 0;
  const size_t row_i = static_cast<size_t>(seq0 + si) * T;
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
  // d heads of step t from d c_t = dc + d c_t from the head.
  auto store_dheads = [&](int t, float dc) {
    const float grad = dc + grad_head, d_tau_pre = grad * (f2 - f1) * tau * (1.f - tau);
    const float d[4] = {grad * (1.f - tau) * (1.f - f1 * f1), grad * tau * (1.f - f2 * f2), d_tau_pre * dt_t,
                        d_tau_pre};
#pragma unroll
    for (int h = 0; h < 4; ++h) StoreToCluster<Tile::kCluster>(&dheads[si][h * kC + i], d[h], copy_i, kCopiesI);
    if (i_writer) {
      float* out = dp + (row_i + t) * 4 * C;
#pragma unroll
      for (int h = 0; h < 4; ++h) out[h * C + i] = d[h];
    }
  };
  PhaseBarrier<Tile::kCluster>();  // also: every block runs before the first distributed store
  load_step(T - 1);
  store_dheads(T - 1, 0.f);
  if (T > 1) load_step(T - 2);
  float bb_pre_t = k_valid ? bb_pre[(row_k + T - 1) * K + k] : 0.f;
  PhaseBarrier<Tile::kCluster>();
  for (int t = T - 1; t >= 0; --t) {
    {
      float acc[4 * kSeqs][1], total[1];
      {
        float by_seq[kSeqs][4];
        Zero(by_seq);
        TileDot<kSeqs, 4, Tile::kWt, kGt>(wt, reinterpret_cast<const float4*>(&dheads[0][0]), kC, gt, by_seq);
#pragma unroll
        for (int s = 0; s < kSeqs; ++s) {
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[4 * s + r][0] = by_seq[s][r];
        }
      }
      GroupReduceScatter<4 * kSeqs, 1, kGt>(acc, gt, total);
      const float v = total[0] * LecunTanhGrad(bb_pre_t);
      StoreToCluster<Tile::kCluster>(&dbb[sk][k], v, copy_k, kCopiesK);
      if (k_writer) dbb_pre[(row_k + t) * K + k] = v;
      if (k_valid && t > 0) bb_pre_t = bb_pre[(row_k + t - 1) * K + k];
    }
    PhaseBarrier<Tile::kCluster>();
    if (t == 0) break;  // no gradient flows into state_in
    {
      float acc[kSeqs][1], dc[1];
      Zero(acc);
      TileDot<kSeqs, 1, Tile::kWu, kGu>(wu, reinterpret_cast<const float4*>(&dbb[0][0]), kK / 4, gu, acc);
      GroupReduceScatter<kSeqs, 1, kGu>(acc, gu, dc);
      store_dheads(t - 1, dc[0]);
      if (t > 1) load_step(t - 2);
    }
    PhaseBarrier<Tile::kCluster>();
  }
}

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
                                  float* dbb_pre) {
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

cudaError_t Multiprocessors(int* sms) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

cudaError_t PlanCfcLaunch(const CfcShape& shape, size_t weight_floats, int per_seq_floats, CfcLaunch* plan) {
  int device = 0, sms = 0, max_shared = 0;
  if (const cudaError_t e = Multiprocessors(&sms); e != cudaSuccess) return e;
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

// Launches a tile kernel with the fewest sequences per cluster (1, 2 or 4) whose clusters all run at once: fewer
// sequences shorten every step, and a second wave would double the window's time.
template <typename Tile, typename Kernels, typename... Args>
cudaError_t LaunchTile(const CfcShape& shape, Kernels kernels, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(kTileThreads);
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
    if (const cudaError_t e = Multiprocessors(&capacity); e != cudaSuccess) return e;
  } else {
    config.gridDim = dim3(Tile::kCluster);
    if (const cudaError_t e = cudaOccupancyMaxActiveClusters(&capacity, kernels[0], &config); e != cudaSuccess) {
      return e;
    }
  }
  int pick = 0;
  while (pick < 2 && CeilDiv(shape.batch, 1 << pick) > capacity) ++pick;
  config.gridDim = dim3(CeilDiv(shape.batch, 1 << pick) * Tile::kCluster);
  return cudaLaunchKernelEx(&config, kernels[pick], args...);
}

bool ValidShape(const CfcShape& s) {
  return s.batch > 0 && s.window > 0 && s.d_model > 0 && s.units > 0 && s.backbone > 0;
}

}  // namespace

size_t CfcPackedFloats(const CfcShape& shape) {
  if (Fits<SmallTile>(shape)) return SmallTile::kPackedFloats;
  if (Fits<LargeTile>(shape)) return LargeTile::kPackedFloats;
  return ForwardWeightFloats(shape.units, shape.backbone) + BackwardWeightFloats(shape.units, shape.backbone);
}

cudaError_t LaunchCfcPackWeights(const CfcWeights& weights, const CfcShape& shape, float* packed, cudaStream_t stream) {
  if (!ValidShape(shape)) return cudaErrorInvalidValue;
  const dim3 grid = GridFor(static_cast<long long>(CfcPackedFloats(shape)), 256);
  if (Fits<SmallTile>(shape)) {
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
  if (Fits<SmallTile>(shape)) {
    const decltype(&CfcForwardTileKernel<SmallTile, 1>) kernels[] = {
        CfcForwardTileKernel<SmallTile, 1>, CfcForwardTileKernel<SmallTile, 2>, CfcForwardTileKernel<SmallTile, 4>};
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
                              cudaStream_t stream) {
  if (!ValidShape(shape)) return cudaErrorInvalidValue;
  if (Fits<SmallTile>(shape)) {
    const decltype(&CfcBackwardTileKernel<SmallTile, 1>) kernels[] = {
        CfcBackwardTileKernel<SmallTile, 1>, CfcBackwardTileKernel<SmallTile, 2>, CfcBackwardTileKernel<SmallTile, 4>};
    return LaunchTile<SmallTile>(shape, kernels, stream, shape, packed, dt, gates, bb_pre, dc_head, ld_dc_head, dp,
                                 dbb_pre);
  }
  if (Fits<LargeTile>(shape)) {
    const decltype(&CfcBackwardTileKernel<LargeTile, 1>) kernels[] = {
        CfcBackwardTileKernel<LargeTile, 1>, CfcBackwardTileKernel<LargeTile, 2>, CfcBackwardTileKernel<LargeTile, 4>};
    return LaunchTile<LargeTile>(shape, kernels, stream, shape, packed, dt, gates, bb_pre, dc_head, ld_dc_head, dp,
                                 dbb_pre);
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
                                                                     ld_dc_head, dp, dbb_pre);
    return cudaGetLastError();
  });
}

}  // namespace perception::kernels
