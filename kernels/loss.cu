// Masked BCE in two phases: each block sums the loss and the mask count over its fixed range of elements; then
// every block adds the partials in the same order (so all agree on the count, bit for bit) and writes d logits
// over its range. One cooperative launch with a grid barrier between the phases, or two launches where data-parallel
// training sums the partials over the ranks in between (the same bits at world size 1). The loss per element is
// evaluated in double from the float logits.
#include <cooperative_groups.h>

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

// Values per thread loaded once, first: the partials read them and the finish writes their d logits (small: 320
// values a block, 2 per thread); the rest of a longer range is read where it is used.
constexpr int kHeld = 2;

struct Held {
  float logit[kHeld], label[kHeld], mask[kHeld];
};

__device__ __forceinline__ void LoadHeld(const float* logits, const float* labels, const float* mask, int begin,
                                         int end, Held& h) {
#pragma unroll
  for (int j = 0; j < kHeld; ++j) {
    const int i = begin + threadIdx.x + j * kThreads;
    if (i < end) {
      h.logit[j] = logits[i];
      h.label[j] = labels[i];
      h.mask[j] = mask[i];
    }
  }
}

__device__ __forceinline__ void AddBce(float logit, float label, float mask, double& loss, double& count) {
  const double l = logit, y = label, m = mask;
  loss += m * (fmax(l, 0.0) - l * y + log1p(exp(-fabs(l))));
  count += m;
}

// The block's loss and mask count into partials[2·block], [2·block + 1]; each thread adds its values in index order.
__device__ void BlockPartials(const Held& h, const float* logits, const float* labels, const float* mask, int begin,
                              int end, double* partials, double* scratch) {
  double loss = 0.0, count = 0.0;
#pragma unroll
  for (int j = 0; j < kHeld; ++j) {
    if (begin + static_cast<int>(threadIdx.x) + j * kThreads < end) {
      AddBce(h.logit[j], h.label[j], h.mask[j], loss, count);
    }
  }
  for (int i = begin + threadIdx.x + kHeld * kThreads; i < end; i += kThreads) {
    AddBce(logits[i], labels[i], mask[i], loss, count);
  }
  loss = BlockSum(loss, scratch);
  count = BlockSum(count, scratch);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = loss;
    partials[2 * blockIdx.x + 1] = count;
  }
}

// Every block adds all partials in the same order; block 0 writes the report, every block its range's d logits.
__device__ void Finish(const Held& h, const float* logits, const float* labels, const float* mask, int begin, int end,
                       const double* partials, float* dlogits, StepReport* report, double* scratch) {
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
  for (int j = 0; j < kHeld; ++j) {
    const int i = begin + threadIdx.x + j * kThreads;
    if (i < end) dlogits[i] = h.mask[j] * (Sigmoid(h.logit[j]) - h.label[j]) / denom;
  }
  for (int i = begin + threadIdx.x + kHeld * kThreads; i < end; i += kThreads) {
    dlogits[i] = mask[i] * (Sigmoid(logits[i]) - labels[i]) / denom;
  }
}

__global__ void __launch_bounds__(kThreads) MaskedBcePartialsKernel(const float* logits, const float* labels,
                                                                    const float* mask, int n, double* partials) {
  __shared__ double scratch[kThreads / kWarpSize];
  int begin, end;
  BlockRange(n, &begin, &end);
  Held h;
  LoadHeld(logits, labels, mask, begin, end, h);
  BlockPartials(h, logits, labels, mask, begin, end, partials, scratch);
}

__global__ void __launch_bounds__(kThreads) MaskedBceFinishKernel(const float* logits, const float* labels,
                                                                  const float* mask, int n, const double* partials,
                                                                  float* dlogits, StepReport* report) {
  __shared__ double scratch[kThreads / kWarpSize];
  int begin, end;
  BlockRange(n, &begin, &end);
  Held h;
  if (dlogits) LoadHeld(logits, labels, mask, begin, end, h);  // before the partials' sums: their latency overlaps
  Finish(h, logits, labels, mask, begin, end, partials, dlogits, report, scratch);
}

// Both in one cooperative launch, a grid barrier between them: one launch less, and the held values read once.
__global__ void __launch_bounds__(kThreads) MaskedBceKernel(const float* logits, const float* labels,
                                                            const float* mask, int n, double* partials,
                                                            float* dlogits, StepReport* report) {
  __shared__ double scratch[kThreads / kWarpSize];
  int begin, end;
  BlockRange(n, &begin, &end);
  Held h;
  LoadHeld(logits, labels, mask, begin, end, h);
  BlockPartials(h, logits, labels, mask, begin, end, partials, scratch);
  cooperative_groups::this_grid().sync();
  Finish(h, logits, labels, mask, begin, end, partials, dlogits, report, scratch);
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
  int sms = 0, per_sm = 0;
  if (const cudaError_t e = MultiprocessorCount(&sms); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, MaskedBceKernel, kThreads, 0);
      e != cudaSuccess) {
    return e;
  }
  if (sms * per_sm < kMaskedBceBlocks) {  // a device too small to hold every block at once: the two launches
    if (const cudaError_t e = LaunchMaskedBcePartials(logits, labels, mask, n, partials, stream); e != cudaSuccess) {
      return e;
    }
    return LaunchMaskedBceFinish(logits, labels, mask, n, partials, dlogits, report, stream);
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(kMaskedBceBlocks);
  launch.blockDim = dim3(kThreads);
  launch.stream = stream;
  launch.attrs = &attribute;
  launch.numAttrs = 1;
  return cudaLaunchKernelEx(&launch, MaskedBceKernel, logits, labels, mask, n, partials, dlogits, report);
}

}  // namespace perception::kernels
