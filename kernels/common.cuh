// Device helpers shared by the kernels: MODEL.md's activation functions, written exactly as engine/cpu_reference.cc
// writes them, and sums in a fixed order (a warp butterfly, then warps in index order), so every result is deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace perception::kernels {

constexpr int kWarpSize = 32;
constexpr float kNormEps = 1e-5f;

__host__ __device__ constexpr int CeilDiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int RoundUpToWarp(int n) { return CeilDiv(n, kWarpSize) * kWarpSize; }
// This thread's lane in its warp.
__device__ __forceinline__ int Lane() { return threadIdx.x % kWarpSize; }

// The current device's multiprocessors, for the launchers that size their grids by them.
inline cudaError_t MultiprocessorCount(int* sms) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

// `pick.template operator()<a, b>()` for two run-time flags: how a launcher chooses among a kernel template's four
// instances for two compile-time facts (say, the product precision and a whole-tile shape).
template <typename Pick>
auto WithFlags(bool a, bool b, Pick pick) {
  if (a) return b ? pick.template operator()<true, true>() : pick.template operator()<true, false>();
  return b ? pick.template operator()<false, true>() : pick.template operator()<false, false>();
}

// The sigmoid from e = e^−|v| (in [0, 1]): 1/(1 + e) for v ≥ 0, e/(1 + e) below, with the bits of IEEE division.
// Where 1 + e rounds to 1 the quotient is its numerator. Otherwise the numerator lies in (2^−24, 1] and the
// denominator in (1, 2], far from the exponent range's ends, and the approximate reciprocal's quotient corrected once
// by its exact residual (an fma) is IEEE's, as tests/cuda/kernel_test.cc checks for every float e in [0, 1]. `/`
// would add a branch to its slow path for extreme operands, across which the compiler does not interleave a thread's
// sigmoids: without it, H200, small's training step 1,002 -> 996 µs (3xtf32) and 923 -> 913 µs (tf32), and no
// streaming tick slower (bench/RESULTS.md, twenty-second session).
__device__ __forceinline__ float SigmoidFromExp(float e, bool nonnegative) {
  const float d = 1.f + e, a = nonnegative ? 1.f : e;
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float q = a * r;
  return d == 1.f ? a : fmaf(fmaf(-d, q, a), r, q);
}
// 1/(1 + e^−v) for v ≥ 0, e^v/(1 + e^v) below: the same bits as those two branches, from one expf and no branch, so a
// warp whose lanes straddle 0 does not evaluate both (and Silu/SiluGrad of one value share it).
__device__ __forceinline__ float Sigmoid(float v) { return SigmoidFromExp(expf(-fabsf(v)), v >= 0.f); }
__device__ __forceinline__ float Softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); }
__device__ __forceinline__ float SoftplusGrad(float v) { return v > 20.f ? 1.f : Sigmoid(v); }
__device__ __forceinline__ float Silu(float v) { return v * Sigmoid(v); }
__device__ __forceinline__ float SiluGrad(float v) {
  const float s = Sigmoid(v);
  return s * (1.f + v * (1.f - s));
}
// lecun_tanh(v) = 1.7159·tanh(0.666·v) (MODEL.md §2.4); the constants are rounded to float as the CPU rounds them.
constexpr double kLecunScale = 1.7159, kLecunSlope = 0.666;
__device__ __forceinline__ float LecunTanh(float v) {
  return static_cast<float>(kLecunScale) * tanhf(static_cast<float>(kLecunSlope) * v);
}
__device__ __forceinline__ float LecunTanhGrad(float v) {
  const float th = tanhf(static_cast<float>(kLecunSlope) * v);
  return static_cast<float>(kLecunScale * kLecunSlope) * (1.f - th * th);
}
__device__ __forceinline__ float Elu(float v) { return v > 0.f ? v : expm1f(v); }
__device__ __forceinline__ float EluGrad(float v) { return v > 0.f ? 1.f : expf(v); }

// Butterfly sum over the 32 lanes: every lane ends with the same bits, and the order never changes.
// The whole warp must be active.
template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32), warps added in index order; every thread gets the total.
// `scratch` holds one T per warp. Contains two __syncthreads, so every thread of the block must call it.
template <typename T>
__device__ T BlockSum(T v, T* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = WarpSum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// A grid of `threads`-wide blocks covering n items, capped so that grid-stride loops take over on huge inputs.
inline dim3 GridFor(long long n, int threads, int max_blocks = 8192) {
  const long long blocks = (n + threads - 1) / threads;
  return dim3(static_cast<unsigned>(blocks < 1 ? 1 : (blocks > max_blocks ? max_blocks : blocks)));
}

// Programmatic dependent launch along a chain of kernels on one stream (the model's forward, engine/cuda_model.cc): a
// kernel launched `programmatic` (LaunchKernel) may start before the kernel ahead of it on the stream has finished,
// once every block of that one has called LetNextKernelLaunch (or exited). WaitForPriorKernels returns once the kernel
// ahead has completed, its stores visible; since that kernel waited likewise, so have all before it. Before the wait a
// kernel reads nothing that the kernels ahead write and writes nothing at all. In a kernel not launched so, or whose
// next kernel was not, both are no-ops.
__device__ __forceinline__ void WaitForPriorKernels() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void LetNextKernelLaunch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), where `programmatic` as the programmatic dependent of the
// kernel ahead of it on the stream (see above). Returns the launch's error, cleared as cudaGetLastError clears it.
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                         bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  const cudaError_t launched = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  const cudaError_t last = cudaGetLastError();
  return launched != cudaSuccess ? launched : last;
}

// An L2 policy that marks the lines an access touches first to be evicted (data streamed through once a pass, such as
// the streaming tick's SSM states where they outgrow the L2), and a 16-byte store under a policy.
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void Store16(float* dst, float4 v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w), "l"(policy)
               : "memory");
}

// Raises a kernel's dynamic shared-memory limit when it needs more than the default 48 KB.
template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

}  // namespace perception::kernels
