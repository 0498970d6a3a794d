// ModelHost::TrainStep's hand-off of the next batch: which Backend entry point a step reaches, with which `next`,
// and that the step's result equals the plain path's (the CPU backend ignores `next`).
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <vector>

#include "engine/config.h"
#include "server/metrics.h"
#include "server/model_host.h"
#include "tests/recording_backend.h"
#include "tests/test_util.h"

namespace perception::server {
namespace {

using testing::BatchContents;
using testing::IsPlainTrainStepOn;
using testing::MakeRandomBatch;
using testing::RandomBatch;
using testing::RecordTrainCalls;
using testing::TrainCall;
using testing::TrainCallLog;
using testing::TrainEntry;

constexpr uint64_t kModelSeed = 3;

ModelConfig Tiny() { return *NamedConfig("tiny"); }

// A CPU host holding the tiny model initialized from kModelSeed; its backends pass through `decorate` where given.
std::unique_ptr<ModelHost> TinyHost(ServerMetrics& metrics, ModelHost::BackendDecorator decorate) {
  auto host = std::make_unique<ModelHost>("cpu", metrics, StreamingConfig{}, /*use_graphs=*/true, Precision::kFloat32,
                                          std::move(decorate));
  const absl::Status init = host->Init(Tiny(), OptimizerConfig{}, kModelSeed, std::nullopt, /*replace=*/false);
  EXPECT_TRUE(init.ok()) << init;
  return host;
}

// Two hosts with the same model: `recorded_`, whose backend records every training call, and `plain_`, the
// reference, undecorated and never given a `next`. Every step is taken on both, so they stay in step.
class ModelHostHandoffTest : public ::testing::Test {
 protected:
  // Trains `plain_` on `batch` and expects `outcome` (the recorded host's step on the same batch) to equal it bit
  // for bit: handing on a `next` must not change the step.
  void ExpectSameAsPlainStep(const absl::StatusOr<TrainOutcome>& outcome, const RandomBatch& batch) {
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    const absl::StatusOr<TrainOutcome> reference = plain_->TrainStep(batch.view());
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_EQ(outcome->result.loss, reference->result.loss);
    EXPECT_EQ(outcome->result.grad_norm, reference->result.grad_norm);
    EXPECT_EQ(outcome->result.step, reference->result.step);
  }

  const ModelConfig config_ = Tiny();
  const std::shared_ptr<TrainCallLog> log_ = std::make_shared<TrainCallLog>();
  ServerMetrics recorded_metrics_, plain_metrics_;
  const std::unique_ptr<ModelHost> recorded_ = TinyHost(recorded_metrics_, RecordTrainCalls(log_));
  const std::unique_ptr<ModelHost> plain_ = TinyHost(plain_metrics_, nullptr);
  const RandomBatch batch_ = MakeRandomBatch(config_, config_.batch, config_.window, /*seed=*/11);
  const RandomBatch next_ = MakeRandomBatch(config_, config_.batch, config_.window, /*seed=*/12);
};

TEST_F(ModelHostHandoffTest, ValidNextReachesTrainStepStagingNextWithThatBatch) {
  ASSERT_FALSE(BatchContents::Of(batch_.view()) == BatchContents::Of(next_.view()));
  const BatchView<float> next = next_.view();
  const absl::StatusOr<TrainOutcome> outcome = recorded_->TrainStep(batch_.view(), &next);
  ExpectSameAsPlainStep(outcome, batch_);
  // The step the hand-off was for, given that very batch as the Train stream gives it: a plain step of its own.
  ExpectSameAsPlainStep(recorded_->TrainStep(next_.view()), next_);

  const std::vector<TrainCall> calls = log_->calls();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].entry, TrainEntry::kTrainStepStagingNext);
  EXPECT_TRUE(calls[0].batch == BatchContents::Of(batch_.view()));
  ASSERT_TRUE(calls[0].next.has_value());
  EXPECT_TRUE(*calls[0].next == BatchContents::Of(next_.view())) << "the staged batch is not the `next` given";
  EXPECT_TRUE(IsPlainTrainStepOn(calls[1], next_.view()));
}

TEST_F(ModelHostHandoffTest, NextOfAnotherShapeFallsBackToPlainTrainStep) {
  // `next` batches that fail the training checks, one dimension off each: the host must not stage them (the step
  // they were for would be refused, leaving the backend holding a batch it knows by address only).
  const ModelConfig more_features = [&] {
    ModelConfig c = config_;
    ++c.n_features;
    return c;
  }();
  const ModelConfig more_horizons = [&] {
    ModelConfig c = config_;
    ++c.n_horizons;
    return c;
  }();
  const struct {
    const char* name;
    RandomBatch next;
  } wrong_shapes[] = {
      {"one window more", MakeRandomBatch(config_, config_.batch + 1, config_.window, 21)},
      {"one event per window more", MakeRandomBatch(config_, config_.batch, config_.window + 1, 22)},
      {"one feature more", MakeRandomBatch(more_features, config_.batch, config_.window, 23)},
      {"one horizon more", MakeRandomBatch(more_horizons, config_.batch, config_.window, 24)},
  };
  for (const auto& [name, wrong] : wrong_shapes) {
    SCOPED_TRACE(name);
    const size_t before = log_->calls().size();
    const BatchView<float> next = wrong.view();
    ExpectSameAsPlainStep(recorded_->TrainStep(batch_.view(), &next), batch_);

    const std::vector<TrainCall> calls = log_->calls();
    ASSERT_EQ(calls.size(), before + 1);
    EXPECT_TRUE(IsPlainTrainStepOn(calls.back(), batch_.view()));
  }
}

TEST_F(ModelHostHandoffTest, NoNextIsPlainTrainStep) {
  ExpectSameAsPlainStep(recorded_->TrainStep(batch_.view(), /*next=*/nullptr), batch_);

  const std::vector<TrainCall> calls = log_->calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_TRUE(IsPlainTrainStepOn(calls[0], batch_.view()));
}

}  // namespace
}  // namespace perception::server
