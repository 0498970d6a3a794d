// The masked BCE's two reductions over the batch, each in one block (thread t adds its values t, t + threads, ...
// in order, then the warps in order): deterministic without atomics.
#include "kernels/common.cuh"
#include "kernels/loss.h"

namespace perception::kernels {
namespace {

constexpr int kCountThreads = 1024;
constexpr int kReportThreads = 256;

__global__ void __launch_bounds__(kCountThreads) MaskCountKernel(const float* mask, int n, double* count) {
  __shared__ double scratch[kCountThreads / kWarpSize];
  double sum = 0.0;
  // Unrolled so that a thread's loads are in flight together (the loop has no stores).
#pragma unroll 8
  for (int i = threadIdx.x; i < n; i += kCountThreads) sum += mask[i];
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) *count = sum;
}

__global__ void __launch_bounds__(kReportThreads)
    MaskedBceReportKernel(const double* partials, int blocks, const double* count, StepReport* report) {
  __shared__ double scratch[kReportThreads / kWarpSize];
  double sum = 0.0;
#pragma unroll 8
  for (int b = threadIdx.x; b < blocks; b += kReportThreads) sum += partials[b];
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) {
    report->loss_sum = sum;
    report->mask_count = *count;
    report->loss = sum / fmax(*count, 1.0);
  }
}

}  // namespace

cudaError_t LaunchMaskCount(const float* mask, int n, double* count, cudaStream_t stream) {
  MaskCountKernel<<<1, kCountThreads, 0, stream>>>(mask, n, count);
  return cudaGetLastError();
}

cudaError_t LaunchMaskedBceReport(const double* partials, int blocks, const double* count, StepReport* report,
                                  cudaStream_t stream) {
  MaskedBceReportKernel<<<1, kReportThreads, 0, stream>>>(partials, blocks, count, report);
  return cudaGetLastError();
}

}  // namespace perception::kernels
