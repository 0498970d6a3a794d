// Bias broadcast for many outputs at once: blockIdx.y picks the job, a grid-stride loop covers its rows × cols.
#include "kernels/bias_fill.h"
#include "kernels/common.cuh"

namespace perception::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerJob = 256;

__global__ void BiasFillKernel(const BiasFillJob* jobs, int rows) {
  const BiasFillJob job = jobs[blockIdx.y];
  const long long n = static_cast<long long>(rows) * job.cols;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i / job.cols), c = static_cast<int>(i % job.cols);
    job.dst[static_cast<size_t>(r) * job.ld + c] = job.bias[c];
  }
}

}  // namespace

cudaError_t LaunchBiasFill(const BiasFillJob* jobs, int count, int rows, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  BiasFillKernel<<<dim3(kBlocksPerJob, count), kThreads, 0, stream>>>(jobs, rows);
  return cudaGetLastError();
}

}  // namespace perception::kernels
