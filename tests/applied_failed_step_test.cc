// A training step that fails after its update was applied (as the CUDA backend's data-parallel replica check does:
// AdamW done, then DATA_LOSS): the daemon's step and weights version follow the weights and the error says so, and
// a client whose Train stream failed reports the model's step as GetStatus reads it, not the last response's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/perception_client.h"
#include "engine/config.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "tests/batch_message.h"
#include "tests/forwarding_backend.h"
#include "tests/in_process_daemon.h"
#include "tests/test_util.h"

namespace perception::server {
namespace {

using testing::BatchMessage;
using testing::ForwardingBackend;
using testing::InProcessDaemon;
using testing::MakeRandomBatch;

constexpr int kFailingStep = 2;

// Applies every training step, then fails step kFailingStep with DATA_LOSS, as a replica divergence would.
class ApplyThenFailBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>& batch) override {
    return Failed(ForwardingBackend::TrainStep(batch));
  }
  absl::StatusOr<TrainStepResult> TrainStepWithNext(const BatchView<float>& batch,
                                                    const BatchView<float>& next) override {
    return Failed(ForwardingBackend::TrainStepWithNext(batch, next));
  }
  absl::StatusOr<TrainStepResult> TrainStepStagingNext(const BatchView<float>& batch,
                                                       const BatchView<float>& next) override {
    return Failed(ForwardingBackend::TrainStepStagingNext(batch, next));
  }

 private:
  static absl::StatusOr<TrainStepResult> Failed(absl::StatusOr<TrainStepResult> result) {
    if (!result.ok() || result->step != kFailingStep) return result;
    return absl::DataLossError("replica check: the ranks' parameters differ");
  }
};

std::unique_ptr<Backend> ApplyThenFail(std::unique_ptr<Backend> backend) {
  return std::make_unique<ApplyThenFailBackend>(std::move(backend));
}

std::chrono::system_clock::time_point Deadline() { return std::chrono::system_clock::now() + std::chrono::seconds(60); }

class AppliedFailedStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const grpc::Status status = daemon_.InitTinyModel(0, false, &initialized_);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }

  v1::TrainStepRequest Request(int seed) const {
    v1::TrainStepRequest request;
    *request.mutable_batch() = BatchMessage(MakeRandomBatch(config_, config_.batch, config_.window, seed), config_);
    return request;
  }

  grpc::Status TrainStep(int seed, v1::TrainStepResponse& response) {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    return daemon_.stub().TrainStep(&context, Request(seed), &response);
  }

  v1::Model CurrentModel() {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::GetStatusResponse response;
    EXPECT_TRUE(daemon_.stub().GetStatus(&context, v1::GetStatusRequest(), &response).ok());
    return response.model();
  }

  const ModelConfig config_ = *NamedConfig("tiny");
  InProcessDaemon daemon_{ApplyThenFail, "applied_failed_step_checkpoints"};
  v1::Model initialized_;
};

// Before, the daemon kept step 1 (and its weights version) while the weights were at step 2, and the next step
// answered step 3.
TEST_F(AppliedFailedStepTest, TheStepAndWeightsVersionFollowAnAppliedStep) {
  v1::TrainStepResponse response;
  ASSERT_TRUE(TrainStep(1, response).ok());
  const grpc::Status failed = TrainStep(2, response);
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_THAT(failed.error_message(), ::testing::HasSubstr("the step was applied: the model is at step 2"));

  const v1::Model after = CurrentModel();
  EXPECT_EQ(after.step(), 2);
  EXPECT_EQ(after.weights_version(), initialized_.weights_version() + 2);
  ASSERT_TRUE(TrainStep(3, response).ok());
  EXPECT_EQ(response.step(), 3);
}

// Before, the client's error ended with the daemon's message alone, which said nothing of the step.
TEST_F(AppliedFailedStepTest, AFailedTrainStreamReportsTheModelsStep) {
  client::PerceptionClient client(daemon_.target(), {.timeout = absl::Seconds(60)});
  std::vector<int64_t> answered;
  const absl::Status trained = client.Train(
      4,
      [&](int i, v1::TrainStepRequest& request) {
        request = Request(10 + i);
        return true;
      },
      [&](const v1::TrainStepResponse& response) { answered.push_back(response.step()); });
  EXPECT_EQ(trained.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(answered, std::vector<int64_t>{1});
  EXPECT_THAT(std::string(trained.message()),
              ::testing::EndsWith("the model is at step 2 (GetStatus; the last response's step was 1)"));
  EXPECT_EQ(CurrentModel().step(), 2);
}

}  // namespace
}  // namespace perception::server
