// Elementwise kernels: standardization and ELU, forward and backward. Grid-stride loops over 32-bit indices (the
// launches refuse more than INT_MAX values): 64-bit division and modulo cost dozens of instructions per element.
// Each thread takes VW consecutive values at a time: 4 (one float4 per array) where every array is 16-byte aligned
// and the count (for the standardization: the row width) is a multiple of 4, a quarter of the load instructions and
// blocks of single values; else 1.
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "kernels/common.cuh"
#include "kernels/pointwise.h"

namespace perception::kernels {
namespace {

constexpr int kThreads = 256;

template <int VW>
__device__ __forceinline__ void Load(const float* p, int i, float (&v)[VW]) {
  if constexpr (VW == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p + i);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
  } else {
    v[0] = p[i];
  }
}

template <int VW>
__device__ __forceinline__ void Store(float* p, int i, const float (&v)[VW]) {
  if constexpr (VW == 4) {
    *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    p[i] = v[0];
  }
}

// The first value of each of this thread's groups of VW, grid-stride.
#define FOR_EACH_GROUP(i, n)                                                                           \
  for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * VW; i < (n); i += gridDim.x * blockDim.x * VW)

template <int VW>
__global__ void StandardizeKernel(const float* x, const float* mean, const float* inv_std, int n, int features,
                                  float* xn) {
  // The head of the forward's chain (engine/cuda_model.cc): the embedding's product may launch beside it.
  WaitForPriorKernels();
  LetNextKernelLaunch();
  FOR_EACH_GROUP(i, n) {
    const int f = i % features;  // VW divides features: the group stays in one row
    float v[VW];
    Load<VW>(x, i, v);
#pragma unroll
    for (int j = 0; j < VW; ++j) v[j] = (v[j] - mean[f + j]) * inv_std[f + j];
    Store<VW>(xn, i, v);
  }
}

template <int VW>
__global__ void EluForwardKernel(const float* pre, int n, float* out) {
  WaitForPriorKernels();  // the forward's chain (engine/cuda_model.cc): the kernel ahead wrote `pre`
  LetNextKernelLaunch();
  FOR_EACH_GROUP(i, n) {
    float v[VW];
    Load<VW>(pre, i, v);
#pragma unroll
    for (int j = 0; j < VW; ++j) v[j] = Elu(v[j]);
    Store<VW>(out, i, v);
  }
}

template <int VW>
__global__ void EluBackwardRowsKernel(const float* pre, int ldpre, const float* d_out, int ldd_out, int n, int cols,
                                      float* d_pre, int ldd_pre) {
  FOR_EACH_GROUP(i, n) {
    const int r = i / cols, c = i - r * cols;  // VW divides cols: the group stays in one row
    float p[VW], d[VW];
    Load<VW>(pre + static_cast<int64_t>(r) * ldpre, c, p);
    Load<VW>(d_out + static_cast<int64_t>(r) * ldd_out, c, d);
#pragma unroll
    for (int j = 0; j < VW; ++j) d[j] *= EluGrad(p[j]);
    Store<VW>(d_pre + static_cast<int64_t>(r) * ldd_pre, c, d);
  }
}

#undef FOR_EACH_GROUP

bool Vectorizable(int count, std::initializer_list<const float*> arrays) {
  if (count % 4 != 0) return false;
  for (const float* p : arrays) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Launches kernel<4> or kernel<1> over n values; op returns the launch's error.
template <typename Op>
cudaError_t Launch(long long n, bool vectorizable, Op&& op) {
  if (n > INT_MAX) return cudaErrorInvalidValue;
  return vectorizable ? op.template operator()<4>(GridFor(n / 4, kThreads))
                      : op.template operator()<1>(GridFor(n, kThreads));
}

}  // namespace

cudaError_t LaunchStandardize(const float* x, const float* mean, const float* inv_std, int rows, int features,
                              float* xn, cudaStream_t stream) {
  const long long n = static_cast<long long>(rows) * features;
  return Launch(n, Vectorizable(features, {x, xn}), [&]<int VW>(dim3 grid) {
    StandardizeKernel<VW><<<grid, kThreads, 0, stream>>>(x, mean, inv_std, static_cast<int>(n), features, xn);
    return cudaGetLastError();
  });
}

cudaError_t LaunchEluForward(const float* pre, int n, float* out, cudaStream_t stream, bool programmatic) {
  return Launch(n, Vectorizable(n, {pre, out}), [&]<int VW>(dim3 grid) {
    return LaunchKernel(EluForwardKernel<VW>, grid, kThreads, 0, stream, programmatic, pre, n, out);
  });
}

cudaError_t LaunchEluBackwardRows(const float* pre, int ldpre, const float* d_out, int ldd_out, int rows, int cols,
                                  float* d_pre, int ldd_pre, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (ldpre < cols || ldd_out < cols || ldd_pre < cols) return cudaErrorInvalidValue;
  const long long n = static_cast<long long>(rows) * cols;
  const bool vec = Vectorizable(cols, {pre, d_out, d_pre}) && ldpre % 4 == 0 && ldd_out % 4 == 0 && ldd_pre % 4 == 0;
  return Launch(n, vec, [&]<int VW>(dim3 grid) {
    EluBackwardRowsKernel<VW><<<grid, kThreads, 0, stream>>>(pre, ldpre, d_out, ldd_out, static_cast<int>(n), cols,
                                                             d_pre, ldd_pre);
    return cudaGetLastError();
  });
}

}  // namespace perception::kernels
