// Training data from LOBSTER events: feature series, chronological split, normalizer, class prior, windows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/lobster.h"
#include "engine/param_layout.h"

namespace perception {

// A stream of events ready for the model: raw features (before standardization), Δt, labels and masks.
struct EventSeries {
  int n_features = 0, n_horizons = 0;
  std::vector<int> horizons;         // [H] in events; kept so that a part of the series can relabel itself
  std::vector<float> features;       // [n, F] raw (MODEL.md §1.1), float32
  std::vector<float> dt;             // [n] seconds
  std::vector<int64_t> doubled_mid;  // [n] ask_px1 + bid_px1
  std::vector<float> labels, mask;   // [n, H]

  size_t size() const { return dt.size(); }
};

// Runs the featurizer over the whole file as one stream and computes the labels (MODEL.md §1.2). Errors
// name the file line (1-based) of a bad event; horizons must be >= 1.
absl::StatusOr<EventSeries> BuildSeries(const LobsterData& data, std::span<const int> horizons);

// Chronological split: the first round(train_fraction·n) events train, the rest validate; both parts must
// be non-empty. Each part's labels are recomputed from its own mids, so no training label looks into the
// validation part (mask 0 past the part's end). The validation part's first event keeps its features and
// Δt as computed in the full stream (the daemon would have seen the earlier events).
struct SplitSeries {
  EventSeries train, validation;
};
absl::StatusOr<SplitSeries> SplitByTime(const EventSeries& series, double train_fraction);

// Per-feature standardization buffers (MODEL.md §2 step 0): inv_std = 1/max(std, 1e-6), population std,
// computed in double. An empty series gives the identity (mean 0, inv_std 1).
struct Normalizer {
  std::vector<float> mean, inv_std;
  bool operator==(const Normalizer&) const = default;
};
Normalizer FitNormalizer(const EventSeries& series);
// The normalizer a flat parameter buffer holds (its norm.mean and norm.inv_std tensors), and one written into it.
Normalizer ReadNormalizer(const ParamLayout& layout, std::span<const float> params);
void WriteNormalizer(const ParamLayout& layout, const Normalizer& normalizer, std::span<float> params);
// The features whose std fell to the 1e-6 floor: constant in the data the normalizer was fitted on. Their inv_std is
// 1e6, so a later event where one differs by a unit moves the model's input by a million, as MODEL.md §2 step 0
// defines; a user should know before training on such a fit.
std::vector<int> UnvaryingFeatures(const Normalizer& normalizer);
// A warning naming UnvaryingFeatures (LOBSTER names, for a normalizer of a LOBSTER transform's width) and what they
// do to later events; empty when every feature varied.
std::string UnvaryingFeaturesWarning(const Normalizer& normalizer, size_t fitted_events);
// A warning naming the UnvaryingFeatures that vary in `series` (a LOBSTER series the model is run on), with how many
// of its events differ from the fitted mean there: each moves the model's input by 1e6 a unit. Empty where none does.
std::string FlooredFeaturesVaryWarning(const Normalizer& normalizer, const EventSeries& series);
// OK when `mean` and `inv_std` have equal sizes and every value is finite with inv_std > 0: the normalizers the
// model can apply. INVALID_ARGUMENT naming the first feature that is not. The one check for every source of a
// normalizer (the API, a checkpoint).
absl::Status ValidateNormalizer(std::span<const float> mean, std::span<const float> inv_std);

// The largest standardized feature, |(x - mean)·inv_std|, a stream takes: up to it float32 computes MODEL.md's
// function (StreamingBackendTest.FeaturesAtTheStandardizedBoundKeepTheStateFiniteAndTheOutputsModelMds). Beyond, the
// RMSNorms' sums of squares over the embedding (|h| near 1.8e19 / sqrt(d_model)) overflow first: the scale becomes 0
// and the output finite but wrong (a review measured a relative error of 0.89 at 6.7e19), then the embedding's sums
// and products overflow to infinity and the output and the stream's state are NaN. 1e16 leaves a margin of ~100 for
// embeddings whose rows sum to a few units in absolute value (the demo's trained `small`: at most 2.4). A valid
// LOBSTER row's features stay below 1e14 before standardization (the extremes: prices near 1e10 over a mid of 1.5), so
// only a feature whose fitted std is below 0.01 can take one past it; the likeliest is one floored at 1e-6 (constant
// in the fitted sample: FlooredFeaturesVaryWarning).
inline constexpr float kMaxStandardizedFeature = 1e16f;
// OK when every feature of one event, x [F], standardizes within ±kMaxStandardizedFeature under `normalizer` (in
// float32, as the model computes it); else INVALID_ARGUMENT naming the first that does not.
absl::Status CheckStandardizedRange(const Normalizer& normalizer, std::span<const float> x);
// CheckStandardizedRange over every event of `series` (a LOBSTER series run through the model offline): its first
// refusal, named by the files' line.
absl::Status CheckSeriesStandardizedRange(const Normalizer& normalizer, const EventSeries& series);
// CheckStandardizedRange over every event of a batch's features x [B, T, F] (F the normalizer's size): its first
// refusal, named by window and event. One pass that branches only per event (137 µs for a `small` training batch of
// 786,432 features on the development machine): the daemon runs it inside ValidateBatch, off the device worker
// unless a SetNormalizer came between (ModelHost checks again).
absl::Status CheckBatchStandardizedRange(const Normalizer& normalizer, int window, std::span<const float> x);

// Whether any label of mask [n, H] (a series' or a batch's) is scored. Where none is, a masked loss reads 0 (Σ m·bce
// over max(Σ m, 1)): a perfect model, not "nothing to score".
bool ScoresALabel(std::span<const float> mask);

// Class prior per horizon: the fraction of label 1 among masked-in labels (0.5 for a horizon with none).
std::vector<double> ClassPrior(const EventSeries& series);
// The masked BCE of MODEL.md §2.7 when predicting the constant probability prior[h] (logit log(p/(1-p)))
// for every event of labels/mask [n, H] (a series' or a batch's): Σ m·bce / max(Σ m, 1). The baseline the
// model must beat. p is clamped to [1e-9, 1 - 1e-9] so that a one-class prior still gives a finite loss.
double PriorBaselineLoss(std::span<const double> prior, std::span<const float> labels, std::span<const float> mask);
// "`what` L vs class-prior baseline P (better by D)", or WORSE; a loss that is not finite says the model diverged,
// where "WORSE by nan" said nothing.
std::string CompareWithPrior(std::string_view what, double loss, double prior_loss);

// A batch as MODEL.md §1: x[B,T,F], dt[B,T], labels[B,T,H], mask[B,T,H] (float32, row-major).
struct Batch {
  int batch = 0, window = 0, n_features = 0, n_horizons = 0;
  std::vector<float> x, dt, labels, mask;
};

// Random windows of `window` consecutive events (uniform start), mask zeroed on the first `warmup` positions.
class WindowSampler {
 public:
  // Needs 1 <= window <= series.size() and 0 <= warmup < window. The sampler keeps a reference to
  // `series`, which must outlive it.
  static absl::StatusOr<WindowSampler> Create(const EventSeries& series, int window, int warmup, uint64_t seed);

  // Fills `out` with `batch` windows; it resizes `out` only when the shape changes, then reuses it.
  void Sample(int batch, Batch& out);
  // Moves on as far as `batches` calls of Sample(batch, ·) would, without copying their windows: a run resumed at
  // step S takes the batches an uninterrupted run takes from step S + 1 on.
  void Skip(int batch, int64_t batches);

 private:
  WindowSampler(const EventSeries& series, int window, int warmup, uint64_t seed);

  const EventSeries* series_;
  int window_, warmup_;
  Rng rng_;
};

// All non-overlapping windows in order (the last partial one dropped), warmup-masked: for validation.
// Needs window >= 1 and 0 <= warmup <= window; max_windows = 0 takes them all.
Batch SequentialWindows(const EventSeries& series, int window, int warmup, int max_windows = 0);
// OK when a training run's validation windows can judge it: one or more, with a scored label; INVALID_ARGUMENT naming
// the remedy otherwise (before the run, which would print a loss of 0 where no label is scored).
absl::Status CheckValidationWindows(const Batch& validation);
// OK when a training run's training part scores a label; INVALID_ARGUMENT naming the remedy otherwise (every step
// would train on a loss of 0, and the class prior read 0.5 for each horizon).
absl::Status CheckTrainingPart(const EventSeries& training);

}  // namespace perception
