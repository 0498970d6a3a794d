// Global gradient-norm clipping and AdamW (MODEL.md §5, torch semantics as engine/optimizer.cc) over every trained
// tensor at once, on the device: learning rate and bias corrections come from a step counter in device memory.
// One cooperative launch, because the clip scale needs the norm of the whole gradient: per-chunk sums of squares, a
// grid barrier, then clip + AdamW, whose blocks each add those partials in the same order.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/step_report.h"

namespace perception::kernels {

// A piece of one trained tensor (the "multi-tensor" table): floats [offset, offset + count) of the flat buffers.
struct AdamWChunk {
  uint64_t offset = 0;
  int count = 0;
  int weight_decay = 0;  // 1 where MODEL.md §4 marks the tensor for decoupled weight decay
};
// Small enough that the chunks outnumber the SMs several times over (a thread updates 4 floats of its chunk).
constexpr int kAdamWChunkFloats = 1024;

// OptimizerConfig as the device reads it.
struct AdamWConfig {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  double max_grad_norm = 0;  // <= 0: no clipping
  double largest_applied_grad_norm = 0;  // LargestAppliedGradNorm<float>: a clipped norm not below it takes no step
  bool warmup_cosine = false;
  int64_t warmup_steps = 0, total_steps = 0;
  double min_lr = 0;
};

// Increments *step (it then names the step being taken); norm = sqrt(Σ g²) over every chunk (partials[i] = Σ g² of
// chunk i in double, added in chunk order); g ← g·min(1, max/(norm + 1e-6)) in place; θ ← θ(1 − lr·wd) where
// decayed; then m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², θ ← θ − lr/(1−β1^step) · m / (sqrt(v)/sqrt(1−β2^step) +
// eps). Writes report->grad_norm, report->step and report->applied. A norm that is not finite, or whose clipped value
// is not below config.largest_applied_grad_norm, changes nothing and leaves *step (StepApplies). partials holds
// `count` doubles.
cudaError_t LaunchClipAdamW(const AdamWChunk* chunks, int count, double* partials, int64_t* step,
                            const AdamWConfig& config, float* params, float* grads, float* exp_avg, float* exp_avg_sq,
                            StepReport* report, cudaStream_t stream);

}  // namespace perception::kernels
