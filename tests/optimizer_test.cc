// Clipping, AdamW (PyTorch semantics) and learning-rate schedules against values computed by hand.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numbers>

#include "engine/optimizer.h"
#include "tests/test_util.h"

namespace perception {
namespace {

struct Buffers {
  explicit Buffers(const ParamLayout& layout)
      : params(layout.total_size()), grads(layout.total_size()), m(layout.total_size()), v(layout.total_size()) {}
  std::vector<double> params, grads, m, v;
};

TEST(ClippingTest, ScalesToMaxNormAndReportsThePreClipNorm) {
  ParamLayout layout(*NamedConfig("tiny"));
  Buffers b(layout);
  const size_t w = layout.tensor(layout.embed.weight).offset, bias = layout.tensor(layout.head_out.bias).offset;
  b.grads[w] = 3.0;
  b.grads[bias] = -4.0;
  b.grads[0] = 100.0;  // a normalizer buffer slot: never part of the norm
  OptimizerConfig config;
  config.max_grad_norm = 1.0;
  const double norm = ClipAndAdamW<double>(layout, config, 1, b.params, b.grads, b.m, b.v);
  EXPECT_DOUBLE_EQ(norm, 5.0);
  EXPECT_NEAR(b.grads[w], 3.0 / (5.0 + 1e-6), 1e-15);
  EXPECT_NEAR(b.grads[bias], -4.0 / (5.0 + 1e-6), 1e-15);
  // Below the max norm nothing is scaled.
  Buffers small(layout);
  small.grads[w] = 0.3;
  small.grads[bias] = 0.4;
  EXPECT_NEAR(ClipAndAdamW<double>(layout, config, 1, small.params, small.grads, small.m, small.v), 0.5, 1e-15);
  EXPECT_EQ(small.grads[w], 0.3);
}

// clip_grad_norm_(error_if_nonfinite=True) raises before the update; here the step is not taken: a NaN or infinite
// gradient anywhere leaves every parameter, moment and gradient as it was, clipping on or off.
TEST(ClippingTest, ANonFiniteNormTakesNoStep) {
  ParamLayout layout(*NamedConfig("tiny"));
  const std::vector<float> init = testing::RandomParams(layout, 4);
  const size_t bias = layout.tensor(layout.head_out.bias).offset;
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    for (const double max_norm : {1.0, 0.0}) {
      Buffers b(layout);
      b.params.assign(init.begin(), init.end());
      for (size_t i = 0; i < b.grads.size(); ++i) b.grads[i] = b.m[i] = b.v[i] = 0.01 * static_cast<double>(i % 7);
      b.grads[bias] = bad;
      const Buffers untouched = b;
      OptimizerConfig config;
      config.max_grad_norm = max_norm;
      const double norm = ClipAndAdamW<double>(layout, config, 3, b.params, b.grads, b.m, b.v);
      EXPECT_FALSE(std::isfinite(norm));
      EXPECT_EQ(b.params, untouched.params);
      EXPECT_EQ(b.m, untouched.m);
      EXPECT_EQ(b.v, untouched.v);
      for (size_t i = 0; i < b.grads.size(); ++i) {
        if (i != bias) {
          ASSERT_EQ(b.grads[i], untouched.grads[i]) << i;
        }
      }
    }
  }
}

// torch.optim.AdamW, written out for one scalar: decoupled decay, moments, bias-corrected step.
struct ScalarAdamW {
  double theta, m = 0, v = 0;
  void Step(double g, double lr, double wd, int step) {
    theta *= 1 - lr * wd;
    m = 0.9 * m + 0.1 * g;
    v = 0.999 * v + 0.001 * g * g;
    const double m_hat = m / (1 - std::pow(0.9, step));
    const double v_hat = v / (1 - std::pow(0.999, step));
    theta -= lr * m_hat / (std::sqrt(v_hat) + 1e-8);
  }
};

TEST(AdamWTest, TenStepsMatchTheFormulaWithAndWithoutDecay) {
  ParamLayout layout(*NamedConfig("tiny"));
  Buffers b(layout);
  const std::vector<float> init = testing::RandomParams(layout, 3);
  b.params.assign(init.begin(), init.end());
  const size_t decayed = layout.tensor(layout.layers[1].in_proj).offset + 5;  // weight decay 0.01
  const size_t plain = layout.tensor(layout.layers[0].a_log).offset + 1;      // no decay
  ScalarAdamW expect_decayed{b.params[decayed]}, expect_plain{b.params[plain]};
  const double buffer_before = b.params[layout.tensor(layout.norm_mean).offset];
  OptimizerConfig config;
  config.lr = 0.05;
  config.max_grad_norm = 0;  // clipping off: the per-scalar formula is the whole update
  for (int step = 1; step <= 10; ++step) {
    std::fill(b.grads.begin(), b.grads.end(), 0.0);
    const double g1 = std::sin(step) * 0.3, g2 = -0.1 * step + 0.45;
    b.grads[decayed] = g1;
    b.grads[plain] = g2;
    ClipAndAdamW<double>(layout, config, step, b.params, b.grads, b.m, b.v);
    expect_decayed.Step(g1, 0.05, 0.01, step);
    expect_plain.Step(g2, 0.05, 0.0, step);
  }
  EXPECT_NEAR(b.params[decayed], expect_decayed.theta, 1e-14);
  EXPECT_NEAR(b.params[plain], expect_plain.theta, 1e-14);
  EXPECT_NEAR(b.m[plain], expect_plain.m, 1e-15);
  EXPECT_NEAR(b.v[plain], expect_plain.v, 1e-15);
  EXPECT_EQ(b.params[layout.tensor(layout.norm_mean).offset], buffer_before);
}

TEST(AdamWTest, FirstStepByHand) {
  // Step 1: m̂ = g, v̂ = g², so θ ← θ(1 − lr·wd) − lr·g/(|g| + eps).
  ParamLayout layout(*NamedConfig("tiny"));
  Buffers b(layout);
  const size_t i = layout.tensor(layout.embed.weight).offset;
  b.params[i] = 0.5;
  b.grads[i] = -0.2;
  OptimizerConfig config;
  config.lr = 0.1;
  ClipAndAdamW<double>(layout, config, 1, b.params, b.grads, b.m, b.v);
  EXPECT_NEAR(b.params[i], 0.5 * (1 - 0.1 * 0.01) + 0.1 * 0.2 / (0.2 + 1e-8), 1e-12);  // 0.5995 + 0.1
}

TEST(ScheduleTest, ConstantAndWarmupCosine) {
  OptimizerConfig c;
  c.lr = 2e-3;
  EXPECT_EQ(LearningRate(c, 1), 2e-3);
  EXPECT_EQ(LearningRate(c, 100000), 2e-3);
  c.schedule = LrSchedule::kWarmupCosine;
  c.warmup_steps = 10;
  c.total_steps = 110;
  c.min_lr = 1e-4;
  EXPECT_NEAR(LearningRate(c, 1), 2e-4, 1e-18);
  EXPECT_NEAR(LearningRate(c, 5), 1e-3, 1e-18);
  EXPECT_NEAR(LearningRate(c, 10), 2e-3, 1e-18);
  EXPECT_NEAR(LearningRate(c, 60), 1e-4 + 1.9e-3 * 0.5, 1e-15);  // halfway: cos(π/2) = 0
  EXPECT_NEAR(LearningRate(c, 35), 1e-4 + 1.9e-3 * 0.5 * (1 + std::cos(std::numbers::pi / 4)), 1e-15);
  EXPECT_NEAR(LearningRate(c, 110), 1e-4, 1e-18);
  EXPECT_NEAR(LearningRate(c, 500), 1e-4, 1e-18);  // stays at the floor
  EXPECT_TRUE(ValidateOptimizerConfig(c).ok());
  c.total_steps = 10;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("warmup_steps"));
  EXPECT_EQ(*ParseLrSchedule("cosine"), LrSchedule::kWarmupCosine);
  EXPECT_FALSE(ParseLrSchedule("linear").ok());
}

// An infinite weight decay made every weight ±inf or NaN one step later, and a NaN max-norm turned clipping off. An
// infinite max-norm, or a NaN min_lr under the constant schedule (which does not read it), trained, but its checkpoint
// saved them as JSON null and then did not load.
TEST(ValidateOptimizerConfigTest, RefusesInfinitiesAndNaNs) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  OptimizerConfig c;
  c.weight_decay = inf;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("weight_decay must be finite and >= 0"));
  c = OptimizerConfig{};
  c.eps = inf;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("eps must be positive"));
  c = OptimizerConfig{};
  c.max_grad_norm = nan;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("max_grad_norm nan is not finite"));
  c.max_grad_norm = inf;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("max_grad_norm inf is not finite (<= 0 "
                                                                         "disables clipping)"));
  c.max_grad_norm = 0;  // disables clipping, as documented
  EXPECT_TRUE(ValidateOptimizerConfig(c).ok());
  c = OptimizerConfig{};
  ASSERT_EQ(c.schedule, LrSchedule::kConstant);
  c.min_lr = nan;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("min_lr nan is not finite"));
  c.min_lr = -inf;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("min_lr -inf is not finite"));
}

// The constant schedule does not read warmup_steps, total_steps or min_lr, but GetStatus shows them and checkpoints
// save them: InitModel took negative ones and echoed them back.
TEST(ValidateOptimizerConfigTest, RefusesNegativeScheduleFieldsUnderEverySchedule) {
  for (const LrSchedule schedule : {LrSchedule::kConstant, LrSchedule::kWarmupCosine}) {
    const OptimizerConfig valid{.schedule = schedule, .warmup_steps = 2, .total_steps = 10, .min_lr = 1e-5};
    ASSERT_TRUE(ValidateOptimizerConfig(valid).ok()) << ValidateOptimizerConfig(valid);
    OptimizerConfig c = valid;
    c.warmup_steps = -5;
    EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("must be >= 0"));
    c = valid;
    c.total_steps = -9;
    EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("must be >= 0"));
    c = valid;
    c.min_lr = -3;
    EXPECT_THAT(ValidateOptimizerConfig(c).message(),
                ::testing::HasSubstr("warmup_steps (2), total_steps (10) and min_lr (-3) must be >= 0"));
  }
}

// The update computes in float32: before, lr 1e39 (or lr * weight_decay, or lr / (1 - beta1), past float32's range)
// became inf and one step made every weight inf or NaN, and eps 1e-50 became 0, dividing a zero moment by zero. Every path to an optimizer
// (InitModel and SetOptimizer's settings, a checkpoint's metadata, the CLI) validates through this function.
TEST(ValidateOptimizerConfigTest, RefusesValuesFloat32CannotHold) {
  OptimizerConfig c;
  c.lr = 1e39;
  EXPECT_EQ(ValidateOptimizerConfig(c).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ValidateOptimizerConfig(c).message(),
              ::testing::HasSubstr("optimizer: lr 1e+39 exceeds float32's largest value 3.40282e+38"));
  c = OptimizerConfig{};
  c.lr = 1e30;
  c.weight_decay = 1e10;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(),
              ::testing::HasSubstr("optimizer: lr * weight_decay 1e+40 exceeds float32's largest value"));
  c = OptimizerConfig{};
  c.lr = 1e38;  // 1e39 after the first step's bias correction, with beta1 0.9
  EXPECT_THAT(ValidateOptimizerConfig(c).message(),
              ::testing::HasSubstr("optimizer: the first step's size lr / (1 - beta1) 1e+39 exceeds float32's"));
  c = OptimizerConfig{};
  c.eps = 1e39;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(), ::testing::HasSubstr("optimizer: eps 1e+39 exceeds"));
  c.eps = 1e-50;
  EXPECT_THAT(ValidateOptimizerConfig(c).message(),
              ::testing::HasSubstr("optimizer: eps 1e-50 rounds to 0 in float32"));

  // The extremes float32 holds are accepted (beta1 0: no bias correction to enlarge the first step).
  c = OptimizerConfig{};
  c.lr = std::numeric_limits<float>::max();
  c.beta1 = 0;
  c.weight_decay = 1;
  c.eps = std::numeric_limits<float>::denorm_min();
  EXPECT_TRUE(ValidateOptimizerConfig(c).ok()) << ValidateOptimizerConfig(c);
}

}  // namespace
}  // namespace perception
