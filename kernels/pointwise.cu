// Elementwise kernels: standardization and ELU, forward and backward. Grid-stride loops over 32-bit indices (the
// launches refuse more than INT_MAX values): 64-bit division and modulo cost dozens of instructions per element.
#include <climits>

#include "kernels/common.cuh"
#include "kernels/pointwise.h"

namespace perception::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void StandardizeKernel(const float* x, const float* mean, const float* inv_std, int n, int features,
                                  float* xn) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int f = i % features;
    xn[i] = (x[i] - mean[f]) * inv_std[f];
  }
}

__global__ void EluForwardKernel(const float* pre, int n, float* out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = Elu(pre[i]);
  }
}

__global__ void EluBackwardKernel(const float* pre, const float* d_out, int n, float* d_pre) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    d_pre[i] = d_out[i] * EluGrad(pre[i]);
  }
}

}  // namespace

cudaError_t LaunchStandardize(const float* x, const float* mean, const float* inv_std, int rows, int features,
                              float* xn, cudaStream_t stream) {
  const long long n = static_cast<long long>(rows) * features;
  if (n > INT_MAX) return cudaErrorInvalidValue;
  StandardizeKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(x, mean, inv_std, static_cast<int>(n), features,
                                                                   xn);
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
