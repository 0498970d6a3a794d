// Elementwise kernels: standardization and ELU, forward and backward.
#include "kernels/common.cuh"
#include "kernels/pointwise.h"

namespace perception::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void StandardizeKernel(const float* x, const float* mean, const float* inv_std, long long n, int features,
                                  float* xn) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int f = static_cast<int>(i % features);
    xn[i] = (x[i] - mean[f]) * inv_std[f];
  }
}

__global__ void EluForwardKernel(const float* pre, long long n, float* out) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    out[i] = Elu(pre[i]);
  }
}

__global__ void EluBackwardKernel(const float* pre, const float* d_out, long long n, float* d_pre) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    d_pre[i] = d_out[i] * EluGrad(pre[i]);
  }
}

}  // namespace

cudaError_t LaunchStandardize(const float* x, const float* mean, const float* inv_std, int rows, int features,
                              float* xn, cudaStream_t stream) {
  const long long n = static_cast<long long>(rows) * features;
  StandardizeKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(x, mean, inv_std, n, features, xn);
  return cudaGetLastError();
}

cudaError_t LaunchEluForward(const float* pre, int n, float* out, cudaStream_t stream) {
  EluForwardKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(pre, n, out);
  return cudaGetLastError();
}

cudaError_t LaunchEluBackward(const float* pre, const float* d_out, int n, float* d_pre, cudaStream_t stream) {
  EluBackwardKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(pre, d_out, n, d_pre);
  return cudaGetLastError();
}

}  // namespace perception::kernels
