// A call the daemon fails, through the service in process: a training step that answers DATA_LOSS (a data-parallel
// replica divergence) is a failure an operator must see, logged at error level, not a refusal of the client's; one
// whose gradient norm was not finite is a refusal that the operator sees too (a counter, a warning).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/backend.h"
#include "engine/config.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "tests/batch_message.h"
#include "tests/captured_log.h"
#include "tests/forwarding_backend.h"
#include "tests/in_process_daemon.h"
#include "tests/test_util.h"

namespace perception::testing {
namespace {

using ::testing::Contains;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// Every training step fails as a replica check that found the ranks' parameters differing does.
class DivergingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>&) override {
    return absl::DataLossError("data-parallel parameters diverged after step 1: an injected divergence");
  }
};

// Every training step's gradient norm is infinite, as a diverging job's would be; each step replays a graph first,
// as the CUDA backend's does.
class OverflowingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>&) override {
    ++counters_.graph_replays;
    return StepNotTakenError(TrainStepResult{.loss = 0.7, .grad_norm = INFINITY, .step = 0});
  }
  TrainingCounters training_counters() const override { return counters_; }

 private:
  TrainingCounters counters_;
};

std::chrono::system_clock::time_point Deadline() { return std::chrono::system_clock::now() + std::chrono::seconds(60); }

grpc::Status TrainOneStep(InProcessDaemon& daemon) {
  const ModelConfig config = *NamedConfig("tiny");
  v1::TrainStepRequest request;
  *request.mutable_batch() = BatchMessage(MakeRandomBatch(config, config.batch, config.window, 1), config);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  v1::TrainStepResponse response;
  return daemon.stub().TrainStep(&context, request, &response);
}

TEST(FailureMetricsTest, ADataLossStepIsAnErrorAndNotARefusal) {
  const CapturedLog log;
  InProcessDaemon daemon(
      [](std::unique_ptr<Backend> inner) { return std::make_unique<DivergingBackend>(std::move(inner)); },
      "failure_metrics_checkpoints");
  ASSERT_TRUE(daemon.InitTinyModel(0).ok());

  const grpc::Status status = TrainOneStep(daemon);
  ASSERT_EQ(status.error_code(), grpc::StatusCode::DATA_LOSS) << status.error_message();

  const std::string metrics = daemon.metrics().Render();
  EXPECT_THAT(metrics, HasSubstr("\nperception_replica_divergences_total 1\n"));
  EXPECT_THAT(metrics, HasSubstr("perception_rpc_duration_seconds_count{code=\"DATA_LOSS\",method=\"TrainStep\"} 1\n"));
  EXPECT_THAT(metrics, Not(HasSubstr("reason=\"data_loss\"")));
  EXPECT_THAT(metrics, Not(ContainsRegex("perception_requests_rejected_total\\{[^}]*\\} [1-9]"))) << "no refusal";
  EXPECT_THAT(log.lines(), Contains(StartsWith("error|TrainStep failed: DATA_LOSS: data-parallel parameters")));
}

TEST(FailureMetricsTest, AStepNotTakenIsARefusalCountedAndLoggedForTheOperator) {
  const CapturedLog log;
  InProcessDaemon daemon(
      [](std::unique_ptr<Backend> inner) { return std::make_unique<OverflowingBackend>(std::move(inner)); },
      "failure_metrics_not_taken_checkpoints");
  ASSERT_TRUE(daemon.InitTinyModel(0).ok());
  const std::string before = daemon.metrics().Render();
  EXPECT_THAT(before, HasSubstr("\nperception_train_steps_not_taken_total 0\n"));

  const grpc::Status status = TrainOneStep(daemon);
  ASSERT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("gradient norm is inf (loss 0.7)"));

  const std::string metrics = daemon.metrics().Render();
  EXPECT_THAT(metrics, HasSubstr("\nperception_train_steps_not_taken_total 1\n"));
  EXPECT_THAT(metrics, HasSubstr("\nperception_train_steps_total 0\n"));
  EXPECT_THAT(metrics, HasSubstr("\nperception_train_graph_replays_total 1\n")) << "the refused step's own graph";
  EXPECT_THAT(metrics, HasSubstr("perception_requests_rejected_total{reason=\"failed_precondition\"} 1\n"));
  EXPECT_THAT(log.lines(), Contains(StartsWith("warning|a training step was not taken: the batch's gradient norm is inf")));
}

// A client that loops TrainStep on diverged weights wrote a warning a step, outside the throttle that bounds the log
// lines of refused calls: at most 20 every 10 s now, as those (the metric counts every step).
TEST(FailureMetricsTest, StepsNotTakenAreLoggedAtMostTwentyEveryTenSeconds) {
  const CapturedLog log;
  InProcessDaemon daemon(
      [](std::unique_ptr<Backend> inner) { return std::make_unique<OverflowingBackend>(std::move(inner)); },
      "failure_metrics_not_taken_flood_checkpoints");
  ASSERT_TRUE(daemon.InitTinyModel(0).ok());
  for (int i = 0; i < 30; ++i) ASSERT_EQ(TrainOneStep(daemon).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(daemon.metrics().Render(), HasSubstr("\nperception_train_steps_not_taken_total 30\n"));
  const std::vector<std::string> lines = log.lines();
  EXPECT_EQ(std::ranges::count_if(lines, [](const std::string& line) {
              return line.starts_with("warning|a training step was not taken:");
            }),
            20);
}

}  // namespace
}  // namespace perception::testing
