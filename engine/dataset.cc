// Event series from LOBSTER data, the chronological split, normalizer, class prior and window batches.
#include "engine/dataset.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/config.h"
#include "engine/status_macros.h"
#include "engine/loss.h"

namespace perception {
namespace {

constexpr double kMinStd = 1e-6;
constexpr double kMinPriorProbability = 1e-9;

absl::Status ValidateHorizons(std::span<const int> horizons) {
  if (horizons.empty()) return absl::InvalidArgumentError("no label horizons");
  for (int k : horizons) {
    if (k < 1) return absl::InvalidArgumentError(absl::StrCat("label horizon ", k, " is not >= 1 event"));
  }
  return absl::OkStatus();
}

// "<orderbook>:<line> (message <messages>:<line>)" for data read from files, "line <line>" otherwise.
std::string EventLocation(const LobsterData& data, size_t event) {
  const size_t line = event + 1;
  if (data.orderbook_path.empty()) return absl::StrCat("line ", line);
  return absl::StrCat(data.orderbook_path, ":", line, " (message ", data.message_path, ":", line, ")");
}

void Relabel(EventSeries& series) {
  const size_t cells = series.size() * series.horizons.size();
  series.labels.resize(cells);
  series.mask.resize(cells);
  ComputeLabels(series.doubled_mid, series.horizons, series.labels, series.mask);
}

// Events [begin, end) of `series` with their features and Δt as they are, labels recomputed from the part.
EventSeries Slice(const EventSeries& series, size_t begin, size_t end) {
  EventSeries part;
  part.n_features = series.n_features;
  part.n_horizons = series.n_horizons;
  part.horizons = series.horizons;
  const size_t width = static_cast<size_t>(series.n_features);
  part.features.assign(series.features.begin() + begin * width, series.features.begin() + end * width);
  part.dt.assign(series.dt.begin() + begin, series.dt.begin() + end);
  part.doubled_mid.assign(series.doubled_mid.begin() + begin, series.doubled_mid.begin() + end);
  Relabel(part);
  return part;
}

void ShapeBatch(int batch, int window, const EventSeries& series, Batch& out) {
  out.batch = batch;
  out.window = window;
  out.n_features = series.n_features;
  out.n_horizons = series.n_horizons;
  const size_t positions = static_cast<size_t>(batch) * window;
  out.x.resize(positions * series.n_features);
  out.dt.resize(positions);
  out.labels.resize(positions * series.n_horizons);
  out.mask.resize(positions * series.n_horizons);
}

// Copies events [start, start + out.window) into batch row `row`; the first `warmup` positions are masked out.
void CopyWindow(const EventSeries& series, size_t start, int warmup, int row, Batch& out) {
  const size_t window = static_cast<size_t>(out.window);
  const size_t features = static_cast<size_t>(series.n_features), horizons = static_cast<size_t>(series.n_horizons);
  const size_t position = static_cast<size_t>(row) * window;
  std::copy_n(series.features.begin() + start * features, window * features, out.x.begin() + position * features);
  std::copy_n(series.dt.begin() + start, window, out.dt.begin() + position);
  std::copy_n(series.labels.begin() + start * horizons, window * horizons, out.labels.begin() + position * horizons);
  std::copy_n(series.mask.begin() + start * horizons, window * horizons, out.mask.begin() + position * horizons);
  std::fill_n(out.mask.begin() + position * horizons, static_cast<size_t>(warmup) * horizons, 0.f);
}

}  // namespace

absl::StatusOr<EventSeries> BuildSeries(const LobsterData& data, std::span<const int> horizons) {
  RETURN_IF_ERROR(ValidateHorizons(horizons));
  if (data.levels < 1 || data.book.size() != data.size() * 4 * static_cast<size_t>(data.levels)) {
    return absl::InvalidArgumentError(absl::StrCat("LOBSTER data with ", data.levels, " levels and ", data.size(),
                                                   " messages has ", data.book.size(), " book values"));
  }
  LobsterFeaturizer featurizer(data.levels);
  EventSeries series;
  series.n_features = featurizer.n_features();
  series.n_horizons = static_cast<int>(horizons.size());
  series.horizons.assign(horizons.begin(), horizons.end());
  series.features.resize(data.size() * series.n_features);
  series.dt.resize(data.size());
  series.doubled_mid.resize(data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    const std::span<float> row = std::span<float>(series.features).subspan(i * series.n_features, series.n_features);
    const absl::StatusOr<double> dt = featurizer.Next(data.BookRow(i), data.messages[i], row);
    if (!dt.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(EventLocation(data, i), ": ", dt.status().message()));
    }
    series.dt[i] = static_cast<float>(*dt);
    series.doubled_mid[i] = DoubledMid(data.BookRow(i));
  }
  Relabel(series);
  return series;
}

absl::StatusOr<SplitSeries> SplitByTime(const EventSeries& series, double train_fraction) {
  if (series.horizons.size() != static_cast<size_t>(series.n_horizons)) {
    return absl::InvalidArgumentError(absl::StrCat("series has n_horizons ", series.n_horizons, " but ",
                                                   series.horizons.size(), " horizons to relabel its parts with"));
  }
  const size_t n = series.size();
  // A fraction outside (0, 1), NaN included, leaves no training part.
  const size_t n_train = train_fraction > 0 && train_fraction < 1
                             ? static_cast<size_t>(std::llround(train_fraction * static_cast<double>(n)))
                             : 0;
  if (n_train == 0 || n_train == n) {
    return absl::InvalidArgumentError(
        absl::StrCat("splitting ", n, " events at train fraction ", train_fraction, " leaves an empty part"));
  }
  return SplitSeries{Slice(series, 0, n_train), Slice(series, n_train, n)};
}

Normalizer FitNormalizer(const EventSeries& series) {
  const size_t n = series.size(), width = static_cast<size_t>(series.n_features);
  Normalizer normalizer{std::vector<float>(width, 0.f), std::vector<float>(width, 1.f)};
  if (n == 0) return normalizer;
  // Two passes (mean, then squared deviations) keep the variance accurate for large, offset features.
  std::vector<double> mean(width, 0.0), squared_deviation(width, 0.0);
  for (size_t t = 0; t < n; ++t) {
    for (size_t f = 0; f < width; ++f) mean[f] += series.features[t * width + f];
  }
  for (size_t f = 0; f < width; ++f) mean[f] /= static_cast<double>(n);
  for (size_t t = 0; t < n; ++t) {
    for (size_t f = 0; f < width; ++f) {
      const double deviation = series.features[t * width + f] - mean[f];
      squared_deviation[f] += deviation * deviation;
    }
  }
  for (size_t f = 0; f < width; ++f) {
    const double standard_deviation = std::sqrt(squared_deviation[f] / static_cast<double>(n));
    normalizer.mean[f] = static_cast<float>(mean[f]);
    normalizer.inv_std[f] = static_cast<float>(1.0 / std::max(standard_deviation, kMinStd));
  }
  return normalizer;
}

absl::Status ValidateNormalizer(std::span<const float> mean, std::span<const float> inv_std) {
  if (mean.size() != inv_std.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalizer mean has ", mean.size(), " values but inv_std has ", inv_std.size()));
  }
  for (size_t i = 0; i < mean.size(); ++i) {
    if (!std::isfinite(mean[i]) || !std::isfinite(inv_std[i]) || !(inv_std[i] > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("normalizer feature ", i, ": mean ", mean[i], ", inv_std ",
                                                     inv_std[i], "; both must be finite and inv_std > 0"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckStandardizedRange(const Normalizer& normalizer, std::span<const float> x) {
  for (size_t i = 0; i < x.size(); ++i) {
    const float standardized = (x[i] - normalizer.mean[i]) * normalizer.inv_std[i];
    if (std::fabs(standardized) <= kMaxStandardizedFeature) continue;
    return absl::InvalidArgumentError(absl::StrFormat(
        "feature %d is %g, %g standard deviations from the model's normalizer mean; a feature must stay within %g "
        "of it (beyond, float32 no longer computes the model: its norms' sums of squares overflow, then the model)",
        i, x[i], standardized, kMaxStandardizedFeature));
  }
  return absl::OkStatus();
}

namespace {

// The first event of x [events, F] (F the normalizer's size) with a feature beyond kMaxStandardizedFeature once
// standardized, if any: one pass that branches only per event.
std::optional<size_t> FirstEventBeyondTheBound(const Normalizer& normalizer, std::span<const float> x) {
  const size_t F = normalizer.mean.size();
  for (size_t event = 0; event * F < x.size(); ++event) {
    const float* features = x.data() + event * F;
    int beyond = 0;  // a count, not a max: an integer sum vectorizes where a float max needs -ffast-math
    for (size_t i = 0; i < F; ++i) {
      beyond += !(std::fabs((features[i] - normalizer.mean[i]) * normalizer.inv_std[i]) <= kMaxStandardizedFeature);
    }
    if (beyond > 0) return event;
  }
  return std::nullopt;
}

}  // namespace

absl::Status CheckSeriesStandardizedRange(const Normalizer& normalizer, const EventSeries& series) {
  const std::optional<size_t> i = FirstEventBeyondTheBound(normalizer, series.features);
  if (!i.has_value()) return absl::OkStatus();
  const size_t F = normalizer.mean.size();
  return absl::InvalidArgumentError(absl::StrCat(
      "line ", *i + 1, " of the LOBSTER files: ",
      CheckStandardizedRange(normalizer, std::span<const float>(series.features).subspan(*i * F, F)).message()));
}

absl::Status CheckBatchStandardizedRange(const Normalizer& normalizer, int window, std::span<const float> x) {
  const std::optional<size_t> event = FirstEventBeyondTheBound(normalizer, x);
  if (!event.has_value()) return absl::OkStatus();
  const size_t F = normalizer.mean.size();
  return absl::InvalidArgumentError(
      absl::StrCat("batch window ", *event / window, ", event ", *event % window, ": ",
                   CheckStandardizedRange(normalizer, x.subspan(*event * F, F)).message()));
}

std::vector<int> UnvaryingFeatures(const Normalizer& normalizer) {
  std::vector<int> unvarying;
  const float floor_inv_std = static_cast<float>(1.0 / kMinStd);
  for (size_t f = 0; f < normalizer.inv_std.size(); ++f) {
    if (normalizer.inv_std[f] >= floor_inv_std) unvarying.push_back(static_cast<int>(f));
  }
  return unvarying;
}

namespace {

// A normalizer's feature by its LOBSTER name (the normalizer's width gives the book levels).
std::string FeatureNameOf(const Normalizer& normalizer, int feature) {
  return LobsterFeatureName(feature, (static_cast<int>(normalizer.inv_std.size()) - LobsterFeatureCount(0)) / 4);
}

}  // namespace

std::string UnvaryingFeaturesWarning(const Normalizer& normalizer, size_t fitted_events) {
  const std::vector<int> unvarying = UnvaryingFeatures(normalizer);
  if (unvarying.empty()) return "";
  std::vector<std::string> names;
  for (int f : unvarying) names.push_back(FeatureNameOf(normalizer, f));
  return absl::StrCat("the normalizer's feature(s) ", absl::StrJoin(names, ", "), " never vary in the ", fitted_events,
                      " events it was fitted on: their inv_std is 1e6 (MODEL.md's std floor of 1e-6), so an event "
                      "where one differs moves the model's input by 1e6 a unit; fit on data where they vary");
}

std::string FlooredFeaturesVaryWarning(const Normalizer& normalizer, const EventSeries& series) {
  const size_t F = normalizer.mean.size();
  if (static_cast<size_t>(series.n_features) != F) return "";
  std::vector<std::string> varied;
  for (const int f : UnvaryingFeatures(normalizer)) {
    size_t differ = 0;
    for (size_t i = 0; i < series.size(); ++i) differ += series.features[i * F + f] != normalizer.mean[f];
    if (differ > 0) varied.push_back(absl::StrCat(FeatureNameOf(normalizer, f), " (", differ, " events)"));
  }
  if (varied.empty()) return "";
  return absl::StrCat("the model's normalizer was fitted where feature(s) ", absl::StrJoin(varied, ", "),
                      " never varied (inv_std 1e6, MODEL.md's std floor of 1e-6), and these events differ there: each "
                      "such event moves the model's input by 1e6 a unit, so its outputs, and the stream's after it, are "
                      "not to be trusted; fit the normalizer on data where these features vary");
}

Normalizer ReadNormalizer(const ParamLayout& layout, std::span<const float> params) {
  const TensorSpec& mean = layout.tensor(layout.norm_mean);
  const TensorSpec& inv_std = layout.tensor(layout.norm_inv_std);
  const auto mean_values = params.subspan(mean.offset, mean.size);
  const auto inv_std_values = params.subspan(inv_std.offset, inv_std.size);
  return {{mean_values.begin(), mean_values.end()}, {inv_std_values.begin(), inv_std_values.end()}};
}

void WriteNormalizer(const ParamLayout& layout, const Normalizer& normalizer, std::span<float> params) {
  std::ranges::copy(normalizer.mean, params.subspan(layout.tensor(layout.norm_mean).offset).begin());
  std::ranges::copy(normalizer.inv_std, params.subspan(layout.tensor(layout.norm_inv_std).offset).begin());
}

std::vector<double> ClassPrior(const EventSeries& series) {
  const size_t horizons = static_cast<size_t>(series.n_horizons);
  std::vector<double> positives(horizons, 0.0), counted(horizons, 0.0);
  for (size_t i = 0; i < series.mask.size(); ++i) {
    positives[i % horizons] += series.mask[i] * series.labels[i];
    counted[i % horizons] += series.mask[i];
  }
  std::vector<double> prior(horizons);
  for (size_t h = 0; h < horizons; ++h) prior[h] = counted[h] > 0 ? positives[h] / counted[h] : 0.5;
  return prior;
}

bool ScoresALabel(std::span<const float> mask) {
  return std::any_of(mask.begin(), mask.end(), [](float m) { return m > 0; });
}

double PriorBaselineLoss(std::span<const double> prior, std::span<const float> labels, std::span<const float> mask) {
  const size_t horizons = prior.size();
  std::vector<double> logits(horizons);
  for (size_t h = 0; h < horizons; ++h) {
    const double p = std::clamp(prior[h], kMinPriorProbability, 1 - kMinPriorProbability);
    logits[h] = std::log(p / (1 - p));
  }
  double loss = 0, weight = 0;
  for (size_t i = 0; i < mask.size(); ++i) {
    loss += mask[i] * Bce<double>(logits[i % horizons], labels[i]);
    weight += mask[i];
  }
  return loss / std::max(weight, 1.0);
}

std::string CompareWithPrior(std::string_view what, double loss, double prior_loss) {
  if (!std::isfinite(loss)) {
    return absl::StrFormat("%s %f vs class-prior baseline %.5f: not finite, the model has diverged", what,
                           std::fabs(loss), prior_loss);
  }
  return absl::StrFormat("%s %.5f vs class-prior baseline %.5f (%s by %.5f)", what, loss, prior_loss,
                         loss < prior_loss ? "better" : "WORSE", std::abs(prior_loss - loss));
}

absl::StatusOr<WindowSampler> WindowSampler::Create(const EventSeries& series, int window, int warmup, uint64_t seed) {
  if (window < 1 || warmup < 0 || warmup >= window) {
    return absl::InvalidArgumentError(
        absl::StrCat("window ", window, " with warmup ", warmup, ": need 0 <= warmup < window"));
  }
  if (series.size() < static_cast<size_t>(window)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the training part (", series.size(), " events) is shorter than one window of ", window));
  }
  return WindowSampler(series, window, warmup, seed);
}

WindowSampler::WindowSampler(const EventSeries& series, int window, int warmup, uint64_t seed)
    : series_(&series), window_(window), warmup_(warmup), rng_(seed) {}

void WindowSampler::Sample(int batch, Batch& out) {
  ShapeBatch(batch, window_, *series_, out);
  const uint64_t starts = series_->size() - static_cast<size_t>(window_) + 1;
  for (int row = 0; row < batch; ++row) CopyWindow(*series_, rng_.Below(starts), warmup_, row, out);
}

void WindowSampler::Skip(int batch, int64_t batches) {
  rng_.Skip(static_cast<uint64_t>(batch) * static_cast<uint64_t>(batches));  // Below draws once a window
}

Batch SequentialWindows(const EventSeries& series, int window, int warmup, int max_windows) {
  size_t count = series.size() / static_cast<size_t>(window);
  if (max_windows > 0) count = std::min(count, static_cast<size_t>(max_windows));
  Batch out;
  ShapeBatch(static_cast<int>(count), window, series, out);
  for (size_t row = 0; row < count; ++row) {
    CopyWindow(series, row * static_cast<size_t>(window), warmup, static_cast<int>(row), out);
  }
  return out;
}

absl::Status CheckTrainingPart(const EventSeries& training) {
  if (ScoresALabel(training.mask)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the training part (", training.size(), " events) scores no label (each of its events is within a horizon of "
      "its end or a tie: its mid's mean over the horizon equals its mid): a larger --train_fraction gives it more "
      "events"));
}

absl::Status CheckValidationWindows(const Batch& validation) {
  if (validation.batch == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the validation part is shorter than one window of ", validation.window, " events"));
  }
  if (!ScoresALabel(validation.mask)) {
    return absl::InvalidArgumentError(
        "the validation part scores no label (each of its events is within a horizon of its end, in a window's "
        "warmup, or a tie: its mid's mean over the horizon equals its mid): a smaller --train_fraction gives it more "
        "events");
  }
  return absl::OkStatus();
}

}  // namespace perception
