// Request checks done on the handler's thread, before anything reaches the device worker.
#include "server/request_validation.h"

#include <cmath>
#include <limits>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "engine/dataset.h"
#include "engine/status_macros.h"
#include "server/proto_convert.h"

namespace perception::server {
namespace {

absl::Status CheckSize(absl::string_view field, int64_t size, int64_t expected, absl::string_view shape) {
  if (size == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has ", size, " floats but its shape ", shape, " needs ", expected));
}

// "x[130] (window 1, event 3, feature 4)": an index and where it sits in a [B, T, inner] array.
std::string Position(absl::string_view field, int64_t index, int window, int inner, absl::string_view inner_name) {
  const int64_t per_window = int64_t{window} * inner;
  std::string where =
      absl::StrCat(field, "[", index, "] (window ", index / per_window, ", event ", index % per_window / inner);
  if (!inner_name.empty()) absl::StrAppend(&where, ", ", inner_name, " ", index % inner);
  return where + ")";
}

// Every value satisfies `ok`; otherwise INVALID_ARGUMENT naming the first that does not and why (with every digit a
// float holds: a label of 1.0000001 read "is 1; labels must be 0 or 1"). A valid array costs
// one pass without branches (a count, which vectorizes for predicates without branches), the search for the first
// bad value runs only where there is one: a `small` batch holds up to 786,432 features.
template <typename Predicate>
absl::Status CheckValues(absl::string_view field, std::span<const float> values, int window, int inner,
                         absl::string_view inner_name, absl::string_view requirement, Predicate ok) {
  size_t bad = 0;
  for (const float v : values) bad += !ok(v);
  if (bad == 0) return absl::OkStatus();
  for (size_t i = 0; i < values.size(); ++i) {
    if (!ok(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s is %.9g; %s", Position(field, i, window, inner, inner_name), values[i], requirement));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckShape(const v1::Batch& batch, const Limits& limits) {
  if (batch.batch() < 1 || batch.window() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("empty batch: batch (", batch.batch(), " windows) and window (",
                                                   batch.window(), " events) must both be at least 1"));
  }
  if (batch.batch() > limits.max_batch) {
    return absl::ResourceExhaustedError(
        absl::StrCat("batch of ", batch.batch(), " windows exceeds the daemon's limit of ", limits.max_batch));
  }
  if (batch.window() > limits.max_window) {
    return absl::ResourceExhaustedError(
        absl::StrCat("window of ", batch.window(), " events exceeds the daemon's limit of ", limits.max_window));
  }
  if (batch.n_features() < 1 || batch.n_horizons() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("n_features (", batch.n_features(), ") and n_horizons (",
                                                   batch.n_horizons(), ") must both be at least 1"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateBatch(const v1::Batch& batch, const Limits& limits, const Normalizer* normalizer) {
  RETURN_IF_ERROR(CheckShape(batch, limits));
  const int64_t events = int64_t{batch.batch()} * batch.window();
  const int F = batch.n_features(), H = batch.n_horizons();
  const std::string events_shape = absl::StrCat("[", batch.batch(), ", ", batch.window());
  RETURN_IF_ERROR(CheckSize("x", batch.x_size(), events * F, absl::StrCat(events_shape, ", ", F, "]")));
  RETURN_IF_ERROR(CheckSize("dt", batch.dt_size(), events, absl::StrCat(events_shape, "]")));
  RETURN_IF_ERROR(CheckSize("labels", batch.labels_size(), events * H, absl::StrCat(events_shape, ", ", H, "]")));
  RETURN_IF_ERROR(CheckSize("mask", batch.mask_size(), events * H, absl::StrCat(events_shape, ", ", H, "]")));

  const BatchView<float> view = ViewOf(batch);
  const int T = batch.window();
  // (Comparisons, not std::isfinite, and | rather than ||: the counting passes vectorize.)
  constexpr float kLargest = std::numeric_limits<float>::max();
  const auto finite = [](float v) { return std::fabs(v) <= kLargest; };
  const auto zero_or_one = [](float v) { return (v == 0.f) | (v == 1.f); };
  const bool standardized = normalizer != nullptr && normalizer->mean.size() == static_cast<size_t>(F);
  // One pass over x checks both: a feature that is not finite is not within the bound either.
  const absl::Status in_range =
      standardized ? CheckBatchStandardizedRange(*normalizer, T, view.x) : absl::OkStatus();
  if (!standardized || !in_range.ok()) {
    RETURN_IF_ERROR(CheckValues("x", view.x, T, F, "feature", "features must be finite", finite));
  }
  RETURN_IF_ERROR(CheckValues("dt", view.dt, T, 1, "", "dt must be finite and >= 0 (seconds)",
                              [](float v) { return (v >= 0.f) & (v <= kLargest); }));
  RETURN_IF_ERROR(CheckValues("labels", view.labels, T, H, "horizon", "labels must be 0 or 1", zero_or_one));
  RETURN_IF_ERROR(CheckValues("mask", view.mask, T, H, "horizon", "mask values must be 0 or 1", zero_or_one));
  return in_range;  // after the checks that need no model, as when the host ran it
}

absl::Status CheckTrainingShapeWithinLimits(const ModelConfig& config, const Limits& limits) {
  if (config.batch > limits.max_batch || config.window > limits.max_window) {
    return absl::ResourceExhaustedError(absl::StrCat("training shape ", config.batch, " windows x ", config.window,
                                                     " events exceeds the daemon's limits (", limits.max_batch, " x ",
                                                     limits.max_window, ")"));
  }
  // A batch is one TrainStep request: x, dt, labels and mask as packed floats, plus a few bytes of tags and lengths.
  // Beyond --max_message_bytes none could ever be sent, and the first train failed in gRPC's words, not these.
  constexpr int64_t kRequestFraming = 64;
  const int64_t floats = int64_t{config.batch} * config.window * (config.n_features + 1 + 2 * config.n_horizons);
  if (const int64_t bytes = 4 * floats + kRequestFraming; bytes > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "training shape ", config.batch, " windows x ", config.window, " events makes batches of ", bytes,
        " bytes, beyond the daemon's largest message (--max_message_bytes ", limits.max_message_bytes,
        "): none could be sent; a smaller batch or window fits"));
  }
  return absl::OkStatus();
}

}  // namespace perception::server
