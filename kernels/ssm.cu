// The selective scan. One block per (head, sequence), one thread per row p of the head's state s[p, 0..N), which it
// keeps in registers; B, C, dt and the decay of the next steps are staged in shared memory.
//
// The backward needs, at each step t walking back in time, the adjoint gs_t = ds_t + dy_t ⊗ C_t (registers again)
// and, for d dt and d A_log, w_t = a_t·⟨gs_t, s_{t−1}⟩ with a_t = exp(dt_t·A). Storing every s_t would cost
// B·T·E·N floats per layer, so instead the exact identity
//     ⟨gs_t, s_t⟩ = a_t·⟨gs_t, s_{t−1}⟩ + ⟨gs_t, u_t⟩,  u_t = dt_t·xs_t ⊗ B_t,  and  ⟨gs_t, s_t⟩ = yC_t + w_{t+1}
// with yC_t = Σ_p dy_t[p]·(s_t[p]·C_t) gives w_t = yC_t + w_{t+1} − dt_t·Σ_p xs_t[p]·(gs_t[p]·B_t): a forward pass
// recomputes the states for yC_t (and d C), a reverse pass carries gs. The subtraction cancels when a_t is tiny,
// and float32 would lose w_t's digits then (relative error ~ε/a_t); both passes therefore run in double, which
// keeps w_t to ~1e-12 for any decay. Per-step sums over p go through shared memory in index order (deterministic).
#include "kernels/common.cuh"
#include "kernels/ssm.h"

namespace perception::kernels {
namespace {

constexpr int kForwardStageSteps = 32, kBackwardStageSteps = 16;

// Per-step inputs of up to kSteps steps, staged for the whole block: B and C as [step][B: kN | C: kN] in type T
// (zero past d_state, so the state loops need no bounds and load 16 bytes at a time), and dt, exp(dt·A), softplus'.
// The backward stages B and C in double, converted once here instead of once per state element.
template <typename T, int kN, int kSteps>
struct Stage {
  T* bc;
  float* dt;
  float* decay;
  float* dt_grad;

  __host__ __device__ static constexpr size_t Bytes() { return kSteps * (2 * kN * sizeof(T) + 3 * sizeof(float)); }
  __device__ static Stage At(void* base) {
    Stage s;
    s.bc = static_cast<T*>(base);
    s.dt = reinterpret_cast<float*>(s.bc + kSteps * 2 * kN);
    s.decay = s.dt + kSteps;
    s.dt_grad = s.decay + kSteps;
    return s;
  }

  // Fills the stage; callers put a __syncthreads before (the previous stage is consumed) and after.
  __device__ void Load(const SsmInput& in, int b, int h, int t0, int len, float A) const {
    const int N = in.d_state, inner = in.heads * in.headdim;
    for (int i = threadIdx.x; i < len * 2 * kN; i += blockDim.x) {
      const int step = i / (2 * kN), half = (i / kN) % 2, n = i % kN;  // half 0: B, 1: C
      const size_t row = static_cast<size_t>(b) * in.window + t0 + step;
      bc[i] = n < N ? static_cast<T>(in.xbc[row * in.ld_xbc + inner + half * N + n]) : T(0);
    }
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
      const size_t row = static_cast<size_t>(b) * in.window + t0 + i;
      const float pre = in.dt_raw[row * in.ld_dt_raw + h] + in.dt_bias[h];
      const float d = Softplus(pre);
      dt[i] = d;
      decay[i] = expf(d * A);
      dt_grad[i] = SoftplusGrad(pre);
    }
  }
};

__device__ __forceinline__ size_t StateOffset(const SsmInput& in, int b, int h, int p) {
  return ((static_cast<size_t>(b) * in.heads + h) * in.headdim + p) * in.d_state;
}

template <int kN>
__global__ void SsmScanForwardKernel(SsmInput in, float* y, float* state_out) {
  extern __shared__ float4 shared_f4[];
  using ForwardStage = Stage<float, kN, kForwardStageSteps>;
  const ForwardStage stage = ForwardStage::At(shared_f4);
  const int N = in.d_state, P = in.headdim, E = in.heads * P;
  const int h = blockIdx.x, b = blockIdx.y, p = threadIdx.x;
  const bool active = p < P;
  const float A = -expf(in.a_log[h]), Dh = in.d_skip[h];
  float s[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    s[n] = (active && n < N && in.state_in) ? in.state_in[StateOffset(in, b, h, p) + n] : 0.f;
  }
  for (int t0 = 0; t0 < in.window; t0 += kForwardStageSteps) {
    const int len = min(kForwardStageSteps, in.window - t0);
    __syncthreads();
    stage.Load(in, b, h, t0, len, A);
    __syncthreads();
    if (!active) continue;
    for (int i = 0; i < len; ++i) {
      const size_t row = static_cast<size_t>(b) * in.window + t0 + i;
      const float x = in.xbc[row * in.ld_xbc + h * P + p];
      const float xv = x * stage.dt[i], decay = stage.decay[i];
      const float4* B4 = reinterpret_cast<const float4*>(stage.bc + i * 2 * kN);
      const float4* C4 = B4 + kN / 4;
      float acc = 0.f;
#pragma unroll
      for (int q = 0; q < kN / 4; ++q) {
        const float4 bq = B4[q], cq = C4[q];
        const float bn[4] = {bq.x, bq.y, bq.z, bq.w}, cn[4] = {cq.x, cq.y, cq.z, cq.w};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          float& sv = s[4 * q + r];
          sv = decay * sv + xv * bn[r];
          acc += cn[r] * sv;
        }
      }
      y[row * E + h * P + p] = acc + Dh * x;
    }
  }
  if (active && state_out) {
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      if (n < N) state_out[StateOffset(in, b, h, p) + n] = s[n];
    }
  }
}

// Shared memory of the backward: the stage, yC per step, per-warp partial sums (double buffered), and the [N][P+1]
// table whose columns are summed over p (double buffered, padded against bank conflicts).
template <int kN>
struct BackwardShared {
  using BackwardStage = Stage<double, kN, kBackwardStageSteps>;
  BackwardStage stage;
  double* yc;         // [window]
  double* warp_sums;  // [2][warps][3]
  float* columns;     // [2][N][P+1]

  static size_t Bytes(const SsmInput& in, int warps) {
    return BackwardStage::Bytes() + sizeof(double) * (in.window + 2 * warps * 3) +
           sizeof(float) * 2 * in.d_state * (in.headdim + 1);
  }
  __device__ static BackwardShared At(void* base, const SsmInput& in, int warps) {
    BackwardShared s;
    s.stage = BackwardStage::At(base);
    s.yc = reinterpret_cast<double*>(static_cast<char*>(base) + BackwardStage::Bytes());
    s.warp_sums = s.yc + in.window;
    s.columns = reinterpret_cast<float*>(s.warp_sums + 2 * warps * 3);
    return s;
  }
};

// Column n of `columns` summed over p in order, for n = thread, thread + blockDim, ...; out[n] receives it.
__device__ __forceinline__ void SumColumns(const float* columns, int N, int P, float* out) {
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    float sum = 0.f;
    for (int q = 0; q < P; ++q) sum += columns[n * (P + 1) + q];
    out[n] = sum;
  }
}

template <int kN>
__global__ void SsmScanBackwardKernel(SsmInput in, const float* dy, SsmGrad grad) {
  extern __shared__ double2 shared_d2[];
  const int warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const BackwardShared<kN> sh = BackwardShared<kN>::At(shared_d2, in, warps);
  const auto& stage = sh.stage;
  const int N = in.d_state, P = in.headdim, H = in.heads, E = H * P;
  const int h = blockIdx.x, b = blockIdx.y, p = threadIdx.x;
  const bool active = p < P;
  const float A = -expf(in.a_log[h]), Dh = in.d_skip[h];
  int buf = 0;

  // Forward in time: recompute s_t, emit d C_t = Σ_p dy_t[p]·s_t[p], keep yC_t.
  double s[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    s[n] = (active && n < N && in.state_in) ? in.state_in[StateOffset(in, b, h, p) + n] : 0.0;
  }
  for (int t0 = 0; t0 < in.window; t0 += kBackwardStageSteps) {
    const int len = min(kBackwardStageSteps, in.window - t0);
    __syncthreads();
    stage.Load(in, b, h, t0, len, A);
    __syncthreads();
    for (int i = 0; i < len; ++i) {
      const size_t row = static_cast<size_t>(b) * in.window + t0 + i;
      const double x = active ? in.xbc[row * in.ld_xbc + h * P + p] : 0.f;
      const double dyv = active ? dy[row * E + h * P + p] : 0.f;
      const double xv = x * stage.dt[i], decay = stage.decay[i];
      const double2* B2 = reinterpret_cast<const double2*>(stage.bc + i * 2 * kN);
      const double2* C2 = B2 + kN / 2;
      float* columns = sh.columns + buf * N * (P + 1);
      double cs = 0.0;
#pragma unroll
      for (int q = 0; q < kN / 2; ++q) {
        const double2 bq = B2[q], cq = C2[q];
        const double bn[2] = {bq.x, bq.y}, cn[2] = {cq.x, cq.y};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = 2 * q + r;
          s[n] = decay * s[n] + xv * bn[r];
          cs += cn[r] * s[n];
          if (active && n < N) columns[n * (P + 1) + p] = static_cast<float>(dyv * s[n]);
        }
      }
      const double yc = WarpSum(dyv * cs);
      if (lane == 0) sh.warp_sums[(buf * warps + warp) * 3] = yc;
      __syncthreads();
      SumColumns(columns, N, P, grad.dbc + (row * H + h) * 2 * N + N);
      if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < warps; ++w) total += sh.warp_sums[(buf * warps + w) * 3];
        sh.yc[t0 + i] = total;
      }
      buf ^= 1;
    }
  }

  // Backward in time: carry the adjoint, emit d xs, d B, d dt_raw and the A_log / D terms.
  double ds[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) ds[n] = 0.0;
  double w_next = 0.0;  // w_{t+1}, kept by thread 0
  for (int t0 = (in.window - 1) / kBackwardStageSteps * kBackwardStageSteps; t0 >= 0; t0 -= kBackwardStageSteps) {
    const int len = min(kBackwardStageSteps, in.window - t0);
    __syncthreads();
    stage.Load(in, b, h, t0, len, A);
    __syncthreads();
    for (int i = len - 1; i >= 0; --i) {
      const size_t row = static_cast<size_t>(b) * in.window + t0 + i;
      const double x = active ? in.xbc[row * in.ld_xbc + h * P + p] : 0.f;
      const double dyv = active ? dy[row * E + h * P + p] : 0.f;
      const double dt = stage.dt[i], decay = stage.decay[i], xdt = x * dt;
      const double2* B2 = reinterpret_cast<const double2*>(stage.bc + i * 2 * kN);
      const double2* C2 = B2 + kN / 2;
      float* columns = sh.columns + buf * N * (P + 1);
      double dxb = 0.0;  // Σ_n gs[p,n]·B[n]
#pragma unroll
      for (int q = 0; q < kN / 2; ++q) {
        const double2 bq = B2[q], cq = C2[q];
        const double bn[2] = {bq.x, bq.y}, cn[2] = {cq.x, cq.y};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = 2 * q + r;
          const double gs = ds[n] + dyv * cn[r];
          dxb += gs * bn[r];
          if (active && n < N) columns[n * (P + 1) + p] = static_cast<float>(gs * xdt);
          ds[n] = gs * decay;
        }
      }
      if (active) grad.dxs[row * E + h * P + p] = static_cast<float>(dyv * Dh + dxb * dt);
      const double gu = WarpSum(xdt * dxb), dt_direct = WarpSum(dxb * x), d_skip = WarpSum(dyv * x);
      if (lane == 0) {
        double* slot = sh.warp_sums + (buf * warps + warp) * 3;
        slot[0] = gu;
        slot[1] = dt_direct;
        slot[2] = d_skip;
      }
      __syncthreads();
      SumColumns(columns, N, P, grad.dbc + (row * H + h) * 2 * N);
      if (threadIdx.x == 0) {
        double gu_total = 0.0, dt_total = 0.0, d_total = 0.0;
        for (int w = 0; w < warps; ++w) {
          const double* slot = sh.warp_sums + (buf * warps + w) * 3;
          gu_total += slot[0];
          dt_total += slot[1];
          d_total += slot[2];
        }
        const double w_t = w_next + sh.yc[t0 + i] - gu_total;  // a_t·⟨gs_t, s_{t−1}⟩
        w_next = w_t;
        const double d_dt = dt_total + w_t * A;
        grad.d_dt_raw[row * grad.ld_d_dt_raw + h] = static_cast<float>(d_dt * stage.dt_grad[i]);
        grad.param_partials[row * 2 * H + h] = static_cast<float>(w_t * dt * A);
        grad.param_partials[row * 2 * H + H + h] = static_cast<float>(d_total);
      }
      buf ^= 1;
    }
  }
}

template <int kN>
cudaError_t LaunchForward(const SsmInput& in, float* y, float* state_out, cudaStream_t stream) {
  const size_t bytes = Stage<float, kN, kForwardStageSteps>::Bytes();
  if (const cudaError_t e = AllowSharedMemory(SsmScanForwardKernel<kN>, bytes); e != cudaSuccess) return e;
  SsmScanForwardKernel<kN><<<dim3(in.heads, in.batch), RoundUpToWarp(in.headdim), bytes, stream>>>(in, y, state_out);
  return cudaGetLastError();
}

template <int kN>
cudaError_t LaunchBackward(const SsmInput& in, const float* dy, const SsmGrad& grad, cudaStream_t stream) {
  const int threads = RoundUpToWarp(in.headdim);
  const size_t bytes = BackwardShared<kN>::Bytes(in, threads / kWarpSize);
  if (const cudaError_t e = AllowSharedMemory(SsmScanBackwardKernel<kN>, bytes); e != cudaSuccess) return e;
  SsmScanBackwardKernel<kN><<<dim3(in.heads, in.batch), threads, bytes, stream>>>(in, dy, grad);
  return cudaGetLastError();
}

// Runs `launch.template operator()<kN>()` with the smallest compiled state width that holds d_state.
template <typename Launch>
cudaError_t WithStateWidth(int d_state, Launch launch) {
  if (d_state <= 4) return launch.template operator()<4>();
  if (d_state <= 8) return launch.template operator()<8>();
  if (d_state <= 16) return launch.template operator()<16>();
  if (d_state <= 32) return launch.template operator()<32>();
  if (d_state <= kMaxSsmState) return launch.template operator()<kMaxSsmState>();
  return cudaErrorInvalidValue;
}

bool ValidShape(const SsmInput& in) {
  return in.batch > 0 && in.window > 0 && in.heads > 0 && in.headdim > 0 && in.headdim <= 1024 && in.d_state > 0;
}

}  // namespace

cudaError_t LaunchSsmScanForward(const SsmInput& in, float* y, float* state_out, cudaStream_t stream) {
  if (!ValidShape(in)) return cudaErrorInvalidValue;
  return WithStateWidth(in.d_state, [&]<int kN>() { return LaunchForward<kN>(in, y, state_out, stream); });
}

cudaError_t LaunchSsmScanBackward(const SsmInput& in, const float* dy, const SsmGrad& grad, cudaStream_t stream) {
  if (!ValidShape(in)) return cudaErrorInvalidValue;
  return WithStateWidth(in.d_state, [&]<int kN>() { return LaunchBackward<kN>(in, dy, grad, stream); });
}

}  // namespace perception::kernels
