// Clipping and AdamW in one cooperative launch over the chunks of the multi-tensor table. The float arithmetic of the
// update mirrors engine/optimizer.cc operation by operation; the schedule and the bias corrections are computed in
// double.
#include <cooperative_groups.h>

#include "kernels/common.cuh"
#include "kernels/optimizer.h"

namespace perception::kernels {
namespace {

constexpr int kThreads = 256;
constexpr double kPi = 3.141592653589793;
constexpr int kPerThread = kAdamWChunkFloats / kThreads;
static_assert(kAdamWChunkFloats % kThreads == 0);

// engine/optimizer.cc's LearningRate, on the device.
__device__ double LearningRate(const AdamWConfig& c, int64_t step) {
  if (!c.warmup_cosine) return c.lr;
  if (step <= c.warmup_steps) return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup_steps);
  const double progress = fmin(1.0, static_cast<double>(step - c.warmup_steps) /
                                        static_cast<double>(c.total_steps - c.warmup_steps));
  return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1.0 + cos(kPi * progress));
}

// Σ g² of one chunk in double, the same in every thread: thread t adds its floats t, t + kThreads, ... in order, then
// the block adds its warps in order. Every thread of the block must call it.
__device__ double ChunkSquares(const float (&g)[kPerThread], int count, double* scratch) {
  double sum = 0.0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    if (threadIdx.x + j * kThreads < count) sum += static_cast<double>(g[j]) * g[j];
  }
  return BlockSum(sum, scratch);
}

__device__ __forceinline__ void LoadChunk(const AdamWChunk& chunk, const float* a, float (&out)[kPerThread]) {
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < chunk.count) out[j] = a[chunk.offset + i];
  }
}

// The step's scalars, from the step number (double as engine/optimizer.cc computes them).
struct AdamWStep {
  float step_size, bias_correction2_sqrt, decay;
};
__device__ AdamWStep StepScalars(const AdamWConfig& c, int64_t step) {
  const double lr = LearningRate(c, step);
  const float bias_correction1 = static_cast<float>(1.0 - pow(c.beta1, static_cast<double>(step)));
  return {static_cast<float>(lr) / bias_correction1,
          static_cast<float>(sqrt(1.0 - pow(c.beta2, static_cast<double>(step)))),
          static_cast<float>(1.0 - lr * c.weight_decay)};
}

__device__ __forceinline__ void UpdateChunk(const AdamWChunk& chunk, const AdamWConfig& c, const AdamWStep& s,
                                            float scale, const float (&g)[kPerThread], float (&p)[kPerThread],
                                            float (&m)[kPerThread], float (&v)[kPerThread], float* params,
                                            float* grads, float* exp_avg, float* exp_avg_sq) {
  const float b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2), eps = static_cast<float>(c.eps);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i >= chunk.count) break;
    const size_t k = chunk.offset + i;
    const float gk = g[j] * scale;
    grads[k] = gk;
    if (chunk.weight_decay) p[j] *= s.decay;
    m[j] = b1 * m[j] + (1.f - b1) * gk;
    v[j] = b2 * v[j] + (1.f - b2) * gk * gk;
    const float denom = sqrtf(v[j]) / s.bias_correction2_sqrt + eps;
    exp_avg[k] = m[j];
    exp_avg_sq[k] = v[j];
    params[k] = p[j] - s.step_size * m[j] / denom;
  }
}

// One cooperative launch of at most one block per chunk: each block writes Σ g² of its chunks to partials, the grid
// waits at one barrier, then every block adds all partials in chunk order (the same bits in every block) and
// updates its chunks. A block's first chunk stays in registers across the barrier (all of them on `small`); a grid
// capped at the blocks the device holds at once reads its further chunks again after it.
__global__ void __launch_bounds__(kThreads)
    ClipAdamWKernel(const AdamWChunk* chunks, int count, double* partials, int64_t* step_counter, AdamWConfig c,
                    float* params, float* grads, float* exp_avg, float* exp_avg_sq, StepReport* report) {
  __shared__ double scratch[kThreads / kWarpSize];
  const AdamWChunk first = chunks[blockIdx.x];
  // Every load of the first chunk before the sums' barriers and any store: the four arrays are distinct, but the
  // compiler cannot know it, and interleaved loads and stores would cost one memory latency per float.
  float g[kPerThread], p[kPerThread], m[kPerThread], v[kPerThread];
  LoadChunk(first, grads, g);
  LoadChunk(first, params, p);
  LoadChunk(first, exp_avg, m);
  LoadChunk(first, exp_avg_sq, v);
  const int64_t step = *step_counter + 1;  // every block reads it before the barrier; block 0 writes it after
  double squares = ChunkSquares(g, first.count, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = squares;
  for (int k = blockIdx.x + gridDim.x; k < count; k += gridDim.x) {
    const AdamWChunk chunk = chunks[k];
    float gk[kPerThread];
    LoadChunk(chunk, grads, gk);
    squares = ChunkSquares(gk, chunk.count, scratch);
    if (threadIdx.x == 0) partials[k] = squares;
  }
  const AdamWStep s = StepScalars(c, step);
  cooperative_groups::this_grid().sync();

  double part = 0.0;
  for (int i = threadIdx.x; i < count; i += kThreads) part += partials[i];
  const double norm = sqrt(BlockSum(part, scratch));
  // A norm that is not finite, or too large for float32's second moment once clipped (the same in every block), takes
  // no step: StepApplies' rule, so that the update does not write NaN into every parameter and moment (or infinity
  // into the second moments); the counter stays, which tells the host. (A NaN or infinite norm fails the comparison.)
  const double clipped = c.max_grad_norm > 0 ? norm * fmin(1.0, c.max_grad_norm / (norm + 1e-6)) : norm;
  if (!(isfinite(norm) && clipped < c.largest_applied_grad_norm)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      report->grad_norm = norm;
      report->step = step - 1;
      report->applied = 0;
    }
    return;
  }
  const float scale = c.max_grad_norm > 0 ? static_cast<float>(fmin(1.0, c.max_grad_norm / (norm + 1e-6))) : 1.f;
  UpdateChunk(first, c, s, scale, g, p, m, v, params, grads, exp_avg, exp_avg_sq);
  for (int k = blockIdx.x + gridDim.x; k < count; k += gridDim.x) {
    const AdamWChunk chunk = chunks[k];
    LoadChunk(chunk, grads, g);
    LoadChunk(chunk, params, p);
    LoadChunk(chunk, exp_avg, m);
    LoadChunk(chunk, exp_avg_sq, v);
    UpdateChunk(chunk, c, s, scale, g, p, m, v, params, grads, exp_avg, exp_avg_sq);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *step_counter = step;
    report->grad_norm = norm;
    report->step = step;
    report->applied = 1;
  }
}

}  // namespace

cudaError_t LaunchClipAdamW(const AdamWChunk* chunks, int count, double* partials, int64_t* step,
                            const AdamWConfig& config, float* params, float* grads, float* exp_avg, float* exp_avg_sq,
                            StepReport* report, cudaStream_t stream) {
  if (count < 1) return cudaErrorInvalidValue;
  int sms = 0, per_sm = 0;
  if (const cudaError_t e = MultiprocessorCount(&sms); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ClipAdamWKernel, kThreads, 0);
      e != cudaSuccess) {
    return e;
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(static_cast<unsigned>(count < sms * per_sm ? count : sms * per_sm));
  launch.blockDim = dim3(kThreads);
  launch.stream = stream;
  launch.attrs = &attribute;
  launch.numAttrs = 1;
  return cudaLaunchKernelEx(&launch, ClipAdamWKernel, chunks, count, partials, step, config, params, grads, exp_avg,
                            exp_avg_sq, report);
}

}  // namespace perception::kernels
