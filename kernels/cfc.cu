// Persistent CfC kernels: each block owns kSeqs sequences for the whole window and runs the time loop with three
// barrier-separated phases per step (backbone, heads, state update). A thread computes one output for all of its
// block's sequences, so every weight read from shared memory feeds kSeqs multiply-adds.
#include "kernels/cfc.h"

#include <algorithm>

#include "kernels/common.cuh"

namespace perception::kernels {
namespace {

// Packed layout, in floats: the forward's block [W_cᵀ: C×K][W_headsᵀ: K×4C][biases: 4C], then the backward's block
// [W_heads: 4C×K][W_c: K×C].
__host__ __device__ inline size_t ForwardWeightFloats(int C, int K) { return 5ull * C * K + 4ull * C; }
__host__ __device__ inline size_t BackwardWeightFloats(int C, int K) { return 5ull * C * K; }

__global__ void CfcPackWeightsKernel(CfcWeights w, CfcShape shape, float* packed) {
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
__global__ void CfcForwardKernel(CfcShape shape, const float* packed, const float* u, const float* dt,
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
__global__ void CfcBackwardKernel(CfcShape shape, const float* packed, const float* dt, const float* gates,
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

// How a CfC kernel is launched on this device: sequences per block (enough blocks to cover the multiprocessors,
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
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) {
    return e;
  }
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

bool ValidShape(const CfcShape& s) {
  return s.batch > 0 && s.window > 0 && s.d_model > 0 && s.units > 0 && s.backbone > 0;
}

}  // namespace

size_t CfcPackedFloats(const CfcShape& shape) {
  return ForwardWeightFloats(shape.units, shape.backbone) + BackwardWeightFloats(shape.units, shape.backbone);
}

cudaError_t LaunchCfcPackWeights(const CfcWeights& weights, const CfcShape& shape, float* packed, cudaStream_t stream) {
  if (!ValidShape(shape)) return cudaErrorInvalidValue;
  CfcPackWeightsKernel<<<GridFor(static_cast<long long>(CfcPackedFloats(shape)), 256), 256, 0, stream>>>(weights, shape,
                                                                                                      packed);
  return cudaGetLastError();
}

cudaError_t LaunchCfcForward(const CfcShape& shape, const float* packed, const float* u, const float* dt,
                             const float* state_in, const CfcActivations& act, float* state_out, cudaStream_t stream) {
  if (!ValidShape(shape)) return cudaErrorInvalidValue;
  CfcLaunch plan;
  const int per_seq = shape.units + shape.backbone + 4 * shape.units;
  if (const cudaError_t e = PlanCfcLaunch(shape, ForwardWeightFloats(shape.units, shape.backbone), per_seq, &plan);
      e != cudaSuccess) {
    return e;
  }
  return Dispatch(plan, [&]<int kSeqs, bool kShared>() {
    const auto kernel = CfcForwardKernel<kSeqs, kShared>;
    if (const cudaError_t e = AllowSharedMemory(kernel, plan.shared_bytes); e != cudaSuccess) return e;
    kernel<<<plan.blocks, plan.threads, plan.shared_bytes, stream>>>(shape, packed, u, dt, state_in, act, state_out);
    return cudaGetLastError();
  });
}

cudaError_t LaunchCfcBackward(const CfcShape& shape, const float* packed, const float* dt, const float* gates,
                              const float* bb_pre, const float* dc_head, int ld_dc_head, float* dp, float* dbb_pre,
                              cudaStream_t stream) {
  if (!ValidShape(shape)) return cudaErrorInvalidValue;
  CfcLaunch plan;
  const int per_seq = shape.units + 4 * shape.units + shape.backbone;
  if (const cudaError_t e = PlanCfcLaunch(shape, BackwardWeightFloats(shape.units, shape.backbone), per_seq, &plan);
      e != cudaSuccess) {
    return e;
  }
  return Dispatch(plan, [&]<int kSeqs, bool kShared>() {
    const auto kernel = CfcBackwardKernel<kSeqs, kShared>;
    if (const cudaError_t e = AllowSharedMemory(kernel, plan.shared_bytes); e != cudaSuccess) return e;
    kernel<<<plan.blocks, plan.threads, plan.shared_bytes, stream>>>(shape, packed, dt, gates, bb_pre, dc_head,
                                                                     ld_dc_head, dp, dbb_pre);
    return cudaGetLastError();
  });
}

}  // namespace perception::kernels
