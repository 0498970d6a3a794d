// CPU clipping, AdamW and learning-rate schedules; the reference the device optimizer is checked against.
#include "engine/optimizer.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/json_object.h"
#include "engine/status_macros.h"

namespace perception {
namespace {

// The CPU and CUDA updates compute in float32: a setting beyond float32's range would become inf there and put inf
// or NaN into the weights on the first step. Compared in double: converting such a value to float is undefined.
absl::Status CheckFitsFloat32(absl::string_view name, double value) {
  if (value <= std::numeric_limits<float>::max()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("optimizer: ", name, " ", value, " exceeds float32's largest value ",
                                                 std::numeric_limits<float>::max(),
                                                 ", and the update computes in float32"));
}

}  // namespace

absl::StatusOr<LrSchedule> ParseLrSchedule(const std::string& name) {
  if (name == "constant") return LrSchedule::kConstant;
  if (name == "cosine") return LrSchedule::kWarmupCosine;
  return absl::InvalidArgumentError(absl::StrCat("unknown lr schedule '", name, "' (constant, cosine)"));
}

absl::Status ValidateOptimizerConfig(const OptimizerConfig& c) {
  if (!(c.lr > 0) || !std::isfinite(c.lr)) return absl::InvalidArgumentError("optimizer: lr must be positive");
  RETURN_IF_ERROR(CheckFitsFloat32("lr", c.lr));
  if (!(c.beta1 >= 0 && c.beta1 < 1) || !(c.beta2 >= 0 && c.beta2 < 1)) {
    return absl::InvalidArgumentError("optimizer: betas must be in [0, 1)");
  }
  // The first step's size, lr / (1 - beta1^1), is the largest the bias correction makes (in float32, as lr).
  RETURN_IF_ERROR(CheckFitsFloat32("the first step's size lr / (1 - beta1)", c.lr / (1.0 - c.beta1)));
  if (!(c.eps > 0) || !std::isfinite(c.eps)) return absl::InvalidArgumentError("optimizer: eps must be positive");
  RETURN_IF_ERROR(CheckFitsFloat32("eps", c.eps));
  // An eps that rounds to 0 divides a zero first moment by a zero denominator: NaN.
  if (static_cast<float>(c.eps) == 0.f) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: eps ", c.eps, " rounds to 0 in float32, in which the ",
                                                   "update computes (its smallest positive value is ",
                                                   std::numeric_limits<float>::denorm_min(), ")"));
  }
  if (!(c.weight_decay >= 0) || !std::isfinite(c.weight_decay)) {
    return absl::InvalidArgumentError("optimizer: weight_decay must be finite and >= 0");
  }
  RETURN_IF_ERROR(CheckFitsFloat32("lr * weight_decay", c.lr * c.weight_decay));
  // (Every field must be finite: a checkpoint's JSON metadata, where they are saved, has no infinities or NaNs.)
  if (!std::isfinite(c.max_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: max_grad_norm ", c.max_grad_norm,
                                                   " is not finite (<= 0 disables clipping)"));
  }
  if (!std::isfinite(c.min_lr)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: min_lr ", c.min_lr, " is not finite"));
  }
  // Unused by the constant schedule, but kept, shown and saved with it: a negative one is refused there too.
  if (c.warmup_steps < 0 || c.total_steps < 0 || !(c.min_lr >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: warmup_steps (", c.warmup_steps, "), total_steps (",
                                                   c.total_steps, ") and min_lr (", c.min_lr, ") must be >= 0"));
  }
  if (c.schedule == LrSchedule::kWarmupCosine) {
    if (c.total_steps <= c.warmup_steps) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer: cosine schedule needs 0 <= warmup_steps (",
                                                     c.warmup_steps, ") < total_steps (", c.total_steps, ")"));
    }
    if (!(c.min_lr >= 0 && c.min_lr <= c.lr)) {
      return absl::InvalidArgumentError("optimizer: min_lr must be in [0, lr]");
    }
  }
  return absl::OkStatus();
}

std::string OptimizerToJson(const OptimizerConfig& c) {
  nlohmann::ordered_json j;
  j["lr"] = c.lr;
  j["beta1"] = c.beta1;
  j["beta2"] = c.beta2;
  j["eps"] = c.eps;
  j["weight_decay"] = c.weight_decay;
  j["max_grad_norm"] = c.max_grad_norm;
  j["schedule"] = c.schedule == LrSchedule::kWarmupCosine ? "cosine" : "constant";
  j["warmup_steps"] = c.warmup_steps;
  j["total_steps"] = c.total_steps;
  j["min_lr"] = c.min_lr;
  return j.dump();
}

absl::StatusOr<OptimizerConfig> OptimizerFromJson(const std::string& text) {
  ASSIGN_OR_RETURN(const nlohmann::json j, ParseJsonObject(text, "optimizer"));
  OptimizerConfig c;
  const std::pair<const char*, double*> reals[] = {{"lr", &c.lr},
                                                   {"beta1", &c.beta1},
                                                   {"beta2", &c.beta2},
                                                   {"eps", &c.eps},
                                                   {"weight_decay", &c.weight_decay},
                                                   {"max_grad_norm", &c.max_grad_norm},
                                                   {"min_lr", &c.min_lr}};
  for (const auto& [key, field] : reals) {
    const auto it = j.find(key);
    if (it == j.end() || !it->is_number()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer: '", key, "' must be a number"));
    }
    *field = it->get<double>();
  }
  const std::pair<const char*, int64_t*> counts[] = {{"warmup_steps", &c.warmup_steps},
                                                     {"total_steps", &c.total_steps}};
  for (const auto& [key, field] : counts) {
    const auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer: '", key, "' must be an integer"));
    }
    // (nlohmann reads an integer past int64's range as unsigned, which get<int64_t> would wrap to a negative count.)
    if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer: '", key, "' ", it->get<uint64_t>(),
                                                     " exceeds the largest step count, ", INT64_MAX));
    }
    *field = it->get<int64_t>();
  }
  const auto schedule = j.find("schedule");
  if (schedule == j.end() || !schedule->is_string()) {
    return absl::InvalidArgumentError("optimizer: 'schedule' must be a string");
  }
  ASSIGN_OR_RETURN(c.schedule, ParseLrSchedule(schedule->get<std::string>()));
  RETURN_IF_ERROR(ValidateOptimizerConfig(c));
  // MODEL.md §5 fixes them, and no request can set or show them: a file with others would train with settings
  // nothing reports, and its next SetOptimizer would reset them unnoticed.
  const OptimizerConfig fixed;
  const std::pair<const char*, std::pair<double, double>> fixed_values[] = {
      {"beta1", {c.beta1, fixed.beta1}}, {"beta2", {c.beta2, fixed.beta2}}, {"eps", {c.eps, fixed.eps}}};
  for (const auto& [key, values] : fixed_values) {
    if (values.first != values.second) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer: ", key, " is ", values.first, " where MODEL.md §5 ",
                                                     "fixes it at ", values.second));
    }
  }
  return c;
}

double LearningRate(const OptimizerConfig& c, int64_t step) {
  if (c.schedule == LrSchedule::kConstant) return c.lr;
  if (step <= c.warmup_steps) return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup_steps);
  const double progress = std::min(
      1.0, static_cast<double>(step - c.warmup_steps) / static_cast<double>(c.total_steps - c.warmup_steps));
  return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

template <typename T>
double GlobalGradNorm(const ParamLayout& layout, std::span<const T> grads) {
  double sum = 0;
  for (size_t i = layout.trained_begin(); i < layout.total_size(); ++i) {
    sum += static_cast<double>(grads[i]) * static_cast<double>(grads[i]);
  }
  return std::sqrt(sum);
}

template <typename T>
double ClipAndAdamW(const ParamLayout& layout, const OptimizerConfig& c, int64_t step, std::span<T> params,
                    std::span<T> grads, std::span<T> exp_avg, std::span<T> exp_avg_sq) {
  const double norm = GlobalGradNorm<T>(layout, grads);
  if (!StepApplies<T>(norm, c)) return norm;
  const T scale = c.max_grad_norm > 0 ? static_cast<T>(std::min(1.0, c.max_grad_norm / (norm + 1e-6))) : T(1);
  const double lr = LearningRate(c, step);
  const T bias_correction1 = static_cast<T>(1.0 - std::pow(c.beta1, static_cast<double>(step)));
  const T bias_correction2_sqrt = static_cast<T>(std::sqrt(1.0 - std::pow(c.beta2, static_cast<double>(step))));
  const T step_size = static_cast<T>(lr) / bias_correction1;
  const T b1 = static_cast<T>(c.beta1), b2 = static_cast<T>(c.beta2), eps = static_cast<T>(c.eps);
  const T decay = static_cast<T>(1.0 - lr * c.weight_decay);
  for (const TensorSpec& t : layout.tensors()) {
    if (!t.trained) continue;
    for (size_t i = t.offset; i < t.offset + t.size; ++i) {
      const T g = grads[i] * scale;
      grads[i] = g;
      if (t.weight_decay) params[i] *= decay;
      exp_avg[i] = b1 * exp_avg[i] + (T(1) - b1) * g;
      exp_avg_sq[i] = b2 * exp_avg_sq[i] + (T(1) - b2) * g * g;
      const T denom = std::sqrt(exp_avg_sq[i]) / bias_correction2_sqrt + eps;
      params[i] -= step_size * exp_avg[i] / denom;
    }
  }
  return norm;
}

template double GlobalGradNorm<float>(const ParamLayout&, std::span<const float>);
template double GlobalGradNorm<double>(const ParamLayout&, std::span<const double>);
template double ClipAndAdamW<float>(const ParamLayout&, const OptimizerConfig&, int64_t, std::span<float>,
                                    std::span<float>, std::span<float>, std::span<float>);
template double ClipAndAdamW<double>(const ParamLayout&, const OptimizerConfig&, int64_t, std::span<double>,
                                     std::span<double>, std::span<double>, std::span<double>);

}  // namespace perception
