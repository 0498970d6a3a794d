// ModelHost's publication of the weights streaming reads: a step whose publication fails is still answered,
// SetNormalizer's failure leaves the previous model in place, and a seed's hold defers training's publications.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <optional>
#include <utility>

#include "engine/config.h"
#include "server/metrics.h"
#include "server/model_host.h"
#include "tests/forwarding_backend.h"
#include "tests/test_util.h"

namespace perception::server {
namespace {

// PublishWeights fails while `failures` is positive, as on a device error.
class FailingPublishBackend final : public testing::ForwardingBackend {
 public:
  FailingPublishBackend(std::unique_ptr<Backend> inner, std::shared_ptr<std::atomic<int>> failures)
      : ForwardingBackend(std::move(inner)), failures_(std::move(failures)) {}
  absl::Status PublishWeights() override {
    if (failures_->fetch_sub(1) > 0) return absl::InternalError("an injected device error");
    *failures_ = 0;
    return ForwardingBackend::PublishWeights();
  }

 private:
  const std::shared_ptr<std::atomic<int>> failures_;
};

// A `tiny` model on the CPU whose backends fail PublishWeights while `failures` is positive.
class ModelHostPublishTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(host.Init(config, OptimizerConfig{}, 3, std::nullopt, /*replace=*/false).ok()); }

  const std::shared_ptr<std::atomic<int>> failures = std::make_shared<std::atomic<int>>(0);
  ServerMetrics metrics;
  ModelHost host{"cpu", metrics, StreamingConfig{}, /*use_graphs=*/true, Precision::kFloat32,
                 [failures = failures](std::unique_ptr<Backend> backend) -> std::unique_ptr<Backend> {
                   return std::make_unique<FailingPublishBackend>(std::move(backend), failures);
                 }};
  const ModelConfig config = *NamedConfig("tiny");
};

// Before, the step came back as an error although the model had taken it, so a client retrying it trained twice.
TEST_F(ModelHostPublishTest, AStepWhosePublicationFailsIsAnsweredAndTheNextOnePublishes) {
  ASSERT_TRUE(host.StreamingBackend().ok());  // streaming configured: every step publishes (publish_every_steps 1)
  const int64_t initial = host.published_weights_version();

  *failures = 1;
  const absl::StatusOr<TrainOutcome> first =
      host.TrainStep(testing::MakeRandomBatch(config, config.batch, config.window, 21).view());
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->result.step, 1);
  EXPECT_EQ(host.published_weights_version(), initial) << "streaming keeps the weights it had";

  const absl::StatusOr<TrainOutcome> second =
      host.TrainStep(testing::MakeRandomBatch(config, config.batch, config.window, 22).view());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->result.step, 2);
  EXPECT_EQ(host.published_weights_version(), initial + 2) << "the next step published both steps' weights";
}

// Before, SetNormalizer whose publication failed answered the failure with the new normalizer kept (in the model, its
// weights and the weights version), while streaming read the previous weights.
TEST_F(ModelHostPublishTest, ASetNormalizerWhosePublicationFailsLeavesThePreviousModel) {
  ASSERT_TRUE(host.StreamingBackend().ok());
  const ModelInfo before = *host.Status().model;
  const absl::StatusOr<Checkpoint> weights_before = (*host.StreamingBackend())->ExportState();
  ASSERT_TRUE(weights_before.ok());
  const Normalizer changed{std::vector<float>(config.n_features, 0.5f), std::vector<float>(config.n_features, 2.f)};

  *failures = 1;
  const absl::Status failed = host.SetNormalizer(changed);
  EXPECT_THAT(failed.message(), ::testing::HasSubstr("an injected device error"));
  const ModelInfo after = *host.Status().model;
  EXPECT_EQ(after.normalizer.mean, before.normalizer.mean);
  EXPECT_EQ(after.normalizer.inv_std, before.normalizer.inv_std);
  EXPECT_EQ(after.weights_version, before.weights_version);
  const absl::StatusOr<Checkpoint> weights_after = (*host.StreamingBackend())->ExportState();
  ASSERT_TRUE(weights_after.ok());
  EXPECT_EQ(weights_after->params, weights_before->params) << "the weights carry the previous normalizer";
  EXPECT_EQ(host.published_weights_version(), before.weights_version) << "the previous weights published again";

  ASSERT_TRUE(host.SetNormalizer(changed).ok());
  EXPECT_EQ(host.Status().model->normalizer.mean, changed.mean);
  EXPECT_EQ(host.published_weights_version(), before.weights_version + 1);
}

// A SeedStream steps its window in several jobs under one weights version: training steps taken meanwhile publish
// once the last hold is released, not before; SetNormalizer still publishes at once.
TEST_F(ModelHostPublishTest, HeldPublicationWaitsForTheLastReleaseButNotForSetNormalizer) {
  ASSERT_TRUE(host.StreamingBackend().ok());
  const int64_t initial = host.published_weights_version();
  host.HoldPublication();
  host.HoldPublication();  // two seeds at once
  EXPECT_FALSE(host.PublicationWaits());
  ASSERT_TRUE(host.TrainStep(testing::MakeRandomBatch(config, config.batch, config.window, 23).view()).ok());
  EXPECT_EQ(host.published_weights_version(), initial);
  EXPECT_TRUE(host.PublicationWaits()) << "a new seed must wait for it";
  host.ReleasePublication();
  EXPECT_EQ(host.published_weights_version(), initial) << "one seed still holds it";
  host.ReleasePublication();
  EXPECT_EQ(host.published_weights_version(), initial + 1) << "the step's weights, published at the last release";
  EXPECT_FALSE(host.PublicationWaits());

  host.HoldPublication();
  const Normalizer changed{std::vector<float>(config.n_features, 0.5f), std::vector<float>(config.n_features, 2.f)};
  ASSERT_TRUE(host.SetNormalizer(changed).ok());
  EXPECT_EQ(host.published_weights_version(), initial + 2) << "streaming standardizes with the normalizer at once";
  host.ReleasePublication();
  EXPECT_EQ(host.published_weights_version(), initial + 2) << "nothing waited";
  ASSERT_TRUE(host.TrainStep(testing::MakeRandomBatch(config, config.batch, config.window, 24).view()).ok());
  EXPECT_EQ(host.published_weights_version(), initial + 3) << "released: steps publish again";
}

}  // namespace
}  // namespace perception::server
