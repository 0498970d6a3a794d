// The Train stream through the real service in process: a step is handed, as `next`, only the batch sent right
// after its own; the batches trained are the batches sent, in order; the last step stages nothing; nothing queued
// behind a failed batch is trained; a batch sent with the half-close is trained; a stream whose model another call
// replaced trains nothing on the new one; a request is parsed into a kept batch.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/config.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "server/device_worker.h"
#include "server/training.h"
#include "tests/batch_message.h"
#include "tests/in_process_daemon.h"
#include "tests/recording_backend.h"
#include "tests/test_util.h"

namespace perception::server {
namespace {

using testing::BatchContents;
using testing::BatchMessage;
using testing::InProcessDaemon;
using testing::WorkerGate;
using testing::IndexOfBatch;
using testing::IsPlainTrainStepOn;
using testing::MakeRandomBatch;
using testing::RandomBatch;
using testing::RecordTrainCalls;
using testing::TrainCall;
using testing::TrainCallLog;
using testing::TrainEntry;

std::chrono::system_clock::time_point Deadline() { return std::chrono::system_clock::now() + std::chrono::seconds(60); }

class TrainStreamHandoffTest : public ::testing::Test {
 protected:
  // Long enough that the batches after a step are read while it runs, so that hand-offs beyond the ones the test
  // arranges are likely (and counted), short enough to keep the test well under a second.
  static constexpr absl::Duration kStepDelay = absl::Milliseconds(20);

  void SetUp() override {
    const grpc::Status status = daemon_.InitTinyModel(5);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }

  ~TrainStreamHandoffTest() override { gate_.Open(); }  // a test that failed while holding the worker

  // `count` distinct random batches of the model's training shape (seeds 100, 101, ...).
  std::vector<RandomBatch> Batches(int count) const {
    std::vector<RandomBatch> batches;
    for (int i = 0; i < count; ++i) batches.push_back(MakeRandomBatch(config_, config_.batch, config_.window, 100 + i));
    return batches;
  }

  // Occupies the device worker with a job of the test's until ReleaseWorkerOnceQueued, so that a stream's steps
  // queue behind it.
  void HoldWorker() { gate_.Hold(daemon_.worker()); }
  // Waits up to 30 s for `jobs` jobs queued behind the held worker, then releases it; returns how many queued.
  int ReleaseWorkerOnceQueued(int jobs) {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (daemon_.worker().queued_jobs() < jobs && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
    const int queued = daemon_.worker().queued_jobs();
    gate_.Open();
    return queued;
  }

  const ModelConfig config_ = *NamedConfig("tiny");
  const std::shared_ptr<TrainCallLog> log_ = std::make_shared<TrainCallLog>();
  WorkerGate gate_;  // outlives the daemon, whose worker runs the gate's job
  InProcessDaemon daemon_{RecordTrainCalls(log_, kStepDelay), "train_stream_handoff_checkpoints"};
};

// `bytes` in a buffer of 16 KiB slices, as the transport delivers a large request.
grpc::ByteBuffer SlicedBytes(const std::string& bytes) {
  const std::vector<grpc::Slice> slices = testing::Slices(bytes, 16384);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// A request parsed into a spare holds exactly the message read, in the spare's batch storage; bytes that are no
// request are refused as ParseRequest refuses them.
TEST(ParseKeepingTheBatch, ParsesIntoTheBatchAlreadyThere) {
  ModelConfig config = *NamedConfig("small");
  v1::TrainStepRequest first, second, spare;
  *first.mutable_batch() = BatchMessage(MakeRandomBatch(config, config.batch, config.window, 1), config);
  *second.mutable_batch() = BatchMessage(MakeRandomBatch(config, 3, config.window, 2), config);
  grpc::ByteBuffer bytes = SlicedBytes(first.SerializeAsString());
  ASSERT_TRUE(ParseKeepingTheBatch(bytes, spare).ok());
  EXPECT_EQ(spare.SerializeAsString(), first.SerializeAsString());
  const float* const storage = spare.batch().x().data();
  bytes = SlicedBytes(second.SerializeAsString());
  ASSERT_TRUE(ParseKeepingTheBatch(bytes, spare).ok());
  EXPECT_EQ(spare.SerializeAsString(), second.SerializeAsString()) << "nothing of the first batch is left";
  EXPECT_EQ(spare.batch().x().data(), storage);
  bytes = SlicedBytes(v1::TrainStepRequest().SerializeAsString());
  ASSERT_TRUE(ParseKeepingTheBatch(bytes, spare).ok());
  EXPECT_EQ(spare.batch().x_size(), 0);
  EXPECT_EQ(spare.batch().batch(), 0);
  bytes = SlicedBytes("\xff\xff\xff\xff");
  const absl::Status refused = ParseKeepingTheBatch(bytes, spare);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(),
              ::testing::HasSubstr("a request could not be parsed as perception.v1.TrainStepRequest"));
}

TEST_F(TrainStreamHandoffTest, EachStepIsHandedOnlyTheBatchSentAfterItsOwn) {
  constexpr int kBatches = 8;
  const std::vector<RandomBatch> sent = Batches(kBatches);
  std::vector<BatchContents> sent_contents;
  for (const RandomBatch& batch : sent) sent_contents.push_back(BatchContents::Of(batch.view()));
  for (int i = 0; i < kBatches; ++i) {
    for (int j = i + 1; j < kBatches; ++j) ASSERT_FALSE(sent_contents[i] == sent_contents[j]) << i << " and " << j;
  }

  // The device is held by a job of the test's until the stream has queued as many steps as it holds unanswered
  // (TrainReactor::kMaxUnansweredSteps): then steps 0 and 1 surely start with the batch after theirs accepted.
  // Later steps find theirs accepted only if the client's next batch arrived while the step before ran (likely,
  // with kStepDelay, but timing), so for them the test asserts only that a `next` given is the right one.
  ASSERT_NO_FATAL_FAILURE(HoldWorker());

  grpc::ClientContext context;
  context.set_deadline(Deadline());
  const std::unique_ptr<grpc::ClientReaderWriter<v1::TrainStepRequest, v1::TrainStepResponse>> stream =
      daemon_.stub().Train(&context);
  // Every batch is written at once on a thread of its own while this thread reads the answers, so the client is
  // never what keeps a batch from being queued behind the running step.
  std::thread writer([&] {
    for (const RandomBatch& batch : sent) {
      v1::TrainStepRequest request;
      *request.mutable_batch() = BatchMessage(batch, config_);
      if (!stream->Write(request)) break;
    }
    stream->WritesDone();
  });
  constexpr int kQueuedBehindGate = static_cast<int>(TrainReactor::kMaxUnansweredSteps);
  const int queued = ReleaseWorkerOnceQueued(kQueuedBehindGate);

  std::vector<v1::TrainStepResponse> responses;
  for (v1::TrainStepResponse response; stream->Read(&response);) responses.push_back(response);
  writer.join();
  const grpc::Status finished = stream->Finish();
  ASSERT_TRUE(finished.ok()) << finished.error_code() << ": " << finished.error_message();
  ASSERT_EQ(queued, kQueuedBehindGate) << "the stream did not queue its steps behind the gate within 30 s";
  ASSERT_EQ(responses.size(), static_cast<size_t>(kBatches));
  for (int i = 0; i < kBatches; ++i) EXPECT_EQ(responses[i].step(), i + 1);

  const std::vector<TrainCall> calls = log_->calls();
  ASSERT_EQ(calls.size(), static_cast<size_t>(kBatches)) << "one backend training call per batch sent";
  std::vector<int> trained, handed_after;
  for (const TrainCall& call : calls) {
    trained.push_back(IndexOfBatch(call.batch, sent_contents));
    handed_after.push_back(call.next.has_value() ? IndexOfBatch(*call.next, sent_contents) : -1);
  }
  std::vector<int> in_order(kBatches);
  std::iota(in_order.begin(), in_order.end(), 0);
  EXPECT_EQ(trained, in_order) << "the batches trained, as indices of the batches sent";

  int handoffs = 0;
  for (int k = 0; k < kBatches; ++k) {
    SCOPED_TRACE(::testing::Message() << "step " << k);
    if (!calls[k].next.has_value()) {
      EXPECT_EQ(calls[k].entry, TrainEntry::kTrainStep);
      continue;
    }
    ++handoffs;
    EXPECT_EQ(calls[k].entry, TrainEntry::kTrainStepStagingNext) << "the Train stream stages through StagingNext";
    EXPECT_EQ(handed_after[k], k + 1) << "handed batch " << handed_after[k] << " (-1: none sent)";
  }
  EXPECT_TRUE(calls[0].next.has_value()) << "step 0 started with batch 1 queued behind it";
  EXPECT_TRUE(calls[1].next.has_value()) << "step 1 started with batch 2 queued behind it";
  EXPECT_FALSE(calls.back().next.has_value()) << "nothing was sent after the last batch";
  RecordProperty("handoffs", handoffs);
  std::cout << "hand-offs: " << handoffs << " of the " << kBatches - 1 << " steps with a batch sent after theirs\n";
}

// Batches queued behind one the device refuses are not trained, so a client resending from the failed batch trains
// each batch once. Before, the third batch here was trained (the model one step further than the responses said).
TEST_F(TrainStreamHandoffTest, BatchesQueuedBehindAFailedOneAreNotTrained) {
  std::vector<RandomBatch> sent = Batches(3);
  ModelConfig fewer_features = config_;
  fewer_features.n_features = config_.n_features - 2;
  sent[1] = MakeRandomBatch(fewer_features, config_.batch, config_.window, 7);  // consistent, but not the model's
  ASSERT_NO_FATAL_FAILURE(HoldWorker());

  grpc::ClientContext context;
  context.set_deadline(Deadline());
  const std::unique_ptr<grpc::ClientReaderWriter<v1::TrainStepRequest, v1::TrainStepResponse>> stream =
      daemon_.stub().Train(&context);
  for (int i = 0; i < 3; ++i) {
    v1::TrainStepRequest request;
    *request.mutable_batch() = BatchMessage(sent[i], i == 1 ? fewer_features : config_);
    ASSERT_TRUE(stream->Write(request));
  }
  stream->WritesDone();
  const int queued = ReleaseWorkerOnceQueued(3);
  ASSERT_EQ(queued, 3) << "the three batches were not all queued behind the gate within 30 s";

  std::vector<v1::TrainStepResponse> responses;
  for (v1::TrainStepResponse response; stream->Read(&response);) responses.push_back(response);
  const grpc::Status finished = stream->Finish();
  EXPECT_EQ(finished.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << finished.error_message();
  EXPECT_THAT(finished.error_message(), ::testing::HasSubstr("features"));
  ASSERT_EQ(responses.size(), 1u);
  EXPECT_EQ(responses[0].step(), 1);
  // Only the batch before the failed one reached the backend; the dropped step told it to forget any batch a step
  // before staged as its next, before that batch's memory was freed for a later one to reuse (the CUDA backend knows
  // a staged batch by its address).
  const std::vector<TrainCall> calls = log_->calls();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(IndexOfBatch(calls[0].batch, {BatchContents::Of(sent[0].view())}), 0);
  EXPECT_EQ(calls[1].entry, TrainEntry::kForgetStagedNext);

  // The next step is the model's second.
  v1::TrainStepRequest request;
  *request.mutable_batch() = BatchMessage(sent[2], config_);
  grpc::ClientContext unary;
  unary.set_deadline(Deadline());
  v1::TrainStepResponse response;
  ASSERT_TRUE(daemon_.stub().TrainStep(&unary, request, &response).ok());
  EXPECT_EQ(response.step(), 2);
}

// A stream reads its next request as soon as a batch is in, so the read that finds the client's half-close can come
// back while that batch is still being parsed: the batch is trained all the same. Each stream here sends one batch
// with its half-close (a write marked last), a batch of many windows, whose parse takes a while.
TEST_F(TrainStreamHandoffTest, ABatchSentWithTheHalfCloseIsTrained) {
  constexpr int kWindows = 1024, kStreams = 24;
  v1::InitModelRequest init;
  init.set_config_name("tiny");
  init.set_batch(kWindows);
  init.set_seed(5);
  init.set_replace(true);
  const grpc::Status initialized = daemon_.Call(&v1::Perception::Stub::InitModel, init);
  ASSERT_TRUE(initialized.ok()) << initialized.error_message();
  for (int i = 0; i < kStreams; ++i) {
    SCOPED_TRACE(::testing::Message() << "stream " << i);
    const RandomBatch batch = MakeRandomBatch(config_, kWindows, config_.window, 200 + i);
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    const std::unique_ptr<grpc::ClientReaderWriter<v1::TrainStepRequest, v1::TrainStepResponse>> stream =
        daemon_.stub().Train(&context);
    v1::TrainStepRequest request;
    *request.mutable_batch() = BatchMessage(batch, config_);
    ASSERT_TRUE(stream->Write(request, grpc::WriteOptions().set_last_message()));
    std::vector<v1::TrainStepResponse> responses;
    for (v1::TrainStepResponse response; stream->Read(&response);) responses.push_back(response);
    const grpc::Status finished = stream->Finish();
    ASSERT_TRUE(finished.ok()) << finished.error_code() << ": " << finished.error_message();
    ASSERT_EQ(responses.size(), 1u);
    EXPECT_EQ(responses[0].step(), i + 1);
  }
  EXPECT_EQ(log_->calls().size(), static_cast<size_t>(kStreams));
}

// Before, the stream went on training whatever model was installed, answering every batch as a success.
TEST_F(TrainStreamHandoffTest, AStreamWhoseModelWasReplacedEndsAborted) {
  const std::vector<RandomBatch> sent = Batches(2);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  const std::unique_ptr<grpc::ClientReaderWriter<v1::TrainStepRequest, v1::TrainStepResponse>> stream =
      daemon_.stub().Train(&context);
  v1::TrainStepRequest request;
  *request.mutable_batch() = BatchMessage(sent[0], config_);
  ASSERT_TRUE(stream->Write(request));
  v1::TrainStepResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.step(), 1);

  ASSERT_TRUE(daemon_.InitTinyModel(6, /*replace=*/true).ok());

  *request.mutable_batch() = BatchMessage(sent[1], config_);
  stream->Write(request);  // may fail once the stream has ended
  stream->WritesDone();
  EXPECT_FALSE(stream->Read(&response)) << "step " << response.step() << " answered on the new model";
  const grpc::Status finished = stream->Finish();
  EXPECT_EQ(finished.error_code(), grpc::StatusCode::ABORTED) << finished.error_message();
  EXPECT_THAT(finished.error_message(), ::testing::HasSubstr("model was replaced"));

  grpc::ClientContext status_context;
  status_context.set_deadline(Deadline());
  v1::GetStatusResponse status;
  ASSERT_TRUE(daemon_.stub().GetStatus(&status_context, v1::GetStatusRequest(), &status).ok());
  EXPECT_EQ(status.model().step(), 0) << "the new model was trained";
  const std::vector<TrainCall> calls = log_->calls();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_NE(calls[0].entry, TrainEntry::kForgetStagedNext);
  EXPECT_EQ(calls[1].entry, TrainEntry::kForgetStagedNext) << "the dropped step's, and no training call after it";
}

// SetOptimizer keeps the model (weights, moments, step), so a stream goes on across it.
TEST_F(TrainStreamHandoffTest, AStreamGoesOnAcrossSetOptimizer) {
  const std::vector<RandomBatch> sent = Batches(2);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  const std::unique_ptr<grpc::ClientReaderWriter<v1::TrainStepRequest, v1::TrainStepResponse>> stream =
      daemon_.stub().Train(&context);
  v1::TrainStepRequest request;
  *request.mutable_batch() = BatchMessage(sent[0], config_);
  ASSERT_TRUE(stream->Write(request));
  v1::TrainStepResponse response;
  ASSERT_TRUE(stream->Read(&response));

  v1::SetOptimizerRequest set;
  set.mutable_optimizer()->set_lr(5e-4);
  grpc::ClientContext set_context;
  set_context.set_deadline(Deadline());
  v1::SetOptimizerResponse changed;
  ASSERT_TRUE(daemon_.stub().SetOptimizer(&set_context, set, &changed).ok());

  *request.mutable_batch() = BatchMessage(sent[1], config_);
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.step(), 2);
  const grpc::Status finished = stream->Finish();
  EXPECT_TRUE(finished.ok()) << finished.error_message();
}

TEST_F(TrainStreamHandoffTest, UnaryTrainStepStagesNothing) {
  const RandomBatch batch = Batches(1).front();
  v1::TrainStepRequest request;
  *request.mutable_batch() = BatchMessage(batch, config_);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  v1::TrainStepResponse response;
  const grpc::Status status = daemon_.stub().TrainStep(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.step(), 1);

  const std::vector<TrainCall> calls = log_->calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_TRUE(IsPlainTrainStepOn(calls[0], batch.view()));
}

}  // namespace
}  // namespace perception::server
