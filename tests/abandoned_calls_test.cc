// Unary calls whose client stopped waiting before the device took them up (deadline passed, cancelled) change
// nothing: the client was told they failed, so a change made afterwards would be one it retries or never learns of.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/config.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "server/device_worker.h"
#include "tests/batch_message.h"
#include "tests/in_process_daemon.h"
#include "tests/test_util.h"

namespace perception::server {
namespace {

using testing::BatchMessage;
using testing::FeatureEvent;
using testing::InProcessDaemon;
using testing::WorkerGate;
using testing::MakeRandomBatch;

std::chrono::system_clock::time_point In(std::chrono::milliseconds delay) {
  return std::chrono::system_clock::now() + delay;
}
constexpr std::chrono::seconds kPatient(60);
constexpr std::chrono::milliseconds kImpatient(100);

class AbandonedCallsTest : public ::testing::Test {
 protected:
  // A model at step 2 whose step-1 state is saved as kCheckpoint.
  void SetUp() override {
    const grpc::Status status = daemon_.InitTinyModel(3);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(Train(kPatient).error_code(), grpc::StatusCode::OK);
    v1::SaveCheckpointRequest save;
    save.set_name(kCheckpoint);
    grpc::ClientContext save_context;
    save_context.set_deadline(In(kPatient));
    v1::SaveCheckpointResponse saved;
    ASSERT_TRUE(daemon_.stub().SaveCheckpoint(&save_context, save, &saved).ok());
    ASSERT_EQ(Train(kPatient).error_code(), grpc::StatusCode::OK);
  }

  ~AbandonedCallsTest() override { gate_.Open(); }  // a test that failed while holding the worker

  grpc::Status Train(std::chrono::milliseconds timeout) {
    v1::TrainStepRequest request;
    *request.mutable_batch() = BatchMessage(MakeRandomBatch(config_, config_.batch, config_.window, 11), config_);
    grpc::ClientContext context;
    context.set_deadline(In(timeout));
    v1::TrainStepResponse response;
    return daemon_.stub().TrainStep(&context, request, &response);
  }

  v1::Model CurrentModel() {
    grpc::ClientContext context;
    context.set_deadline(In(kPatient));
    v1::GetStatusResponse response;
    EXPECT_TRUE(daemon_.stub().GetStatus(&context, v1::GetStatusRequest(), &response).ok());
    return response.model();
  }

  // Occupies the device worker with a job of the test's until ReleaseWorker, as a long evaluation would.
  void HoldWorker() { gate_.Hold(daemon_.worker()); }
  // Opens the gate and returns once every job queued behind it has run.
  void ReleaseWorker() {
    gate_.Open();
    ASSERT_TRUE(daemon_.worker().Run(JobPriority::kTraining, [](ModelHost&) { return absl::OkStatus(); }).ok());
  }

  static constexpr char kCheckpoint[] = "step1.safetensors";
  const ModelConfig config_ = *NamedConfig("tiny");
  WorkerGate gate_;  // outlives the daemon, whose worker runs the gate's job
  InProcessDaemon daemon_{nullptr, "abandoned_calls_checkpoints"};
};

// Before, both ran once the device was free: the step trained the batch (step 3), the load put step 1 back.
TEST_F(AbandonedCallsTest, CallsWhoseDeadlinePassedInTheQueueChangeNothing) {
  const v1::Model before = CurrentModel();
  ASSERT_EQ(before.step(), 2);
  ASSERT_NO_FATAL_FAILURE(HoldWorker());

  EXPECT_EQ(Train(kImpatient).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  v1::LoadCheckpointRequest load;
  load.set_name(kCheckpoint);
  EXPECT_EQ(daemon_.Call(&v1::Perception::Stub::LoadCheckpoint, load, kImpatient).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(daemon_.worker().queued_jobs(), 2) << "both calls wait behind the gate";
  ASSERT_NO_FATAL_FAILURE(ReleaseWorker());

  const v1::Model after = CurrentModel();
  EXPECT_EQ(after.step(), before.step());
  EXPECT_EQ(after.weights_version(), before.weights_version());
}

TEST_F(AbandonedCallsTest, ACallTheClientCancelledInTheQueueChangesNothing) {
  const v1::Model before = CurrentModel();
  ASSERT_NO_FATAL_FAILURE(HoldWorker());

  v1::SetOptimizerRequest request;
  request.mutable_optimizer()->set_lr(before.optimizer().lr() * 2);
  grpc::ClientContext context;
  context.set_deadline(In(kPatient));
  grpc::Status answer;
  std::thread caller([&] {
    v1::SetOptimizerResponse response;
    answer = daemon_.stub().SetOptimizer(&context, request, &response);
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (daemon_.worker().queued_jobs() < 1 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(daemon_.worker().queued_jobs(), 1) << "the call did not queue within 30 s";
  context.TryCancel();
  caller.join();
  EXPECT_EQ(answer.error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_NO_FATAL_FAILURE(ReleaseWorker());

  EXPECT_EQ(CurrentModel().optimizer().lr(), before.optimizer().lr());
}

// Before, each ran once the device was free: the reset and the seed replaced A's state (a client told they failed
// would then stream on from a state it did not expect), the read marked A's convictions read back (a drain could then
// exit before the client read them), and the close forgot A's log.
TEST_F(AbandonedCallsTest, StreamingCallsWhoseDeadlinePassedInTheQueueChangeNothing) {
  const testing::RandomBatch series = MakeRandomBatch(config_, 1, 8, 21);
  const auto events = [&](const std::string& instrument, int from, int to) {
    std::vector<v1::StreamEvent> events;
    for (int t = from; t < to; ++t) events.push_back(FeatureEvent(series, config_.n_features, t, instrument, t));
    return events;
  };
  ASSERT_TRUE(daemon_.Stream({events("A", 0, 3)}).status.ok());
  ASSERT_EQ(daemon_.streams().NotReadBack().convictions, 3u);
  ASSERT_NO_FATAL_FAILURE(HoldWorker());

  using Stub = v1::Perception::Stub;
  v1::ResetStreamRequest reset;
  reset.set_instrument("A");
  EXPECT_EQ(daemon_.Call(&Stub::ResetStream, reset, kImpatient).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  v1::SeedStreamRequest seed;
  seed.set_instrument("A");
  for (const v1::StreamEvent& event : events("A", 4, 6)) *seed.add_events() = event;
  EXPECT_EQ(daemon_.Call(&Stub::SeedStream, seed, kImpatient).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  v1::ReadConvictionsRequest read;
  read.set_instrument("A");
  EXPECT_EQ(daemon_.Call(&Stub::ReadConvictions, read, kImpatient).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  v1::CloseStreamRequest close;
  close.set_instrument("A");
  EXPECT_EQ(daemon_.Call(&Stub::CloseStream, close, kImpatient).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(daemon_.worker().queued_jobs(), 4) << "the four calls wait behind the gate";
  ASSERT_NO_FATAL_FAILURE(ReleaseWorker());

  EXPECT_EQ(daemon_.streams().NotReadBack().convictions, 3u) << "no page was read back";
  // A's state is the one its three events left: its fourth event's conviction is that of B, fed the same four.
  ASSERT_TRUE(daemon_.Stream({events("A", 3, 4), events("B", 0, 4)}).status.ok());
  const v1::ReadConvictionsResponse a = daemon_.ReadConvictions("A"), b = daemon_.ReadConvictions("B");
  ASSERT_EQ(a.convictions_size(), 4);
  ASSERT_EQ(b.convictions_size(), 4);
  EXPECT_EQ(a.first_seq(), 0u);
  EXPECT_EQ(a.convictions(3), b.convictions(3));
}

// A Stream or Train call whose client went quiet until its deadline passed, or cancelled it, after the call had
// answered all it had sent: the failed read ended the call's input as a half-close does, and the call was recorded
// (perception_rpc_session_seconds, the log) as OK when gRPC reported the cancellation after it had finished.
TEST_F(AbandonedCallsTest, StreamingCallsTheClientAbandonedAreRecordedAsTheClientSawThem) {
  // Time for the first acknowledgement or step to come back, under ThreadSanitizer too, before the client goes quiet.
  constexpr std::chrono::milliseconds kBriefDeadline(1500);
  const testing::RandomBatch series = MakeRandomBatch(config_, 1, 8, 21);
  const auto stream_then_leave = [&](const std::string& instrument, bool cancel) {
    grpc::ClientContext context;
    context.set_deadline(In(cancel ? kPatient : kBriefDeadline));
    const auto call = daemon_.stub().Stream(&context);
    v1::StreamRequest request;
    *request.add_events() = FeatureEvent(series, config_.n_features, 0, instrument, 1);
    request.set_ack(true);
    v1::StreamResponse ack;
    EXPECT_TRUE(call->Write(request));
    EXPECT_TRUE(call->Read(&ack));
    EXPECT_EQ(ack.processed_events(), 1);
    if (cancel) context.TryCancel();
    EXPECT_FALSE(call->Read(&ack));
    return call->Finish().error_code();
  };
  const auto train_then_leave = [&]() {
    grpc::ClientContext context;
    context.set_deadline(In(kBriefDeadline));
    const auto call = daemon_.stub().Train(&context);
    v1::TrainStepRequest request;
    *request.mutable_batch() = BatchMessage(MakeRandomBatch(config_, config_.batch, config_.window, 12), config_);
    v1::TrainStepResponse response;
    EXPECT_TRUE(call->Write(request));
    EXPECT_TRUE(call->Read(&response));
    EXPECT_FALSE(call->Read(&response));
    return call->Finish().error_code();
  };
  EXPECT_EQ(stream_then_leave("quiet", /*cancel=*/false), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(stream_then_leave("cancelled", /*cancel=*/true), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(train_then_leave(), grpc::StatusCode::DEADLINE_EXCEEDED);

  // Recorded as gRPC finishes with each call (OnDone), which may come just after the client's Finish returns.
  const auto count = [&](const std::string& code, const std::string& method) {
    return daemon_.Metric(absl::StrCat("perception_rpc_session_seconds_count{code=\"", code, "\",method=\"",
                                       method, "\"}"));
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline && (count("DEADLINE_EXCEEDED", "Stream") < 1 || count("CANCELLED", "Stream") < 1 ||
                                    count("DEADLINE_EXCEEDED", "Train") < 1)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(count("DEADLINE_EXCEEDED", "Stream"), 1);
  EXPECT_EQ(count("CANCELLED", "Stream"), 1);
  EXPECT_EQ(count("DEADLINE_EXCEEDED", "Train"), 1);
  EXPECT_EQ(count("OK", "Stream"), -1) << "no Stream call of this test ended OK";
  EXPECT_EQ(count("OK", "Train"), -1) << "no Train call of this test ended OK";
}

}  // namespace
}  // namespace perception::server
