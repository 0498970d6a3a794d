// Global-norm clipping, AdamW with PyTorch semantics and learning-rate schedules (MODEL.md §5), on the CPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "engine/param_layout.h"

namespace perception {

enum class LrSchedule { kConstant, kWarmupCosine };

struct OptimizerConfig {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;  // <= 0 disables clipping
  LrSchedule schedule = LrSchedule::kConstant;
  int64_t warmup_steps = 0;  // kWarmupCosine: linear ramp over these steps
  int64_t total_steps = 0;   // kWarmupCosine: cosine reaches min_lr at this step
  double min_lr = 0.0;
  bool operator==(const OptimizerConfig&) const = default;
};

absl::StatusOr<LrSchedule> ParseLrSchedule(const std::string& name);  // "constant" | "cosine"
absl::Status ValidateOptimizerConfig(const OptimizerConfig& config);

// Every field as JSON (a checkpoint's `optimizer` metadata), doubles written to round-trip exactly; parsing
// requires every field and validates the result.
std::string OptimizerToJson(const OptimizerConfig& config);
absl::StatusOr<OptimizerConfig> OptimizerFromJson(const std::string& text);

// Learning rate of optimizer step `step` (1-based: the first update is step 1).
//   warmup:  lr · step / warmup_steps                       for step <= warmup_steps
//   cosine:  min_lr + (lr − min_lr) · ½(1 + cos(π·progress)), progress = (step − warmup)/(total − warmup), capped at 1
double LearningRate(const OptimizerConfig& config, int64_t step);

// ‖g‖₂ over the trained tensors, accumulated in double.
template <typename T>
double GlobalGradNorm(const ParamLayout& layout, std::span<const T> grads);

// The largest gradient norm, after clipping, that a step in T applies: below it every element's square, and with it
// the second moment, stays within T's range. A norm beyond it is finite only because it is summed in double; its
// update would make the second moment infinite (and the parameters under it stop moving for good), which no
// checkpoint may hold.
template <typename T>
double LargestAppliedGradNorm() {
  return 0.99 * std::sqrt(static_cast<double>(std::numeric_limits<T>::max()));
}

// Whether a step in T whose gradient norm before clipping is `norm` is applied: the norm is finite and, clipped by
// `config`, below LargestAppliedGradNorm<T>.
template <typename T>
bool StepApplies(double norm, const OptimizerConfig& config) {
  if (!std::isfinite(norm)) return false;
  const double clipped = config.max_grad_norm > 0 ? norm * std::min(1.0, config.max_grad_norm / (norm + 1e-6)) : norm;
  return clipped < LargestAppliedGradNorm<T>();
}

// One optimizer step, as torch.nn.utils.clip_grad_norm_ followed by torch.optim.AdamW.step():
// g ← g·min(1, max/(‖g‖+1e-6)); θ ← θ(1 − lr·wd) where decayed; m, v moments; bias corrections from `step`
// (1-based, the step being taken). Grads are scaled in place. Returns the pre-clip norm. A step StepApplies refuses
// changes nothing (the step is not taken), as clip_grad_norm_(error_if_nonfinite=True) raises before the update on a
// norm that is not finite: the update would write NaN into the parameters and both moments (or, for a finite norm
// too large, infinity into the second moment).
template <typename T>
double ClipAndAdamW(const ParamLayout& layout, const OptimizerConfig& config, int64_t step, std::span<T> params,
                    std::span<T> grads, std::span<T> exp_avg, std::span<T> exp_avg_sq);

}  // namespace perception
