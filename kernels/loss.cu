// The masked BCE's sums over the batch, each in a fixed order (a thread adds its values in order, then the warps in
// order; the loss's blocks over fixed ranges, then one block adds them in order): deterministic without atomics.
#include "kernels/common.cuh"
#include "kernels/loss.h"

namespace perception::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kCountThreads = 1024;

__global__ void __launch_bounds__(kCountThreads) MaskCountKernel(const float* mask, int n, double* count) {
  __shared__ double scratch[kCountThreads / kWarpSize];
  double sum = 0.0;
  // Unrolled so that a thread's loads are in flight together (the loop has no stores).
#pragma unroll 8
  for (int i = threadIdx.x; i < n; i += kCountThreads) sum += mask[i];
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) *count = sum;
}

__global__ void __launch_bounds__(kThreads) MaskedBcePartialsKernel(const float* logits, const float* labels,
                                                                    const float* mask, int n, double* partials) {
  __shared__ double scratch[kThreads / kWarpSize];
  const int per_block = CeilDiv(n, kMaskedBceBlocks);
  const int begin = min(n, static_cast<int>(blockIdx.x) * per_block), end = min(n, begin + per_block);
  double loss = 0.0;
  for (int i = begin + threadIdx.x; i < end; i += kThreads) {
    const double l = logits[i], y = labels[i], m = mask[i];
    loss += m * (fmax(l, 0.0) - l * y + log1p(exp(-fabs(l))));
  }
  loss = BlockSum(loss, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = loss;
}

__global__ void __launch_bounds__(kThreads)
    MaskedBceReportKernel(const double* partials, const double* count, StepReport* report) {
  __shared__ double scratch[kThreads / kWarpSize];
  double sum = 0.0;
  for (int b = threadIdx.x; b < kMaskedBceBlocks; b += kThreads) sum += partials[b];
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

cudaError_t LaunchMaskedBcePartials(const float* logits, const float* labels, const float* mask, int n,
                                    double* partials, cudaStream_t stream) {
  MaskedBcePartialsKernel<<<kMaskedBceBlocks, kThreads, 0, stream>>>(logits, labels, mask, n, partials);
  return cudaGetLastError();
}

cudaError_t LaunchMaskedBceReport(const double* partials, const double* count, StepReport* report,
                                  cudaStream_t stream) {
  MaskedBceReportKernel<<<1, kThreads, 0, stream>>>(partials, count, report);
  return cudaGetLastError();
}

}  // namespace perception::kernels
