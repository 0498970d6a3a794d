// Clipping and AdamW, one block per chunk of the multi-tensor table. The float arithmetic of the update mirrors
// engine/optimizer.cc operation by operation; the schedule and the bias corrections are computed in double.
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

__global__ void __launch_bounds__(kThreads)
    GradNormPartialsKernel(const AdamWChunk* chunks, const float* grads, double* partials, int64_t* step) {
  __shared__ double scratch[kThreads / kWarpSize];
  const AdamWChunk chunk = chunks[blockIdx.x];
  double sum = 0.0;
  for (int i = threadIdx.x; i < chunk.count; i += kThreads) {
    const double g = grads[chunk.offset + i];
    sum += g * g;
  }
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = sum;
    if (blockIdx.x == 0) *step += 1;
  }
}

__global__ void __launch_bounds__(kThreads)
    ClipAdamWKernel(const AdamWChunk* chunks, int count, const double* partials, const int64_t* step_counter,
                    AdamWConfig c, float* params, float* grads, float* exp_avg, float* exp_avg_sq,
                    StepReport* report) {
  const AdamWChunk chunk = chunks[blockIdx.x];
  // Every load of the thread's floats first, before the norm's barriers and any store: the four arrays are distinct,
  // but the compiler cannot know it, and interleaved loads and stores would cost one memory latency per float.
  float g[kPerThread], p[kPerThread], m[kPerThread], v[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i >= chunk.count) break;
    const size_t k = chunk.offset + i;
    g[j] = grads[k];
    p[j] = params[k];
    m[j] = exp_avg[k];
    v[j] = exp_avg_sq[k];
  }
  __shared__ double scratch[kThreads / kWarpSize];
  double part = 0.0;
  for (int i = threadIdx.x; i < count; i += kThreads) part += partials[i];
  const double norm = sqrt(BlockSum(part, scratch));
  const int64_t step = *step_counter;
  const float scale = c.max_grad_norm > 0 ? static_cast<float>(fmin(1.0, c.max_grad_norm / (norm + 1e-6))) : 1.f;
  const double lr = LearningRate(c, step);
  const float bias_correction1 = static_cast<float>(1.0 - pow(c.beta1, static_cast<double>(step)));
  const float bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(c.beta2, static_cast<double>(step))));
  const float step_size = static_cast<float>(lr) / bias_correction1;
  const float b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2), eps = static_cast<float>(c.eps);
  const float decay = static_cast<float>(1.0 - lr * c.weight_decay);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i >= chunk.count) break;
    const size_t k = chunk.offset + i;
    const float gk = g[j] * scale;
    grads[k] = gk;
    if (chunk.weight_decay) p[j] *= decay;
    m[j] = b1 * m[j] + (1.f - b1) * gk;
    v[j] = b2 * v[j] + (1.f - b2) * gk * gk;
    const float denom = sqrtf(v[j]) / bias_correction2_sqrt + eps;
    exp_avg[k] = m[j];
    exp_avg_sq[k] = v[j];
    params[k] = p[j] - step_size * m[j] / denom;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    report->grad_norm = norm;
    report->step = step;
  }
}

}  // namespace

cudaError_t LaunchGradNormPartials(const AdamWChunk* chunks, int count, const float* grads, double* partials,
                                   int64_t* step, cudaStream_t stream) {
  GradNormPartialsKernel<<<count, kThreads, 0, stream>>>(chunks, grads, partials, step);
  return cudaGetLastError();
}

cudaError_t LaunchClipAdamW(const AdamWChunk* chunks, int count, const double* partials, const int64_t* step,
                            const AdamWConfig& config, float* params, float* grads, float* exp_avg, float* exp_avg_sq,
                            StepReport* report, cudaStream_t stream) {
  ClipAdamWKernel<<<count, kThreads, 0, stream>>>(chunks, count, partials, step, config, params, grads, exp_avg,
                                                   exp_avg_sq, report);
  return cudaGetLastError();
}

}  // namespace perception::kernels
