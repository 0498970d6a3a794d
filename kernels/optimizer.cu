// Clipping and AdamW, one block per chunk of the multi-tensor table. The float arithmetic of the update mirrors
// engine/optimizer.cc operation by operation; the schedule and the bias corrections are computed in double.
#include "kernels/common.cuh"
#include "kernels/optimizer.h"

namespace perception::kernels {
namespace {

constexpr int kThreads = 256;
constexpr double kPi = 3.141592653589793;

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
  const AdamWChunk chunk = chunks[blockIdx.x];
  for (int i = threadIdx.x; i < chunk.count; i += kThreads) {
    const size_t k = chunk.offset + i;
    const float g = grads[k] * scale;
    grads[k] = g;
    if (chunk.weight_decay) params[k] *= decay;
    exp_avg[k] = b1 * exp_avg[k] + (1.f - b1) * g;
    exp_avg_sq[k] = b2 * exp_avg_sq[k] + (1.f - b2) * g * g;
    const float denom = sqrtf(exp_avg_sq[k]) / bias_correction2_sqrt + eps;
    params[k] -= step_size * exp_avg[k] / denom;
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
