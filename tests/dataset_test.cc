// Tests of the event series, chronological split, normalizer, class prior and window batches.
#include "engine/dataset.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/lobster_samples.h"

namespace perception {
namespace {

using ::testing::HasSubstr;
using testing::ShippedLobsterPath;

const std::vector<int> kDefaultHorizons = {10, 20, 50, 100, 200};

EventSeries AmznSeries(const std::vector<int>& horizons) {
  const absl::StatusOr<LobsterData> data =
      ReadLobster(ShippedLobsterPath("AMZN", "orderbook", 1), ShippedLobsterPath("AMZN", "message", 1));
  EXPECT_TRUE(data.ok()) << data.status();
  if (!data.ok()) return {};
  absl::StatusOr<EventSeries> series = BuildSeries(*data, horizons);
  EXPECT_TRUE(series.ok()) << series.status();
  return series.ok() ? *std::move(series) : EventSeries{};
}

// A synthetic series whose feature 0 is the event index, so a window's start can be read off its first row.
EventSeries IndexedSeries(int n, int n_features, int n_horizons) {
  EventSeries series;
  series.n_features = n_features;
  series.n_horizons = n_horizons;
  for (int h = 0; h < n_horizons; ++h) series.horizons.push_back(h + 1);
  for (int t = 0; t < n; ++t) {
    series.features.push_back(static_cast<float>(t));
    for (int f = 1; f < n_features; ++f) series.features.push_back(static_cast<float>(t) * 0.5f - f);
    series.dt.push_back(0.25f * static_cast<float>(t % 7));
    series.doubled_mid.push_back(20000 + (t * 37) % 11);
    for (int h = 0; h < n_horizons; ++h) {
      series.labels.push_back((t * 7 + h) % 3 == 0 ? 1.f : 0.f);
      series.mask.push_back((t + h) % 5 != 0 ? 1.f : 0.f);
    }
  }
  return series;
}

// Row `row` of a batch holds series events [start, start + window): x, dt and labels copied, mask zero on the
// first `warmup` positions and the series mask after them.
void ExpectWindow(const EventSeries& series, const Batch& batch, int row, size_t start, int warmup) {
  const size_t f_count = static_cast<size_t>(series.n_features), h_count = static_cast<size_t>(series.n_horizons);
  for (size_t p = 0; p < static_cast<size_t>(batch.window); ++p) {
    SCOPED_TRACE("row " + std::to_string(row) + " position " + std::to_string(p));
    const size_t event = start + p, position = static_cast<size_t>(row) * batch.window + p;
    for (size_t f = 0; f < f_count; ++f) {
      ASSERT_EQ(batch.x[position * f_count + f], series.features[event * f_count + f]);
    }
    ASSERT_EQ(batch.dt[position], series.dt[event]);
    for (size_t h = 0; h < h_count; ++h) {
      ASSERT_EQ(batch.labels[position * h_count + h], series.labels[event * h_count + h]);
      const float expected_mask = p < static_cast<size_t>(warmup) ? 0.f : series.mask[event * h_count + h];
      ASSERT_EQ(batch.mask[position * h_count + h], expected_mask);
    }
  }
}

float Sum(const std::vector<float>& values) {
  float total = 0;
  for (float v : values) total += v;
  return total;
}

TEST(BuildSeries, AmznDay) {
  const EventSeries series = AmznSeries({1, 2, 3, 10});
  ASSERT_EQ(series.size(), 57515u);
  EXPECT_EQ(series.n_features, 12);
  EXPECT_EQ(series.n_horizons, 4);
  ASSERT_EQ(series.features.size(), 57515u * 12);
  ASSERT_EQ(series.labels.size(), 57515u * 4);
  ASSERT_EQ(series.mask.size(), 57515u * 4);
  // Line 2: ask 2239500, bid 2238100 after ask 2239500, bid 2231800: doubled mid 4477600; return
  // (4477600/4471300 - 1)*1e4 = 14.08986200881257; Δt = 34200.18960767 - 34200.017459617 = 0.172148053 s.
  EXPECT_EQ(series.doubled_mid[1], 4477600);
  EXPECT_FLOAT_EQ(series.features[12 + 5], 14.08986200881257);
  EXPECT_FLOAT_EQ(series.dt[1], 0.172148053f);
  EXPECT_EQ(series.dt[0], 0.f);
  // Line 76 (see lobster_test): doubled mid 4480800, labels down / equal (masked) / up / down.
  EXPECT_EQ(series.doubled_mid[75], 4480800);
  EXPECT_EQ(std::vector<float>(series.labels.begin() + 300, series.labels.begin() + 304),
            (std::vector<float>{0, 0, 1, 0}));
  EXPECT_EQ(std::vector<float>(series.mask.begin() + 300, series.mask.begin() + 304), (std::vector<float>{1, 0, 1, 1}));
}

TEST(BuildSeries, AaplHasFortyEightFeatures) {
  const absl::StatusOr<LobsterData> data =
      ReadLobster(ShippedLobsterPath("AAPL", "orderbook", 10), ShippedLobsterPath("AAPL", "message", 10));
  ASSERT_TRUE(data.ok()) << data.status();
  const absl::StatusOr<EventSeries> series = BuildSeries(*data, kDefaultHorizons);
  ASSERT_TRUE(series.ok()) << series.status();
  EXPECT_EQ(series->size(), 999u);  // 999 lines; the last has no final newline, so `wc -l` says 998
  EXPECT_EQ(series->n_features, 48);
  // Line 4: mid return (5856200/5856350 - 1)*1e4 = -0.25613223253340145 at feature 4·10 + 1.
  EXPECT_FLOAT_EQ(series->features[3 * 48 + 41], -0.25613223253340145);
  // Horizon 200 at line 799 (t = 798, t+200 = 998, the last event): doubled mid 11712700, the next 200 sum to
  // 2341851500 < 200*11712700 = 2342540000: down. Line 800 on have no full future.
  EXPECT_EQ(series->mask[798 * 5 + 4], 1.f);
  EXPECT_EQ(series->labels[798 * 5 + 4], 0.f);
  EXPECT_EQ(series->mask[799 * 5 + 4], 0.f);
}

// Three level-1 events built in memory; the third has bid >= ask.
LobsterData CrossedThirdEvent() {
  LobsterData data;
  data.levels = 1;
  data.book = {2239500, 100, 2231800, 100, 2239500, 100, 2238100, 21, 2238100, 100, 2238100, 21};
  data.messages = {{1.0, 1, 1, 1, 1, 1}, {2.0, 1, 2, 1, 1, 1}, {3.0, 1, 3, 1, 1, 1}};
  return data;
}

TEST(BuildSeries, NamesTheLineOfABadEvent) {
  LobsterData data = CrossedThirdEvent();
  const absl::StatusOr<EventSeries> in_memory = BuildSeries(data, kDefaultHorizons);
  EXPECT_EQ(in_memory.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(in_memory.status().message(), HasSubstr("line 3: no mid"));

  data.orderbook_path = "book.csv";
  data.message_path = "messages.csv";
  const absl::StatusOr<EventSeries> from_files = BuildSeries(data, kDefaultHorizons);
  EXPECT_THAT(from_files.status().message(), HasSubstr("book.csv:3 (message messages.csv:3): no mid"));
}

TEST(BuildSeries, RejectsBadHorizonsAndInconsistentData) {
  LobsterData data = CrossedThirdEvent();
  data.book.resize(8);  // two events, three messages
  EXPECT_THAT(BuildSeries(data, kDefaultHorizons).status().message(),
              HasSubstr("1 levels and 3 messages has 8 book values"));
  data.messages.pop_back();
  EXPECT_TRUE(BuildSeries(data, kDefaultHorizons).ok());
  EXPECT_THAT(BuildSeries(data, std::vector<int>{10, 0}).status().message(), HasSubstr("horizon 0"));
  EXPECT_THAT(BuildSeries(data, std::vector<int>{}).status().message(), HasSubstr("no label horizons"));
}

TEST(SplitByTime, AmznSplitRelabelsTheTrainingPart) {
  const EventSeries full = AmznSeries(kDefaultHorizons);
  const absl::StatusOr<SplitSeries> split = SplitByTime(full, 0.75);
  ASSERT_TRUE(split.ok()) << split.status();
  const EventSeries& train = split->train;
  const EventSeries& validation = split->validation;
  // round(0.75 * 57515) = round(43136.25) = 43136 training events, 14379 validation events.
  ASSERT_EQ(train.size(), 43136u);
  ASSERT_EQ(validation.size(), 14379u);
  ASSERT_EQ(train.labels.size(), 43136u * 5);
  ASSERT_EQ(validation.mask.size(), 14379u * 5);

  for (size_t h = 0; h < 5; ++h) {
    const size_t k = static_cast<size_t>(kDefaultHorizons[h]);
    SCOPED_TRACE("horizon " + std::to_string(k));
    // The last k training events would need validation mids: all masked, though the full series labels them all.
    size_t masked_in_full = 0;
    for (size_t t = 43136 - k; t < 43136; ++t) {
      EXPECT_EQ(train.mask[t * 5 + h], 0.f);
      masked_in_full += full.mask[t * 5 + h] != 0.f;
    }
    EXPECT_EQ(masked_in_full, k);
    // Earlier training events keep the full series' labels.
    for (size_t t = 0; t < 43136 - k; ++t) {
      ASSERT_EQ(train.mask[t * 5 + h], full.mask[t * 5 + h]) << t;
      ASSERT_EQ(train.labels[t * 5 + h], full.labels[t * 5 + h]) << t;
    }
  }
  // Event 43125 (t = n_train - 11), horizon 10: its future ends at the last training event: labelled up.
  EXPECT_EQ(train.mask[43125 * 5], 1.f);
  EXPECT_EQ(train.labels[43125 * 5], 1.f);
  // The validation part starts mid-stream: its first event keeps the full stream's Δt
  // 53219.768688617 - 53219.768386744 = 0.000301873 s (not the 0 of a first event), and its labels are unchanged.
  EXPECT_FLOAT_EQ(validation.dt[0], 0.000301873f);
  EXPECT_EQ(std::vector<float>(validation.features.begin(), validation.features.begin() + 12),
            std::vector<float>(full.features.begin() + 43136 * 12, full.features.begin() + 43137 * 12));
  EXPECT_EQ(validation.labels, std::vector<float>(full.labels.begin() + 43136 * 5, full.labels.end()));
  EXPECT_EQ(validation.mask, std::vector<float>(full.mask.begin() + 43136 * 5, full.mask.end()));
  EXPECT_EQ(validation.doubled_mid[0], full.doubled_mid[43136]);
}

TEST(SplitByTime, RejectsFractionsThatLeaveAnEmptyPart) {
  const EventSeries series = IndexedSeries(4, 2, 1);
  for (double fraction : {0.0, 1.0, -0.5, 1.5, std::nan(""), 0.1, 0.9}) {
    const absl::StatusOr<SplitSeries> split = SplitByTime(series, fraction);
    EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument) << fraction;
    EXPECT_THAT(split.status().message(), HasSubstr("leaves an empty part")) << fraction;
  }
  // 4 events at 0.5: two and two.
  const absl::StatusOr<SplitSeries> halves = SplitByTime(series, 0.5);
  ASSERT_TRUE(halves.ok()) << halves.status();
  EXPECT_EQ(halves->train.size(), 2u);
  EXPECT_EQ(halves->validation.size(), 2u);
}

TEST(SplitByTime, NeedsTheHorizonsToRelabel) {
  EventSeries series = IndexedSeries(4, 2, 1);
  series.horizons.clear();
  EXPECT_THAT(SplitByTime(series, 0.5).status().message(), HasSubstr("n_horizons 1 but 0 horizons"));
}

TEST(FitNormalizer, HandMadeSeries) {
  EventSeries series;
  series.n_features = 2;
  // Feature 0: 1, 2, 6 (mean 3, population variance (4 + 1 + 9)/3 = 14/3, std 2.160246899469287,
  // 1/std = 0.4629100498862757). Feature 1: constant 5 (std 0, so inv_std = 1/1e-6).
  series.features = {1, 5, 2, 5, 6, 5};
  series.dt = {0, 1, 1};
  const Normalizer normalizer = FitNormalizer(series);
  ASSERT_EQ(normalizer.mean.size(), 2u);
  ASSERT_EQ(normalizer.inv_std.size(), 2u);
  EXPECT_FLOAT_EQ(normalizer.mean[0], 3.0);
  EXPECT_FLOAT_EQ(normalizer.inv_std[0], 0.4629100498862757);
  EXPECT_FLOAT_EQ(normalizer.mean[1], 5.0);
  EXPECT_FLOAT_EQ(normalizer.inv_std[1], 1e6);
}

TEST(FitNormalizer, EmptySeriesIsTheIdentity) {
  EventSeries series;
  series.n_features = 3;
  const Normalizer normalizer = FitNormalizer(series);
  EXPECT_EQ(normalizer.mean, std::vector<float>(3, 0.f));
  EXPECT_EQ(normalizer.inv_std, std::vector<float>(3, 1.f));
}

TEST(CheckStandardizedRange, RefusesAFeatureThatStandardizesBeyondTheBoundOrOverflows) {
  const Normalizer normalizer{{0.f, 10.f, 0.f}, {1.f, 2.f, 1e6f}};
  const float bound = kMaxStandardizedFeature;
  EXPECT_TRUE(CheckStandardizedRange(normalizer, std::vector<float>{bound, 10.f - bound / 2, -bound / 1e6f}).ok());
  const absl::Status beyond = CheckStandardizedRange(normalizer, std::vector<float>{0.f, 10.f - bound, 0.f});
  EXPECT_EQ(beyond.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(beyond.message(), HasSubstr("feature 1 is -1e+16, -2e+16 standard deviations from the model's "
                                          "normalizer mean; a feature must stay within 1e+16 of it"));
  // Finite, but infinite once standardized in float32, as the model computes it.
  EXPECT_THAT(CheckStandardizedRange(normalizer, std::vector<float>{0.f, 3e38f, 0.f}).message(),
              HasSubstr("feature 1 is 3e+38, inf standard deviations"));
}

// perception eval runs a whole file through the model: it refuses one whose event standardizes beyond the bound,
// naming the line, as the daemon refuses that event streamed (the logits from it on would not be MODEL.md's).
TEST(CheckStandardizedRange, ASeriesIsRefusedAtItsFirstEventBeyondTheBound) {
  EventSeries series;
  series.n_features = 3;
  series.features = {0.f, 1.f, 2.f, 0.f, 1.f, 2.f, 0.f, 5e16f, 2.f, 0.f, -5e16f, 0.f};
  series.dt = {0.f, 1.f, 1.f, 1.f};
  const Normalizer identity{{0.f, 0.f, 0.f}, {1.f, 1.f, 1.f}};
  const absl::Status refused = CheckSeriesStandardizedRange(identity, series);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("line 3 of the LOBSTER files: feature 1 is 5e+16"));
  series.features[7] = 5e15f;
  series.features[10] = -5e15f;
  EXPECT_TRUE(CheckSeriesStandardizedRange(identity, series).ok());
}

// A batch [B, T, F] is refused at its first event beyond the bound, named by window and event; one within it passes.
TEST(CheckStandardizedRange, ABatchIsRefusedAtItsFirstEventBeyondTheBoundByWindowAndEvent) {
  const Normalizer normalizer{{1.f, -2.f}, {0.5f, 1e6f}};
  constexpr int kWindows = 3, kWindow = 4;
  std::mt19937 rng(29);
  std::normal_distribution<float> noise(0.f, 3.f);
  std::vector<float> x(kWindows * kWindow * 2);
  for (float& value : x) value = noise(rng);
  EXPECT_TRUE(CheckBatchStandardizedRange(normalizer, kWindow, x).ok());
  x[(1 * kWindow + 3) * 2 + 1] = 2e10f;  // window 1, event 3, feature 1: 2e16 standardized
  x[(2 * kWindow + 0) * 2 + 0] = 5e16f;  // a later one, not the first
  const absl::Status refused = CheckBatchStandardizedRange(normalizer, kWindow, x);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("batch window 1, event 3: feature 1 is 2e+10, 2e+16 standard deviations"));
  x[(1 * kWindow + 3) * 2 + 1] = 9e9f;  // 9e15 standardized: within
  EXPECT_THAT(CheckBatchStandardizedRange(normalizer, kWindow, x).message(),
              HasSubstr("batch window 2, event 0: feature 0 is 5e+16, 2.5e+16 standard deviations"));
}

// The features of a valid book row are bounded (prices below 1e10, a mid of at least 1.5): under a normalizer whose
// every std fell to the 1e-6 floor, the most extreme rows standardize past 1e19, where float32's norms no longer
// compute MODEL.md's function; they are refused there (before, with a bound of 1e24, they passed and gave outputs a
// review found wrong by 89%). Under a normalizer fitted where those large features vary (a std of 1,000), they pass.
TEST(CheckStandardizedRange, TheMostExtremeValidBookRowsAreRefusedOnlyWhereAPriceStdIsFloored) {
  LobsterFeaturizer featurizer(2);
  const int F = featurizer.n_features();
  const Normalizer floor{std::vector<float>(F, 0.f), std::vector<float>(F, 1e6f)};
  Normalizer prices_fitted = floor;
  const int64_t far = kEmptyAskPrice - 1, most = int64_t{1} << 53;
  const LobsterMessage message{.time = 1.0, .type = 1, .size = 1, .price = 2, .direction = -1};
  // Level 1 at the lowest mid, level 2 at the highest prices; then the mid jumps to the highest there is.
  const std::vector<std::vector<int64_t>> rows = {{2, most, 1, most, far, most, kEmptyBidPrice, 0},
                                                  {far, 0, far - 1, most, kEmptyAskPrice, 0, 1, 7}};
  std::vector<std::vector<float>> features;
  for (const std::vector<int64_t>& row : rows) {
    std::vector<float> x(F);
    ASSERT_TRUE(featurizer.Next(row, message, x).ok());
    EXPECT_GT(*std::ranges::max_element(x, {}, [](float v) { return std::fabs(v); }), 1e13f) << "not extreme";
    for (int f = 0; f < F; ++f) {
      if (std::fabs(x[f]) > 1e6f) prices_fitted.inv_std[f] = 1e-3f;  // a std of 1,000 bps, say
    }
    features.push_back(x);
  }
  for (const std::vector<float>& x : features) {
    const absl::Status refused = CheckStandardizedRange(floor, x);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_THAT(refused.message(), HasSubstr("a feature must stay within 1e+16 of it"));
    EXPECT_TRUE(CheckStandardizedRange(prices_fitted, x).ok()) << CheckStandardizedRange(prices_fitted, x);
  }
}

TEST(UnvaryingFeatures, TheAaplTrainingPartHasNoPartialCancellation) {
  // The shipped AAPL sample holds no type-2 message (a partial cancellation), so that one-hot column is constant in
  // its training part (699 events): a normalizer fitted there standardizes a later type-2 event to 1e6, and training
  // should say so. With one such event among those fitted, every feature varies.
  const absl::StatusOr<LobsterData> data =
      ReadLobster(ShippedLobsterPath("AAPL", "orderbook", 10), ShippedLobsterPath("AAPL", "message", 10));
  ASSERT_TRUE(data.ok()) << data.status();
  const absl::StatusOr<EventSeries> series = BuildSeries(*data, kDefaultHorizons);
  ASSERT_TRUE(series.ok()) << series.status();
  const absl::StatusOr<SplitSeries> split = SplitByTime(*series, 0.7);
  ASSERT_TRUE(split.ok()) << split.status();
  const Normalizer fitted = FitNormalizer(split->train);
  EXPECT_EQ(UnvaryingFeatures(fitted), std::vector<int>{4 * 10 + 3});
  EXPECT_THAT(UnvaryingFeaturesWarning(fitted, split->train.size()),
              HasSubstr("feature(s) type2 never vary in the 699 events"));
  EventSeries with_partial_cancel = split->train;
  with_partial_cancel.features[100 * 48 + 4 * 10 + 3] = 1.f;
  const Normalizer varied = FitNormalizer(with_partial_cancel);
  EXPECT_TRUE(UnvaryingFeatures(varied).empty());
  EXPECT_EQ(UnvaryingFeaturesWarning(varied, with_partial_cancel.size()), "");
}

// Evaluating such a model on data where the floored feature varies said nothing, while each event there moves the
// model's input by 1e6 a unit (a review moved a logit from -0.40 to +0.46 by one message's type).
TEST(UnvaryingFeatures, AModelRunWhereAFlooredFeatureVariesIsWarned) {
  const absl::StatusOr<LobsterData> data =
      ReadLobster(ShippedLobsterPath("AAPL", "orderbook", 10), ShippedLobsterPath("AAPL", "message", 10));
  ASSERT_TRUE(data.ok()) << data.status();
  absl::StatusOr<EventSeries> series = BuildSeries(*data, kDefaultHorizons);
  ASSERT_TRUE(series.ok()) << series.status();
  const Normalizer fitted = FitNormalizer(*series);
  EXPECT_EQ(FlooredFeaturesVaryWarning(fitted, *series), "") << "the data it was fitted on";
  for (const size_t event : {500, 600}) series->features[event * 48 + 4 * 10 + 3] = 1.f;
  EXPECT_THAT(FlooredFeaturesVaryWarning(fitted, *series),
              HasSubstr("the model's normalizer was fitted where feature(s) type2 (2 events) never varied (inv_std "
                        "1e6"));
}

// ReadNormalizer takes back what WriteNormalizer put in a parameter buffer, and touches nothing else.
TEST(Normalizer, WrittenIntoParametersReadsBack) {
  const ModelConfig config = *NamedConfig("tiny");
  const ParamLayout layout(config);
  std::vector<float> params(layout.total_size(), 0.5f);
  const Normalizer normalizer{{1, 2, 3, 4, 5, 6}, {0.75f, 0.25f, 2, 4, 8, 1e6f}};
  WriteNormalizer(layout, normalizer, params);
  const Normalizer read = ReadNormalizer(layout, params);
  EXPECT_EQ(read.mean, normalizer.mean);
  EXPECT_EQ(read.inv_std, normalizer.inv_std);
  EXPECT_EQ(std::count(params.begin(), params.end(), 0.5f), static_cast<long>(params.size()) - 12);
}

TEST(LobsterFeatureName, FollowsTheTransformsOrder) {
  EXPECT_EQ(LobsterFeatureName(0, 1), "ask_px1");
  EXPECT_EQ(LobsterFeatureName(3, 1), "bid_sz1");
  EXPECT_EQ(LobsterFeatureName(4, 1), "imbalance");
  EXPECT_EQ(LobsterFeatureName(11, 1), "direction");
  EXPECT_EQ(LobsterFeatureName(37, 10), "ask_sz10");
  EXPECT_EQ(LobsterFeatureName(45, 10), "type4");
  EXPECT_EQ(LobsterFeatureName(48, 10), "feature 48");
}

// Four events, two horizons. Horizon 0: labels 1, 0, 1, (1 masked out); horizon 1: labels 0, 0, 1, 0.
EventSeries PriorSeries() {
  EventSeries series;
  series.n_features = 1;
  series.n_horizons = 2;
  series.features = {0, 0, 0, 0};
  series.dt = {0, 0, 0, 0};
  series.labels = {1, 0, 0, 0, 1, 1, 1, 0};
  series.mask = {1, 1, 1, 1, 1, 1, 0, 1};
  return series;
}

TEST(ClassPrior, FractionOfPositivesAmongMaskedInLabels) {
  const std::vector<double> prior = ClassPrior(PriorSeries());
  ASSERT_EQ(prior.size(), 2u);
  EXPECT_DOUBLE_EQ(prior[0], 2.0 / 3);  // 2 ups among 3 masked-in labels
  EXPECT_DOUBLE_EQ(prior[1], 1.0 / 4);  // 1 up among 4
}

TEST(ClassPrior, HorizonWithoutLabelsIsEven) {
  EventSeries series = PriorSeries();
  for (size_t i = 1; i < series.mask.size(); i += 2) series.mask[i] = 0;
  const std::vector<double> prior = ClassPrior(series);
  EXPECT_DOUBLE_EQ(prior[0], 2.0 / 3);
  EXPECT_DOUBLE_EQ(prior[1], 0.5);
}

TEST(PriorBaselineLoss, HandComputed) {
  const EventSeries series = PriorSeries();
  const std::vector<double> prior = {2.0 / 3, 1.0 / 4};
  // bce(log(p/(1-p)), y) = -log p for y = 1 and -log(1-p) for y = 0. Horizon 0 (p = 2/3): 2·log(3/2) + log 3;
  // horizon 1 (p = 1/4): 3·log(4/3) + log 4. The sum is log(9/4 · 3 · 64/27 · 4) = log 64 over 7 masked-in labels:
  // log(64)/7 = 4.1588830833596715/7 = 0.5941261547656673.
  EXPECT_NEAR(PriorBaselineLoss(prior, series.labels, series.mask), 0.5941261547656673, 1e-12);
  // On another series: every label up, every mask in. -(4·log(2/3) + 4·log(1/4))/8 = (log 1.5 + log 4)/2 = log(6)/2.
  EventSeries all_up = series;
  all_up.labels.assign(8, 1.f);
  all_up.mask.assign(8, 1.f);
  EXPECT_NEAR(PriorBaselineLoss(prior, all_up.labels, all_up.mask), 0.8958797346140275, 1e-12);
}

TEST(PriorBaselineLoss, OneClassPriorStaysFinite) {
  const EventSeries series = PriorSeries();
  const double loss = PriorBaselineLoss(std::vector<double>{1.0, 0.0}, series.labels, series.mask);
  EXPECT_TRUE(std::isfinite(loss));
  // Clamped to 1e-9 either side: the two wrong labels (horizon 0's down, horizon 1's up) cost -log(1e-9) = 20.72 each.
  EXPECT_NEAR(loss, 2 * 20.72326583694641 / 7, 1e-6);
}

TEST(CompareWithPrior, SaysBetterOrWorseAndNamesADivergedModel) {
  EXPECT_EQ(CompareWithPrior("validation loss", 0.6, 0.69), "validation loss 0.60000 vs class-prior baseline 0.69000 (better by 0.09000)");
  EXPECT_EQ(CompareWithPrior("validation loss", 0.7, 0.69), "validation loss 0.70000 vs class-prior baseline 0.69000 (WORSE by 0.01000)");
  for (const double diverged : {std::nan(""), -std::nan(""), double{INFINITY}}) {
    EXPECT_THAT(CompareWithPrior("validation loss", diverged, 0.69),
                ::testing::MatchesRegex("validation loss (nan|inf) vs class-prior baseline 0.69000: not finite, the "
                                        "model has diverged"));
  }
}

TEST(WindowSampler, WindowsAreConsecutiveEventsWithWarmupMasked) {
  const EventSeries series = IndexedSeries(200, 3, 2);
  absl::StatusOr<WindowSampler> sampler = WindowSampler::Create(series, 16, 4, 7);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  Batch batch;
  sampler->Sample(8, batch);
  EXPECT_EQ(batch.batch, 8);
  EXPECT_EQ(batch.window, 16);
  EXPECT_EQ(batch.n_features, 3);
  EXPECT_EQ(batch.n_horizons, 2);
  ASSERT_EQ(batch.x.size(), 8u * 16 * 3);
  ASSERT_EQ(batch.dt.size(), 8u * 16);
  ASSERT_EQ(batch.labels.size(), 8u * 16 * 2);
  ASSERT_EQ(batch.mask.size(), 8u * 16 * 2);
  for (int row = 0; row < 8; ++row) {
    const float start = batch.x[static_cast<size_t>(row) * 16 * 3];
    ASSERT_GE(start, 0.f);
    ASSERT_LE(start, 200.f - 16);
    ExpectWindow(series, batch, row, static_cast<size_t>(start), 4);
  }
  EXPECT_GT(Sum(batch.mask), 0.f);
  EXPECT_GT(Sum(batch.labels), 0.f);
}

TEST(WindowSampler, AmznWindowsMatchTheSeries) {
  const EventSeries series = AmznSeries(kDefaultHorizons);
  absl::StatusOr<WindowSampler> sampler = WindowSampler::Create(series, 64, 16, 2024);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  Batch batch;
  sampler->Sample(4, batch);
  // Real features repeat, so find each row's start by its dt and features, then compare the whole window.
  for (int row = 0; row < 4; ++row) {
    size_t matches = 0;
    for (size_t start = 0; start + 64 <= series.size(); ++start) {
      if (std::equal(batch.dt.begin() + row * 64, batch.dt.begin() + (row + 1) * 64, series.dt.begin() + start) &&
          std::equal(batch.x.begin() + row * 64 * 12, batch.x.begin() + (row + 1) * 64 * 12,
                     series.features.begin() + start * 12)) {
        ExpectWindow(series, batch, row, start, 16);
        ++matches;
      }
    }
    EXPECT_EQ(matches, 1u) << "row " << row;
  }
}

TEST(WindowSampler, DeterministicForASeedAndDifferentForAnother) {
  const EventSeries series = IndexedSeries(500, 2, 1);
  absl::StatusOr<WindowSampler> first = WindowSampler::Create(series, 8, 2, 42);
  absl::StatusOr<WindowSampler> again = WindowSampler::Create(series, 8, 2, 42);
  absl::StatusOr<WindowSampler> other = WindowSampler::Create(series, 8, 2, 43);
  ASSERT_TRUE(first.ok() && again.ok() && other.ok());
  Batch a, b, c;
  for (int draw = 0; draw < 3; ++draw) {
    first->Sample(16, a);
    again->Sample(16, b);
    other->Sample(16, c);
    EXPECT_EQ(a.x, b.x);
    EXPECT_EQ(a.mask, b.mask);
    EXPECT_NE(a.x, c.x);
  }
}

// A resumed offline run skips the batches of the steps its checkpoint holds: the batch it takes next is the one an
// uninterrupted run takes there, window for window, whatever the batches skipped.
TEST(WindowSampler, SkippingBatchesLeavesItWhereSamplingThemWould) {
  const EventSeries series = IndexedSeries(500, 2, 1);
  for (const int64_t skipped : {int64_t{0}, int64_t{1}, int64_t{7}}) {
    absl::StatusOr<WindowSampler> sampling = WindowSampler::Create(series, 8, 2, 42);
    absl::StatusOr<WindowSampler> skipping = WindowSampler::Create(series, 8, 2, 42);
    ASSERT_TRUE(sampling.ok() && skipping.ok());
    Batch sampled, next;
    for (int64_t i = 0; i < skipped; ++i) sampling->Sample(16, sampled);
    skipping->Skip(16, skipped);
    for (int draw = 0; draw < 2; ++draw) {
      sampling->Sample(16, sampled);
      skipping->Sample(16, next);
      EXPECT_EQ(next.x, sampled.x) << "skipped " << skipped << ", draw " << draw;
      EXPECT_EQ(next.mask, sampled.mask) << "skipped " << skipped << ", draw " << draw;
    }
  }
}

TEST(WindowSampler, ReusesTheBatchAndReachesEveryStart) {
  const EventSeries series = IndexedSeries(10, 2, 1);  // window 8: starts 0, 1 and 2
  absl::StatusOr<WindowSampler> sampler = WindowSampler::Create(series, 8, 3, 5);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  Batch batch;
  sampler->Sample(4, batch);
  const float* storage = batch.x.data();
  std::set<float> starts;
  for (int draw = 0; draw < 25; ++draw) {
    sampler->Sample(4, batch);
    EXPECT_EQ(batch.x.data(), storage);
    for (int row = 0; row < 4; ++row) starts.insert(batch.x[static_cast<size_t>(row) * 8 * 2]);
  }
  EXPECT_EQ(starts, (std::set<float>{0, 1, 2}));
}

TEST(WindowSampler, CreateRejectsImpossibleWindows) {
  const EventSeries series = IndexedSeries(10, 2, 1);
  EXPECT_THAT(WindowSampler::Create(series, 11, 2, 1).status().message(),
              HasSubstr("the training part (10 events) is shorter than one window of 11"));
  EXPECT_EQ(WindowSampler::Create(series, 0, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(WindowSampler::Create(series, 8, 8, 1).status().message(), HasSubstr("need 0 <= warmup < window"));
  EXPECT_EQ(WindowSampler::Create(series, 8, -1, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(WindowSampler::Create(series, 10, 9, 1).ok());
}

TEST(SequentialWindows, NonOverlappingInOrderWithThePartialOneDropped) {
  const EventSeries series = IndexedSeries(50, 3, 2);
  const Batch all = SequentialWindows(series, 16, 5);
  ASSERT_EQ(all.batch, 3);  // 50 = 3·16 + 2: the last two events are dropped
  EXPECT_EQ(all.window, 16);
  ASSERT_EQ(all.x.size(), 3u * 16 * 3);
  for (int row = 0; row < 3; ++row) ExpectWindow(series, all, row, static_cast<size_t>(row) * 16, 5);
  EXPECT_GT(Sum(all.mask), 0.f);

  const Batch two = SequentialWindows(series, 16, 5, 2);
  ASSERT_EQ(two.batch, 2);
  EXPECT_EQ(two.x, std::vector<float>(all.x.begin(), all.x.begin() + 2 * 16 * 3));
  EXPECT_EQ(SequentialWindows(series, 51, 0).batch, 0);
}

// Train's checks of its validation part: one window at least (the message names its length), and a label scored.
TEST(CheckValidationWindows, RefusesNoWindowAndNoScoredLabel) {
  const EventSeries series = IndexedSeries(50, 3, 2);
  const absl::Status none = CheckValidationWindows(SequentialWindows(series, 51, 0));
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.message(), HasSubstr("the validation part is shorter than one window of 51 events"));
  Batch unscored = SequentialWindows(series, 16, 5);
  EXPECT_TRUE(CheckValidationWindows(unscored).ok());
  std::fill(unscored.mask.begin(), unscored.mask.end(), 0.f);
  EXPECT_THAT(CheckValidationWindows(unscored).message(), HasSubstr("the validation part scores no label"));
}

// A training part that scores no label trained every step on a loss of 0 (and its class prior read 0.5), exiting 0.
TEST(CheckTrainingPart, RefusesAPartThatScoresNoLabel) {
  EventSeries series = IndexedSeries(50, 3, 2);
  EXPECT_TRUE(CheckTrainingPart(series).ok());
  std::fill(series.mask.begin(), series.mask.end(), 0.f);
  const absl::Status refused = CheckTrainingPart(series);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("the training part (50 events) scores no label"));
  EXPECT_THAT(refused.message(), HasSubstr("a larger --train_fraction"));
}

}  // namespace
}  // namespace perception
