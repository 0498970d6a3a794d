// Masked BCE in two launches: each block sums the loss and the mask count over its fixed range of elements; then
// every block adds the partials in the same order (so all agree on the count, bit for bit) and writes d logits
// over its range. The loss per element is evaluated in double from the float logits.
#include "kernels/common.cuh"
#include "kernels/loss.h"

namespace perception::kernels {
namespace {

constexpr int kThreads = 256;

// Block b's range of the n elements.
__device__ __forceinline__ void BlockRange(int n, int* begin, int* end) {
  const int per_block = CeilDiv(n, kMaskedBceBlocks);
  *begin = min(n, static_cast<int>(blockIdx.x) * per_block);
  *end = min(n, *begin + per_block);
}

__global__ void __launch_bounds__(kThreads) MaskedBcePartialsKernel(const float* logits, const float* labels,
                                                                    const float* mask, int n, double* partials) {
  __shared__ double scratch[kThreads / kWarpSize];
  int begin, end;
  BlockRange(n, &begin, &end);
  double loss = 0.0, count = 0.0;
  for (int i = begin + threadIdx.x; i < end; i += kThreads) {
    const double l = logits[i], y = labels[i], m = mask[i];
    loss += m * (fmax(l, 0.0) - l * y + log1p(exp(-fabs(l))));
    count += m;
  }
  loss = BlockSum(loss, scratch);
  count = BlockSum(count, scratch);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = loss;
    partials[2 * blockIdx.x + 1] = count;
  }
}

// Values per thread the finish loads before it sums the partials, so that their latency overlaps the sums' (small:
// 320 values a block, 2 per thread); the rest of a longer range is read after.
constexpr int kFinishHeld = 2;

__global__ void __launch_bounds__(kThreads) MaskedBceFinishKernel(const float* logits, const float* labels,
                                                                  const float* mask, int n, const double* partials,
                                                                  float* dlogits, StepReport* report) {
  __shared__ double scratch[kThreads / kWarpSize];
  int begin, end;
  BlockRange(n, &begin, &end);
  float held_logit[kFinishHeld], held_label[kFinishHeld], held_mask[kFinishHeld];
#pragma unroll
  for (int j = 0; j < kFinishHeld; ++j) {
    const int i = begin + threadIdx.x + j * kThreads;
    if (dlogits && i < end) {
      held_logit[j] = logits[i];
      held_label[j] = labels[i];
      held_mask[j] = mask[i];
    }
  }
  double loss = 0.0, count = 0.0;
  for (int b = threadIdx.x; b < kMaskedBceBlocks; b += kThreads) {
    loss += partials[2 * b];
    count += partials[2 * b + 1];
  }
  loss = BlockSum(loss, scratch);
  count = BlockSum(count, scratch);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    report->loss_sum = loss;
    report->mask_count = count;
    report->loss = loss / fmax(count, 1.0);
  }
  if (!dlogits) return;
  const float denom = static_cast<float>(fmax(count, 1.0));
#pragma unroll
  for (int j = 0; j < kFinishHeld; ++j) {
    const int i = begin + threadIdx.x + j * kThreads;
    if (i < end) dlogits[i] = held_mask[j] * (Sigmoid(held_logit[j]) - held_label[j]) / denom;
  }
  for (int i = begin + threadIdx.x + kFinishHeld * kThreads; i < end; i += kThreads) {
    dlogits[i] = mask[i] * (Sigmoid(logits[i]) - labels[i]) / denom;
  }
}

}  // namespace

cudaError_t LaunchMaskedBcePartials(const float* logits, const float* labels, const float* mask, int n,
                                    double* partials, cudaStream_t stream) {
  MaskedBcePartialsKernel<<<kMaskedBceBlocks, kThreads, 0, stream>>>(logits, labels, mask, n, partials);
  return cudaGetLastError();
}

cudaError_t LaunchMaskedBceFinish(const float* logits, const float* labels, const float* mask, int n,
                                  const double* partials, float* dlogits, StepReport* report, cudaStream_t stream) {
  MaskedBceFinishKernel<<<kMaskedBceBlocks, kThreads, 0, stream>>>(logits, labels, mask, n, partials, dlogits,
                                                                   report);
  return cudaGetLastError();
}

cudaError_t LaunchMaskedBce(const float* logits, const float* labels, const float* mask, int n, float* dlogits,
                            double* partials, StepReport* report, cudaStream_t stream) {
  if (const cudaError_t e = LaunchMaskedBcePartials(logits, labels, mask, n, partials, stream); e != cudaSuccess) {
    return e;
  }
  return LaunchMaskedBceFinish(logits, labels, mask, n, partials, dlogits, report, stream);
}

}  // namespace perception::kernels
