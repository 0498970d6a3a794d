// The streaming step kernel: a thread-block cluster carries groups of events through the whole model. A tick is a
// chain of about a dozen dependent products, so what sets its latency is how long each link waits: every block
// starts bulk copies of its rows of every product (and the norms' weights) into shared memory at launch, in stage
// order, and each stage waits only for its own rows, so the loads run under the chain instead of inside it. The
// states of the block's rows are prefetched the same way. Matrix products are split by rows over the cluster's blocks
// (eight lanes per row, four consecutive inputs per lane) and each result is stored into every block's shared memory
// through distributed shared memory, fused with what the row's owner can finish alone (the causal conv, softplus,
// the residual, the CfC update, the GRN gate), then the cluster synchronizes. A layer's in_proj is split by SSM rows:
// each block computes its share of the few B, C and Δt rows every SSM row needs and sends them out first, then the z
// and x rows of its own SSM rows, so the exchange's latency hides under that product and the SSM update and its gate
// follow in the same stage. A layer's two RMSNorms are folded into the products that read them (the weights into the
// rows, 1/rms applied to the sums), and the GRN's fc1 into gate and value. Every sum runs in one fixed order, whatever
// the launch shape.
#include <cooperative_groups.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <type_traits>
#include <utility>

#include "kernels/common.cuh"
#include "kernels/mbarrier.cuh"
#include "kernels/stream_step.h"

namespace perception::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kStreamThreads = 256;
constexpr int kStreamWarps = kStreamThreads / kWarpSize;
constexpr int kLanesPerRow = 8;
constexpr int kRowGroups = kStreamThreads / kLanesPerRow;
constexpr int kMaxEvents = 8;
constexpr int kMaxStages = 3 * kStreamMaxLayers + 6;
// Results cross the cluster at the end of every stage but the head's output (exchange x belongs to stage x); which
// ones do depends on the stages' modes.
constexpr int kMaxExchanges = kMaxStages - 1;
static_assert(kMaxExchanges <= kWarpSize, "a warp's lanes arm the exchanges");
// The launch's copies (shared vectors, then each stage's rows), the exchanges, and the group's bulk-copied SSM states.
constexpr int kBarriers = 1 + kMaxStages + kMaxExchanges + 1;

__host__ __device__ constexpr int Align4(int n) { return (n + 3) / 4 * 4; }
// A running count of floats that hands out 16-byte aligned runs in order: Take(n) is where the next n start.
struct FloatRuns {
  int at = 0;
  __host__ __device__ constexpr int Take(int n) {
    const int start = at;
    at += Align4(n);
    return start;
  }
};

// Where an event's head activations start, in the order the head writes them: [s ; c_t] (the final norm's output,
// then the CfC state), the backbone, ELU(fc2), the skip, the GRN's pre-norm sum, its gated output and the logits. The
// cluster kernel and the wide head lay them out alike.
struct HeadRuns {
  int a, bb, e2, skip, pre, g, logits;
  bool operator==(const HeadRuns&) const = default;
};
__host__ __device__ constexpr HeadRuns TakeHeadRuns(FloatRuns& runs, int D, int C, int K, int G, int H) {
  HeadRuns r{};
  r.a = runs.Take(D + C);
  r.bb = runs.Take(K);
  r.e2 = runs.Take(G);
  r.skip = runs.Take(G);
  r.pre = runs.Take(G);
  r.g = runs.Take(G);
  r.logits = runs.Take(H);
  return r;
}

// kInProjShared: a layer's B, C and Δt rows of in_proj; kInProjHeads: its z and x rows, a unit per SSM row.
enum StageKind : int {
  kEmbed, kInProjShared, kInProjHeads, kOutProj, kBackbone, kCfcHeads, kFc2Skip, kGateValue, kHeadOut
};

// How a product's rows are spread: over the cluster (results exchanged), or all on rank 0 (the head's output). Every
// product but the last is split, the embedding and the GRN's gate/value too: one row per row group and an exchange
// measured faster than all rows on every block (or on rank 0) and no exchange.
enum StageMode : int { kSplit, kRankZero };

// One product in the pack: `units` row units of `outputs` weight rows each (padded to in_pad with zeros) followed by
// `params` per-unit constants (biases, conv taps), `stride` floats per unit.
struct PackStage {
  int kind, layer, units, outputs, in, in_pad, params, stride, pack, mode;
  bool operator==(const PackStage&) const = default;
};

// Where everything lives: the pack (independent of the launch) and one block's shared memory for a launch shape.
// All offsets are in floats and multiples of 4.
struct StreamPlan {
  int F, D, L, E, P, Hh, N, W, C, K, G, H;
  int stages;
  PackStage stage[kMaxStages];
  // Vectors every block needs whole (standardization, SSM constants, the final norms), at shared_pack in the pack;
  // offsets within the section. (A layer's two RMSNorm weights are folded into the rows of the product that reads the
  // norm.)
  int shared_pack, shared_size;
  int mean, inv_std, a_log[kStreamMaxLayers], skip_d[kStreamMaxLayers], norm_f, ln_w, ln_b;
  int pack_size;

  // A launch shape: clusters of `cluster` blocks, groups of `events` events.
  int cluster, events;
  int bars, meta, rows, shared, stage_at[kMaxStages];  // stage_at: −1 when the stage is read from the pack in global memory
  int ev_base, per_event;                        // event e's activations at ev_base + e·per_event
  int xn, h, bcdt, y;  // offsets within an event's activations: the layers', the head's, the carried conv inputs'
  HeadRuns head;
  int conv;
  int rstd_h, rstd_y;  // 1/rms of h and y, for groups of several events
  // Conv state channels per layer and tap: the block's x channels (up to ssm_rows), then B's and C's (2N).
  int conv_channels, ssm_rows;
  int ssm_base;  // the block's SSM rows per event and layer, or −1 when they are read from global memory
  int floats;
  bool operator==(const StreamPlan&) const = default;
};

__host__ __device__ constexpr void RowRange(const PackStage& s, int cluster, int rank, int& r0, int& r1) {
  if (s.mode == kSplit) {
    r0 = rank * s.units / cluster;
    r1 = (rank + 1) * s.units / cluster;
  } else {
    r0 = 0;
    r1 = rank == 0 ? s.units : 0;
  }
}

__host__ __device__ constexpr StreamPlan MakePackPlan(const StreamWeights& w) {
  StreamPlan p{};
  p.F = w.F, p.D = w.D, p.L = w.L, p.E = w.E, p.P = w.P, p.Hh = w.Hh, p.N = w.N, p.W = w.W, p.C = w.C, p.K = w.K,
  p.G = w.G, p.H = w.H;
  int at = 0;
  auto add = [&](int kind, int layer, int units, int outputs, int in, int params, int mode) {
    PackStage& s = p.stage[p.stages++];
    s = PackStage{kind, layer, units, outputs, in, Align4(in), params, outputs * Align4(in) + Align4(params), at, mode};
    at += units * s.stride;
  };
  const int DC = w.D + w.C;
  add(kEmbed, 0, w.D, 1, w.F, 1, kSplit);
  for (int l = 0; l < w.L; ++l) {
    add(kInProjShared, l, 2 * w.N + w.Hh, 1, w.D, w.W + 1, kSplit);  // conv taps and bias of B, C; dt_bias
    add(kInProjHeads, l, w.E, 2, w.D, w.W + 1, kSplit);                   // z and x rows; x's conv taps and bias
    add(kOutProj, l, w.D, 1, w.E, 0, kSplit);
  }
  add(kBackbone, 0, w.K, 1, DC, 1, kSplit);
  add(kCfcHeads, 0, w.C, 4, w.K, 4, kSplit);  // ff1, ff2, time_a, time_b of one unit together: its owner updates c
  add(kFc2Skip, 0, w.G, 2, DC, 1, kSplit);
  add(kGateValue, 0, w.G, 2, w.G, 2, kSplit);  // of e2: fc1 is folded into gate and value
  add(kHeadOut, 0, w.H, 1, w.G, 1, kRankZero);
  p.shared_pack = at;
  FloatRuns sh;
  p.mean = sh.Take(w.F);
  p.inv_std = sh.Take(w.F);
  for (int l = 0; l < w.L; ++l) {
    p.a_log[l] = sh.Take(w.Hh);
    p.skip_d[l] = sh.Take(w.Hh);
  }
  p.norm_f = sh.Take(w.D);
  p.ln_w = sh.Take(w.G);
  p.ln_b = sh.Take(w.G);
  p.shared_size = sh.at;
  p.pack_size = at + sh.at;
  return p;
}

// Lays one block's shared memory out for a launch shape; false when the activations do not fit. Then the shared
// vectors, the SSM rows and the stages' rows take what is left, in that order (the chain's order).
__host__ __device__ constexpr bool Layout(StreamPlan& p, int events, int cluster, size_t max_shared_bytes) {
  p.cluster = cluster;
  p.events = events;
  const int budget = static_cast<int>(max_shared_bytes / sizeof(float));
  const int W1 = p.W - 1;
  int at = 0;
  p.bars = at;
  at += Align4(2 * kBarriers);  // 8-byte mbarriers
  p.meta = at;
  at += 4 * kMaxEvents;  // slot ids, Δt, log entry numbers (8 bytes)
  p.rows = at;
  at += Align4(2 * kMaxStages);  // the block's first and end row of every stage
  p.ssm_rows = CeilDiv(p.E, cluster);
  p.conv_channels = p.ssm_rows + 2 * p.N;
  FloatRuns ev;
  p.xn = ev.Take(p.F);
  p.h = ev.Take(p.D);
  p.bcdt = ev.Take(2 * p.N + p.Hh);
  p.y = ev.Take(p.E);
  p.head = TakeHeadRuns(ev, p.D, p.C, p.K, p.G, p.H);
  p.conv = ev.Take(p.L * W1 * p.conv_channels);
  p.rstd_h = ev.Take(1);
  p.rstd_y = ev.Take(1);
  p.per_event = ev.at;
  p.ev_base = at;
  at += events * ev.at;
  p.shared = at;
  at += p.shared_size;
  if (at > budget) return false;
  const int ssm = events * p.L * p.ssm_rows * p.N;
  p.ssm_base = at + ssm <= budget ? at : -1;
  if (p.ssm_base >= 0) at += Align4(ssm);
  for (int s = 0; s < p.stages; ++s) {
    const PackStage& st = p.stage[s];
    const int rows = st.mode == kSplit ? CeilDiv(st.units, cluster) : st.units;
    p.stage_at[s] = at + rows * st.stride <= budget ? at : -1;
    if (p.stage_at[s] >= 0) at += rows * st.stride;
  }
  p.floats = at;
  return true;
}

bool Supported(const StreamWeights& w) {
  return w.L >= 1 && w.L <= kStreamMaxLayers && w.W >= 1 && w.W <= kStreamMaxConvTaps &&
         w.F <= kStreamThreads && w.C <= kStreamThreads && w.P > 0 && w.E == w.Hh * w.P;
}

// The one-event launch shapes of the shipped configs (engine/config.cc) whose plan is compiled into a kernel of its
// own: a tick's chain is a run of instructions each executed once, and with the plan known at compile time its
// offsets are immediates, its stage loops unroll and no plan value is read at a run-time index. A launch takes such a
// kernel when its plan equals the fixed one (the layout records no budget, so any device with room for it); any
// other shape takes the kernel that reads the launch's plan. The shapes: `small`'s one-instrument tick, clusters of 8
// with every weight in shared memory (laid out within the H200's 227 KB), with the features of every LOBSTER book
// level count from 1 to 10 (4·levels + 8: 12 … 48; the preset's 40 are 8 levels, the shipped AMZN day's 12, AAPL's
// 48), so that any LOBSTER-fed `small` model's lone events get the resident step.
constexpr size_t kFixedSharedBytes = 232448;
__host__ __device__ constexpr StreamWeights SmallDims(int features) {
  StreamWeights w{};
  w.F = features, w.D = 128, w.L = 2, w.E = 256, w.P = 64, w.Hh = 4, w.N = 32, w.W = 4, w.C = 64, w.K = 128, w.G = 64,
  w.H = 5;
  return w;
}
constexpr int kFixedShapes = 10;
__host__ __device__ constexpr int FixedFeatures(int shape) {
  constexpr int kFeatures[kFixedShapes] = {40, 12, 16, 20, 24, 28, 32, 36, 44, 48};
  return kFeatures[shape];
}
__host__ __device__ constexpr StreamPlan FixedPlan(int shape) {
  StreamPlan p = MakePackPlan(SmallDims(FixedFeatures(shape)));
  Layout(p, 1, 8, kFixedSharedBytes);
  return p;
}
// In constant memory, where device code may read it: read at compile-time indices (all of the fixed kernels' reads),
// its values become immediates.
struct FixedPlanTable {
  StreamPlan plan[kFixedShapes];
  __host__ __device__ constexpr const StreamPlan& operator[](int shape) const { return plan[shape]; }
};
template <int... kShapes>
constexpr FixedPlanTable FixedPlans(std::integer_sequence<int, kShapes...>) {
  return {{FixedPlan(kShapes)...}};
}
__constant__ constexpr FixedPlanTable kFixedPlans = FixedPlans(std::make_integer_sequence<int, kFixedShapes>());
// A fixed plan's lone event keeps its slot's carried conv inputs as the slot holds them ([L][W−1][E + 2N], every
// channel), after the plan's floats: one bulk copy brings them in (the plan's own layout, the block's channels of
// each layer and tap, took 2·L·(W−1) copies, and each bulk copy costs its thread ~150–190 cycles to issue).
__host__ __device__ constexpr int SlotConvFloats(const StreamPlan& p) {
  return Align4(p.L * (p.W - 1) * (p.E + 2 * p.N));
}
static_assert((FixedPlan(0).floats + SlotConvFloats(FixedPlan(0))) * sizeof(float) <= kFixedSharedBytes,
              "the fixed plan's slot conv inputs fit");
// Whether no product of a plan reads padding (every input's length a multiple of 4): then, with lone events, every
// activation is written before it is read.
__host__ __device__ constexpr bool Unpadded(const StreamPlan& p) {
  for (int s = 0; s < p.stages; ++s) {
    if (p.stage[s].in != p.stage[s].in_pad) return false;
  }
  return true;
}

// How many warps hold rows of stage si in the block with the most (row group g: threads 8g..8g+7).
__host__ __device__ constexpr int RowWarps(const StreamPlan& p, int si) {
  int most = 0;
  for (int rank = 0; rank < p.cluster; ++rank) {
    int r0 = 0, r1 = 0;
    RowRange(p.stage[si], p.cluster, rank, r0, r1);
    most = r1 - r0 > most ? r1 - r0 : most;
  }
  return CeilDiv((most < kRowGroups ? most : kRowGroups) * kLanesPerRow, kWarpSize);
}

// Whether a lone event's carried states (its SSM rows, conv and CfC states) can be bulk-copied in a plan: every run
// a multiple of 16 bytes at 16-byte aligned offsets (the slots' arrays are 256-byte aligned).
__host__ __device__ constexpr bool BulkCarried(const StreamPlan& p) {
  return p.ssm_base >= 0 && p.E % (4 * p.cluster) == 0 && p.N % 4 == 0 && p.ssm_rows % 4 == 0 &&
         p.conv_channels % 4 == 0 && p.C % 4 == 0 && p.D % 4 == 0;
}

// ---- Pack construction (once per published parameter set) ----

__device__ const float* PackRow(const StreamWeights& w, const PackStage& s, int u, int m) {
  const int DC = w.D + w.C;
  switch (s.kind) {
    case kEmbed: return w.embed_w + static_cast<size_t>(u) * w.F;
    case kInProjShared: return w.layers[s.layer].in_proj + static_cast<size_t>(2 * w.E + u) * w.D;
    case kInProjHeads: return w.layers[s.layer].in_proj + static_cast<size_t>(m * w.E + u) * w.D;
    case kOutProj: return w.layers[s.layer].out_proj + static_cast<size_t>(u) * w.E;
    case kBackbone: return w.backbone_w + static_cast<size_t>(u) * DC;
    case kCfcHeads: {
      const float* heads[4] = {w.ff1_w, w.ff2_w, w.time_a_w, w.time_b_w};
      return heads[m] + static_cast<size_t>(u) * w.K;
    }
    case kFc2Skip: return (m == 0 ? w.fc2_w : w.skip_w) + static_cast<size_t>(u) * DC;
    case kGateValue: return (m == 0 ? w.gate_w : w.value_w) + static_cast<size_t>(u) * w.G;
    default: return w.out_w + static_cast<size_t>(u) * w.G;
  }
}

// Weight k of output m of row unit u as the kernel reads it. A layer's RMSNorm weights are folded into the products
// that read the norm: rmsnorm(v, w)·Wᵀ = (v·(W ⊙ w)ᵀ) / rms(v). The GRN's fc1 is folded into gate and value, as no
// activation lies between them: gate(fc1(e)) = (W_gate·W_fc1)·e + W_gate·b_fc1 + b_gate (in double), one product
// fewer in the chain.
__device__ float PackWeight(const StreamWeights& w, const PackStage& s, int u, int m, int k) {
  const float* row = PackRow(w, s, u, m);
  switch (s.kind) {
    case kInProjShared:
    case kInProjHeads: return row[k] * w.layers[s.layer].norm[k];
    case kOutProj: return row[k] * w.layers[s.layer].mixer_norm[k];
    case kGateValue: {
      double sum = 0.0;
      for (int j = 0; j < w.G; ++j) sum += static_cast<double>(row[j]) * w.fc1_w[static_cast<size_t>(j) * w.G + k];
      return static_cast<float>(sum);
    }
    default: return row[k];
  }
}

__device__ float PackParam(const StreamWeights& w, const PackStage& s, int u, int q) {
  switch (s.kind) {
    case kEmbed: return w.embed_b[u];
    case kInProjShared: {
      const StreamLayerWeights& lw = w.layers[s.layer];
      const int c = w.E + u;  // the conv channel of a B or C row
      if (u < 2 * w.N) return q < w.W ? lw.conv_weight[c * w.W + q] : lw.conv_bias[c];
      return q == 0 ? lw.dt_bias[u - 2 * w.N] : 0.f;
    }
    case kInProjHeads: {
      const StreamLayerWeights& lw = w.layers[s.layer];
      return q < w.W ? lw.conv_weight[u * w.W + q] : lw.conv_bias[u];
    }
    case kBackbone: return w.backbone_b[u];
    case kCfcHeads: {
      const float* biases[4] = {w.ff1_b, w.ff2_b, w.time_a_b, w.time_b_b};
      return biases[q][u];
    }
    case kFc2Skip: return w.fc2_b[u];
    case kGateValue: {
      const float* row = PackRow(w, s, u, q);
      double sum = q == 0 ? w.gate_b[u] : w.value_b[u];
      for (int j = 0; j < w.G; ++j) sum += static_cast<double>(row[j]) * w.fc1_b[j];
      return static_cast<float>(sum);
    }
    case kHeadOut: return w.out_b[u];
    default: return 0.f;
  }
}

__device__ float SharedValue(const StreamWeights& w, const StreamPlan& p, int i) {
  auto in = [i](int start, int len) { return i >= start && i < start + len; };
  if (in(p.mean, w.F)) return w.norm_mean[i - p.mean];
  if (in(p.inv_std, w.F)) return w.norm_inv_std[i - p.inv_std];
  for (int l = 0; l < w.L; ++l) {
    const StreamLayerWeights& lw = w.layers[l];
    if (in(p.a_log[l], w.Hh)) return lw.a_log[i - p.a_log[l]];
    if (in(p.skip_d[l], w.Hh)) return lw.d[i - p.skip_d[l]];
  }
  if (in(p.norm_f, w.D)) return w.norm_f[i - p.norm_f];
  if (in(p.ln_w, w.G)) return w.ln_w[i - p.ln_w];
  if (in(p.ln_b, w.G)) return w.ln_b[i - p.ln_b];
  return 0.f;  // alignment padding
}

__global__ void PackKernel(const __grid_constant__ StreamWeights w, const __grid_constant__ StreamPlan p, float* pack) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.pack_size; i += gridDim.x * blockDim.x) {
    float v = 0.f;
    if (i >= p.shared_pack) {
      v = SharedValue(w, p, i - p.shared_pack);
    } else {
      int si = 0;
      while (si + 1 < p.stages && i >= p.stage[si + 1].pack) ++si;
      const PackStage& s = p.stage[si];
      const int offset = i - s.pack, u = offset / s.stride, o = offset % s.stride;
      if (o < s.outputs * s.in_pad) {
        const int m = o / s.in_pad, k = o % s.in_pad;
        if (k < s.in) v = PackWeight(w, s, u, m, k);
      } else if (o - s.outputs * s.in_pad < s.params) {
        v = PackParam(w, s, u, o - s.outputs * s.in_pad);
      }
    }
    pack[i] = v;
  }
}

// ---- Asynchronous copies and barriers (PTX) ----

__device__ __forceinline__ void BarrierInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddress(bar)) : "memory");
}
__device__ __forceinline__ void BarrierInitFence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Arrives once, expecting `bytes` of bulk copies to complete the barrier's first phase.
__device__ __forceinline__ void BarrierExpect(uint64_t* bar, uint32_t bytes) {
  MbarrierArriveExpect(SharedAddress(bar), bytes);
}
__device__ __forceinline__ void BulkCopy(float* dst, const float* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   SharedAddress(dst)),
               "l"(src), "r"(bytes), "r"(SharedAddress(bar))
               : "memory");
}
// Waits for the barrier's first phase (every barrier here completes exactly once per launch).
__device__ __forceinline__ void BarrierWait(uint64_t* bar) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(SharedAddress(bar))
      : "memory");
}
// Distributed shared memory: this block's shared address as seen in block `rank`, and a 4-byte store there that
// signals the barrier at `remote_bar` (also in block `rank`) when it lands.
__device__ __forceinline__ uint32_t MapToRank(uint32_t address, int rank) {
  uint32_t mapped;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(mapped) : "r"(address), "r"(rank));
  return mapped;
}
__device__ __forceinline__ void StoreRemote(uint32_t address, float v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(address),
               "r"(__float_as_uint(v)), "r"(remote_bar)
               : "memory");
}
// Waits for phase `parity` of a barrier that completes once per group: an exchange's, whose bytes come from every
// block of the cluster, or the group's SSM states'.
__device__ __forceinline__ void ExchangeWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(SharedAddress(bar)),
      "r"(parity)
      : "memory");
}
// The cluster barrier in halves: arrive (releasing this block's earlier writes, the barriers' initialization among
// them) and wait, so that work can run in between.
__device__ __forceinline__ void ClusterArrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void CopyAsync4(float* dst, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(SharedAddress(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void CopyAsync16(float* dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(SharedAddress(dst)), "l"(src) : "memory");
}
// A 16-byte copy under an L2 policy (EvictFirstPolicy, kernels/common.cuh).
__device__ __forceinline__ void CopyAsync16(float* dst, const float* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(SharedAddress(dst)), "l"(src),
               "l"(policy)
               : "memory");
}
__device__ __forceinline__ void CopyAsyncWaitAll() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Zeros shared memory by a copy of no source bytes (cp.async's zero fill), so that whatever tracks this thread's
// copies (CopyAsyncArrive, cp.async.wait_all) covers the zeros too; `any` is any valid global address (none is read).
__device__ __forceinline__ void CopyAsyncZeros4(float* dst, const float* any) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, 0;" ::"r"(SharedAddress(dst)), "l"(any) : "memory");
}
__device__ __forceinline__ void CopyAsyncZeros16(float* dst, const float* any) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, 0;" ::"r"(SharedAddress(dst)), "l"(any) : "memory");
}
// This thread's one arrival on the barrier's current phase, made once its earlier cp.async copies have all landed
// (.noinc: the arrival is one of those the barrier counts, not an extra pending one that the thread must arrive for
// again, which synccheck reported as a second arrive without a wait).
__device__ __forceinline__ void CopyAsyncArrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(SharedAddress(bar)) : "memory");
}

// Sum over the eight lanes of a row group (butterfly: every lane ends with the same bits).
__device__ __forceinline__ float RowSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v;
}

// ---- Per-unit math of the step, one copy for the cluster kernel and the wide path (so both give the same bits) ----

// Calls f(i) for i = first, first + step, … below n, in order (first < step). kUnrolled (n known at compile time once
// inlined, as with a fixed plan): as ceil(n / step) steps, unrolled.
template <bool kUnrolled, typename F>
__device__ __forceinline__ void StridedFor(int first, int n, int step, F&& f) {
  if constexpr (kUnrolled) {
#pragma unroll
    for (int j = 0; j < CeilDiv(n, step); ++j) {
      if (first + j * step < n) f(first + j * step);
    }
  } else {
#pragma unroll 1
    for (int i = first; i < n; i += step) f(i);
  }
}

// A channel's causal conv before its SiLU: the bias, the newest tap times v, then the carried inputs oldest first
// (old[k·stride]); prm holds the W taps, oldest first, then the bias.
template <bool kUnrolled = false>
__device__ __forceinline__ float ConvTaps(const float* prm, int W1, float v, const float* old, size_t stride) {
  float conv = prm[W1 + 1] + prm[W1] * v;
  StridedFor<kUnrolled>(0, W1, 1, [&](int k) { conv += prm[k] * old[k * stride]; });
  return conv;
}

// An element of an SSM row: its new state decay·state + (Δt·x)·B, and the readout's running sum with C·state added.
// The roundings are spelled out, so that every caller gets the same bits.
__device__ __forceinline__ float SsmState(float decay, float state, float dt_x, float b) {
  return __fmaf_rn(decay, state, __fmul_rn(dt_x, b));
}
__device__ __forceinline__ float SsmReadout(float sum, float c, float state) { return __fmaf_rn(c, state, sum); }

// One lane's share of an SSM row (d_state N, eight lanes): the new states of n = lane, lane + 8, …, stored to `out`
// when given (state null: a zero state; out may be state), and the lane's part of the readout Σ C n·state n.
// kInPlace: state is given and out is state.
template <bool kInPlace = false>
__device__ __forceinline__ float SsmRowShare(const float* state, float* out, const float* bc, float decay, float dt_x,
                                             int N, int lane) {
  float sum = 0.f;
  for (int n = lane; n < N; n += kLanesPerRow) {
    const float s_new = SsmState(decay, kInPlace || state ? state[n] : 0.f, dt_x, bc[n]);
    if (kInPlace || out) out[n] = s_new;
    sum = SsmReadout(sum, bc[N + n], s_new);
  }
  return sum;
}

// y of an SSM row after the skip and the gate.
__device__ __forceinline__ float GatedY(float y, float skip_d, float xc, float z) {
  return (y + skip_d * xc) * Silu(z);
}

// The CfC update of one unit from its four heads' sums (ff1, ff2, time_a, time_b) and biases.
__device__ __forceinline__ float CfcUnit(float ff1, float ff2, float time_a, float time_b, const float* prm, float dt) {
  const float tau = Sigmoid((time_a + prm[2]) * dt + (time_b + prm[3]));
  return tanhf(ff1 + prm[0]) * (1.f - tau) + tau * tanhf(ff2 + prm[1]);
}

// The GRN's pre-norm output: the skip plus the gated value.
__device__ __forceinline__ float GrnPre(float skip, float gate, float value, const float* prm) {
  return skip + Sigmoid(gate + prm[0]) * (value + prm[1]);
}

// The GRN's layer norm of one event, by one whole warp.
template <bool kUnrolled = false>
__device__ __forceinline__ void GrnLayerNorm(const float* pre, float* out, const float* ln_w, const float* ln_b, int G,
                                             int lane) {
  float sum = 0.f;
  StridedFor<kUnrolled>(lane, G, kWarpSize, [&](int i) { sum += pre[i]; });
  const float mean = WarpSum(sum) / G;
  float var = 0.f;
  StridedFor<kUnrolled>(lane, G, kWarpSize, [&](int i) { var += (pre[i] - mean) * (pre[i] - mean); });
  const float rstd = 1.f / sqrtf(WarpSum(var) / G + kNormEps);
  StridedFor<kUnrolled>(lane, G, kWarpSize, [&](int i) { out[i] = (pre[i] - mean) * rstd * ln_w[i] + ln_b[i]; });
}

// The index of the most confident horizon of an event's logits (MODEL.md §2.8: |p − ½| largest, lowest on ties).
// |σ(l) − ½| grows with |l|, so the logits decide: float32 probabilities would round exact ties apart (σ(−l) and σ(l)
// round differently) and make every logit past ~17 tie at ½ from its probability. A NaN is never the most confident.
__device__ __forceinline__ int MostConfident(const float* logits, int H) {
  int best = 0;
  float best_magnitude = -1.f;
  for (int h = 0; h < H; ++h) {
    if (fabsf(logits[h]) > best_magnitude) {
      best_magnitude = fabsf(logits[h]);
      best = h;
    }
  }
  return best;
}

// A logged event's logit came out not finite: the slot's first such entry since the host zeroed it, for the host.
// The fence makes the word visible to the host before the resident step's answer, which follows this thread's next
// barrier, is written: a host that has seen the answer (Backend::CheckTicks) sees the word.
__device__ __forceinline__ void NoteNonFinite(const StreamSlots& st, int slot, int64_t entry_number) {
  if (st.first_nonfinite[slot] == 0) st.first_nonfinite[slot] = entry_number + 1;
  *st.nonfinite_seen = 1;
  __threadfence_system();
}

// Probabilities, conviction and the log entry of one logged event: its number, at ring position `position`.
__device__ __forceinline__ void WriteOutputs(const float* logits, const StreamSlots& st, int slot, int64_t position,
                                             int64_t entry_number, int H) {
  const size_t entry = static_cast<size_t>(slot) * st.log_entries + position;
  bool finite = true;
  for (int h = 0; h < H; ++h) {
    finite = finite && isfinite(logits[h]);
    const float prob = Sigmoid(logits[h]);
    st.probs[slot * H + h] = prob;
    st.log_probs[entry * H + h] = prob;
  }
  st.log_convictions[entry] = 2.f * Sigmoid(logits[MostConfident(logits, H)]) - 1.f;
  if (!finite) NoteNonFinite(st, slot, entry_number);
}

// ---- The step ----

template <int EG, int M>
struct RowSums {
  float v[M][EG];
  float squares;  // Σ input² of a lone event, when asked for (a folded RMSNorm's)
};

// A lane's share of Σ v² in the products' order (its inputs 4j..4j+3, 4j+32, …), one step.
__device__ __forceinline__ float AddSquares(float sum, float4 x) {
  sum = fmaf(x.x, x.x, sum);
  sum = fmaf(x.y, x.y, sum);
  sum = fmaf(x.z, x.z, sum);
  return fmaf(x.w, x.w, sum);
}
__device__ __forceinline__ float InverseRms(float squares, int n) { return 1.f / sqrtf(squares / n + kNormEps); }

// A lane's step of a row group's sums (SumRows): inputs i..i+3 of each event, in[e·per_event + i, +4).
template <int EG>
__device__ __forceinline__ void LoadInputs(float4 (&x)[EG], const float* in, int per_event, int i) {
#pragma unroll
  for (int e = 0; e < EG; ++e) x[e] = *reinterpret_cast<const float4*>(in + e * per_event + i);
}
// One event's product of one output's weights wv with inputs x, added to v in order: every row sum of the streaming
// kernels adds its steps this way, so that their paths give the same bits.
__device__ __forceinline__ float AddProductStep(float v, float4 wv, float4 x) {
  v += wv.x * x.x;
  v += wv.y * x.y;
  v += wv.z * x.z;
  return v + wv.w * x.w;
}
// ... and the products with them of one output's weights wv, added to v[e] in order.
template <int EG>
__device__ __forceinline__ void AddProduct(float (&v)[EG], float4 wv, const float4 (&x)[EG]) {
#pragma unroll
  for (int e = 0; e < EG; ++e) v[e] = AddProductStep(v[e], wv, x[e]);
}
// ... of M outputs' weights (output m's at w + m·in_pad), added to v[m][e].
template <int EG, int M>
__device__ __forceinline__ void AddProducts(float (*v)[EG], const float* w, int in_pad, int i, const float4 (&x)[EG]) {
#pragma unroll
  for (int m = 0; m < M; ++m) AddProduct<EG>(v[m], *reinterpret_cast<const float4*>(w + m * in_pad + i), x);
}

// One step of a lane's sums (RowSumsOf): inputs i..i+3 of each event.
template <int EG, int M>
__device__ __forceinline__ void SumStep(RowSums<EG, M>& sums, const float* wu, const float* in, int in_pad,
                                        int per_event, int i, bool squares) {
  float4 x[EG];
  LoadInputs<EG>(x, in, per_event, i);
  if (EG == 1 && squares) sums.squares = AddSquares(sums.squares, x[0]);
  AddProducts<EG, M>(sums.v, wu, in_pad, i, x);
}

// One row unit's M products for every event of the group: lane j of the row group sums inputs 4j..4j+3, 4j+32..,
// in order, then the group adds its lanes. Every lane of the warp calls it (the lanes of a row past the block's rows
// with active = false, and get zeros). With `squares` (a lone event), the row group also sums its inputs' squares, so
// that a norm folded into the product needs no pass of its own; the sum has the bits of NormScales's. kUnrolled (a
// length known at compile time once inlined): the lane's steps as a loop of fixed count, unrolled.
template <int EG, int M, bool kUnrolled>
__device__ __forceinline__ RowSums<EG, M> RowSumsOf(const float* wu, const float* in, int in_pad, int per_event,
                                                    int lane, bool active, bool squares) {
  RowSums<EG, M> sums;
  sums.squares = 0.f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int e = 0; e < EG; ++e) sums.v[m][e] = 0.f;
  }
  if constexpr (kUnrolled) {
    if (active) {  // (one branch around the steps, so that their loads are issued together)
#pragma unroll
      for (int j = 0; j < CeilDiv(in_pad, 4 * kLanesPerRow); ++j) {
        const int i = lane * 4 + j * 4 * kLanesPerRow;
        if (i < in_pad) SumStep<EG, M>(sums, wu, in, in_pad, per_event, i, squares);
      }
    }
  } else {
    for (int i = lane * 4; active && i < in_pad; i += 4 * kLanesPerRow) {
      SumStep<EG, M>(sums, wu, in, in_pad, per_event, i, squares);
    }
  }
  if (EG == 1 && squares) sums.squares = RowSum(sums.squares);
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int e = 0; e < EG; ++e) sums.v[m][e] = RowSum(sums.v[m][e]);
  }
  return sums;
}
// Not inlined where the lengths come from the launch's plan: a tick runs most of the kernel's instructions once, on
// an SM whose instruction cache is likely cold (ncu counts instruction-fetch stalls), so one copy of the loop serves
// every product.
template <int EG, int M>
__device__ __noinline__ RowSums<EG, M> SumRows(const float* wu, const float* in, int in_pad, int per_event, int lane,
                                               bool active, bool squares) {
  return RowSumsOf<EG, M, false>(wu, in, in_pad, per_event, lane, active, squares);
}

// For groups of several events: 1/rms of each event's in[0, n) (n_pad with its zero padding) at `out` of its
// activations, a row group per event summing in SumRows's order (so every launch shape gets the same bits), then the
// block synchronizes. A lone event's products sum the squares themselves instead, under the product.
template <int EG>
__device__ __noinline__ void NormScales(float* ev, int per_event, int in, int n, int n_pad, int out) {
  const int group = threadIdx.x / kLanesPerRow, lane = threadIdx.x % kLanesPerRow;
  if (threadIdx.x < RoundUpToWarp(EG * kLanesPerRow)) {  // whole warps: the row sum's shuffles take every lane
    const float* v = ev + group * per_event + in;
    float squares = 0.f;
    for (int i = lane * 4; group < EG && i < n_pad; i += 4 * kLanesPerRow) {
      squares = AddSquares(squares, *reinterpret_cast<const float4*>(v + i));
    }
    squares = RowSum(squares);
    if (group < EG && lane == 0) ev[group * per_event + out] = InverseRms(squares, n);
  }
  __syncthreads();
}

// The block's rows of stage `si`, `outputs` products each, for every event of the group: row group (eight lanes)
// g takes rows r0+g, r0+g+32, ….
// With norm_n > 0 the input is the RMSNorm of its first norm_n values (the weight is in the rows): the sums are scaled
// by 1/rms, which a lone event's first row of each row group computes under the product and larger groups read from
// `rstd_offset` of each event's activations (NormScales).
// `epilogue(u, acc, params, lane, active)` receives the finished sums of row unit u (every lane of the group gets
// them); every row group of the block calls it, those past the block's last row with active = false (so that an
// epilogue may use the whole warp), and they must not touch u's sums or params.
// kFixed: the plan is known at compile time (the block's rows follow from its rank; the sums are inlined).
template <int EG, int M, bool kFixed, typename Epilogue>
__device__ __forceinline__ void Products(const StreamPlan& p, int si, int rank, const float* pack, float* smem,
                                         uint64_t* bars, int in_offset, int norm_n, int rstd_offset,
                                         Epilogue&& epilogue) {
  const PackStage& s = p.stage[si];
  int r0, r1;
  if constexpr (kFixed) {
    RowRange(s, p.cluster, rank, r0, r1);
  } else {
    const int* rows = reinterpret_cast<const int*>(smem + p.rows);
    r0 = rows[2 * si];
    r1 = rows[2 * si + 1];
  }
  const float* weights;
  if (p.stage_at[si] >= 0) {
    BarrierWait(bars + 1 + si);
    weights = smem + p.stage_at[si];
  } else {
    weights = pack + s.pack + static_cast<size_t>(r0) * s.stride;
  }
  const int group = threadIdx.x / kLanesPerRow, lane = threadIdx.x % kLanesPerRow;
  const float* in = smem + p.ev_base + in_offset;
  // A fixed plan's inputs' padded length: a folded norm spans the whole input, and its length, unlike the stage's
  // fields inside the layer loop, is a constant before the loops unroll, so that the sums' steps unroll fully.
  const int fixed_in_pad = norm_n > 0 ? Align4(norm_n) : s.in_pad;
  float lone_rstd = 1.f;
  for (int base = r0; base < r1; base += kRowGroups) {
    const int u = base + group;
    const bool active = u < r1;
    const float* wu = weights + static_cast<size_t>(u - r0) * s.stride;
    const bool squares = norm_n > 0 && base == r0;
    RowSums<EG, M> sums;
    if constexpr (kFixed) {
      sums = RowSumsOf<EG, M, true>(wu, in, fixed_in_pad, p.per_event, lane, active, squares);
    } else {
      sums = SumRows<EG, M>(wu, in, s.in_pad, p.per_event, lane, active, squares);
    }
    if (norm_n > 0 && active) {
      if (EG == 1 && base == r0) lone_rstd = InverseRms(sums.squares, norm_n);
#pragma unroll
      for (int e = 0; e < EG; ++e) {
        const float rstd = EG == 1 ? lone_rstd : smem[p.ev_base + e * p.per_event + rstd_offset];
#pragma unroll
        for (int m = 0; m < M; ++m) sums.v[m][e] *= rstd;
      }
    }
    epilogue(u, sums.v, wu + M * (kFixed ? fixed_in_pad : s.in_pad), lane, active);
  }
}

// out = v / sqrt(mean(v²) + eps) ⊙ w for each event (a warp per event), then the block synchronizes. kUnrolled: n
// known at compile time once inlined (a fixed plan).
template <int EG, bool kUnrolled>
__device__ __forceinline__ void RmsNormOf(float* ev, int per_event, int in, int out, const float* w, int n) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int e = warp; e < EG; e += kStreamWarps) {
    const float* v = ev + e * per_event + in;
    float* o = ev + e * per_event + out;
    float ss = 0.f;
    if constexpr (kUnrolled) {
      StridedFor<true>(lane, n, kWarpSize, [&](int i) { ss += v[i] * v[i]; });
    } else {
      for (int i = lane; i < n; i += kWarpSize) ss += v[i] * v[i];
    }
    const float rstd = 1.f / sqrtf(WarpSum(ss) / n + kNormEps);
    if constexpr (kUnrolled) {
      StridedFor<true>(lane, n, kWarpSize, [&](int i) { o[i] = v[i] * rstd * w[i]; });
    } else {
      for (int i = lane; i < n; i += kWarpSize) o[i] = v[i] * rstd * w[i];
    }
  }
  __syncthreads();
}
// Not inlined where n comes from the launch's plan (as SumRows).
template <int EG>
__device__ __noinline__ void RmsNormEvents(float* ev, int per_event, int in, int out, const float* w, int n) {
  RmsNormOf<EG, false>(ev, per_event, in, out, w, n);
}

// The resident step's event in a block's shared memory (after a fixed plan's slot conv inputs): the payload words of
// its ring entry (slot, Δt, logged, log entry number, features), then the mailbox barrier that rank 0's stores
// complete.
enum ResidentWord : int { kResidentSlot, kResidentDt, kResidentLogged, kResidentLogLow, kResidentLogHigh, kResidentX };
constexpr uint32_t kResidentEventBytes = kStreamResidentWords * sizeof(uint32_t);
__host__ __device__ constexpr int ResidentMailFloats(const StreamPlan& p) { return p.floats + SlotConvFloats(p); }
constexpr size_t ResidentSharedBytes(const StreamPlan& p) {
  return ResidentMailFloats(p) * sizeof(float) + kResidentEventBytes + 16;
}

__device__ __forceinline__ uint64_t GlobalNanoseconds() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

constexpr int kResidentReaders = kStreamResidentWords / 2;
static_assert(kStreamResidentWords % 2 == 0 && kResidentReaders <= kWarpSize, "a lane reads two words");
// A lane of rank 0's warp 0 reads its two words of ring entry k (each 8-byte word whole). The registers wait for the
// read only where they are used: the next event's entry is read as soon as an event arrives, and is likely there
// (when the host posts ahead) by the time the event is done.
__device__ __forceinline__ void ReadResidentWords(const StreamResidentQueue& q, uint32_t k, uint64_t& w0,
                                                  uint64_t& w1) {
  const int lane = threadIdx.x % kWarpSize;
  if (lane < kResidentReaders) {
    asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];"
                 : "=l"(w0), "=l"(w1)
                 : "l"(q.ring[k % q.ring_size].words + 2 * lane)
                 : "memory");
  }
}

// Rank 0's warp 0: waits until ring entry k holds event k (every word carries k + 1, so a word read before the host
// wrote it is seen as stale), from the words read ahead (w0, w1) on, then stores its payload into every block's
// mailbox, each store completing that block's mailbox barrier. Without an event for idle_ns (read every 256 polls), a
// stop. kStamped: an event (not a stop) is stamped into `stamp` as seen.
template <bool kStamped>
__device__ __noinline__ void FetchResidentEvent(const StreamResidentQueue& q, uint32_t k, uint64_t w0, uint64_t w1,
                                                uint32_t* mail, uint64_t* mail_bar, int R,
                                                StreamResidentStamp* stamp) {
  const int lane = threadIdx.x % kWarpSize;
  constexpr int kReaders = kResidentReaders;
  const uint64_t start = GlobalNanoseconds();
  uint32_t payload[2] = {0, 0};
  for (uint32_t polls = 1;; ++polls) {
    if (polls > 1) ReadResidentWords(q, k, w0, w1);
    const bool current = lane >= kReaders || ((w0 >> 32) == k + 1 && (w1 >> 32) == k + 1);
    if (__all_sync(0xffffffffu, current)) {
      payload[0] = static_cast<uint32_t>(w0);
      payload[1] = static_cast<uint32_t>(w1);
      break;
    }
    if (polls % 256 == 0 && __shfl_sync(0xffffffffu, GlobalNanoseconds() - start > q.idle_ns, 0)) {
      payload[0] = lane == 0 ? 0xffffffffu : 0u;  // slot −1: stop
      break;
    }
  }
  const uint64_t seen_cycles = kStamped ? clock64() : 0;
  for (int r = 0; lane < kReaders && r < R; ++r) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
                     MapToRank(SharedAddress(mail + 2 * lane), r)),
                 "r"(payload[0]), "r"(payload[1]), "r"(MapToRank(SharedAddress(mail_bar), r))
                 : "memory");
  }
  if (kStamped && lane == 0 && static_cast<int32_t>(payload[0]) >= 0) {  // (an event, not a stop)
    *stamp = StreamResidentStamp{k, seen_cycles, GlobalNanoseconds(), 0, 0};
  }
}

// The step of one tick (Source = StreamTickInput: a launched kernel) or, resident (Source = StreamResidentQueue: a
// fixed plan's lone events), of every event the host posts until a stop: the same code, so the same bits.
// kShape ≥ 0: the launch's plan is kFixedPlans[kShape] (the launch passes it too, unread). kStamped (resident only):
// each event is stamped on the device's clocks into tick.stamps (a kernel of its own, so that a step run without
// stamps, CudaStreamer::set_time_ticks(0), carries none of their code).
template <int EG, int kShape, typename Source, bool kStamped = false>
__device__ __forceinline__ void StreamStep(const StreamPlan& plan, const float* __restrict__ pack,
                                           const StreamSlots& st, const Source& tick) {
  constexpr bool kResident = std::is_same_v<Source, StreamResidentQueue>;
  static_assert(!kResident || (kShape >= 0 && EG == 1), "a resident step carries a fixed plan's lone events");
  constexpr bool kFixed = kShape >= 0;
  constexpr int kFixedIndex = kFixed ? kShape : 0;  // (0 where unused: the expressions below compile for any kShape)
  const StreamPlan& p = kFixed ? kFixedPlans[kFixedIndex] : plan;
  extern __shared__ __align__(16) float smem[];
  const cg::cluster_group cluster = cg::this_cluster();
  const int R = p.cluster, rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, lane = tid % kLanesPerRow;
  const int E = p.E, N = p.N, cd = E + 2 * N, W1 = p.W - 1, pe = p.per_event;
  const size_t conv_per_slot = static_cast<size_t>(p.L) * W1 * cd;
  const size_t ssm_per_layer = static_cast<size_t>(E) * N;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + p.bars);
  uint64_t* exchange_bars = bars + 1 + kMaxStages;
  int* slot_ids = reinterpret_cast<int*>(smem + p.meta);
  float* event_dt = smem + p.meta + kMaxEvents;
  int64_t* log_at = reinterpret_cast<int64_t*>(smem + p.meta + 2 * kMaxEvents);
  float* ev = smem + p.ev_base;
  const float* sh = smem + p.shared;
  const int cfc_stage = 1 + 3 * p.L, exchanges = p.stages - 1;
  auto exchanged = [&](int si) { return R > 1 && p.stage[si].mode == kSplit; };

  // A group's events: read at once, into registers, before anything else (inline events arrive with the launch's
  // parameters).
  // (The resident step: from the mailbox, rank 0's copy of the ring entry.)
  uint32_t* const mail = reinterpret_cast<uint32_t*>(smem + ResidentMailFloats(p));
  uint64_t* const mail_bar = reinterpret_cast<uint64_t*>(mail + kStreamResidentWords);
  const float *tick_x = nullptr, *tick_dt = nullptr;
  const int32_t* tick_slots = nullptr;
  const int64_t* tick_log = nullptr;
  if constexpr (!kResident) {
    tick_x = tick.x ? tick.x : tick.inline_x;
    tick_dt = tick.x ? tick.dt : tick.inline_dt;
    tick_slots = tick.x ? tick.slots : tick.inline_slots;
    tick_log = tick.x ? tick.log_indices : tick.inline_log;
  }
  int slot_read = -1;
  float dt_read = 0.f;
  int64_t log_read = 0;
  bool resident_logged = false;
  auto logged = [&] {
    if constexpr (kResident) {
      return resident_logged;
    } else {
      return tick.logged;
    }
  };
  float x_raw[EG];  // feature `tid` of each event
  auto read_group = [&](int first) {
    if constexpr (kResident) {
      resident_logged = mail[kResidentLogged] != 0;
      slot_read = tid == 0 ? static_cast<int>(mail[kResidentSlot]) : -1;
      dt_read = tid == 0 ? __uint_as_float(mail[kResidentDt]) : 0.f;
      log_read = tid == 0 && resident_logged
                     ? static_cast<int64_t>(static_cast<uint64_t>(mail[kResidentLogHigh]) << 32 | mail[kResidentLogLow])
                     : 0;
      x_raw[0] = tid < p.F ? __uint_as_float(mail[kResidentX + tid]) : 0.f;
    } else {
      const bool reads_event = tid < EG && first + tid < tick.n;
      // (A fixed plan reads an inline tick's slot, Δt and log entry number from the parameters directly, not through a
      // generic address, which is a load from memory: the states' copies wait for the slot, the first block barrier for
      // Δt and the log entry number. Not the features: a warp's constant loads at distinct addresses run one at a time,
      // ~500 cycles for warp 0's 32, H200 clock64 stamps, and nothing reads them before the shared vectors are in.)
      const bool from_parameters = kFixed && tick.x == nullptr;
      slot_read = !reads_event ? -1 : from_parameters ? tick.inline_slots[first + tid] : tick_slots[first + tid];
      dt_read = reads_event ? (from_parameters ? tick.inline_dt[first + tid] : tick_dt[first + tid]) : 0.f;
      log_read = reads_event && tick.logged ? (from_parameters ? tick.inline_log[first + tid] : tick_log[first + tid])
                                            : 0;
#pragma unroll
      for (int e = 0; e < EG; ++e) {
        x_raw[e] = tid < p.F && first + e < tick.n ? tick_x[static_cast<size_t>(first + e) * p.F + tid] : 0.f;
      }
    }
  };
  // The shared vectors (launch barrier 0) are the first step's wait: their copy starts before anything else.
  // A fixed plan's lone event (kEarlyStates): before the embedding only the shared vectors' and the embedding's rows
  // are copied. The warps without rows of the embedding then start, while it runs, the copies of the first group's
  // carried states (its SSM rows, conv and CfC states, bulk-copied), then every other stage's rows, and arm the
  // exchanges; a later group's carried states are copied by the same warps. The states' copies complete the states'
  // barrier (each of those threads arrives once), which layer 0 waits for anyway: no block barrier for them after the
  // embedding. (Bulk copies are issued only as fast as the copy engine takes them: with every stage's copy issued
  // before it, the block reached the embedding at ~3,200 cycles, H200 clock64 stamps.)
  constexpr bool kEarlyStates = kFixed && EG == 1;
  constexpr int kCarryWarp = kEarlyStates ? RowWarps(kFixedPlans[kFixedIndex], 0) : 0;
  static_assert(!kEarlyStates || (kCarryWarp < kStreamWarps &&
                                  kFixedPlans[kFixedIndex].C <= (kStreamWarps - kCarryWarp) * kWarpSize),
                "a fixed plan's embedding leaves warps to copy the carried states");
  static_assert(!kEarlyStates || BulkCarried(kFixedPlans[kFixedIndex]), "a fixed plan's states are bulk-copied");
  if (tid == 0) {
    BarrierInit(bars);
    if constexpr (kEarlyStates) {  // (the states' barrier)
      constexpr int kCarryThreads = (kStreamWarps - kCarryWarp) * kWarpSize;
      MbarrierInit(SharedAddress(exchange_bars + kMaxExchanges), 1 + kCarryThreads);
    }
    if constexpr (kResident) BarrierInit(mail_bar);
    BarrierInitFence();
    BarrierExpect(bars, p.shared_size * sizeof(float));
    BulkCopy(smem + p.shared, pack + p.shared_pack, p.shared_size * sizeof(float), bars);
  }
  int groups = 0;
  if constexpr (!kResident) groups = CeilDiv(tick.n, EG);
  int group_index = static_cast<int>(blockIdx.x) / R;
  if constexpr (!kResident) read_group(group_index * EG);

  // Launch barrier b ≥ 1 (stage b − 1's rows) belongs to lane 0 of warp b mod 8, which initializes it, starts its
  // copy and leaves the block's row range of its stage: the warps issue in parallel, each reading the plan at one
  // index at a time. The exchanges' barriers and the states' follow in the same count, armed after a block barrier.
  // One loop of lane 0s: an init under a warp-uniform predicate (what nvcc made of `if (warp == 1 && lane < n)`)
  // is counted by racecheck as every lane's, at a stale address, whether or not the predicate holds.
  const int launch_bars = 1 + p.stages, warp = tid / kWarpSize, warp_lane = tid % kWarpSize;
  uint64_t* state_bar = exchange_bars + kMaxExchanges;
  const int inits = launch_bars + exchanges + (kEarlyStates ? 0 : 1);
  auto barrier = [&](int b) {
    return b < launch_bars ? bars + b : b < launch_bars + exchanges ? exchange_bars + (b - launch_bars) : state_bar;
  };
  const bool issues = warp_lane == 0 && warp < launch_bars, initializes = warp_lane == 0 && warp < inits;
  for (int b = warp > 0 ? warp : kStreamWarps; initializes && b < inits; b += kStreamWarps) BarrierInit(barrier(b));
  if (initializes && (warp > 0 || kStreamWarps < inits)) BarrierInitFence();
  int* rows = reinterpret_cast<int*>(smem + p.rows);
  auto issue = [&](int b) {
    const int si = b - 1;
    int r0, r1;
    RowRange(p.stage[si], R, rank, r0, r1);
    if constexpr (!kFixed) {  // (a fixed plan's products find their rows from the rank)
      rows[2 * si] = r0;
      rows[2 * si + 1] = r1;
    }
    if (p.stage_at[si] < 0) return;
    const uint32_t bytes = (r1 - r0) * p.stage[si].stride * sizeof(float);
    BarrierExpect(bars + b, bytes);
    if (bytes > 0) {
      BulkCopy(smem + p.stage_at[si], pack + p.stage[si].pack + static_cast<size_t>(r0) * p.stage[si].stride, bytes,
               bars + b);
    }
  };
  // The chain's first copies start at once; the rest wait until this block has arrived at the cluster barrier (a
  // fixed plan's lone event: until the embedding). (A fixed plan: each warp's test of every barrier, so that the plan
  // is read at compile-time indices only.)
  if constexpr (kEarlyStates) {
    if (issues && warp == 1) issue(1);
  } else if constexpr (kFixed) {
#pragma unroll
    for (int b = 1; b < kStreamWarps && b < launch_bars; ++b) {
      if (issues && warp == b) issue(b);
    }
  } else if (issues && warp > 0) {
    issue(warp);
  }
  // Activations start at zero: the products read their zero padding. The blocks' barriers must exist before the first
  // exchange; the wait comes as late as it can. A fixed plan's lone event without padding needs no zeros, and then
  // the cluster barrier releases nothing but the barriers' initialization, which their fence has (CUTLASS's order:
  // fence.mbarrier_init, then a relaxed arrive; the arrive's release took ~1,200 cycles). Racecheck over small's
  // every-launch-shape test fails with an internal sanitizer error and one reported hazard with either arrive, and
  // with the run-time plan's kernel alone too (H200, 2026-11-30).
  constexpr bool kNoZeros = kEarlyStates && Unpadded(kFixedPlans[kFixedIndex]);
  if constexpr (kNoZeros) {
    ClusterArriveRelaxed();
  } else {
    float4* ev4 = reinterpret_cast<float4*>(ev);
    for (int i = tid; i < EG * pe / 4; i += kStreamThreads) ev4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    ClusterArrive();
  }
  // (A fixed plan's lone event issues them under the embedding: late_copies below.)
  if constexpr (!kFixed) {
    for (int b = warp + kStreamWarps; issues && b < launch_bars; b += kStreamWarps) issue(b);
  } else if constexpr (!kEarlyStates) {
#pragma unroll
    for (int b = kStreamWarps; b < launch_bars; ++b) {
      if (issues && warp == b % kStreamWarps) issue(b);
    }
  }
  // Lane j of a row group sends results to blocks j and j + 8: their activations and exchange barriers.
  uint32_t remote_ev[2] = {0, 0}, remote_bars[2] = {0, 0};
  const int remotes = (R > lane) + (R > lane + kLanesPerRow);
  for (int k = 0; k < remotes; ++k) {
    remote_ev[k] = MapToRank(SharedAddress(ev), lane + kLanesPerRow * k);
    remote_bars[k] = MapToRank(SharedAddress(exchange_bars), lane + kLanesPerRow * k);
  }
  // Result v of stage x's exchange for event e at `offset` of its activations, into every block of the cluster.
  auto put = [&](int x, int e, int offset, float v) {
    for (int k = 0; k < remotes; ++k) {
      StoreRemote(remote_ev[k] + (e * pe + offset) * sizeof(float), v, remote_bars[k] + x * sizeof(uint64_t));
    }
  };
  // A stage's result: exchanged, or kept by the block that computed it (lane 0 of the row group stores it).
  auto emit = [&](int si, int e, int offset, float v) {
    if (exchanged(si)) {
      put(si, e, offset, v);
    } else if (lane == 0) {
      ev[e * pe + offset] = v;
    }
  };
  // Waits for the stage's results: every block's share of its exchange, or this block's own.
  // (It and group_index count a resident launch's events in an int: the host relaunches before 2³¹,
  // CudaStreamer::kResidentLaunchEvents.)
  int phase = 0;
  auto finish = [&](int si) {
    if (exchanged(si)) {
      ExchangeWait(exchange_bars + si, phase & 1);
    } else {
      __syncthreads();
    }
  };
  // This block's SSM rows (and x conv channels): the rows of its share of every layer's z/x product. A layer's rows
  // of one slot's SSM state are one contiguous run, bulk-copied when its bytes allow (16-byte multiples).
  const int q0 = rank * E / R, q1 = (rank + 1) * E / R, nx = q1 - q0;
  const bool bulk_states = p.ssm_base >= 0 && nx > 0 && N * sizeof(float) % 16 == 0;
  // The carried conv inputs: a fixed plan's lone event's in the slot's layout, its whole run at conv_in
  // (SlotConvFloats); else each event's at p.conv of its activations, per layer and tap the block's x channels, then
  // every B and C channel.
  constexpr bool kSlotConv = kEarlyStates;
  float* const conv_in = smem + p.floats;
  const int conv_stride = kSlotConv ? cd : p.conv_channels;  // between a channel's taps
  if constexpr (kResident) ClusterWait();  // (rank 0 stores into every block's mailbox from the first event on)
  uint64_t ahead[2] = {0, 0};  // (the resident step's rank 0, warp 0: the next event's words, read ahead)
  StreamResidentStamp* stamps = nullptr;
  uint32_t stamp_mask = 0;
  if constexpr (kResident) {
    if (rank == 0 && warp == 0) ReadResidentWords(tick, tick.first, ahead[0], ahead[1]);
    if constexpr (kStamped) {
      stamps = tick.stamps;
      stamp_mask = tick.stamp_slots - 1;
    }
  }
  for (; kResident || group_index < groups; group_index += static_cast<int>(gridDim.x) / R, ++phase) {
    if constexpr (kResident) {
      // The next event, or a stop (slot −1), which every block receives alike.
      if (rank == 0 && warp == 0) {
        const uint32_t k = tick.first + phase;
        FetchResidentEvent<kStamped>(tick, k, ahead[0], ahead[1], mail, mail_bar, R, stamps + (k & stamp_mask));
      }
      if (tid == 0) MbarrierArriveExpect(SharedAddress(mail_bar), kResidentEventBytes);
      ExchangeWait(mail_bar, phase & 1);
      if (static_cast<int>(mail[kResidentSlot]) < 0) {
        if (static_cast<int>(mail[kResidentSlot]) == kStreamResidentTrapSlot) __trap();
        if (phase == 0) {  // (the launch's first copies are in flight)
          BarrierWait(bars);
          BarrierWait(bars + 1);
        }
        break;
      }
      if (rank == 0 && warp == 0) ReadResidentWords(tick, tick.first + phase + 1, ahead[0], ahead[1]);
    }
    if (kResident || phase > 0) read_group(group_index * EG);
    if (tid < EG) {
      slot_ids[tid] = slot_read;
      event_dt[tid] = dt_read;
      log_at[tid] = log_read;
    }
    __syncthreads();
    // Arms this group's exchanges (results may land before: the barrier's byte count goes negative meanwhile). After
    // the block barrier: a warp's mbarrier.init runs one address at a time for all its lanes, so without a barrier
    // between them racecheck sees another lane's initialization race with this lane's arming.
    auto exchange_bytes = [&](int x) {  // (fc2 and skip send two results per unit)
      return static_cast<uint32_t>(p.stage[x].units * (p.stage[x].kind == kFc2Skip ? 2 : 1) * EG * sizeof(float));
    };
    auto arm_exchanges = [&](int arming_warp) {
      if constexpr (kFixed) {
        uint32_t bytes = 0;
#pragma unroll
        for (int x = 0; x < exchanges; ++x) {
          if (warp_lane == x && exchanged(x)) bytes = exchange_bytes(x);
        }
        if (warp == arming_warp && bytes > 0) BarrierExpect(exchange_bars + warp_lane, bytes);
      } else if (warp == arming_warp && warp_lane < exchanges && exchanged(warp_lane)) {
        BarrierExpect(exchange_bars + warp_lane, exchange_bytes(warp_lane));
      }
    };
    if constexpr (!kEarlyStates) arm_exchanges(1);
    // The carried states of this block's rows, copied asynchronously (padding events get zeros): its SSM rows, its
    // x conv channels and every B and C channel, the CfC state. (The resident step's later events copy their SSM rows
    // with the others, in the generic proxy, as the event before wrote them: a bulk copy would need a proxy fence.)
    if (bulk_states && tid == 0 && !(kEarlyStates && phase == 0)) {
      uint32_t bytes = 0;
      for (int e = 0; !kResident && e < EG; ++e) bytes += slot_ids[e] >= 0 ? p.L * nx * N * sizeof(float) : 0;
      BarrierExpect(state_bar, bytes);
      for (int e = 0; !kResident && e < EG; ++e) {
        for (int l = 0; slot_ids[e] >= 0 && l < p.L; ++l) {
          BulkCopy(smem + p.ssm_base + (e * p.L + l) * p.ssm_rows * N,
                   st.ssm + slot_ids[e] * (p.L * ssm_per_layer) + l * ssm_per_layer + static_cast<size_t>(q0) * N,
                   nx * N * sizeof(float), state_bar);
        }
      }
    }
    // The carried conv and CfC states of the group's events (and its SSM rows where not bulk-copied; padding events
    // get zeros, as copies of no bytes), by warps first_warp on, each its share.
    auto copy_carried = [&](int first_warp) {
      const int w = warp - first_warp, warps = kStreamWarps - first_warp, t = tid - first_warp * kWarpSize;
#pragma unroll 1
      for (int e = 0; e < EG; ++e) {
        const int slot = slot_ids[e];
#pragma unroll 1
        for (int l = w; p.ssm_base >= 0 && l < p.L; l += warps) {
          float* dst = smem + p.ssm_base + (e * p.L + l) * p.ssm_rows * N;
          const float* src = st.ssm + slot * (p.L * ssm_per_layer) + l * ssm_per_layer + static_cast<size_t>(q0) * N;
#pragma unroll 1
          for (int o = warp_lane; (slot < 0 || !bulk_states) && !kResident && o < nx * N; o += kWarpSize) {
            if (slot >= 0) {
              CopyAsync4(dst + o, src + o);
            } else {
              CopyAsyncZeros4(dst + o, st.ssm);
            }
          }
        }
        if constexpr (kResident) {  // (its lone event's SSM rows, 16 bytes a copy over all the warps: BulkCarried)
          const float* src = st.ssm + slot * (p.L * ssm_per_layer) + static_cast<size_t>(q0) * N;
#pragma unroll 1
          for (int i = 4 * t; i < p.L * nx * N; i += 4 * warps * kWarpSize) {
            const int l = i / (nx * N), o = i % (nx * N);
            CopyAsync16(smem + p.ssm_base + l * p.ssm_rows * N + o, src + l * ssm_per_layer + o);
          }
        }
        if constexpr (kSlotConv) {
          const float* src = st.conv + slot * conv_per_slot;
#pragma unroll 1
          for (int i = 4 * t; i < p.L * W1 * cd; i += 4 * warps * kWarpSize) {
            if (slot >= 0) {
              CopyAsync16(conv_in + i, src + i);
            } else {
              CopyAsyncZeros16(conv_in + i, st.conv);
            }
          }
        } else {
#pragma unroll 1
          for (int lk = w; lk < p.L * W1; lk += warps) {
            float* dst = ev + e * pe + p.conv + lk * p.conv_channels;
            const float* src = st.conv + slot * conv_per_slot + static_cast<size_t>(lk) * cd;
#pragma unroll 1
            for (int j = warp_lane; j < nx + 2 * N; j += kWarpSize) {
              const int channel = j < nx ? j : p.ssm_rows + j - nx, c = j < nx ? q0 + j : E + j - nx;
              if (slot >= 0) {
                CopyAsync4(dst + channel, src + c);
              } else {
                CopyAsyncZeros4(dst + channel, st.conv);
              }
            }
          }
        }
        if (t < p.C) {
          float* dst = ev + e * pe + p.head.a + p.D + t;
          if (slot >= 0) {
            CopyAsync4(dst, st.cfc + slot * p.C + t);
          } else {
            CopyAsyncZeros4(dst, st.cfc);
          }
        }
      }
    };
    if constexpr (!kEarlyStates) copy_carried(0);
    // The first group's copies after the embedding's (lane 0 of the warps from kCarryWarp on, lane 0 of the first of
    // them arming the states' barrier): the carried states over the warps, then the stages' rows from stage 1 on, in
    // turn. Copy q of the states: q = 0 the slot's conv inputs, then an SSM layer's rows each, then the CfC state.
    auto late_copies = [&]() {
      constexpr int kCarryWarps = kStreamWarps - kCarryWarp;
      const int w = warp - kCarryWarp, slot = slot_ids[0], runs = p.L + 2;
      const int state_copies = slot >= 0 ? runs : 0;
      if (w == 0) {
        BarrierExpect(state_bar, slot >= 0 ? (p.L * W1 * cd + p.L * nx * N + p.C) * sizeof(float) : 0);
      }
#pragma unroll
      for (int q = 0; q < runs; ++q) {
        if (q >= state_copies || w != q * kCarryWarps / runs) continue;
        if (q == 0) {
          BulkCopy(conv_in, st.conv + slot * conv_per_slot, p.L * W1 * cd * sizeof(float), state_bar);
        } else if (q <= p.L) {
          BulkCopy(smem + p.ssm_base + (q - 1) * p.ssm_rows * N,
                   st.ssm + slot * (p.L * ssm_per_layer) + (q - 1) * ssm_per_layer + static_cast<size_t>(q0) * N,
                   nx * N * sizeof(float), state_bar);
        } else {
          BulkCopy(ev + p.head.a + p.D, st.cfc + slot * p.C, p.C * sizeof(float), state_bar);
        }
      }
#pragma unroll
      for (int b = 2; b < launch_bars; ++b) {
        if (w == (b - 2) % kCarryWarps) issue(b);
      }
    };
    BarrierWait(bars);
    if (tid < p.F) {
#pragma unroll
      for (int e = 0; e < EG; ++e) {
        ev[e * pe + p.xn + tid] = slot_ids[e] >= 0 ? (x_raw[e] - sh[p.mean + tid]) * sh[p.inv_std + tid] : 0.f;
      }
    }
    if (!kResident && phase == 0) ClusterWait();  // (its barrier also publishes xn)
    __syncthreads();
    if constexpr (kEarlyStates) {
      if (warp >= kCarryWarp) {
        arm_exchanges(kStreamWarps - 1);
        if (phase == 0) {
          if (warp_lane == 0) late_copies();
          MbarrierArrive(SharedAddress(state_bar));
        } else {
          copy_carried(kCarryWarp);
          CopyAsyncArrive(state_bar);
        }
      }
    }

    Products<EG, 1, kFixed>(p, 0, rank, pack, smem, bars, p.xn, 0, 0,
                    [&](int u, const float(&acc)[1][EG], const float* prm, int, bool active) {
                      if (!active) return;
#pragma unroll
                      for (int e = 0; e < EG; ++e) emit(0, e, p.h + u, acc[0][e] + prm[0]);
                    });
    // The carried conv and CfC states are read from layer 0 on: a block barrier publishes each thread's copies (or the
    // states' barrier).
    if constexpr (!kEarlyStates) {
      CopyAsyncWaitAll();
      if (exchanged(0)) __syncthreads();
    }
    finish(0);

#pragma unroll  // (a fixed plan's layers: its stages' offsets become immediates)
    for (int l = 0; l < p.L; ++l) {
      const int si_bcdt = 1 + 3 * l, si_heads = 2 + 3 * l, si_out = 3 + 3 * l;
      const bool bcdt_exchanged = exchanged(si_bcdt);
      const float* conv_rows = (kSlotConv ? conv_in : ev + p.conv) + l * W1 * conv_stride;  // event 0's, this layer
      if (l == 0 && (bulk_states || kEarlyStates)) ExchangeWait(state_bar, phase & 1);
      // B, C (causal conv, SiLU) and Δt (softplus) of the layer's RMSNorm (folded), split and exchanged; each row's
      // owner advances its conv state.
      if constexpr (EG > 1) NormScales<EG>(ev, pe, p.h, p.D, Align4(p.D), p.rstd_h);
      Products<EG, 1, kFixed>(p, si_bcdt, rank, pack, smem, bars, p.h, p.D, p.rstd_h,
                      [&](int u, const float(&acc)[1][EG], const float* prm, int row_lane, bool active) {
                        if (!active) return;
#pragma unroll
                        for (int e = 0; e < EG; ++e) {
                          const float v = acc[0][e];
                          float out;
                          if (u < 2 * N) {
                            const float* old_rows = kSlotConv ? conv_rows + E + u : conv_rows + e * pe + p.ssm_rows + u;
                            out = Silu(ConvTaps<kFixed>(prm, W1, v, old_rows, conv_stride));
                            const int slot = slot_ids[e];
                            if (row_lane == 0 && slot >= 0 && W1 > 0) {
                              float* state = st.conv + slot * conv_per_slot + static_cast<size_t>(l) * W1 * cd + E + u;
                              StridedFor<kFixed>(0, W1 - 1, 1, [&](int k) {
                                state[k * cd] = old_rows[(k + 1) * conv_stride];
                              });
                              state[(W1 - 1) * cd] = v;
                            }
                          } else {
                            out = Softplus(v + prm[0]);
                          }
                          emit(si_bcdt, e, p.bcdt + u, out);
                        }
                      });
      if (!bcdt_exchanged) __syncthreads();
      // z and x of this block's SSM rows (h, p) of the same norm; x's causal conv (its owner advances the conv state),
      // then (once B, C and Δt are in) the SSM update and readout (eight lanes over the state dimension) and the gate;
      // y is exchanged.
      Products<EG, 2, kFixed>(p, si_heads, rank, pack, smem, bars, p.h, p.D, p.rstd_h,
                      [&](int hp, const float(&acc)[2][EG], const float* prm, int row_lane, bool active) {
                        if (active && bcdt_exchanged) ExchangeWait(exchange_bars + si_bcdt, phase & 1);
                        const int head = active ? hp / p.P : 0;
                        const float A = -expf(sh[p.a_log[l] + head]), Dh = sh[p.skip_d[l] + head];
                        float y[EG], xc[EG];
#pragma unroll
                        for (int e = 0; e < EG; ++e) {
                          y[e] = xc[e] = 0.f;
                          if (!active) continue;
                          const int slot = slot_ids[e];
                          const float* old_rows = kSlotConv ? conv_rows + hp : conv_rows + e * pe + hp - q0;
                          xc[e] = Silu(ConvTaps<kFixed>(prm, W1, acc[1][e], old_rows, conv_stride));
                          if (row_lane == 0 && slot >= 0 && W1 > 0) {
                            float* state = st.conv + slot * conv_per_slot + static_cast<size_t>(l) * W1 * cd + hp;
                            StridedFor<kFixed>(0, W1 - 1, 1, [&](int k) {
                              state[k * cd] = old_rows[(k + 1) * conv_stride];
                            });
                            state[(W1 - 1) * cd] = acc[1][e];
                          }
                          const float* bcdt = ev + e * pe + p.bcdt;
                          const float dt = bcdt[2 * N + head], decay = expf(dt * A);
                          float* global_state = slot >= 0 ? st.ssm + slot * (p.L * ssm_per_layer) +
                                                                l * ssm_per_layer + static_cast<size_t>(hp) * N
                                                          : nullptr;
                          const float* state =
                              p.ssm_base >= 0 ? smem + p.ssm_base + ((e * p.L + l) * p.ssm_rows + hp - q0) * N
                                              : global_state;
                          y[e] = SsmRowShare(state, global_state, bcdt, decay, dt * xc[e], N, row_lane);
                        }
#pragma unroll
                        for (int e = 0; e < EG; ++e) y[e] = RowSum(y[e]);
                        if (!active) return;
#pragma unroll
                        for (int e = 0; e < EG; ++e) {
                          emit(si_heads, e, p.y + hp, GatedY(y[e], Dh, xc[e], acc[0][e]));
                        }
                      });
      finish(si_heads);

      // out_proj of the gated RMSNorm (folded) of y.
      if constexpr (EG > 1) NormScales<EG>(ev, pe, p.y, E, Align4(E), p.rstd_y);
      Products<EG, 1, kFixed>(p, si_out, rank, pack, smem, bars, p.y, E, p.rstd_y,
                      [&](int u, const float(&acc)[1][EG], const float*, int, bool active) {
                        // Every lane of the row group reads the residual h[u] before any lane writes the new one
                        // into it (racecheck flagged the unordered read and write).
                        const unsigned active_lanes = __ballot_sync(0xffffffffu, active);
                        if (!active) return;
                        float out[EG];
#pragma unroll
                        for (int e = 0; e < EG; ++e) out[e] = ev[e * pe + p.h + u] + acc[0][e];
                        __syncwarp(active_lanes);
#pragma unroll
                        for (int e = 0; e < EG; ++e) emit(si_out, e, p.h + u, out[e]);
                      });
      finish(si_out);
    }

    // Final norm into the CfC input [s ; c_{t−1}], the CfC, then the GRN head.
    if constexpr (kFixed) {
      RmsNormOf<EG, true>(ev, pe, p.h, p.head.a, sh + p.norm_f, p.D);
    } else {
      RmsNormEvents<EG>(ev, pe, p.h, p.head.a, sh + p.norm_f, p.D);
    }
    Products<EG, 1, kFixed>(p, cfc_stage, rank, pack, smem, bars, p.head.a, 0, 0,
                    [&](int u, const float(&acc)[1][EG], const float* prm, int, bool active) {
                      if (!active) return;
#pragma unroll
                      for (int e = 0; e < EG; ++e)
                        emit(cfc_stage, e, p.head.bb + u, LecunTanh(acc[0][e] + prm[0]));
                    });
    finish(cfc_stage);
    Products<EG, 4, kFixed>(p, cfc_stage + 1, rank, pack, smem, bars, p.head.bb, 0, 0,
                    [&](int u, const float(&acc)[4][EG], const float* prm, int row_lane, bool active) {
                      if (!active) return;
#pragma unroll
                      for (int e = 0; e < EG; ++e) {
                        const float c = CfcUnit(acc[0][e], acc[1][e], acc[2][e], acc[3][e], prm, event_dt[e]);
                        emit(cfc_stage + 1, e, p.head.a + p.D + u, c);  // the head reads [s ; c_t]
                        if (row_lane == 0 && slot_ids[e] >= 0) st.cfc[slot_ids[e] * p.C + u] = c;
                      }
                    });
    finish(cfc_stage + 1);
    Products<EG, 2, kFixed>(p, cfc_stage + 2, rank, pack, smem, bars, p.head.a, 0, 0,
                    [&](int u, const float(&acc)[2][EG], const float* prm, int, bool active) {
                      if (!active) return;
#pragma unroll
                      for (int e = 0; e < EG; ++e) {
                        emit(cfc_stage + 2, e, p.head.e2 + u, Elu(acc[0][e] + prm[0]));
                        emit(cfc_stage + 2, e, p.head.skip + u, acc[1][e]);
                      }
                    });
    finish(cfc_stage + 2);
    // gate/value, of fc1's output (folded in).
    Products<EG, 2, kFixed>(p, cfc_stage + 3, rank, pack, smem, bars, p.head.e2, 0, 0,
                    [&](int u, const float(&acc)[2][EG], const float* prm, int, bool active) {
                      if (!active) return;
#pragma unroll
                      for (int e = 0; e < EG; ++e) {
                        emit(cfc_stage + 3, e, p.head.pre + u,
                             GrnPre(ev[e * pe + p.head.skip + u], acc[0][e], acc[1][e], prm));
                      }
                    });
    finish(cfc_stage + 3);

    if (rank == 0) {
      // Layer norm (a warp per event), the output layer, then the outputs.
      for (int e = warp; e < EG; e += kStreamWarps) {
        GrnLayerNorm<kFixed>(ev + e * pe + p.head.pre, ev + e * pe + p.head.g, sh + p.ln_w, sh + p.ln_b, p.G,
                             warp_lane);
      }
      __syncthreads();
      // (A fixed plan's lone event: each horizon's row group writes its probability to the slot and the log, so that
      // the sigmoids run side by side, and its logit for thread 0's conviction.)
      // (The ring position is found here, with the outputs: found where a group starts, it cost a 64-event tick 1.2 µs
      // on the H200.)
      auto logged_entry = [&](int e) {
        return static_cast<size_t>(slot_ids[e]) * st.log_entries +
               StreamLogPosition(log_at[e], st.log_entries, st.log_reciprocal);
      };
      Products<EG, 1, kFixed>(p, cfc_stage + 4, rank, pack, smem, bars, p.head.g, 0, 0,
                      [&](int u, const float(&acc)[1][EG], const float* prm, int row_lane, bool active) {
                        if (!active || row_lane != 0) return;
                        if constexpr (kEarlyStates) {
                          const float logit = acc[0][0] + prm[0], prob = Sigmoid(logit);
                          ev[p.head.logits + u] = logit;
                          if (slot_ids[0] >= 0 && logged()) {
                            st.probs[slot_ids[0] * p.H + u] = prob;
                            st.log_probs[logged_entry(0) * p.H + u] = prob;
                            if (!isfinite(logit)) NoteNonFinite(st, slot_ids[0], log_at[0]);
                          }
                        } else {
#pragma unroll
                          for (int e = 0; e < EG; ++e) ev[e * pe + p.head.logits + u] = acc[0][e] + prm[0];
                        }
                      });
      __syncthreads();
      if (tid < EG && slot_ids[tid] >= 0 && logged()) {
        if constexpr (kEarlyStates) {
          const float* logits = ev + p.head.logits;
          st.log_convictions[logged_entry(0)] = 2.f * Sigmoid(logits[MostConfident(logits, p.H)]) - 1.f;
        } else {
          WriteOutputs(ev + tid * pe + p.head.logits, st, slot_ids[tid],
                       StreamLogPosition(log_at[tid], st.log_entries, st.log_reciprocal), log_at[tid], p.H);
        }
      }
    }
    __syncthreads();  // the group's slot ids and buffers are free for the next group
    if constexpr (kResident) {
      // Every block's writes of the event (the states, which the next event's copies read in any block, and the
      // outputs) are performed at gpu scope (the barrier's release) before the next event and before the answer, which
      // carries nothing else (a release at sys scope would cost a system-wide fence).
      ClusterArrive();
      ClusterWait();
      if (rank == 0 && tid == 0) {
        const uint32_t k = tick.first + phase;
        const uint64_t done_cycles = kStamped ? clock64() : 0;
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(tick.done), "r"(k + 1) : "memory");
        if constexpr (kStamped) {  // (after the answer, which it does not hold back)
          stamps[k & stamp_mask].done_cycles = done_cycles;
          stamps[k & stamp_mask].done_ns = GlobalNanoseconds();
        }
      }
    }
  }
  // A block leaves only once every block has received all it was sent (each arrives after its last wait), so no
  // store into a block's shared memory is in flight when it exits.
  ClusterArriveRelaxed();
  ClusterWait();
}

template <int EG, int kShape>
__global__ void __launch_bounds__(kStreamThreads, 1)
    StreamStepKernel(const __grid_constant__ StreamPlan plan, const float* __restrict__ pack,
                     const __grid_constant__ StreamSlots st, const __grid_constant__ StreamTickInput tick) {
  StreamStep<EG, kShape>(plan, pack, st, tick);
}

// The resident step (CudaStreamer's path for lone events): one cluster, launched once, carries the events the host posts.
template <int kShape, bool kStamped>
__global__ void __launch_bounds__(kStreamThreads, 1)
    StreamResidentKernel(const __grid_constant__ StreamPlan plan, const float* __restrict__ pack,
                         const __grid_constant__ StreamSlots st, const __grid_constant__ StreamResidentQueue queue) {
  StreamStep<1, kShape, StreamResidentQueue, kStamped>(plan, pack, st, queue);
}

// ---- The wide path: a tick of many events as a few grid-wide kernels ----
//
// The cluster kernel carries a group through the whole chain, so each group's blocks stream every weight and its
// states inside a latency-bound chain. For ticks of many events the wide path runs each link for all the tick's
// events at once instead: tiles of kWideEvents events, every row read once per tile (the cluster kernel's row sums,
// SumRows, in its order), activations between the links in device scratch. One kernel for the embedding and layer
// 0's B, C and Δt; per layer, one for z and x with the conv, the SSM update and the gate (the state traffic, split
// by SSM rows), and one for out_proj with the next layer's B, C and Δt, or after the last layer the CfC and the
// head. Like the cluster kernel, a block starts the copies of its states and inputs into shared memory at once and
// waits once; its rows it reads straight from L2 (an L1 prefetch of each stage's rows ahead of it mostly missed and
// doubled their L2 traffic: without them the ticks measured up to 6% faster, `s43b` in bench/RESULTS.md). The
// stores go out from the epilogues, whose scalar work the eight lanes of a row share (one event each).

constexpr int kWideEvents = kMaxEvents;
// Threads of the kernels that take all of a tile's rows in one block (512: every row of `small`'s widest such
// product in one or two passes, at most 128 registers a thread).
constexpr int kWideThreads = 512;

struct WideArgs {
  StreamPlan p;  // the pack's plan (MakePackPlan)
  const float* pack;
  StreamSlots st;
  StreamWideScratch scratch;
  int n;
  bool logged;
};

// Programmatic dependent launch (kernels/common.cuh): each wide kernel but the first may launch before the one ahead
// of it has finished. It reads what this tick's earlier kernels wrote only after WaitForPriorKernels, and lets the
// next kernel launch right after that wait, so a kernel that starts finds every kernel before the one ahead of it
// complete: before its own wait it reads only what the kernel ahead does not write (the pack, the tick's slots, its
// own states).

// The slot of a tick's event (−1: padding, or past the tick's end).
__device__ __forceinline__ int WideSlot(const WideArgs& a, int event) {
  return event < a.n ? a.scratch.slots[event] : -1;
}

// The epilogues spread a tile's events over the lanes of a row (lane e finishes event e), so a row's scalar work is
// not repeated in every lane. Lane e's sum of event e from the row's lanes' parts v: RowSum's butterfly as a
// reduce-scatter (each lane keeps the half of the events its next steps need and adds its partner's part of them),
// the same pairs added in the same order as RowSum adds them, so the same bits, in 7 shuffles instead of 24.
static_assert(kLanesPerRow == kWideEvents && kWideEvents == 8, "a row's lanes take one event each");
__device__ __forceinline__ float LaneRowSum(const float (&v)[kWideEvents], int lane) {
  float a[4], b[2];
  const bool hi4 = lane & 4, hi2 = lane & 2, hi1 = lane & 1;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float keep = hi4 ? v[j + 4] : v[j], send = hi4 ? v[j] : v[j + 4];
    a[j] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float keep = hi2 ? a[j + 2] : a[j], send = hi2 ? a[j] : a[j + 2];
    b[j] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
  }
  const float keep = hi1 ? b[1] : b[0], send = hi1 ? b[0] : b[1];
  return keep + __shfl_xor_sync(0xffffffffu, send, 1);
}

// Starts copying `len` floats of each of `events` events from `first` on (row stride `stride` in `src`) to
// ev + e·per_event; zeros in their padding to a multiple of 4 and for events past the tick's end. A warp an event at
// a time, its lanes the event's pieces (16-byte pieces when the rows allow), so that no thread divides to find its
// piece.
__device__ void LoadTileAsync(float* ev, int per_event, const float* src, int stride, int len, int first, int n,
                              int events) {
  const bool vec4 = len % 4 == 0 && stride % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  const int width = vec4 ? 4 : 1, len_pad = Align4(len), warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize, lane = threadIdx.x % kWarpSize;
#pragma unroll 1
  for (int e = warp; e < events; e += warps) {
    float* to = ev + e * per_event;
    const float* from = src + static_cast<size_t>(first + e) * stride;
    const bool event_present = first + e < n;
#pragma unroll 1
    for (int k = lane * width; k < len_pad; k += kWarpSize * width) {
      const bool present = event_present && k < len;
      if (vec4 && present) {
        CopyAsync16(to + k, from + k);
      } else if (vec4) {
        *reinterpret_cast<float4*>(to + k) = make_float4(0.f, 0.f, 0.f, 0.f);
      } else if (present) {
        CopyAsync4(to + k, from + k);
      } else {
        to[k] = 0.f;
      }
    }
  }
}

// Starts copying channels [c0, c0 + channels) of layer l's carried conv inputs (W − 1 taps, oldest first) of each of
// `events` slots to dst + (e·taps + k)·stride + c; zeros for padding slots. A warp an event at a time, a lane a
// channel's taps (the addresses worked out once for all of them).
__device__ void LoadConvAsync(float* dst, const StreamPlan& p, const StreamSlots& st, const int* slots, int events,
                              int l, int c0, int channels, int stride) {
  const int W1 = p.W - 1, cd = p.E + 2 * p.N, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  const size_t per_slot = static_cast<size_t>(p.L) * W1 * cd;
#pragma unroll 1
  for (int e = warp; e < events; e += warps) {
    const int slot = slots[e];
    const float* from = st.conv + max(slot, 0) * per_slot + static_cast<size_t>(l * W1) * cd + c0;
    float* to = dst + e * W1 * stride;
#pragma unroll 1
    for (int c = lane; c < channels; c += kWarpSize) {
      const float* tap_from = from + c;
      float* tap_to = to + c;
#pragma unroll 1
      for (int k = 0; k < W1; ++k, tap_from += cd, tap_to += stride) {
        if (slot >= 0) {
          CopyAsync4(tap_to, tap_from);
        } else {
          *tap_to = 0.f;
        }
      }
    }
  }
}

// The wide path's row sums: R row units' M products (unit r's weights at wu + r·unit_stride) for every event of a
// tile, each lane's own parts of SumRows's sums in SumRows's order, for LaneRowSum to add up. A load of the tile's
// inputs serves R units, so the products read shared memory R times less often; kSteps steps of the loop are
// unrolled, so that a step's loads are in flight under the one before (where the registers allow), or with kBatched
// the weights of kSteps steps are loaded before their products, so that one round trip to L2 serves them all. Not
// inlined, as SumRows.
template <int M, int R, int kSteps, bool kBatched>
__device__ __noinline__ RowSums<kWideEvents, M * R> TileRowParts(const float* wu, int unit_stride, const float* in,
                                                                  int in_pad, int per_event, int lane, bool active) {
  RowSums<kWideEvents, M * R> parts;
#pragma unroll
  for (int m = 0; m < M * R; ++m) {
#pragma unroll
    for (int e = 0; e < kWideEvents; ++e) parts.v[m][e] = 0.f;
  }
  constexpr int kStep = 4 * kLanesPerRow;
  if constexpr (kBatched) {
    for (int i0 = lane * 4; active && i0 < in_pad; i0 += kSteps * kStep) {
      float4 w[kSteps][R * M];
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const float* at = wu + r * unit_stride + m * in_pad + i0 + k * kStep;
            if (i0 + k * kStep < in_pad) w[k][r * M + m] = *reinterpret_cast<const float4*>(at);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        if (i0 + k * kStep < in_pad) {
          float4 x[kWideEvents];
          LoadInputs<kWideEvents>(x, in, per_event, i0 + k * kStep);
#pragma unroll
          for (int j = 0; j < R * M; ++j) AddProduct<kWideEvents>(parts.v[j], w[k][j], x);
        }
      }
    }
  } else {
#pragma unroll(kSteps)
    for (int i = lane * 4; active && i < in_pad; i += kStep) {
      float4 x[kWideEvents];
      LoadInputs<kWideEvents>(x, in, per_event, i);
#pragma unroll
      for (int r = 0; r < R; ++r) AddProducts<kWideEvents, M>(parts.v + r * M, wu + r * unit_stride, in_pad, i, x);
    }
  }
  return parts;
}

// Lane e's M sums of event e for R row units (weights at wu + r·unit_stride) of the tile whose inputs are at
// in + e·per_event, with the bits of Products's (scaled by the event's 1/rms at rstd + e·per_event when rstd is
// given). Every lane of the warp calls it.
template <int M, int R = 1, int kSteps = 1, bool kBatched = false>
__device__ __forceinline__ void TileRowSums(float (&out)[R][M], const float* wu, int unit_stride, const float* in,
                                            int in_pad, int per_event, const float* rstd, int lane, bool active) {
  const RowSums<kWideEvents, M * R> parts =
      TileRowParts<M, R, kSteps, kBatched>(wu, unit_stride, in, in_pad, per_event, lane, active);
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      out[r][m] = LaneRowSum(parts.v[r * M + m], lane);
      if (rstd && active) out[r][m] *= rstd[lane * per_event];
    }
  }
}

// A row unit's M outputs' weights held in registers, the lane's float4 of each of kSteps steps (zeros past in_pad):
// loaded when a kernel starts, their round trip to L2 runs under its other copies instead of inside its product.
template <int kSteps, int M>
struct HeldRow {
  float4 w[kSteps][M];
};
template <int kSteps, int M>
__device__ __forceinline__ HeldRow<kSteps, M> LoadHeldRow(const float* wu, int in_pad, int lane, bool active) {
  HeldRow<kSteps, M> row;
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int i = lane * 4 + k * 4 * kLanesPerRow;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      row.w[k][m] = active && i < in_pad ? *reinterpret_cast<const float4*>(wu + m * in_pad + i)
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  return row;
}
// TileRowSums of one row unit (R = 1) from its held weights (in_pad ≤ kSteps·32): the same sums in the same order,
// so the same bits; the tile's inputs are read an event at a time, which leaves registers for the weights.
template <int kSteps, int M>
__device__ __forceinline__ void HeldRowSums(float (&out)[M], const HeldRow<kSteps, M>& row, const float* in,
                                            int in_pad, int per_event, const float* rstd, int lane, bool active) {
  float v[M][kWideEvents];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int e = 0; e < kWideEvents; ++e) v[m][e] = 0.f;
  }
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int i = lane * 4 + k * 4 * kLanesPerRow;
    if (!active || i >= in_pad) continue;
#pragma unroll
    for (int e = 0; e < kWideEvents; ++e) {
      const float4 x = *reinterpret_cast<const float4*>(in + e * per_event + i);
#pragma unroll
      for (int m = 0; m < M; ++m) v[m][e] = AddProductStep(v[m][e], row.w[k][m], x);
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    out[m] = LaneRowSum(v[m], lane);
    if (rstd && active) out[m] *= rstd[lane * per_event];
  }
}

// Rows [u0, u1) of stage s (row u0's weights at `rows`) for the tile whose inputs are at in + e·per_event (1/rms at
// rstd + e·per_event when given), R consecutive rows a row group, kSteps steps in flight (TileRowParts, kBatched);
// `epilogue(u, acc, params, e, active)` receives lane e's sums of row u for event e, and every row group calls it
// for each of its R rows, as Products's.
template <int M, int R = 1, int kSteps = 1, bool kBatched = false, typename Epilogue>
__device__ __forceinline__ void TileRows(const PackStage& s, const float* rows, const float* in, int per_event,
                                         const float* rstd, int u0, int u1, Epilogue&& epilogue) {
  static_assert(R == 1 || R == 2, "a row group's last row may be past the end: it then sums its first row again");
  const int group = threadIdx.x / kLanesPerRow, lane = threadIdx.x % kLanesPerRow;
  for (int base = u0; base < u1; base += blockDim.x / kLanesPerRow * R) {
    const int u = base + group * R;
    const bool active = u < u1;
    const float* wu = rows + static_cast<size_t>(active ? u - u0 : 0) * s.stride;
    const int unit_stride = u + R - 1 < u1 ? s.stride : 0;
    float acc[R][M];
    TileRowSums<M, R, kSteps, kBatched>(acc, wu, unit_stride, in, s.in_pad, per_event, rstd, lane, active);
#pragma unroll
    for (int r = 0; r < R; ++r) epilogue(u + r, acc[r], wu + r * unit_stride + M * s.in_pad, lane, active && u + r < u1);
  }
}

// Shared memory of each wide kernel, in floats, and where its parts start.
struct WideLayout {
  int embed_x, embed_h, embed_conv, embed;       // standardized inputs, h (1/rms after each), B/C conv inputs
  int ssm_states, ssm_conv, ssm_h, ssm_bc, ssm;  // states, x conv inputs, h, B/C/Δt
  int out_y, out_h, out_conv, out_head, out;     // y (1/rms after each), then h and B/C conv inputs, or the head's
  HeadRuns head;                // an event's head activations within out_head, then its h (head_h); head_per_event
  int head_h, head_per_event;   // floats an event
};
constexpr int kSsmEvents = kWideEvents;  // a block of the SSM kernel: rows [u0, u0 + 32) of a tile
// Floats between two rows of SSM states in the SSM kernel's shared memory: 16-byte aligned, and when the rows would
// start in the same bank, eight more, so that the four rows (eight lanes each) of a warp's update fall in four banks
// apart.
__host__ __device__ constexpr int SsmRowStride(int N) { return Align4(N) % 16 == 0 ? Align4(N) + 8 : Align4(N); }
__host__ __device__ inline WideLayout MakeWideLayout(const StreamPlan& p) {
  WideLayout o{};
  const int W1 = p.W - 1, BC = 2 * p.N + p.Hh, D4 = Align4(p.D), E4 = Align4(p.E);
  FloatRuns runs;
  o.embed_x = runs.Take(kWideEvents * Align4(p.F));
  o.embed_h = runs.Take(kWideEvents * (D4 + 4));
  o.embed_conv = runs.Take(kWideEvents * W1 * 2 * p.N);
  o.embed = runs.at;
  runs.at = 0;
  o.ssm_states = runs.Take(kSsmEvents * kRowGroups * SsmRowStride(p.N));
  o.ssm_conv = runs.Take(kSsmEvents * W1 * kRowGroups);
  o.ssm_h = runs.Take(kSsmEvents * (D4 + 4));
  o.ssm_bc = runs.Take(kSsmEvents * Align4(BC));
  o.ssm = runs.at;
  runs.at = 0;
  o.head = TakeHeadRuns(runs, p.D, p.C, p.K, p.G, p.H);
  o.head_h = runs.Take(p.D);
  o.head_per_event = runs.at;
  runs.at = 0;
  o.out_y = runs.Take(kWideEvents * (E4 + 4));
  o.out_h = o.out_head = runs.at;  // the last layer's kernel keeps the head's activations where the others keep h
  o.out_conv = o.out_h + Align4(kWideEvents * (D4 + 4));
  const int layer_part = o.out_conv - o.out_h + Align4(kWideEvents * W1 * 2 * p.N);
  o.out = runs.at + (layer_part > kWideEvents * o.head_per_event ? layer_part : kWideEvents * o.head_per_event);
  return o;
}

// The per-tile kernels (embedding, out_proj) at kBlocks blocks an SM: one (all the registers a thread wants) while
// a tick's tiles fit one wave, two (64 registers, a few spilled) beyond, where more warps an SM hide more latency.
// Measured on the H200 (`small`, a2769ca): two blocks took 190.0 µs at 1,024 instruments (one: 156.9) and 1,154.1 at
// 10,000 (one: 1,250.0). With one block an SM, a row group of the one-output products takes two rows at a time (the
// registers allow it), which halves their shared-memory reads and their passes over a stage's rows.
template <int kBlocks>
constexpr int kWideRowsPerGroup = kBlocks == 1 ? 2 : 1;
// ... and a row group's products of at most two outputs, two steps in flight; in the long-row kernels (kBatched, one
// block an SM) the weights of four steps loaded at once (TileRowParts). Measured on the H200 (perf-wide10, 3e4f04b):
// `large`'s ticks 7% faster (1,024 instruments 1,887 -> 1,758 µs), but `small`'s 7-10 µs slower at 256 and 1,024
// (the unrolled sums' instruction fetch), so only plans of long rows (kWideLongRows) take them.
template <int kBlocks, bool kBatched>
constexpr int kWideSteps = kBatched ? 4 : kBlocks == 1 ? 2 : 1;
// The model width from which a plan's per-tile and SSM kernels load several steps' weights at once (`large`'s).
constexpr int kWideLongRows = 512;

// Layer l's B, C (causal conv, SiLU; each row's conv state advanced) and Δt (softplus) of its RMSNorm (folded), from
// the tile's h (stride D4 + 4, zero padding, 1/rms stored after each) and carried B/C conv inputs in shared memory,
// in a per-tile kernel of kBlocks blocks an SM.
template <int kBlocks, bool kBatched>
__device__ void SharedPhase(const WideArgs& a, int l, float* h, const float* conv, const int* slot_s, int first) {
  constexpr int kSteps = kWideSteps<kBlocks, kBatched>;
  const StreamPlan& p = a.p;
  const int D4 = Align4(p.D), pe = D4 + 4, N = p.N, W1 = p.W - 1, cd = p.E + 2 * N, BC = 2 * N + p.Hh;
  const PackStage& s = p.stage[1 + 3 * l];
  NormScales<kWideEvents>(h, pe, 0, p.D, D4, D4);
  const size_t conv_per_slot = static_cast<size_t>(p.L) * W1 * cd;
  TileRows<1, kWideRowsPerGroup<kBlocks>, kSteps, kBatched>(s, a.pack + s.pack, h, pe, h + D4, 0, BC,
              [&](int u, const float(&acc)[1], const float* prm, int e, bool active) {
                const float v = acc[0];
                if (!active || first + e >= a.n) return;
                float out;
                if (u < 2 * N) {
                  const float* old = conv + e * W1 * 2 * N + u;
                  out = Silu(ConvTaps(prm, W1, v, old, 2 * N));
                  const int slot = slot_s[e];
                  if (slot >= 0 && W1 > 0) {
                    float* state = a.st.conv + slot * conv_per_slot + static_cast<size_t>(l) * W1 * cd + p.E + u;
#pragma unroll 1
                    for (int k = 0; k + 1 < W1; ++k) state[k * cd] = old[(k + 1) * 2 * N];
                    state[(W1 - 1) * cd] = v;
                  }
                } else {
                  out = Softplus(v + prm[0]);
                }
                a.scratch.bcdt[static_cast<size_t>(first + e) * BC + u] = out;
              });
}


// Standardization and the embedding, then layer 0's B, C and Δt; the tick's slots, Δt and log entry numbers into
// scratch for the later kernels.
template <int kBlocks, bool kBatched>
__global__ void __launch_bounds__(kWideThreads, kBlocks) WideEmbedKernel(const __grid_constant__ WideArgs a,
                                                                         const __grid_constant__ StreamTickInput tick) {
  constexpr int kSteps = kWideSteps<kBlocks, kBatched>;
  extern __shared__ __align__(16) float smem[];
  __shared__ int slot_s[kWideEvents];
  const StreamPlan& p = a.p;
  const WideLayout o = MakeWideLayout(p);
  const int first = blockIdx.x * kWideEvents, tid = threadIdx.x, pe = Align4(p.F), pe_h = Align4(p.D) + 4;
  LetNextKernelLaunch();
  // The tick's reads all issued before any of their results is used.
  const float* tick_x = tick.x ? tick.x : tick.inline_x;
  const int e0 = first + tid;
  const bool reads_event = tid < kWideEvents && e0 < a.n;
  const int slot = reads_event ? (tick.x ? tick.slots : tick.inline_slots)[e0] : -1;
  const float dt = reads_event ? (tick.x ? tick.dt : tick.inline_dt)[e0] : 0.f;
  const int64_t log_index = reads_event && tick.logged ? (tick.x ? tick.log_indices : tick.inline_log)[e0] : 0;
  float* xn = smem + o.embed_x;
  float* h = smem + o.embed_h;
  // Thread f reads feature f of every event of the tile and its standardization at once (one round trip, not one an
  // event), before the slots arrive (F ≤ kStreamThreads < kWideThreads: a thread a feature).
  static_assert(kStreamThreads < kWideThreads, "a thread of the embedding kernel a feature");
  const float* shared = a.pack + p.shared_pack;
  const bool feature = tid < p.F;
  float x_raw[kWideEvents];
#pragma unroll
  for (int e = 0; e < kWideEvents; ++e) {
    x_raw[e] = feature && first + e < a.n ? tick_x[static_cast<size_t>(first + e) * p.F + tid] : 0.f;
  }
  const float mean = feature ? shared[p.mean + tid] : 0.f, inv_std = feature ? shared[p.inv_std + tid] : 0.f;
  for (int i = tid; i < kWideEvents * pe_h; i += blockDim.x) h[i] = 0.f;
  if (tid < kWideEvents) slot_s[tid] = slot;
  if (reads_event) {
    a.scratch.slots[e0] = slot;
    a.scratch.dt[e0] = dt;
    a.scratch.log[e0] = log_index;
  }
  __syncthreads();
  LoadConvAsync(smem + o.embed_conv, p, a.st, slot_s, kWideEvents, 0, p.E, 2 * p.N, 2 * p.N);
  if (tid < pe) {
#pragma unroll
    for (int e = 0; e < kWideEvents; ++e) {
      xn[e * pe + tid] = feature && slot_s[e] >= 0 ? (x_raw[e] - mean) * inv_std : 0.f;
    }
  }
  __syncthreads();
  TileRows<1, kWideRowsPerGroup<kBlocks>, kSteps, kBatched>(p.stage[0], a.pack + p.stage[0].pack, xn, pe,
                                                            nullptr, 0, p.D,
              [&](int u, const float(&acc)[1], const float* prm, int e, bool active) {
                const float v = acc[0] + prm[0];
                if (!active) return;
                h[e * pe_h + u] = v;
                if (first + e < a.n) a.scratch.h[static_cast<size_t>(first + e) * p.D + u] = v;
              });
  CopyAsyncWaitAll();
  __syncthreads();
  SharedPhase<kBlocks, kBatched>(a, 0, h, smem + o.embed_conv, slot_s, first);
}

// The wide SSM kernel's in-place update of a row (event k's at row + k·tile_state, its B and C at bc + k·per_event)
// for each of the tile's events: lane's part of event k's readout in parts[k]. With kN known (a multiple of 8) the
// events go in batches whose loads all come before their math and stores, so that a warp has a batch's shared-memory
// loads in flight at once rather than one event's chain at a time (a store may alias a later load, as the compiler
// sees it, so it keeps them in order).
template <int kN>
__device__ __forceinline__ void WideSsmUpdate(float (&parts)[kSsmEvents], float* row, int tile_state, const float* bc,
                                              int per_event, const float (&decay)[kSsmEvents],
                                              const float (&dt_x)[kSsmEvents], int N, int lane) {
  if constexpr (kN > 0) {
    static_assert(kN % kLanesPerRow == 0, "a lane takes elements lane, lane + 8, …");
    constexpr int kPer = kN / kLanesPerRow, kBatch = kPer <= 4 ? 4 : 2;
    static_assert(kSsmEvents % kBatch == 0, "whole batches");
#pragma unroll
    for (int k0 = 0; k0 < kSsmEvents; k0 += kBatch) {
      float s[kBatch][kPer], b[kBatch][kPer], c[kBatch][kPer];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int n = lane + i * kLanesPerRow;
          s[j][i] = row[(k0 + j) * tile_state + n];
          b[j][i] = bc[(k0 + j) * per_event + n];
          c[j][i] = bc[(k0 + j) * per_event + kN + n];
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const float s_new = SsmState(decay[k0 + j], s[j][i], dt_x[k0 + j], b[j][i]);
          row[(k0 + j) * tile_state + lane + i * kLanesPerRow] = s_new;
          sum = SsmReadout(sum, c[j][i], s_new);
        }
        parts[k0 + j] = sum;
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kSsmEvents; ++k) {
      float* state = row + k * tile_state;
      parts[k] = SsmRowShare<true>(state, state, bc + k * per_event, decay[k], dt_x[k], N, lane);
    }
  }
}

// Layer l's z and x for SSM rows [u0, u0 + 32) of a tile, x's causal conv, the SSM update and readout and the gate,
// as the cluster kernel's z/x stage computes them; a block an item, the items of a tile's row blocks consecutive (so
// that blocks running together share the tile's inputs and read neighbouring runs of each instrument's states). The
// rows' states and carried conv inputs are copied into shared memory before the kernel waits for the one ahead (but
// layer 0's, whose kernel ahead writes the tick's slots). The update runs in place in
// shared memory, whose rows lie SsmRowStride apart so that the four rows a warp updates at once fall in different
// banks; then the new states go out whole rows at a time. kN: d_state when it is a multiple of 8 known at compile
// time (the update unrolls whole; the states move in 16-byte pieces, which the launch checks they are aligned for),
// else 0 (4-byte pieces). Four blocks an SM (64 registers), as many as `small`'s shared memory allows. kBatched (long
// rows): the weights of two steps of the row sums loaded at once. kEvictFirst (kN > 0): the states' loads and stores
// marked first out of L2 (WideStatesEvictFirst). kWeightsAhead (kN > 0, rows of at most kHeldInputs inputs): the row's
// z/x weights loaded into registers first, before the states (WideWeightsAhead).
constexpr int kSsmBlocksPerSm = 4;
constexpr int kHeldSteps = 4, kHeldInputs = kHeldSteps * 4 * kLanesPerRow;
template <int kN, bool kBatched, bool kEvictFirst = false, bool kWeightsAhead = false>
__global__ void __launch_bounds__(kStreamThreads, kSsmBlocksPerSm) WideSsmKernel(const __grid_constant__ WideArgs a,
                                                                                 int l) {
  static_assert(!kWeightsAhead || (kN > 0 && !kBatched), "held weights: the one-step row sums of compiled d_state");
  extern __shared__ __align__(16) float smem[];
  __shared__ int slot_s[kSsmEvents];
  const StreamPlan& p = a.p;
  const WideLayout o = MakeWideLayout(p);
  const int N = kN > 0 ? kN : p.N, E = p.E, W1 = p.W - 1, cd = E + 2 * N, BC = 2 * N + p.Hh;
  const int row_blocks = CeilDiv(E, kRowGroups), item = blockIdx.x;
  const int first = item / row_blocks * kSsmEvents, tid = threadIdx.x, group = tid / kLanesPerRow;
  const int lane = tid % kLanesPerRow, warp = tid / kWarpSize, warp_lane = tid % kWarpSize;
  const int u0 = item % row_blocks * kRowGroups, u1 = min(E, u0 + kRowGroups), u = u0 + group;
  const bool active = u < u1;
  const int Nr = SsmRowStride(N), tile_state = kRowGroups * Nr, D4 = Align4(p.D), pe_h = D4 + 4, pe_b = Align4(BC);
  const PackStage& s = p.stage[2 + 3 * l];
  float* states = smem + o.ssm_states;
  float* conv = smem + o.ssm_conv;
  float* h = smem + o.ssm_h;
  float* bc_tile = smem + o.ssm_bc;
  const float* rows = a.pack + s.pack + static_cast<size_t>(u0) * s.stride;
  // (The row's address is worked out again for the product below: kept live across the state copies, it made the
  // held-weights kernels spill.)
  [[maybe_unused]] HeldRow<kHeldSteps, 2> held;
  if constexpr (kWeightsAhead) {
    held = LoadHeldRow<kHeldSteps, 2>(rows + static_cast<size_t>(active ? u - u0 : 0) * s.stride, s.in_pad, lane,
                                      active);
  }
  const int ssm_per_slot = p.L * E * N;
  // Thread t moves kWidth floats of rows r0(t), r0(t) + rows_per_pass, … of every event: a warp's lanes cover whole
  // consecutive rows of an event at a time (one contiguous run in global memory).
  constexpr int kWidth = kN > 0 ? 4 : 1;
  const int pieces = N / kWidth, rows_per_step = pieces >= kWarpSize ? 1 : kWarpSize / pieces;
  const int sub = pieces >= kWarpSize ? 0 : warp_lane / pieces, first_piece = (warp_lane - sub * pieces) * kWidth;
  const int rows_per_pass = kStreamWarps * rows_per_step, first_row = warp * rows_per_step + sub;
  const size_t layer_rows = (static_cast<size_t>(l) * E + u0) * N;
  // fn(the piece in shared memory, the piece in global memory, whether the event has a slot) for each of the
  // thread's pieces, the same ones of every event.
  auto each_piece = [&](auto&& fn) {
#pragma unroll 1
    for (int r = first_row; sub < rows_per_step && r < u1 - u0; r += rows_per_pass) {
#pragma unroll 1
      for (int c = first_piece; c < N; c += kWarpSize * kWidth) {
        float* const piece = a.st.ssm + layer_rows + r * N + c;
#pragma unroll
        for (int k = 0; k < kSsmEvents; ++k) {
          const int slot = slot_s[k];
          fn(states + k * tile_state + r * Nr + c, piece + static_cast<ptrdiff_t>(max(slot, 0)) * ssm_per_slot, slot >= 0);
        }
      }
    }
  };
  static_assert(!kEvictFirst || kWidth == 4, "marked 16-byte pieces");
  const uint64_t evict_first = kEvictFirst ? EvictFirstPolicy() : 0;
  auto copy_states = [&] {
    if (tid < kSsmEvents) slot_s[tid] = WideSlot(a, first + tid);
    __syncthreads();
    each_piece([&](float* to, const float* from, bool present) {
      if constexpr (kWidth == 4) {
        if (present && kEvictFirst) {
          CopyAsync16(to, from, evict_first);
        } else if (present) {
          CopyAsync16(to, from);
        } else {
          *reinterpret_cast<float4*>(to) = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      } else if (present) {
        CopyAsync4(to, from);
      } else {
        *to = 0.f;
      }
    });
    LoadConvAsync(conv, p, a.st, slot_s, kSsmEvents, l, u0, u1 - u0, kRowGroups);
  };
  if (l > 0) copy_states();
  WaitForPriorKernels();
  LetNextKernelLaunch();
  if (l == 0) copy_states();
  LoadTileAsync(h, pe_h, a.scratch.h, p.D, p.D, first, a.n, kSsmEvents);
  LoadTileAsync(bc_tile, pe_b, a.scratch.bcdt, BC, BC, first, a.n, kSsmEvents);
  CopyAsyncWaitAll();
  __syncthreads();
  NormScales<kSsmEvents>(h, pe_h, 0, p.D, D4, D4);
  const float* wu = rows + static_cast<size_t>(active ? u - u0 : 0) * s.stride;
  float zx[1][2];
  if constexpr (kWeightsAhead) {
    HeldRowSums<kHeldSteps, 2>(zx[0], held, h, s.in_pad, pe_h, h + D4, lane, active);
  } else {
    TileRowSums<2, 1, kBatched ? 2 : 1, kBatched>(zx, wu, 0, h, s.in_pad, pe_h, h + D4, lane, active);
  }
  const float* prm = wu + 2 * s.in_pad;
  const float* shared = a.pack + p.shared_pack;
  const int head = active ? u / p.P : 0;
  const float A = -expf(shared[p.a_log[l] + head]), Dh = shared[p.skip_d[l] + head];
  const size_t conv_per_slot = static_cast<size_t>(p.L) * W1 * cd;
  // Lane e finishes event e: its conv, Δt and decay, which the row's lanes share for the update (split over the
  // state dimension), then its gate and conv state.
  const int e = lane, slot = slot_s[e];
  const float z = zx[0][0], x = zx[0][1];
  const float* old = conv + e * W1 * kRowGroups + (u - u0);
  float xc = 0.f, dt = 0.f, decay = 0.f;
  if (active) {
    xc = Silu(ConvTaps(prm, W1, x, old, kRowGroups));
    dt = bc_tile[e * pe_b + 2 * N + head];
    decay = expf(dt * A);
  }
  const float dt_x = dt * xc;
  float dt_x_k[kSsmEvents], decay_k[kSsmEvents], parts[kSsmEvents];
#pragma unroll
  for (int k = 0; k < kSsmEvents; ++k) {
    dt_x_k[k] = __shfl_sync(0xffffffffu, dt_x, k, kLanesPerRow);
    decay_k[k] = __shfl_sync(0xffffffffu, decay, k, kLanesPerRow);
    parts[k] = 0.f;
  }
  if (active) WideSsmUpdate<kN>(parts, states + (u - u0) * Nr, tile_state, bc_tile, pe_b, decay_k, dt_x_k, N, lane);
  const float y = LaneRowSum(parts, lane);
  if (active && first + e < a.n) a.scratch.y[static_cast<size_t>(first + e) * E + u] = GatedY(y, Dh, xc, z);
  if (active && slot >= 0 && W1 > 0) {
    float* state = a.st.conv + slot * conv_per_slot + static_cast<size_t>(l) * W1 * cd + u;
#pragma unroll 1
    for (int k = 0; k + 1 < W1; ++k) state[k * cd] = old[(k + 1) * kRowGroups];
    state[(W1 - 1) * cd] = x;
  }
  __syncthreads();
  each_piece([&](const float* from, float* to, bool present) {
    if (!present) return;
    if constexpr (kWidth == 4) {
      const float4 v = *reinterpret_cast<const float4*>(from);
      if constexpr (kEvictFirst) {
        Store16(to, v, evict_first);
      } else {
        *reinterpret_cast<float4*>(to) = v;
      }
    } else {
      *to = *from;
    }
  });
}

// The final norm, the CfC (its state advanced) and the GRN head of a tile whose h and carried CfC states are in the
// head's activations `ev`, then the outputs of its logged events (their entry numbers in log_s, the numbers' ring
// positions in position_s). In a per-tile kernel of kBlocks blocks an SM.
template <int kBlocks, bool kBatched>
__device__ void HeadPhase(const WideArgs& a, float* ev, const int* slot_s, const float* dt_s, const int64_t* log_s,
                          const int64_t* position_s) {
  constexpr int kSteps = kWideSteps<kBlocks, kBatched>;
  const StreamPlan& p = a.p;
  const WideLayout o = MakeWideLayout(p);
  const int tid = threadIdx.x, pe = o.head_per_event;
  const int warp = tid / kWarpSize, warp_lane = tid % kWarpSize, cfc_stage = 1 + 3 * p.L;
  auto stage_rows = [&](int si) { return a.pack + p.stage[si].pack; };
  const float* shared = a.pack + p.shared_pack;
  RmsNormEvents<kWideEvents>(ev, pe, o.head_h, o.head.a, shared + p.norm_f, p.D);
  TileRows<1, kWideRowsPerGroup<kBlocks>, kSteps, kBatched>(p.stage[cfc_stage], stage_rows(cfc_stage),
                                                            ev + o.head.a, pe, nullptr, 0, p.K,
              [&](int u, const float(&acc)[1], const float* prm, int e, bool active) {
                const float v = acc[0];
                if (active) ev[e * pe + o.head.bb + u] = LecunTanh(v + prm[0]);
              });
  __syncthreads();
  // Four outputs a row: with kBatched the weights of two steps at once (the registers allow no more).
  TileRows<4, 1, kBatched ? 2 : 1, kBatched>(p.stage[cfc_stage + 1], stage_rows(cfc_stage + 1), ev + o.head.bb, pe,
                                             nullptr, 0, p.C,
              [&](int u, const float(&acc)[4], const float* prm, int e, bool active) {
                const float ff1 = acc[0], ff2 = acc[1],
                            time_a = acc[2], time_b = acc[3];
                if (!active) return;
                const float c = CfcUnit(ff1, ff2, time_a, time_b, prm, dt_s[e]);
                ev[e * pe + o.head.a + p.D + u] = c;  // the head reads [s ; c_t]
                if (slot_s[e] >= 0) a.st.cfc[slot_s[e] * p.C + u] = c;
              });
  __syncthreads();
  TileRows<2, 1, kSteps, kBatched>(p.stage[cfc_stage + 2], stage_rows(cfc_stage + 2), ev + o.head.a, pe,
                                   nullptr, 0, p.G,
              [&](int u, const float(&acc)[2], const float* prm, int e, bool active) {
                const float fc2 = acc[0], skip = acc[1];
                if (!active) return;
                ev[e * pe + o.head.e2 + u] = Elu(fc2 + prm[0]);
                ev[e * pe + o.head.skip + u] = skip;
              });
  __syncthreads();
  TileRows<2, 1, kSteps, kBatched>(p.stage[cfc_stage + 3], stage_rows(cfc_stage + 3), ev + o.head.e2, pe,
                                   nullptr, 0, p.G,
              [&](int u, const float(&acc)[2], const float* prm, int e, bool active) {
                const float gate = acc[0], value = acc[1];
                if (!active) return;
                ev[e * pe + o.head.pre + u] = GrnPre(ev[e * pe + o.head.skip + u], gate, value, prm);
              });
  __syncthreads();
  for (int e = warp; e < kWideEvents; e += kStreamWarps) {
    GrnLayerNorm(ev + e * pe + o.head.pre, ev + e * pe + o.head.g, shared + p.ln_w, shared + p.ln_b, p.G, warp_lane);
  }
  __syncthreads();
  TileRows<1>(p.stage[cfc_stage + 4], stage_rows(cfc_stage + 4), ev + o.head.g, pe, nullptr, 0, p.H,
              [&](int u, const float(&acc)[1], const float* prm, int e, bool active) {
                const float v = acc[0];
                if (active) ev[e * pe + o.head.logits + u] = v + prm[0];
              });
  __syncthreads();
  if (tid < kWideEvents && slot_s[tid] >= 0 && a.logged) {
    WriteOutputs(ev + tid * pe + o.head.logits, a.st, slot_s[tid], position_s[tid], log_s[tid], p.H);
  }
}

// Layer l's out_proj of the gated RMSNorm (folded) of y, every row, added to the residual; then the next layer's B, C
// and Δt, or after the last layer the CfC and the head.
template <int kBlocks, bool kBatched>
__global__ void __launch_bounds__(kWideThreads, kBlocks) WideOutKernel(const __grid_constant__ WideArgs a, int l) {
  constexpr int kSteps = kWideSteps<kBlocks, kBatched>;
  extern __shared__ __align__(16) float smem[];
  __shared__ int slot_s[kWideEvents];
  __shared__ float dt_s[kWideEvents];
  __shared__ int64_t log_s[kWideEvents], position_s[kWideEvents];
  const StreamPlan& p = a.p;
  const WideLayout o = MakeWideLayout(p);
  const int first = blockIdx.x * kWideEvents, tid = threadIdx.x, E4 = Align4(p.E), pe_y = E4 + 4;
  const bool last = l + 1 == p.L;
  const PackStage& s = p.stage[3 + 3 * l];
  // Before the wait: the tile's slots (written two kernels back) and what only this kernel writes, the next layer's
  // carried B/C conv inputs or the CfC states.
  if (tid < kWideEvents) {
    const int e = first + tid;
    slot_s[tid] = WideSlot(a, e);
    dt_s[tid] = e < a.n ? a.scratch.dt[e] : 0.f;
    log_s[tid] = e < a.n ? a.scratch.log[e] : 0;
    // (Here, off the chain: found with the outputs, it cost a 1,024-event tick 0.3 µs on the H200.)
    position_s[tid] = StreamLogPosition(log_s[tid], a.st.log_entries, a.st.log_reciprocal);
  }
  float* y = smem + o.out_y;
  float* h = smem + (last ? o.out_head + o.head_h : o.out_h);
  const int pe_h = last ? o.head_per_event : Align4(p.D) + 4;
  if (last) {
    for (int i = tid; i < kWideEvents * o.head_per_event; i += blockDim.x) smem[o.out_head + i] = 0.f;
  }
  __syncthreads();
  if (last) {
#pragma unroll 1
    for (int e = 0; e < kWideEvents; ++e) {
      for (int k = tid; slot_s[e] >= 0 && k < p.C; k += blockDim.x) {
        CopyAsync4(smem + o.out_head + e * pe_h + o.head.a + p.D + k, a.st.cfc + slot_s[e] * p.C + k);
      }
    }
  } else {
    LoadConvAsync(smem + o.out_conv, p, a.st, slot_s, kWideEvents, l + 1, p.E, 2 * p.N, 2 * p.N);
  }
  WaitForPriorKernels();
  LetNextKernelLaunch();
  LoadTileAsync(y, pe_y, a.scratch.y, p.E, p.E, first, a.n, kWideEvents);
  LoadTileAsync(h, pe_h, a.scratch.h, p.D, p.D, first, a.n, kWideEvents);
  CopyAsyncWaitAll();
  __syncthreads();
  NormScales<kWideEvents>(y, pe_y, 0, p.E, E4, E4);
  TileRows<1, kWideRowsPerGroup<kBlocks>, kSteps, kBatched>(s, a.pack + s.pack, y, pe_y, y + E4, 0,
                                                            p.D,
              [&](int u, const float(&acc)[1], const float*, int e, bool active) {
                const float v = acc[0];
                if (!active) return;
                const float out = h[e * pe_h + u] + v;
                h[e * pe_h + u] = out;
                if (!last && first + e < a.n) a.scratch.h[static_cast<size_t>(first + e) * p.D + u] = out;
              });
  __syncthreads();
  if (last) {
    HeadPhase<kBlocks, kBatched>(a, smem + o.out_head, slot_s, dt_s, log_s, position_s);
  } else {
    SharedPhase<kBlocks, kBatched>(a, l + 1, h, smem + o.out_conv, slot_s, first);
  }
}

// The wide kernels' static shared memory (a few slot ids) comes out of a block's limit too: at most this much.
constexpr size_t kWideStaticBytes = 256;

bool WideFits(const StreamPlan& p, size_t max_shared_bytes) {
  const WideLayout o = MakeWideLayout(p);
  return sizeof(float) * std::max({o.embed, o.ssm, o.out}) + kWideStaticBytes <= max_shared_bytes;
}

// Raises a wide kernel's dynamic shared-memory limit to what its static shared memory leaves of the block's.
template <typename... Params>
cudaError_t PrepareWide(void (*kernel)(Params...), size_t max_shared_bytes) {
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(&attributes, kernel);
  if (error != cudaSuccess) return error;
  if (attributes.sharedSizeBytes > kWideStaticBytes) return cudaErrorInvalidValue;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(max_shared_bytes - attributes.sharedSizeBytes));
}

cudaLaunchConfig_t LaunchConfig(const StreamPlan& plan, size_t bytes, int clusters, cudaStream_t stream,
                                cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(clusters * plan.cluster);
  config.blockDim = dim3(kStreamThreads);
  config.dynamicSmemBytes = bytes;
  config.stream = stream;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = plan.cluster;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// The kernels of the fixed plans, by shape.
using StreamStepKernelPointer = void (*)(StreamPlan, const float*, StreamSlots, StreamTickInput);
using StreamResidentKernelPointer = void (*)(StreamPlan, const float*, StreamSlots, StreamResidentQueue);
template <int... kShapes>
constexpr std::array<StreamStepKernelPointer, kFixedShapes> FixedKernels(std::integer_sequence<int, kShapes...>) {
  return {StreamStepKernel<1, kShapes>...};
}
template <bool kStamped, int... kShapes>
constexpr std::array<StreamResidentKernelPointer, kFixedShapes> ResidentKernels(
    std::integer_sequence<int, kShapes...>) {
  return {StreamResidentKernel<kShapes, kStamped>...};
}
constexpr auto kFixedKernels = FixedKernels(std::make_integer_sequence<int, kFixedShapes>());
constexpr auto kResidentKernels = ResidentKernels<false>(std::make_integer_sequence<int, kFixedShapes>());
constexpr auto kStampedResidentKernels = ResidentKernels<true>(std::make_integer_sequence<int, kFixedShapes>());

// The kernel of a launch's plan and its shared memory: its fixed plan's own where it has one (and the device room for
// the slot's conv inputs), else the one that reads the plan.
struct StepKernel {
  StreamStepKernelPointer kernel;
  size_t bytes;
};
template <int EG>
StepKernel KernelFor(const StreamPlan& plan, size_t max_shared_bytes) {
  const size_t bytes = static_cast<size_t>(plan.floats) * sizeof(float);
  if constexpr (EG == 1) {
    const size_t fixed_bytes = bytes + SlotConvFloats(plan) * sizeof(float);
    for (int shape = 0; shape < kFixedShapes; ++shape) {
      if (plan == FixedPlan(shape) && fixed_bytes <= max_shared_bytes) return {kFixedKernels[shape], fixed_bytes};
    }
  }
  return {StreamStepKernel<EG, -1>, bytes};
}

template <int EG>
cudaError_t Launch(const StreamPlan& plan, const float* pack, const StreamSlots& slots, const StreamTickInput& tick,
                   int max_clusters, size_t max_shared_bytes, cudaStream_t stream) {
  const StepKernel k = KernelFor<EG>(plan, max_shared_bytes);
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      LaunchConfig(plan, k.bytes, std::min(CeilDiv(tick.n, EG), max_clusters), stream, &attribute);
  return cudaLaunchKernelEx(&config, k.kernel, plan, pack, slots, tick);
}

template <int EG>
cudaError_t MaxClusters(const StreamPlan& plan, size_t max_shared_bytes, int* clusters) {
  const StepKernel k = KernelFor<EG>(plan, max_shared_bytes);
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = LaunchConfig(plan, k.bytes, 1, nullptr, &attribute);
  return cudaOccupancyMaxActiveClusters(clusters, k.kernel, &config);
}

template <typename Kernel>
cudaError_t Prepare(Kernel kernel, size_t max_shared_bytes) {
  cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_shared_bytes));
  if (error != cudaSuccess) return error;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
}

// The plan of a launch shape; false when the model or the shape is unsupported or the activations do not fit.
bool PlanFor(const StreamWeights& w, int events_per_group, int cluster_size, size_t max_shared_bytes,
             StreamPlan* plan) {
  const bool valid_shape =
      (events_per_group == 1 || events_per_group == 2 || events_per_group == 4 || events_per_group == 8) &&
      cluster_size >= 1 && cluster_size <= kStreamMaxCluster;
  if (!Supported(w) || !valid_shape) return false;
  *plan = MakePackPlan(w);
  return Layout(*plan, events_per_group, cluster_size, max_shared_bytes);
}

// Whether a wide tick of n events marks its SSM states' traffic first out of L2 (each state is read and written once a
// tick): where the tick's states outgrow the L2 (they cannot stay there for the next tick anyway), so that what the
// tick reads again (the weights, which every tile reads, the activations, the conv states) keeps the room; up to
// 2,048 events. Measured on the H200 (s16f–s16h, alternating with unmarked traffic): small's 1,024 instruments (64 MB
// of states) 126.1–127.8 → 118.9–120.6 µs, 2,048 238.9–244.1 → 234.7–238.7, large's 256 701.6–703.8 → 687.1–690.9
// and 1,024 1,701.2–1,703.8 → 1,663.7–1,683.0; marked regardless of size, small's 256 (16 MB, which stay in L2 unmarked) took 1 µs more and its 10,000
// 989–993 against 978. Marking the loads or the stores alone gained ≤ 1.5 µs at 1,024.
constexpr int kWideEvictFirstMaxEvents = 2048;
bool WideStatesEvictFirst(const StreamPlan& p, int n, size_t l2_bytes) {
  const size_t state_bytes = sizeof(float) * n * p.L * p.E * p.N;
  return n <= kWideEvictFirstMaxEvents && state_bytes > l2_bytes;
}

// Whether a wide tick's SSM kernel (small's d_state of 32, rows of at most kHeldInputs inputs) loads its z/x weights
// into registers before its states: where its blocks outnumber one wave of the device. Measured on the H200
// (graph-launched small ticks back to back, against the L1 prefetch the kernel then had): held at every size
// (`s21d`), 256 and 512 instruments (one wave) took 0.2–0.7 µs more; held past one wave (`s21e`), 1,024 109.4–109.9 →
// 105.0–105.2 µs, 2,048 215.5–216.7 → 199.2–200.0, 10,000 969.9–970.7 → 895.2–896.4.
bool WideWeightsAhead(const StreamPlan& p, int ssm_blocks, int sm_count) {
  return p.N == 32 && Align4(p.D) <= kHeldInputs && ssm_blocks > kSsmBlocksPerSm * sm_count;
}

}  // namespace

size_t StreamPackSize(const StreamWeights& w) { return Supported(w) ? MakePackPlan(w).pack_size : 0; }

cudaError_t PackStreamWeights(const StreamWeights& w, float* pack, cudaStream_t stream) {
  if (!Supported(w)) return cudaErrorInvalidValue;
  const StreamPlan plan = MakePackPlan(w);
  PackKernel<<<GridFor(plan.pack_size, 256, 1024), 256, 0, stream>>>(w, plan, pack);
  return cudaGetLastError();
}

cudaError_t PrepareStreamStep(size_t max_shared_bytes) {
  for (cudaError_t error :
       {Prepare(StreamStepKernel<1, -1>, max_shared_bytes), Prepare(StreamStepKernel<2, -1>, max_shared_bytes),
        Prepare(StreamStepKernel<4, -1>, max_shared_bytes), Prepare(StreamStepKernel<8, -1>, max_shared_bytes),
        PrepareWide(WideEmbedKernel<1, false>, max_shared_bytes),
        PrepareWide(WideEmbedKernel<1, true>, max_shared_bytes),
        PrepareWide(WideEmbedKernel<2, false>, max_shared_bytes),
        PrepareWide(WideSsmKernel<0, false>, max_shared_bytes), PrepareWide(WideSsmKernel<32, false>, max_shared_bytes),
        PrepareWide(WideSsmKernel<64, false>, max_shared_bytes), PrepareWide(WideSsmKernel<64, true>, max_shared_bytes),
        PrepareWide(WideSsmKernel<32, false, true>, max_shared_bytes),
        PrepareWide(WideSsmKernel<32, false, true, true>, max_shared_bytes),
        PrepareWide(WideSsmKernel<32, false, false, true>, max_shared_bytes),
        PrepareWide(WideSsmKernel<64, false, true>, max_shared_bytes),
        PrepareWide(WideSsmKernel<64, true, true>, max_shared_bytes),
        PrepareWide(WideOutKernel<1, false>, max_shared_bytes), PrepareWide(WideOutKernel<1, true>, max_shared_bytes),
        PrepareWide(WideOutKernel<2, false>, max_shared_bytes)}) {
    if (error != cudaSuccess) return error;
  }
  for (StreamStepKernelPointer kernel : kFixedKernels) {
    if (const cudaError_t error = Prepare(kernel, max_shared_bytes); error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

bool StreamWideFits(const StreamWeights& w, size_t max_shared_bytes) {
  return Supported(w) && WideFits(MakePackPlan(w), max_shared_bytes);
}

cudaError_t LaunchStreamWide(const StreamWeights& w, const float* pack, const StreamSlots& slots,
                             const StreamWideScratch& scratch, const StreamTickInput& tick, size_t max_shared_bytes,
                             int sm_count, size_t l2_bytes, cudaStream_t stream) {
  if (tick.n <= 0) return cudaSuccess;
  if (!StreamWideFits(w, max_shared_bytes)) return cudaErrorInvalidValue;
  const WideArgs a{MakePackPlan(w), pack, slots, scratch, tick.n, tick.logged};
  const StreamPlan& p = a.p;
  const WideLayout o = MakeWideLayout(p);
  auto bytes = [](int floats) { return sizeof(float) * floats; };
  const int tiles = CeilDiv(tick.n, kWideEvents);
  const bool one_wave = tiles <= sm_count;
  const bool states_aligned = reinterpret_cast<uintptr_t>(slots.ssm) % 16 == 0;
  const bool long_rows = p.D >= kWideLongRows;  // then the batched weight loads (kWideSteps)
  const bool evict_first = WideStatesEvictFirst(p, tick.n, l2_bytes);
  const int ssm_blocks = tiles * CeilDiv(p.E, kRowGroups);  // a block a tile's row block
  const bool weights_ahead = WideWeightsAhead(p, ssm_blocks, sm_count);
  void (*ssm_kernel)(WideArgs, int) = !states_aligned ? WideSsmKernel<0, false>
                                      : weights_ahead ? (evict_first ? WideSsmKernel<32, false, true, true>
                                                                     : WideSsmKernel<32, false, false, true>)
                                      : p.N == 32     ? (evict_first ? WideSsmKernel<32, false, true>
                                                                     : WideSsmKernel<32, false>)
                                      : p.N != 64     ? WideSsmKernel<0, false>
                                      : long_rows     ? (evict_first ? WideSsmKernel<64, true, true>
                                                                     : WideSsmKernel<64, true>)
                                                      : (evict_first ? WideSsmKernel<64, false, true>
                                                                     : WideSsmKernel<64, false>);
  void (*embed_kernel)(WideArgs, StreamTickInput) = !one_wave  ? WideEmbedKernel<2, false>
                                                    : long_rows ? WideEmbedKernel<1, true>
                                                                : WideEmbedKernel<1, false>;
  void (*out_kernel)(WideArgs, int) = !one_wave  ? WideOutKernel<2, false>
                                      : long_rows ? WideOutKernel<1, true>
                                                  : WideOutKernel<1, false>;
  // The first kernel waits for everything queued before it; each later one may launch under the one ahead.
  cudaError_t error =
      LaunchKernel(embed_kernel, dim3(tiles), kWideThreads, bytes(o.embed), stream, false, a, tick);
  for (int l = 0; l < p.L && error == cudaSuccess; ++l) {
    error = LaunchKernel(ssm_kernel, dim3(ssm_blocks), kStreamThreads, bytes(o.ssm), stream, true, a, l);
    if (error != cudaSuccess) return error;
    error = LaunchKernel(out_kernel, dim3(tiles), kWideThreads, bytes(o.out), stream, true, a, l);
  }
  return error;
}

cudaError_t FitStreamStep(const StreamWeights& w, int events_per_group, int cluster_size, size_t max_shared_bytes,
                          StreamShapeFit* fit) {
  *fit = StreamShapeFit{};
  StreamPlan plan;
  if (!PlanFor(w, events_per_group, cluster_size, max_shared_bytes, &plan)) return cudaSuccess;
  fit->weights_resident = std::all_of(plan.stage_at, plan.stage_at + plan.stages, [](int at) { return at >= 0; });
  switch (events_per_group) {
    case 1: return MaxClusters<1>(plan, max_shared_bytes, &fit->max_clusters);
    case 2: return MaxClusters<2>(plan, max_shared_bytes, &fit->max_clusters);
    case 4: return MaxClusters<4>(plan, max_shared_bytes, &fit->max_clusters);
    default: return MaxClusters<8>(plan, max_shared_bytes, &fit->max_clusters);
  }
}

cudaError_t SetStreamStepTick(cudaGraphExec_t exec, cudaGraphNode_t node, const StreamTickInput& tick) {
  cudaKernelNodeParams params;
  const cudaError_t error = cudaGraphKernelNodeGetParams(node, &params);
  if (error != cudaSuccess) return error;
  // The kernel's arguments: the plan, the pack and the slots as captured, then the tick.
  void* arguments[4] = {params.kernelParams[0], params.kernelParams[1], params.kernelParams[2],
                        const_cast<StreamTickInput*>(&tick)};
  params.kernelParams = arguments;
  params.extra = nullptr;
  return cudaGraphExecKernelNodeSetParams(exec, node, &params);
}

cudaError_t LaunchStreamStep(const StreamWeights& w, const float* pack, const StreamSlots& slots,
                             const StreamTickInput& tick, int events_per_group, int cluster_size, int max_clusters,
                             size_t max_shared_bytes, cudaStream_t stream) {
  if (tick.n <= 0) return cudaSuccess;
  StreamPlan plan;
  if (!PlanFor(w, events_per_group, cluster_size, max_shared_bytes, &plan) || max_clusters < 1) {
    return cudaErrorInvalidValue;
  }
  switch (events_per_group) {
    case 1: return Launch<1>(plan, pack, slots, tick, max_clusters, max_shared_bytes, stream);
    case 2: return Launch<2>(plan, pack, slots, tick, max_clusters, max_shared_bytes, stream);
    case 4: return Launch<4>(plan, pack, slots, tick, max_clusters, max_shared_bytes, stream);
    default: return Launch<8>(plan, pack, slots, tick, max_clusters, max_shared_bytes, stream);
  }
}

namespace {
// The fixed plan whose launch shape the model takes for lone events, if any (−1).
int ResidentShape(const StreamWeights& w, size_t max_shared_bytes) {
  for (int shape = 0; shape < kFixedShapes; ++shape) {
    const StreamPlan fixed = FixedPlan(shape);
    StreamPlan plan;
    if (PlanFor(w, 1, fixed.cluster, max_shared_bytes, &plan) && plan == fixed &&
        w.F <= kStreamResidentWords - kResidentX && ResidentSharedBytes(plan) <= max_shared_bytes) {
      return shape;
    }
  }
  return -1;
}
}  // namespace

bool StreamResidentFits(const StreamWeights& w, size_t max_shared_bytes) {
  return ResidentShape(w, max_shared_bytes) >= 0;
}

cudaError_t LaunchStreamResident(const StreamWeights& w, const float* pack, const StreamSlots& slots,
                                 const StreamResidentQueue& queue, size_t max_shared_bytes, cudaStream_t stream) {
  const int shape = ResidentShape(w, max_shared_bytes);
  if (shape < 0 || queue.ring == nullptr || queue.ring_size < 1 ||
      !std::has_single_bit(static_cast<uint32_t>(queue.ring_size)) || queue.done == nullptr ||
      (queue.stamps != nullptr && !std::has_single_bit(queue.stamp_slots))) {
    return cudaErrorInvalidValue;
  }
  const StreamPlan plan = FixedPlan(shape);
  const size_t bytes = ResidentSharedBytes(plan);
  const StreamResidentKernelPointer kernel =
      queue.stamps != nullptr ? kStampedResidentKernels[shape] : kResidentKernels[shape];
  if (const cudaError_t error = Prepare(kernel, bytes); error != cudaSuccess) return error;
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = LaunchConfig(plan, bytes, 1, stream, &attribute);
  return cudaLaunchKernelEx(&config, kernel, plan, pack, slots, queue);
}

namespace {
__global__ void SlotFiniteKernel(const float* conv, size_t n_conv, const float* ssm, size_t n_ssm, const float* cfc,
                                 size_t n_cfc, int* not_finite) {
  bool finite = true;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n_conv + n_ssm + n_cfc;
       i += gridDim.x * size_t{blockDim.x}) {
    const float v = i < n_conv ? conv[i] : i < n_conv + n_ssm ? ssm[i - n_conv] : cfc[i - n_conv - n_ssm];
    finite = finite && isfinite(v);
  }
  if (!__syncthreads_and(finite) && threadIdx.x == 0) *not_finite = 1;
}
}  // namespace

cudaError_t CheckStreamSlotFinite(const StreamSlots& slots, int slot, size_t conv, size_t ssm, size_t cfc,
                                  int* not_finite, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>(std::min<size_t>(32, (conv + ssm + cfc + kThreads - 1) / kThreads));
  SlotFiniteKernel<<<blocks, kThreads, 0, stream>>>(slots.conv + slot * conv, conv, slots.ssm + slot * ssm, ssm,
                                                    slots.cfc + slot * cfc, cfc, not_finite);
  return cudaGetLastError();
}

void PostStreamResidentEvent(StreamResidentEntry* ring, int ring_size, uint32_t index, int32_t slot, float dt,
                             bool logged, int64_t log_index, const float* x, int F) {
  uint32_t payload[kStreamResidentWords] = {};
  payload[kResidentSlot] = static_cast<uint32_t>(slot);
  payload[kResidentDt] = std::bit_cast<uint32_t>(dt);
  payload[kResidentLogged] = logged ? 1 : 0;
  payload[kResidentLogLow] = static_cast<uint32_t>(static_cast<uint64_t>(log_index));
  payload[kResidentLogHigh] = static_cast<uint32_t>(static_cast<uint64_t>(log_index) >> 32);
  for (int i = 0; i < F && kResidentX + i < kStreamResidentWords; ++i) {
    payload[kResidentX + i] = std::bit_cast<uint32_t>(x[i]);
  }
  const uint64_t sequence = static_cast<uint64_t>(index + 1) << 32;
  StreamResidentEntry& entry = ring[index % ring_size];
  for (int i = 0; i < kStreamResidentWords; ++i) {
    std::atomic_ref<uint64_t>(entry.words[i]).store(sequence | payload[i], std::memory_order_relaxed);
  }
}

}  // namespace perception::kernels
