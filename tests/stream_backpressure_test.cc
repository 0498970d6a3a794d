// The daemon's bound on queued stream events: with the device busy, Stream calls stop reading at the bound (their
// clients held back by flow control) but a call with nothing waiting reads one request; once the device is free
// every event is processed, none lost.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/config.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "tests/batch_message.h"
#include "tests/in_process_daemon.h"
#include "tests/test_util.h"

namespace perception::testing {
namespace {

constexpr int kCalls = 4, kRequests = 10, kEventsPerRequest = 5, kEvents = kRequests * kEventsPerRequest;
constexpr int64_t kMaxPending = 40;

server::StreamOptions BoundedOptions() {
  server::StreamOptions options;
  options.max_pending_events = kMaxPending;
  // No acknowledgement by time within a test: a held call must look again on its own processed events.
  options.ack_every_ms = 600'000;
  return options;
}

struct CallOutcome {
  grpc::Status status;
  uint64_t last_acked = 0;
};

class StreamBackpressureTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.InitTinyModel(3).ok()); }

  // One Stream call of instrument `instrument`: `requests` requests of `per_request` events, then the
  // acknowledgements.
  CallOutcome Stream(const std::string& instrument, uint64_t seed, int requests = kRequests,
                     int per_request = kEventsPerRequest) {
    const RandomBatch series = MakeRandomBatch(config_, 1, requests * per_request, seed);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    const auto call = daemon_.stub().Stream(&context);
    for (int r = 0; r < requests; ++r) {
      v1::StreamRequest request;
      for (int i = 0; i < per_request; ++i) {
        const int t = r * per_request + i;
        *request.add_events() = FeatureEvent(series, config_.n_features, t, instrument, t);
      }
      if (!call->Write(request)) break;
    }
    call->WritesDone();
    CallOutcome outcome;
    for (v1::StreamResponse response; call->Read(&response);) {
      for (const v1::InstrumentAck& ack : response.acks()) outcome.last_acked = ack.last_seq();
    }
    outcome.status = call->Finish();
    return outcome;
  }

  v1::ListStreamsResponse Streams() {
    grpc::ClientContext context;
    v1::ListStreamsResponse response;
    EXPECT_TRUE(daemon_.stub().ListStreams(&context, v1::ListStreamsRequest(), &response).ok());
    return response;
  }

  // Waits until at least `n` events are pending (20 s at most).
  void AwaitPending(uint64_t n) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (PendingEvents() < n && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  uint64_t PendingEvents() {
    uint64_t pending = 0;
    const v1::ListStreamsResponse streams = Streams();
    for (const v1::StreamInfo& info : streams.streams()) pending += info.pending_events();
    return pending;
  }

  const ModelConfig config_ = *NamedConfig("tiny");
  WorkerGate gate_;  // outlives the daemon, whose worker runs the gate's job
  InProcessDaemon daemon_{nullptr, "stream_backpressure_checkpoints", BoundedOptions()};
};

TEST_F(StreamBackpressureTest, CallsStopReadingAtTheBoundAndLoseNoEvent) {
  gate_.Hold(daemon_.worker());
  std::vector<CallOutcome> outcomes(kCalls);
  std::vector<std::thread> calls;
  for (int c = 0; c < kCalls; ++c) {
    calls.emplace_back([this, c, &outcomes] { outcomes[c] = Stream(absl::StrCat("I", c), 40 + c); });
  }
  AwaitPending(kMaxPending);
  // Time for the held calls to read more if they would.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const uint64_t held_pending = PendingEvents();
  EXPECT_GE(held_pending, static_cast<uint64_t>(kMaxPending));
  // Each call reads at most one request past the bound; without it all kCalls · kEvents would be queued.
  EXPECT_LE(held_pending, static_cast<uint64_t>(kMaxPending + kCalls * kEventsPerRequest));
  EXPECT_EQ(daemon_.Metric("perception_stream_pending_events"), static_cast<double>(held_pending));
  EXPECT_GE(daemon_.Metric("perception_stream_reads_held_total"), 1);
  grpc::ClientContext context;
  v1::GetStatusResponse status;
  ASSERT_TRUE(daemon_.stub().GetStatus(&context, v1::GetStatusRequest(), &status).ok());
  EXPECT_EQ(status.streaming().max_pending_events(), kMaxPending);
  EXPECT_EQ(status.streaming().pending_events(), static_cast<int64_t>(held_pending));

  gate_.Open();
  for (std::thread& call : calls) call.join();
  for (int c = 0; c < kCalls; ++c) {
    EXPECT_TRUE(outcomes[c].status.ok()) << outcomes[c].status.error_message();
    EXPECT_EQ(outcomes[c].last_acked, static_cast<uint64_t>(kEvents - 1)) << "call " << c;
  }
  const v1::ListStreamsResponse streams = Streams();
  ASSERT_EQ(streams.streams_size(), kCalls);
  for (const v1::StreamInfo& info : streams.streams()) {
    EXPECT_EQ(info.processed_events(), static_cast<uint64_t>(kEvents)) << info.instrument();
    EXPECT_EQ(info.pending_events(), 0u) << info.instrument();
  }
  EXPECT_EQ(daemon_.Metric("perception_stream_pending_events"), 0);
}

// A call with no event waiting reads one request past the bound (busy calls, which look again first after every
// tick, would otherwise win every bit of room), and then waits like the others.
TEST_F(StreamBackpressureTest, ANewCallReadsOneRequestPastTheBound) {
  gate_.Hold(daemon_.worker());
  constexpr int kFirst = kMaxPending + 5;
  CallOutcome first, second;
  std::thread first_call([&] { first = Stream("A", 50, 1, kFirst); });
  AwaitPending(kFirst);
  std::thread second_call([&] { second = Stream("B", 51, 2, kEventsPerRequest); });
  AwaitPending(kFirst + kEventsPerRequest);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(PendingEvents(), static_cast<uint64_t>(kFirst + kEventsPerRequest))
      << "the new call read no request, or a second one past the bound";
  EXPECT_GE(daemon_.Metric("perception_stream_reads_held_total"), 1);

  const auto opened = std::chrono::steady_clock::now();
  gate_.Open();
  first_call.join();
  second_call.join();
  EXPECT_LT(std::chrono::steady_clock::now() - opened, std::chrono::seconds(10)) << "a held call slept";
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(first.last_acked, static_cast<uint64_t>(kFirst - 1));
  EXPECT_EQ(second.last_acked, static_cast<uint64_t>(2 * kEventsPerRequest - 1));
}

}  // namespace
}  // namespace perception::testing
