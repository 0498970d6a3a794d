// The streaming step kernel: a thread-block cluster per group of events carries them through the whole model.
// Every block keeps the activations of its group in shared memory; matrix products are split by rows over the
// cluster's blocks (a warp per row, lanes over the input) and each result row is stored into every block's shared
// memory through distributed shared memory, then the cluster synchronizes. Elementwise stages and norms are
// recomputed by every block (cheap), so only the products and the SSM rows cross blocks. Sums run in a fixed order.
#include <cooperative_groups.h>

#include "kernels/common.cuh"
#include "kernels/stream_step.h"

namespace perception::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kStreamThreads = 256;
constexpr int kStreamWarps = kStreamThreads / kWarpSize;

__host__ __device__ constexpr int Align4(int n) { return (n + 3) / 4 * 4; }

// Offsets (in floats) of each activation inside one event's shared-memory region.
struct EventLayout {
  int xn, h, r, zx, xbc, conv_old, y, yn, proj, a, bb, heads, fs, e2, e1, gv, g, logits, per_event;

  __host__ __device__ explicit EventLayout(const StreamWeights& w) {
    const int cd = w.E + 2 * w.N, zd = 2 * w.E + 2 * w.N + w.Hh;
    int at = 0;
    auto take = [&at](int n) {
      const int start = at;
      at += Align4(n);
      return start;
    };
    xn = take(w.F);
    h = take(w.D);
    r = take(w.D);
    zx = take(zd);
    xbc = take(cd);
    conv_old = take(w.L * (w.W - 1) * cd);
    y = take(w.E);
    yn = take(w.E);
    proj = take(w.D);
    a = take(w.D + w.C);
    bb = take(w.K);
    heads = take(4 * w.C);
    fs = take(2 * w.G);
    e2 = take(w.G);
    e1 = take(w.G);
    gv = take(2 * w.G);
    g = take(w.G);
    logits = take(w.H);
    per_event = at;
  }
};

constexpr int kReductionScratch = kStreamWarps;

struct MatvecSegment {
  const float* weight;  // [rows, in] row-major
  const float* bias;    // [rows] or null
  int rows;
  int out;  // offset of the result in each event's region
};

// out[e][seg.out + row] = W·in[e] (+ b) for every row of the segments, rows split over the cluster's warps; each
// result is stored into every block of the cluster, then the cluster synchronizes.
template <int EG, int SEGMENTS>
__device__ void ClusterMatvec(const cg::cluster_group& cluster, const MatvecSegment (&segments)[SEGMENTS], int in,
                              int in_len, float* smem, int per_event) {
  const int blocks = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  int total = 0;
  for (const MatvecSegment& s : segments) total += s.rows;
  for (int row = rank * kStreamWarps + warp; row < total; row += blocks * kStreamWarps) {
    int local = row, seg = 0;
    while (local >= segments[seg].rows) local -= segments[seg++].rows;
    const MatvecSegment& s = segments[seg];
    const float* weights = s.weight + static_cast<size_t>(local) * in_len;
    float acc[EG];
#pragma unroll
    for (int e = 0; e < EG; ++e) acc[e] = 0.f;
    for (int i = lane; i < in_len; i += kWarpSize) {
      const float wv = __ldg(weights + i);
#pragma unroll
      for (int e = 0; e < EG; ++e) acc[e] += wv * smem[e * per_event + in + i];
    }
    const float bias = s.bias ? __ldg(s.bias + local) : 0.f;
#pragma unroll
    for (int e = 0; e < EG; ++e) acc[e] = WarpSum(acc[e]) + bias;
    if (lane < blocks) {
      float* remote = cluster.map_shared_rank(smem, lane);
#pragma unroll
      for (int e = 0; e < EG; ++e) remote[e * per_event + s.out + local] = acc[e];
    }
  }
  cluster.sync();
}

// out = v / sqrt(mean(v²) + eps) ⊙ w over n values, computed by the whole block (deterministic order).
__device__ void BlockRmsNorm(const float* v, const float* w, int n, float* out, float* scratch) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += v[i] * v[i];
  const float rstd = 1.f / sqrtf(BlockSum(ss, scratch) / n + kNormEps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = v[i] * rstd * __ldg(w + i);
  __syncthreads();
}

template <int EG>
__global__ void __launch_bounds__(kStreamThreads)
    StreamStepKernel(const __grid_constant__ StreamWeights w, const __grid_constant__ StreamSlots st,
                     const __grid_constant__ StreamTickInput tick) {
  const cg::cluster_group cluster = cg::this_cluster();
  const int blocks = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int first = static_cast<int>(blockIdx.x / blocks) * EG;
  const int count = min(EG, tick.n - first);
  // The tick's inputs may live in pinned host memory, where every read is a round trip over the bus: slot ids and
  // Δt are read once here. Padding events (past n, or a negative slot in a tick padded to its graph's bucket) read
  // zeros and write nothing.
  __shared__ int slot_ids[EG];
  __shared__ float event_dt[EG];
  if (threadIdx.x < EG) {
    const int e = threadIdx.x;
    slot_ids[e] = e < count ? tick.slots[first + e] : -1;
    event_dt[e] = e < count ? tick.dt[first + e] : 0.f;
  }
  __syncthreads();
  auto slot_of = [&](int e) { return slot_ids[e]; };
  extern __shared__ float smem[];
  __shared__ float scratch[kReductionScratch];
  const EventLayout lay(w);
  const int P = lay.per_event, tid = threadIdx.x;
  const int E = w.E, N = w.N, cd = E + 2 * N, zd = 2 * E + 2 * N + w.Hh, W1 = w.W - 1, DC = w.D + w.C;
  const size_t conv_per_slot = static_cast<size_t>(w.L) * W1 * cd;
  const size_t ssm_per_layer = static_cast<size_t>(w.Hh) * w.P * N;

  // Inputs: standardized features, the carried conv rows and c_{t−1}; padding events are zeros and never written.
  for (int e = 0; e < EG; ++e) {
    float* ev = smem + e * P;
    const int slot = slot_of(e);
    const bool valid = slot >= 0;
    for (int f = tid; f < w.F; f += blockDim.x) {
      ev[lay.xn + f] = valid ? (tick.x[static_cast<size_t>(first + e) * w.F + f] - __ldg(w.norm_mean + f)) *
                                   __ldg(w.norm_inv_std + f)
                             : 0.f;
    }
    for (size_t i = tid; i < conv_per_slot; i += blockDim.x) {
      ev[lay.conv_old + i] = valid ? st.conv[static_cast<size_t>(slot) * conv_per_slot + i] : 0.f;
    }
    for (int u = tid; u < w.C; u += blockDim.x) ev[lay.a + w.D + u] = valid ? st.cfc[slot * w.C + u] : 0.f;
  }
  cluster.sync();  // every block is running before any distributed shared-memory store

  ClusterMatvec<EG>(cluster, {MatvecSegment{w.embed_w, w.embed_b, w.D, lay.h}}, lay.xn, w.F, smem, P);

  for (int l = 0; l < w.L; ++l) {
    const StreamLayerWeights& lw = w.layers[l];
    for (int e = 0; e < EG; ++e) BlockRmsNorm(smem + e * P + lay.h, lw.norm, w.D, smem + e * P + lay.r, scratch);
    ClusterMatvec<EG>(cluster, {MatvecSegment{lw.in_proj, nullptr, zd, lay.zx}}, lay.r, w.D, smem, P);

    // Causal conv over the carried rows and the new input; this block's share of channels updates the state.
    for (int e = 0; e < EG; ++e) {
      float* ev = smem + e * P;
      const float* old_rows = ev + lay.conv_old + l * W1 * cd;
      const float* x_new = ev + lay.zx + E;
      const int slot = slot_of(e);
      for (int c = tid; c < cd; c += blockDim.x) {
        float acc = __ldg(lw.conv_bias + c) + __ldg(lw.conv_weight + c * w.W + W1) * x_new[c];
        for (int k = 0; k < W1; ++k) acc += __ldg(lw.conv_weight + c * w.W + k) * old_rows[k * cd + c];
        ev[lay.xbc + c] = Silu(acc);
        if (slot >= 0 && c % blocks == rank) {
          float* state = st.conv + slot * conv_per_slot + static_cast<size_t>(l) * W1 * cd;
          for (int k = 0; k + 1 < W1; ++k) state[k * cd + c] = old_rows[(k + 1) * cd + c];
          if (W1 > 0) state[(W1 - 1) * cd + c] = x_new[c];
        }
      }
    }
    __syncthreads();

    // SSM rows (h, p) split over the cluster's warps; lanes over the state dimension.
    {
      const int lane = tid % kWarpSize, warp = tid / kWarpSize;
      for (int hp = rank * kStreamWarps + warp; hp < E; hp += blocks * kStreamWarps) {
        const int head = hp / w.P;
        const float A = -expf(__ldg(lw.a_log + head)), Dh = __ldg(lw.d + head), bias = __ldg(lw.dt_bias + head);
        float y[EG];
#pragma unroll
        for (int e = 0; e < EG; ++e) {
          const float* ev = smem + e * P;
          const float dt = Softplus(ev[lay.zx + E + cd + head] + bias);
          const float decay = expf(dt * A), x = ev[lay.xbc + hp];
          const int slot = slot_of(e);
          float* s = slot >= 0 ? st.ssm + slot * (w.L * ssm_per_layer) + l * ssm_per_layer + static_cast<size_t>(hp) * N
                               : nullptr;
          float acc = 0.f;
          for (int n = lane; n < N; n += kWarpSize) {
            const float s_new = decay * (s ? s[n] : 0.f) + dt * x * ev[lay.xbc + E + n];
            if (s) s[n] = s_new;
            acc += ev[lay.xbc + E + N + n] * s_new;
          }
          y[e] = WarpSum(acc) + Dh * x;
        }
        if (lane < blocks) {
          float* remote = cluster.map_shared_rank(smem, lane);
#pragma unroll
          for (int e = 0; e < EG; ++e) remote[e * P + lay.y + hp] = y[e];
        }
      }
      cluster.sync();
    }

    // Gate, gated RMSNorm, out_proj, residual.
    for (int e = 0; e < EG; ++e) {
      float* ev = smem + e * P;
      for (int i = tid; i < E; i += blockDim.x) ev[lay.y + i] *= Silu(ev[lay.zx + i]);
      __syncthreads();
      BlockRmsNorm(ev + lay.y, lw.mixer_norm, E, ev + lay.yn, scratch);
    }
    ClusterMatvec<EG>(cluster, {MatvecSegment{lw.out_proj, nullptr, w.D, lay.proj}}, lay.yn, E, smem, P);
    for (int e = 0; e < EG; ++e) {
      float* ev = smem + e * P;
      for (int i = tid; i < w.D; i += blockDim.x) ev[lay.h + i] += ev[lay.proj + i];
    }
    __syncthreads();
  }

  // Final norm into the CfC input [s ; c_{t−1}].
  for (int e = 0; e < EG; ++e) BlockRmsNorm(smem + e * P + lay.h, w.norm_f, w.D, smem + e * P + lay.a, scratch);
  ClusterMatvec<EG>(cluster, {MatvecSegment{w.backbone_w, w.backbone_b, w.K, lay.bb}}, lay.a, DC, smem, P);
  for (int e = 0; e < EG; ++e) {
    for (int k = tid; k < w.K; k += blockDim.x) smem[e * P + lay.bb + k] = LecunTanh(smem[e * P + lay.bb + k]);
  }
  __syncthreads();
  ClusterMatvec<EG>(cluster,
                    {MatvecSegment{w.ff1_w, w.ff1_b, w.C, lay.heads}, MatvecSegment{w.ff2_w, w.ff2_b, w.C, lay.heads + w.C},
                     MatvecSegment{w.time_a_w, w.time_a_b, w.C, lay.heads + 2 * w.C},
                     MatvecSegment{w.time_b_w, w.time_b_b, w.C, lay.heads + 3 * w.C}},
                    lay.bb, w.K, smem, P);
  for (int e = 0; e < EG; ++e) {
    float* ev = smem + e * P;
    const int slot = slot_of(e);
    const bool valid = slot >= 0;
    const float dt = valid ? event_dt[e] : 0.f;
    for (int u = tid; u < w.C; u += blockDim.x) {
      const float* hd = ev + lay.heads;
      const float tau = Sigmoid(hd[2 * w.C + u] * dt + hd[3 * w.C + u]);
      const float c = tanhf(hd[u]) * (1.f - tau) + tau * tanhf(hd[w.C + u]);
      ev[lay.a + w.D + u] = c;  // the head reads [s ; c_t]
      if (valid && rank == 0) st.cfc[slot * w.C + u] = c;
    }
  }
  __syncthreads();

  // GRN head.
  ClusterMatvec<EG>(cluster,
                    {MatvecSegment{w.fc2_w, w.fc2_b, w.G, lay.fs}, MatvecSegment{w.skip_w, nullptr, w.G, lay.fs + w.G}},
                    lay.a, DC, smem, P);
  for (int e = 0; e < EG; ++e) {
    for (int i = tid; i < w.G; i += blockDim.x) smem[e * P + lay.e2 + i] = Elu(smem[e * P + lay.fs + i]);
  }
  __syncthreads();
  ClusterMatvec<EG>(cluster, {MatvecSegment{w.fc1_w, w.fc1_b, w.G, lay.e1}}, lay.e2, w.G, smem, P);
  ClusterMatvec<EG>(cluster,
                    {MatvecSegment{w.gate_w, w.gate_b, w.G, lay.gv}, MatvecSegment{w.value_w, w.value_b, w.G, lay.gv + w.G}},
                    lay.e1, w.G, smem, P);
  for (int e = 0; e < EG; ++e) {
    float* ev = smem + e * P;
    for (int i = tid; i < w.G; i += blockDim.x) {
      ev[lay.fs + w.G + i] += Sigmoid(ev[lay.gv + i]) * ev[lay.gv + w.G + i];
    }
    __syncthreads();
    const float* pre = ev + lay.fs + w.G;
    float sum = 0.f;
    for (int i = tid; i < w.G; i += blockDim.x) sum += pre[i];
    const float mean = BlockSum(sum, scratch) / w.G;
    float var = 0.f;
    for (int i = tid; i < w.G; i += blockDim.x) var += (pre[i] - mean) * (pre[i] - mean);
    const float rstd = 1.f / sqrtf(BlockSum(var, scratch) / w.G + kNormEps);
    for (int i = tid; i < w.G; i += blockDim.x) {
      ev[lay.g + i] = (pre[i] - mean) * rstd * __ldg(w.ln_w + i) + __ldg(w.ln_b + i);
    }
    __syncthreads();
  }
  ClusterMatvec<EG>(cluster, {MatvecSegment{w.out_w, w.out_b, w.H, lay.logits}}, lay.g, w.G, smem, P);

  // Probabilities, conviction (MODEL.md §2.8: the most confident horizon, lowest on ties) and the log entry.
  if (rank == 0 && tid < EG && slot_of(tid) >= 0 && tick.log_indices) {
    const int e = tid;
    const float* logits = smem + e * P + lay.logits;
    const int slot = slot_of(e);
    const size_t entry = static_cast<size_t>(slot) * st.log_entries + tick.log_indices[first + e];
    int best = 0;
    float best_distance = -1.f;
    for (int h = 0; h < w.H; ++h) {
      const float p = Sigmoid(logits[h]);
      st.probs[slot * w.H + h] = p;
      st.log_probs[entry * w.H + h] = p;
      if (fabsf(p - 0.5f) > best_distance) {
        best_distance = fabsf(p - 0.5f);
        best = h;
      }
    }
    st.log_convictions[entry] = 2.f * Sigmoid(logits[best]) - 1.f;
  }
}

template <int EG>
cudaError_t Launch(const StreamWeights& w, const StreamSlots& slots, const StreamTickInput& tick, int cluster_size,
                   cudaStream_t stream) {
  const int groups = CeilDiv(tick.n, EG);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(groups * cluster_size);
  config.blockDim = dim3(kStreamThreads);
  config.dynamicSmemBytes = StreamStepSharedBytes(w, EG);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster_size;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, StreamStepKernel<EG>, w, slots, tick);
}

template <int EG>
cudaError_t Prepare(const StreamWeights& w) {
  return cudaFuncSetAttribute(StreamStepKernel<EG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(StreamStepSharedBytes(w, EG)));
}

}  // namespace

size_t StreamStepSharedBytes(const StreamWeights& w, int events_per_group) {
  return static_cast<size_t>(EventLayout(w).per_event) * events_per_group * sizeof(float);
}

int StreamStepMaxGroup(const StreamWeights& w, size_t max_shared_bytes) {
  for (int group = 8; group >= 1; group /= 2) {
    if (StreamStepSharedBytes(w, group) + kReductionScratch * sizeof(float) <= max_shared_bytes) return group;
  }
  return 0;
}

cudaError_t PrepareStreamStep(const StreamWeights& w, int events_per_group) {
  switch (events_per_group) {
    case 1: return Prepare<1>(w);
    case 2: return Prepare<2>(w);
    case 4: return Prepare<4>(w);
    case 8: return Prepare<8>(w);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchStreamStep(const StreamWeights& w, const StreamSlots& slots, const StreamTickInput& tick,
                             int events_per_group, int cluster_size, cudaStream_t stream) {
  if (tick.n <= 0) return cudaSuccess;
  if (cluster_size < 1 || cluster_size > 8 || w.L > kStreamMaxLayers) return cudaErrorInvalidValue;
  switch (events_per_group) {
    case 1: return Launch<1>(w, slots, tick, cluster_size, stream);
    case 2: return Launch<2>(w, slots, tick, cluster_size, stream);
    case 4: return Launch<4>(w, slots, tick, cluster_size, stream);
    case 8: return Launch<8>(w, slots, tick, cluster_size, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace perception::kernels
