// Bias broadcast for many outputs at once: blockIdx.y picks the job, each warp fills whole rows (lanes over the
// columns), so no index is divided per element.
#include "kernels/bias_fill.h"
#include "kernels/common.cuh"

namespace perception::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kBlocksPerJob = 256;

__global__ void __launch_bounds__(kWarps * kWarpSize) BiasFillKernel(const BiasFillJob* jobs, int rows) {
  const BiasFillJob job = jobs[blockIdx.y];
  const int lane = threadIdx.x % kWarpSize;
  for (int r = blockIdx.x * kWarps + threadIdx.x / kWarpSize; r < rows; r += gridDim.x * kWarps) {
    float* dst = job.dst + static_cast<size_t>(r) * job.ld;
    for (int c = lane; c < job.cols; c += kWarpSize) dst[c] = job.bias[c];
  }
}

}  // namespace

cudaError_t LaunchBiasFill(const BiasFillJob* jobs, int count, int rows, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  BiasFillKernel<<<dim3(kBlocksPerJob, count), kWarps * kWarpSize, 0, stream>>>(jobs, rows);
  return cudaGetLastError();
}

}  // namespace perception::kernels
