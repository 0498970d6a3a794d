// ModelHost's range check of training and evaluation batches (kMaxStandardizedFeature): the daemon checks a batch off
// the device worker under the normalizer it last published, and the host checks it again only where its normalizer
// has changed since (a SetNormalizer in between), so that no batch beyond the bound trains or evaluates, a staged one
// included. On "cpu" and, where a device exists, "cuda" (whose backend stages the next batch; the CPU's ignores it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/dataset.h"
#include "server/metrics.h"
#include "server/model_host.h"
#include "tests/test_util.h"

namespace perception::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class ModelHostRangeTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    // Feature 2's std floored (1e-6): a raw 2e10 there is 2e16 standard deviations out, within the bound under the
    // identity the model started with.
    fitted_ = Normalizer{std::vector<float>(config_.n_features, 0.5f), std::vector<float>(config_.n_features, 2.f)};
    fitted_.inv_std[2] = 1e6f;
    for (ModelHost* host : {&host_, &reference_}) {
      const absl::Status init = host->Init(config_, OptimizerConfig{}, 3, std::nullopt, /*replace=*/false);
      // No device, or a build without the CUDA backend (the sanitizers' CI stage).
      if (GetParam() == "cuda" && init.code() == absl::StatusCode::kFailedPrecondition) {
        GTEST_SKIP() << "backend cuda unavailable: " << init.message();
      }
      ASSERT_TRUE(init.ok()) << init;
      ASSERT_TRUE(host->SetNormalizer(fitted_).ok());
    }
    far_.x[(1 * config_.window + 4) * config_.n_features + 2] = 2e10f;  // window 1, event 4
  }

  int64_t Step() const { return host_.Status().model->step; }

  // Trains `batch` after writing other_'s contents into its arrays (the same addresses, as a freed batch's buffers may
  // be reused), and expects the step's loss to be other_'s, as `reference_` (the same steps on the CPU, which stages
  // nothing) gives it, not that of a copy staged from `staged` (the arrays' contents before).
  void ExpectTrainsWhatItHolds(testing::RandomBatch& batch, const testing::RandomBatch& staged) {
    const absl::StatusOr<Evaluation> expected = reference_.Evaluate(other_.view(), false);
    const absl::StatusOr<Evaluation> stale = reference_.Evaluate(staged.view(), false, &fitted_);  // unchecked
    ASSERT_TRUE(expected.ok() && stale.ok()) << expected.status() << stale.status();
    ASSERT_GT(std::abs(stale->loss - expected->loss), 1e-3 * expected->loss) << "the test would not tell them apart";
    std::ranges::copy(other_.x, batch.x.begin());
    std::ranges::copy(other_.dt, batch.dt.begin());
    std::ranges::copy(other_.labels, batch.labels.begin());
    std::ranges::copy(other_.mask, batch.mask.begin());
    const absl::StatusOr<TrainOutcome> step = host_.TrainStep(batch.view(), nullptr, &fitted_);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_NEAR(step->result.loss, expected->loss, 1e-5 * expected->loss);
  }

  ServerMetrics metrics_;
  ModelHost host_{GetParam(), metrics_, StreamingConfig{}, /*use_graphs=*/true, Precision::kFloat32};
  ModelHost reference_{"cpu", metrics_, StreamingConfig{}, /*use_graphs=*/true, Precision::kFloat32};
  const ModelConfig config_ = *NamedConfig("tiny");
  const Normalizer identity_{std::vector<float>(config_.n_features, 0.f), std::vector<float>(config_.n_features, 1.f)};
  Normalizer fitted_;
  testing::RandomBatch near_ = testing::MakeRandomBatch(config_, config_.batch, config_.window, 5);
  testing::RandomBatch far_ = testing::MakeRandomBatch(config_, config_.batch, config_.window, 6);
  const testing::RandomBatch other_ = testing::MakeRandomBatch(config_, config_.batch, config_.window, 7);
};

TEST_P(ModelHostRangeTest, ABatchCheckedUnderAnotherNormalizerIsCheckedAgainAndRefused) {
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

// A next batch beyond the bound, checked under a stale normalizer, is checked again before it is staged (so not
// staged) and refused as its own step's batch: a later batch at the same addresses trains on what it holds.
TEST_P(ModelHostRangeTest, ANextBatchBeyondTheBoundIsNotStagedAndItsStepIsRefused) {
  const BatchView<float> far = far_.view();
  ASSERT_TRUE(host_.TrainStep(near_.view(), &far, &fitted_, &identity_).ok());
  ASSERT_TRUE(reference_.TrainStep(near_.view()).ok());
  EXPECT_EQ(host_.TrainStep(far, nullptr, &identity_).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Step(), 1);
  ExpectTrainsWhatItHolds(far_, testing::RandomBatch(far_));
  EXPECT_EQ(Step(), 2);
}

// The review's case: the next batch is staged within the bound, then a SetNormalizer (another client's job between the
// two steps) puts it beyond; its step is refused, and the copy staged under the old normalizer is not trained later.
TEST_P(ModelHostRangeTest, ABatchStagedBeforeANormalizerChangePutItBeyondTheBoundIsNeverTrained) {
  const BatchView<float> far = far_.view();
  for (ModelHost* host : {&host_, &reference_}) ASSERT_TRUE(host->SetNormalizer(identity_).ok());
  ASSERT_TRUE(host_.TrainStep(near_.view(), &far, &identity_, &identity_).ok());
  ASSERT_TRUE(reference_.TrainStep(near_.view()).ok());
  for (ModelHost* host : {&host_, &reference_}) ASSERT_TRUE(host->SetNormalizer(fitted_).ok());
  const absl::StatusOr<TrainOutcome> refused = host_.TrainStep(far, nullptr, &identity_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_EQ(Step(), 1);
  ExpectTrainsWhatItHolds(far_, testing::RandomBatch(far_));
  EXPECT_EQ(Step(), 2);
}

// Checked under the normalizer the host has: not checked again (the pass a training batch would cost the worker).
TEST_P(ModelHostRangeTest, ABatchCheckedUnderTheHostsNormalizerIsNotCheckedAgain) {
  // The caller's check is taken as done (here it was not, so the step runs on a batch beyond the bound, whatever it
  // then makes of it): equal values in another object, as the daemon passes a copy of the published normalizer.
  const Normalizer copy = fitted_;
  EXPECT_THAT(host_.TrainStep(far_.view(), nullptr, &copy).status().message(), Not(HasSubstr("standard deviations")));
}

INSTANTIATE_TEST_SUITE_P(Backends, ModelHostRangeTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace perception::server
