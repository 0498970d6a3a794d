// The CPU reference against itself: finite-difference gradients in double, step path ≡ sequence path,
// carried state ≡ whole window, float ≡ double, loss and conviction by hand.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>

#include "engine/cpu_reference.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using testing::MakeRandomBatch;
using testing::RandomParams;
using testing::RandomState;
using testing::RelativeError;
using testing::ToDouble;

// Fourth-order central difference (f(−2h) − 8f(−h) + 8f(h) − f(2h)) / 12h: truncation O(h⁴), so h can be large
// enough that rounding in the loss (~1e-16) stays far below the 1e-6 bar even for the smallest gradients.
template <typename Fn>
double CentralDifference(Fn loss_shifted_by) {
  constexpr double h = 1e-4;
  return (loss_shifted_by(-2 * h) - 8 * loss_shifted_by(-h) + 8 * loss_shifted_by(h) - loss_shifted_by(2 * h)) /
         (12 * h);
}

// Central differences of the double loss for every trained scalar and every input feature.
class GradientCheck : public ::testing::TestWithParam<bool> {};

TEST_P(GradientCheck, EveryTensorAndTheInputsMatchCentralDifferences) {
  const bool carried_state = GetParam();
  const ModelConfig config = *NamedConfig("tiny");
  ParamLayout layout(config);
  CpuReference<double> model(layout, 1);
  std::vector<double> params = ToDouble(RandomParams(layout, 11));
  const int B = 2, T = config.window;
  auto data = MakeRandomBatch(config, B, T, 12).As<double>();
  std::vector<StreamState<double>> initial;
  for (int b = 0; b < B; ++b) initial.push_back(RandomState<double>(config, 13 + b));

  auto loss_at = [&](const std::vector<double>& p, const std::vector<double>& x) {
    auto states = initial;
    std::vector<double> grads(layout.total_size());
    BatchView<double> view{B, T, x, data.dt, data.labels, data.mask};
    return model.LossAndGradients(p, view, grads, {},
                                  carried_state ? std::span<StreamState<double>>(states)
                                                : std::span<StreamState<double>>());
  };
  auto states = initial;
  std::vector<double> grads(layout.total_size()), dx(data.x.size());
  const double loss = model.LossAndGradients(
      params, data.view(B, T), grads, dx,
      carried_state ? std::span<StreamState<double>>(states) : std::span<StreamState<double>>());
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, loss_at(params, data.x), 1e-15);

  for (const TensorSpec& t : layout.tensors()) {
    if (!t.trained) continue;
    std::vector<double> numeric(t.size), analytic(grads.begin() + t.offset, grads.begin() + t.offset + t.size);
    for (size_t i = 0; i < t.size; ++i) {
      numeric[i] = CentralDifference([&](double delta) {
        std::vector<double> p = params;
        p[t.offset + i] += delta;
        return loss_at(p, data.x);
      });
    }
    EXPECT_LE(RelativeError(analytic, numeric), 1e-6) << t.name;
  }
  std::vector<double> numeric(data.x.size());
  for (size_t i = 0; i < data.x.size(); ++i) {
    numeric[i] = CentralDifference([&](double delta) {
      std::vector<double> x = data.x;
      x[i] += delta;
      return loss_at(params, x);
    });
  }
  EXPECT_LE(RelativeError(dx, numeric), 1e-6) << "input features";
  for (size_t i = 0; i < layout.trained_begin(); ++i) EXPECT_EQ(grads[i], 0.0) << "normalizer buffers get no gradient";
}

INSTANTIATE_TEST_SUITE_P(ZeroAndCarriedState, GradientCheck, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "carried" : "zero"; });

// One event at a time through the step path gives the sequence path's logits at every position.
template <typename T>
void ExpectStepMatchesSequence(const std::string& name, double tolerance) {
  const ModelConfig config = *NamedConfig(name);
  ParamLayout layout(config);
  CpuReference<T> model(layout);
  const auto params32 = RandomParams(layout, 21);
  const std::vector<T> params(params32.begin(), params32.end());
  const int B = 2, T_ = config.window, F = config.n_features, H = config.n_horizons;
  auto data = MakeRandomBatch(config, B, T_, 22).As<T>();
  std::vector<T> logits(static_cast<size_t>(B) * T_ * H);
  std::vector<StreamState<T>> seq_states = {StreamState<T>::Zero(config), RandomState<T>(config, 23)};
  const std::vector<StreamState<T>> initial = seq_states;
  model.Forward(params, data.view(B, T_), logits, seq_states);
  for (int b = 0; b < B; ++b) {
    StreamState<T> state = initial[b];
    std::vector<T> stepped(static_cast<size_t>(T_) * H);
    for (int t = 0; t < T_; ++t) {
      const size_t event = static_cast<size_t>(b) * T_ + t;
      model.Step(params, std::span<const T>(data.x).subspan(event * F, F), data.dt[event], state,
                 std::span<T>(stepped).subspan(static_cast<size_t>(t) * H, H));
      const std::span<const T> seq_t(logits.data() + event * H, H);
      ASSERT_LE(RelativeError(std::span<const T>(stepped).subspan(t * H, H), seq_t), tolerance)
          << name << " stream " << b << " position " << t;
    }
    EXPECT_LE(RelativeError(state.conv, seq_states[b].conv), tolerance);
    EXPECT_LE(RelativeError(state.ssm, seq_states[b].ssm), tolerance);
    EXPECT_LE(RelativeError(state.cfc, seq_states[b].cfc), tolerance);
  }
}

TEST(StepPathTest, MatchesSequencePathTinyDouble) { ExpectStepMatchesSequence<double>("tiny", 1e-12); }
TEST(StepPathTest, MatchesSequencePathTinyFloat) { ExpectStepMatchesSequence<float>("tiny", 1e-5); }
TEST(StepPathTest, MatchesSequencePathSmallDouble) { ExpectStepMatchesSequence<double>("small", 1e-12); }
TEST(StepPathTest, MatchesSequencePathSmallFloat) { ExpectStepMatchesSequence<float>("small", 1e-5); }

// Running two halves with the state carried equals running the whole window (logits and final state).
TEST(CarriedStateTest, SplitWindowsEqualTheWholeWindow) {
  for (const std::string name : {"tiny", "small"}) {
    const ModelConfig config = *NamedConfig(name);
    ParamLayout layout(config);
    CpuReference<double> model(layout);
    const auto params32 = RandomParams(layout, 31);
    const std::vector<double> params(params32.begin(), params32.end());
    const int T = config.window, F = config.n_features, H = config.n_horizons, cut = T / 3 + 1;
    auto data = MakeRandomBatch(config, 1, T, 32).As<double>();
    std::vector<double> whole(static_cast<size_t>(T) * H);
    std::vector<StreamState<double>> whole_state = {RandomState<double>(config, 33)};
    std::vector<StreamState<double>> split_state = whole_state;
    model.Forward(params, data.view(1, T), whole, whole_state);
    std::vector<double> split(static_cast<size_t>(T) * H);
    for (auto [begin, end] : {std::pair{0, cut}, std::pair{cut, T}}) {
      const int n = end - begin;
      BatchView<double> part{1, n, std::span<const double>(data.x).subspan(begin * F, n * F),
                             std::span<const double>(data.dt).subspan(begin, n),
                             std::span<const double>(data.labels).subspan(begin * H, n * H),
                             std::span<const double>(data.mask).subspan(begin * H, n * H)};
      model.Forward(params, part, std::span<double>(split).subspan(begin * H, n * H), split_state);
    }
    EXPECT_LE(RelativeError(split, whole), 1e-13) << name;
    EXPECT_LE(RelativeError(split_state[0].ssm, whole_state[0].ssm), 1e-13) << name;
    EXPECT_LE(RelativeError(split_state[0].conv, whole_state[0].conv), 1e-13) << name;
    EXPECT_LE(RelativeError(split_state[0].cfc, whole_state[0].cfc), 1e-13) << name;
  }
}

// Float32 against the float64 evaluation of the same function on `params` and a batch of B windows from `seed`,
// MODEL.md §8 tolerances: loss and logits within 1e-5, every trained tensor's gradient within 1e-4.
void ExpectFloatAgreesWithDouble(const ParamLayout& layout, const std::vector<float>& params, int B, uint64_t seed) {
  const ModelConfig& config = layout.config();
  const int T = config.window;
  auto data = MakeRandomBatch(config, B, T, seed);
  auto data64 = data.As<double>();
  CpuReference<float> f32(layout);
  CpuReference<double> f64(layout);
  std::vector<float> g32(layout.total_size()), logits32(static_cast<size_t>(B) * T * config.n_horizons);
  std::vector<double> g64(layout.total_size()), logits64(logits32.size());
  const float loss32 = f32.LossAndGradients(params, data.view(), g32);
  const double loss64 = f64.LossAndGradients(ToDouble(params), data64.view(B, T), g64);
  f32.Forward(params, data.view(), logits32);
  f64.Forward(ToDouble(params), data64.view(B, T), logits64);
  EXPECT_LE(std::abs(loss32 - loss64) / std::abs(loss64), 1e-5);
  EXPECT_LE(RelativeError(logits32, logits64), 1e-5);
  for (const TensorSpec& t : layout.tensors()) {
    if (!t.trained) continue;
    EXPECT_LE(RelativeError(std::span<const float>(g32).subspan(t.offset, t.size),
                            std::span<const double>(g64).subspan(t.offset, t.size)),
              1e-4)
        << t.name;
  }
}

TEST(PrecisionTest, FloatAgreesWithDouble) {
  for (const std::string name : {"tiny", "small"}) {
    SCOPED_TRACE(name);
    const ParamLayout layout(*NamedConfig(name));
    ExpectFloatAgreesWithDouble(layout, RandomParams(layout, 41), 3, 42);
  }
}

// Heads whose Δt argument passes 20 (softplus is the argument there): float32 stays finite and agrees with double.
TEST(PrecisionTest, FloatAgreesWithDoubleWhereSoftplusIsItsArgument) {
  const ParamLayout layout(*NamedConfig("tiny"));
  ExpectFloatAgreesWithDouble(layout, testing::RandomParamsWithLargeDtBias(layout, 43), 2, 44);
}

// The same batch on any number of threads gives the same loss and gradients, bit for bit: the sums' order once
// followed the thread count, so a CPU run trained to other bits on a machine with other cores. Batches below, at and
// above the fixed group count.
TEST(ThreadingTest, AnyNumberOfWorkersGivesTheSameBits) {
  const ModelConfig config = *NamedConfig("tiny");
  ParamLayout layout(config);
  const auto params = RandomParams(layout, 51);
  for (const int batch : {5, CpuReference<float>::kGradientGroups, 37}) {
    SCOPED_TRACE(batch);
    auto data = MakeRandomBatch(config, batch, config.window, 52);
    std::vector<float> g1(layout.total_size());
    const float l1 = CpuReference<float>(layout, 1).LossAndGradients(params, data.view(), g1);
    for (const int threads : {2, 3, 7, 16, 40}) {
      std::vector<float> g(layout.total_size());
      const float l = CpuReference<float>(layout, threads).LossAndGradients(params, data.view(), g);
      EXPECT_EQ(std::bit_cast<uint32_t>(l), std::bit_cast<uint32_t>(l1)) << threads << " threads";
      EXPECT_TRUE(g == g1) << threads << " threads";
    }
  }
}

TEST(LossTest, MaskedBceByHand) {
  // bce(l, y) = max(l,0) − l·y + log(1+e^{−|l|}); masked mean over Σm = 2.
  const std::vector<double> logits = {2.0, -1.0, 0.5}, labels = {1, 1, 0}, mask = {1, 0, 1};
  const double expected = ((2.0 - 2.0 + std::log1p(std::exp(-2.0))) + (0.5 + std::log1p(std::exp(-0.5)))) / 2;
  EXPECT_NEAR(CpuReference<double>::MaskedBce(logits, labels, mask), expected, 1e-15);
  const std::vector<double> none = {0, 0, 0};
  EXPECT_EQ(CpuReference<double>::MaskedBce(logits, labels, none), 0.0);  // max(Σm, 1) keeps it finite
}

// perception eval and the CPU backend's Evaluate take the loss of a whole stream in float: 5M terms (a day of ten
// book levels, five horizons) summed in float were 2.4e-3 off the float64 loss, past MODEL.md §8's 1e-5.
TEST(LossTest, MaskedBceOverMillionsOfTermsHoldsFloat64sLoss) {
  constexpr size_t kTerms = 5'000'000;
  std::mt19937_64 rng(20261207);
  std::normal_distribution<float> logit(0.f, 2.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<float> logits(kTerms), labels(kTerms), mask(kTerms);
  for (size_t i = 0; i < kTerms; ++i) {
    logits[i] = logit(rng);
    labels[i] = unit(rng) < 0.5f ? 1.f : 0.f;
    mask[i] = unit(rng) < 0.8f ? 1.f : 0.f;
  }
  const double loss = CpuReference<float>::MaskedBce(logits, labels, mask);
  const double expected = CpuReference<double>::MaskedBce(ToDouble(logits), ToDouble(labels), ToDouble(mask));
  EXPECT_LT(std::abs(loss - expected) / expected, 1e-6) << loss << " against " << expected;
}

TEST(ConvictionTest, PicksTheMostConfidentHorizonLowestOnTies) {
  const std::vector<double> logits = {0.3, -2.0, 1.5};  // p = 0.574, 0.119, 0.818: |p−½| largest at h=1
  EXPECT_NEAR(Conviction<double>(logits), 2.0 / (1.0 + std::exp(2.0)) - 1.0, 1e-15);
  const std::vector<double> tie = {-1.0, 1.0, 0.0};  // equal distance: the lowest horizon wins
  EXPECT_NEAR(Conviction<double>(tie), 2.0 / (1.0 + std::exp(1.0)) - 1.0, 1e-15);
  const std::vector<float> positive = {0.0f, 3.0f};
  EXPECT_GT(Conviction<float>(positive), 0.9f);
}

// In float32 as in double: the horizon comes from the logits. Before, it came from the rounded probabilities, which
// split the exact tie below by rounding (σ(−1) and σ(1) lie unequally far from ½ in float32: h=1 won, +0.462) and
// put every logit past ~17 at ½ exactly (h=0 won below, −1 where the stronger logit says +1).
TEST(ConvictionTest, Float32TiesGoToTheLowestHorizonAndSaturatedLogitsStayApart) {
  for (const float x : {0.5f, 1.0f, 1.5f, 3.0f, 7.25f, 30.0f}) {
    const std::vector<float> tie = {-x, x, 0.0f};
    EXPECT_NEAR(Conviction<float>(tie), 2.0 / (1.0 + std::exp(static_cast<double>(x))) - 1.0, 1e-6) << x;
    EXPECT_LT(Conviction<float>(tie), 0.0f) << x;
  }
  const std::vector<float> saturated = {-20.0f, 25.0f, 1.0f};
  EXPECT_EQ(Conviction<float>(saturated), 1.0f);
  const std::vector<float> saturated_tie = {40.0f, -40.0f};
  EXPECT_EQ(Conviction<float>(saturated_tie), 1.0f);
  const std::vector<double> saturated_double = {-40.0, 45.0};
  EXPECT_GT(Conviction<double>(saturated_double), 0.0);
}

}  // namespace
}  // namespace perception
