// ModelHost's range check of training and evaluation batches (kMaxStandardizedFeature): the daemon checks a batch off
// the device worker under the normalizer it last published, and the host checks it again only where its normalizer
// has changed since (a SetNormalizer in between), so that no batch beyond the bound trains or evaluates.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "engine/config.h"
#include "engine/dataset.h"
#include "server/metrics.h"
#include "server/model_host.h"
#include "tests/test_util.h"

namespace perception::server {
namespace {

using ::testing::HasSubstr;

class ModelHostRangeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(host_.Init(config_, OptimizerConfig{}, 3, std::nullopt, /*replace=*/false).ok());
    // Feature 2's std floored (1e-6): a raw 2e10 there is 2e16 standard deviations out, within the bound under the
    // identity the model started with.
    fitted_ = Normalizer{std::vector<float>(config_.n_features, 0.5f), std::vector<float>(config_.n_features, 2.f)};
    fitted_.inv_std[2] = 1e6f;
    ASSERT_TRUE(host_.SetNormalizer(fitted_).ok());
    far_.x[(1 * config_.window + 4) * config_.n_features + 2] = 2e10f;  // window 1, event 4
  }

  int64_t Step() const { return host_.Status().model->step; }

  ServerMetrics metrics_;
  ModelHost host_{"cpu", metrics_, StreamingConfig{}, /*use_graphs=*/true, Precision::kFloat32};
  const ModelConfig config_ = *NamedConfig("tiny");
  const Normalizer identity_{std::vector<float>(config_.n_features, 0.f), std::vector<float>(config_.n_features, 1.f)};
  Normalizer fitted_;
  testing::RandomBatch near_ = testing::MakeRandomBatch(config_, config_.batch, config_.window, 5);
  testing::RandomBatch far_ = testing::MakeRandomBatch(config_, config_.batch, config_.window, 6);
};

TEST_F(ModelHostRangeTest, ABatchCheckedUnderAnotherNormalizerIsCheckedAgainAndRefused) {
  for (const Normalizer* checked_under : {static_cast<const Normalizer*>(nullptr), &identity_}) {
    const absl::StatusOr<TrainOutcome> step = host_.TrainStep(far_.view(), nullptr, checked_under);
    EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(step.status().message(), HasSubstr("batch window 1, event 4: feature 2 is 2e+10, 2e+16 standard "
                                                   "deviations from the model's normalizer mean"));
    const absl::StatusOr<Evaluation> evaluation = host_.Evaluate(far_.view(), false, checked_under);
    EXPECT_THAT(evaluation.status().message(), HasSubstr("batch window 1, event 4: feature 2 is 2e+10"));
  }
  EXPECT_EQ(Step(), 0) << "nothing trained";
  // A batch within the bound trains, however stale the normalizer it was checked under.
  ASSERT_TRUE(host_.TrainStep(near_.view(), nullptr, &identity_).ok());
  EXPECT_EQ(Step(), 1);
}

// The next batch, staged beside a step, is checked as the step's own: one beyond the bound is not staged, and its own
// step is refused.
TEST_F(ModelHostRangeTest, ANextBatchBeyondTheBoundIsNotStagedAndItsStepIsRefused) {
  const BatchView<float> far = far_.view();
  ASSERT_TRUE(host_.TrainStep(near_.view(), &far, &fitted_, &identity_).ok());
  EXPECT_EQ(Step(), 1);
  EXPECT_EQ(host_.TrainStep(far, nullptr, &identity_).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Step(), 1);
}

// Checked under the normalizer the host has: not checked again (the pass a training batch would cost the worker).
TEST_F(ModelHostRangeTest, ABatchCheckedUnderTheHostsNormalizerIsNotCheckedAgain) {
  ASSERT_TRUE(host_.TrainStep(near_.view(), nullptr, &fitted_).ok());
  EXPECT_EQ(Step(), 1);
  // The caller's check is taken as done (here it was not, so the step runs on a batch beyond the bound, whatever it
  // then makes of it): equal values in another object, as the daemon passes a copy of the published normalizer.
  const Normalizer copy = fitted_;
  EXPECT_THAT(host_.TrainStep(far_.view(), nullptr, &copy).status().message(),
              ::testing::Not(HasSubstr("standard deviations")));
}

}  // namespace
}  // namespace perception::server
