// A streaming tick the device fails, through the service in process: the instruments it held stop, no event is
// skipped or logged twice, their streams can be reset or closed and the model replaced, and the daemon keeps serving.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/perception_client.h"
#include "client/stream_commands.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "engine/cpu_reference.h"
#include "engine/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "tests/batch_message.h"
#include "tests/forwarding_backend.h"
#include "tests/in_process_daemon.h"
#include "tests/lobster_samples.h"
#include "tests/test_util.h"

namespace perception::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// What the decorated backends do wrong, set by the test while the daemon runs.
struct StreamFaults {
  std::atomic<bool> refuse_streaming{false};  // ConfigureStreaming fails, as for a model the kernels cannot stream
  std::atomic<bool> streaming_out_of_memory{false};  // ConfigureStreaming cannot allocate the slots and logs
  std::atomic<bool> streaming_throws{false};  // ConfigureStreaming runs the host out of memory (std::bad_alloc)
  std::atomic<int> failing_ticks{0};          // the next ForwardStepInto calls fail, as on a device error
  std::atomic<bool> tick_out_of_memory{false};  // the next ForwardStepInto runs the host out of memory
  std::atomic<int> failing_seeds{0};          // the next AdvanceSlot calls write the slot, then fail
  std::atomic<int> failing_tick_in{0};        // the ForwardStepInto call this many from now fails (1: the next)
  std::atomic<bool> slow_ticks{false};        // CheckTicks without a wait: every tick since the last wait unfinished
  std::atomic<bool> ticks_unknown{false};     // CheckTicks fails, as on a device error
  std::atomic<bool> hold_ticks{false};        // CheckTicks with a wait waits until this is cleared...
  std::atomic<int> ticks_held{0};             // ...and counts its waits here
  std::atomic<int> failing_resets{0};         // the next ResetSlot calls fail
  std::atomic<bool> seed_failure_fails_reset{false};  // the ResetSlot after a failing_seeds AdvanceSlot fails
  std::atomic<bool> hold_launch{false};       // ForwardStepInto waits, before launching, until this is cleared...
  std::atomic<int> launches_held{0};          // ...and counts its waits here
  std::atomic<int> nonfinite_slot{-1};        // the next CheckTicks with a wait also reports this slot's...
  std::atomic<int64_t> nonfinite_entry{0};    // ...log entry's output as not finite...
  std::atomic<bool> nonfinite_unwaited{false};  // ...or, with slow_ticks, the next without a wait
  // And what they were given: every event's Δt the ticks carried, in order.
  absl::Mutex mu;
  std::vector<float> dt_ticked ABSL_GUARDED_BY(mu);
};

class StreamFaultBackend final : public ForwardingBackend {
 public:
  StreamFaultBackend(std::unique_ptr<Backend> inner, std::shared_ptr<StreamFaults> faults)
      : ForwardingBackend(std::move(inner)), faults_(std::move(faults)) {}

  absl::Status ConfigureStreaming(int slots, int64_t log_entries_per_slot) override {
    if (faults_->refuse_streaming) return absl::InvalidArgumentError("this model's streaming step is not supported");
    if (faults_->streaming_out_of_memory) {
      return absl::ResourceExhaustedError("cannot allocate the streams' states and conviction logs: out of memory");
    }
    if (faults_->streaming_throws.exchange(false)) throw std::bad_alloc();
    return ForwardingBackend::ConfigureStreaming(slots, log_entries_per_slot);
  }
  absl::Status ForwardStepInto(const StreamTick& tick) override {
    if (faults_->failing_tick_in > 0 && --faults_->failing_tick_in == 0) faults_->failing_ticks = 1;
    if (faults_->hold_launch) {
      ++faults_->launches_held;
      while (faults_->hold_launch) absl::SleepFor(absl::Milliseconds(1));
    }
    if (faults_->tick_out_of_memory.exchange(false)) throw std::bad_alloc();
    if (faults_->failing_ticks.fetch_sub(1) > 0) return absl::InternalError("an injected device error");
    faults_->failing_ticks = 0;
    RETURN_IF_ERROR(ForwardingBackend::ForwardStepInto(tick));
    {
      absl::MutexLock lock(&faults_->mu);
      faults_->dt_ticked.insert(faults_->dt_ticked.end(), tick.dt.begin(), tick.dt.end());
    }
    ++running_;
    return absl::OkStatus();
  }
  absl::StatusOr<TicksChecked> CheckTicks(bool wait_for_ticks) override {
    if (faults_->ticks_unknown) return absl::InternalError("an injected error asking which ticks finished");
    if (faults_->slow_ticks && !wait_for_ticks) {
      TicksChecked unfinished{running_, {}, {}, {}};
      // As a backend may: a non-finite output found while its tick, or one after it, is still running.
      if (faults_->nonfinite_unwaited && faults_->nonfinite_slot >= 0) {
        unfinished.nonfinite.push_back({faults_->nonfinite_slot.exchange(-1), faults_->nonfinite_entry});
      }
      return unfinished;
    }
    if (wait_for_ticks && faults_->hold_ticks) {
      ++faults_->ticks_held;
      while (faults_->hold_ticks) absl::SleepFor(absl::Milliseconds(1));
    }
    running_ = 0;
    ASSIGN_OR_RETURN(TicksChecked checked, ForwardingBackend::CheckTicks(wait_for_ticks));
    if (wait_for_ticks && faults_->nonfinite_slot >= 0) {
      checked.nonfinite.push_back({faults_->nonfinite_slot.exchange(-1), faults_->nonfinite_entry});
    }
    return checked;
  }
  absl::Status ResetSlot(int slot) override {
    if (faults_->failing_resets.fetch_sub(1) > 0) return absl::InternalError("an injected reset failure");
    faults_->failing_resets = 0;
    return ForwardingBackend::ResetSlot(slot);
  }
  absl::Status AdvanceSlot(int slot, std::span<const float> x, std::span<const float> dt) override {
    const absl::Status seeded = ForwardingBackend::AdvanceSlot(slot, x, dt);
    if (faults_->failing_seeds.fetch_sub(1) > 0) {
      if (faults_->seed_failure_fails_reset.exchange(false)) faults_->failing_resets = 1;
      return absl::InternalError("an injected seed failure");
    }
    faults_->failing_seeds = 0;
    return seeded;
  }

 private:
  const std::shared_ptr<StreamFaults> faults_;
  int64_t running_ = 0;  // ticks since CheckTicks last answered all finished
};

std::chrono::system_clock::time_point Deadline() { return std::chrono::system_clock::now() + std::chrono::seconds(60); }

class StreamFailureTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(InitModel().ok()); }

  // The tiny model from kSeed, replacing the one there.
  grpc::Status InitModel() { return daemon_.InitTinyModel(kSeed, /*replace=*/true); }

  // Event `t` of the instrument's random series, with sequence number `seq`.
  v1::StreamEvent Event(const std::string& instrument, int t, uint64_t seq) const {
    return FeatureEvent(instrument == "A" ? a_ : b_, config_.n_features, t, instrument, seq);
  }

  absl::StatusOr<uint64_t> Close(const std::string& instrument) {
    grpc::ClientContext context;
    v1::CloseStreamRequest request;
    request.set_instrument(instrument);
    v1::CloseStreamResponse response;
    const grpc::Status status = daemon_.stub().CloseStream(&context, request, &response);
    if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
    return response.processed_events();
  }

  // The tiny model from kSeed for LOBSTER books of `levels` levels, replacing the one there.
  void InitLobsterModel(int levels) {
    v1::InitModelRequest init;
    init.set_config_name("tiny");
    init.set_levels(levels);
    init.set_seed(kSeed);
    init.set_replace(true);
    ASSERT_TRUE((daemon_.Call(&v1::Perception::Stub::InitModel, init).ok()));
  }

  // perceptionctl stream's options for the shipped AAPL 10-level files, as instrument AAPL.
  static client::StreamOptions AaplOptions() {
    client::StreamOptions options;
    options.files = {ShippedLobsterPath("AAPL", "orderbook", 10), ShippedLobsterPath("AAPL", "message", 10), 10};
    options.instrument = "AAPL";
    return options;
  }

  // perceptionctl streams AAPL's events 0 to 2 as seq 1 to 3, then event 3 as seq 4 in a tick the device fails: the
  // instrument stops at seq 4. `options` are the failed run's.
  void StreamThreeThenStopAtFour(client::PerceptionClient& client, client::StreamOptions& options) {
    options.count = 3;
    ASSERT_TRUE(client::StreamLobster(client, options).ok());
    faults_->failing_ticks = 1;
    options.first = 3;
    options.count = 1;
    options.start_seq = 4;
    EXPECT_EQ(client::StreamLobster(client, options).code(), absl::StatusCode::kInternal);
    ASSERT_THAT(daemon_.Streams()["AAPL"].stopped(), HasSubstr("then from seq 4"));
  }

  // Seeds the instrument with its series' events [from, to).
  grpc::Status Seed(const std::string& instrument, int from, int to) {
    std::vector<v1::StreamEvent> window;
    for (int t = from; t < to; ++t) window.push_back(Event(instrument, t, 0));
    return daemon_.SeedStream(instrument, window);
  }

  // Convictions of the instrument's events [from, to) streamed from a zero state, by the model on the CPU: the first
  // event's Δt is 0 (MODEL.md §1), as the daemon takes it.
  std::vector<float> Offline(const std::string& instrument, int from, int to) const {
    const RandomBatch& series = instrument == "A" ? a_ : b_;
    const std::unique_ptr<Backend> model = MakeCpuBackend(config_, OptimizerConfig{}, InitialParams(config_, kSeed));
    const int F = config_.n_features, H = config_.n_horizons, n = to - from;
    std::vector<float> dt(series.dt.begin() + from, series.dt.begin() + to);
    dt[0] = 0.f;
    std::vector<float> logits(static_cast<size_t>(n) * H);
    EXPECT_TRUE(model->ForwardStream(std::span<const float>(series.x).subspan(from * F, n * F), dt, logits).ok());
    std::vector<float> convictions;
    for (int i = 0; i < n; ++i) {
      convictions.push_back(Conviction<float>(std::span<const float>(logits).subspan(i * H, H)));
    }
    return convictions;
  }

  // The daemon's count of streamed events refused for `reason`.
  double Refused(const std::string& reason) const {
    return daemon_.Metric(absl::StrCat("perception_stream_events_rejected_total{reason=\"", reason, "\"}"));
  }
  // ... because their instrument was stopped.
  double RefusedAsStopped() const { return Refused("stopped"); }

  // With hold_failure_notices_ set, a failed tick's calls hear of it only once the test has sent its next request:
  // failure_stopped_ tells the test that the instruments are stopped (or closed), and the notices wait (up to 30 s)
  // until the daemon has refused an event as stopped (or, with hold_until_call_ended_, as sent after its call failed).
  void BeforeFailureNotices() {
    if (drain_before_failure_notices_) daemon_.BeginDrain();
    if (!hold_failure_notices_) return;
    failure_stopped_.Notify();
    const std::string reason = hold_until_call_ended_ ? "call_ended" : "stopped";
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (Refused(reason) < 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  }

  // Reads the call's responses to its end, expecting no acknowledgement (nothing of the call was processed), and
  // returns its status.
  static grpc::Status FinishUnacknowledged(grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>& call) {
    for (v1::StreamResponse response; call.Read(&response);) {
      EXPECT_EQ(response.acks_size(), 0) << "nothing of the call was processed";
    }
    return call.Finish();
  }

  static constexpr uint64_t kSeed = 5;
  // The status of a call whose one event, A's seq 2, was in the injected failed tick.
  static constexpr char kFailedFromTwo[] =
      "the device failed a streaming tick (an injected device error); 1 events of this call were not processed: 'A' "
      "from seq 2";
  const ModelConfig config_ = *NamedConfig("tiny");
  const RandomBatch a_ = MakeRandomBatch(config_, 1, 8, 31), b_ = MakeRandomBatch(config_, 1, 8, 32);
  const std::shared_ptr<StreamFaults> faults_ = std::make_shared<StreamFaults>();
  std::atomic<bool> hold_failure_notices_{false};
  std::atomic<bool> hold_until_call_ended_{false};
  std::atomic<bool> drain_before_failure_notices_{false};  // the drain reaches the calls ahead of a failure's notices
  absl::Notification failure_stopped_;
  InProcessDaemon daemon_{[faults = faults_](std::unique_ptr<Backend> backend) -> std::unique_ptr<Backend> {
                            return std::make_unique<StreamFaultBackend>(std::move(backend), faults);
                          },
                          "stream_failure_checkpoints",
                          [this] {
                            server::StreamOptions options;
                            options.before_failure_notices = [this] { BeforeFailureNotices(); };
                            return options;
                          }()};
};

TEST_F(StreamFailureTest, AFailedTickStopsItsInstrumentsUntilResetAndSkipsNoEvent) {
  StreamOutcome first = daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2), Event("A", 2, 3), Event("B", 0, 1)}});
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.acked["A"], 3u);

  // One request: its first tick takes A's seq 4 and B's seq 2 and fails; A's 5 and 6 wait behind it.
  faults_->failing_ticks = 1;
  StreamOutcome failed = daemon_.Stream({{Event("A", 3, 4), Event("A", 4, 5), Event("A", 5, 6), Event("B", 1, 2)}});
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(failed.status.error_message(),
              HasSubstr("the device failed a streaming tick (an injected device error)"));
  EXPECT_THAT(failed.status.error_message(), HasSubstr("4 events of this call were not processed: 'A' from seq 4, "
                                                       "'B' from seq 2"));
  EXPECT_TRUE(failed.acked.empty()) << "nothing of the call was processed";
  EXPECT_EQ(daemon_.Metric("perception_stream_events_dropped_total{reason=\"failed_tick\"}"), 4);
  EXPECT_EQ(daemon_.Metric("perception_stream_events_dropped_total{reason=\"nonfinite_output\"}"), 0);

  std::map<std::string, v1::StreamInfo> streams = daemon_.Streams();
  EXPECT_EQ(streams["A"].processed_events(), 3u);
  EXPECT_EQ(streams["A"].last_accepted_seq(), 3u) << "the events dropped are no longer accepted";
  EXPECT_EQ(streams["A"].pending_events(), 0u);
  EXPECT_EQ(streams["B"].processed_events(), 1u);
  EXPECT_THAT(streams["A"].stopped(), HasSubstr("instrument 'A' stopped at seq 4 when the device failed its tick"));

  // Stopped: neither the next number nor the one it stopped at is taken until a reset.
  for (const uint64_t seq : {4u, 7u}) {
    const StreamOutcome refused = daemon_.Stream({{Event("A", 3, seq)}});
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << seq;
    EXPECT_THAT(refused.status.error_message(), HasSubstr("instrument 'A' stopped at seq 4 when the device failed"));
  }
  const absl::StatusOr<uint64_t> closed = Close("B");
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(*closed, 1u);

  // After ResetStream, A takes its events again from seq 4, from a zero state.
  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  EXPECT_EQ(daemon_.Streams()["A"].stopped(), "") << "streaming again";
  const StreamOutcome resumed = daemon_.Stream({{Event("A", 3, 4), Event("A", 4, 5), Event("A", 5, 6)}});
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  EXPECT_EQ(resumed.acked.at("A"), 6u);
  const v1::ReadConvictionsResponse log = daemon_.ReadConvictions("A");
  ASSERT_EQ(log.seqs_size(), 6) << "one entry for each of seq 1..6, none for the failed tick";
  EXPECT_EQ(log.first_seq(), 1u);
  std::vector<float> expected = Offline("A", 0, 3);
  const std::vector<float> after_reset = Offline("A", 3, 6);
  expected.insert(expected.end(), after_reset.begin(), after_reset.end());
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(log.convictions(i), expected[i], 1e-6) << "seq " << i + 1;
}

// A std::bad_alloc on the device worker ended the daemon; now the tick fails as a device error does.
TEST_F(StreamFailureTest, ATickThatRunsTheHostOutOfMemoryStopsItsInstrumentsAndTheDaemonGoesOn) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1)}}).status.ok());
  faults_->tick_out_of_memory = true;
  const StreamOutcome failed = daemon_.Stream({{Event("A", 1, 2), Event("B", 0, 1)}});
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(failed.status.error_message(), HasSubstr("(cannot allocate this tick: out of host memory)"));
  EXPECT_THAT(failed.status.error_message(), HasSubstr("'A' from seq 2, 'B' from seq 1"));
  EXPECT_THAT(daemon_.Streams()["A"].stopped(), HasSubstr("instrument 'A' stopped at seq 2"));

  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  ASSERT_TRUE(daemon_.ResetStream("B").ok());
  const StreamOutcome resumed = daemon_.Stream({{Event("A", 1, 2), Event("B", 0, 1)}});
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  EXPECT_EQ(resumed.acked.at("A"), 2u);
  EXPECT_EQ(daemon_.ReadConvictions("A").seqs_size(), 2);
}

// A tick that fails while the one before it may still be running: the device, asked with a wait, says that one
// finished, so its events are processed and acknowledged, and only the failed tick's and those queued behind it fail.
TEST_F(StreamFailureTest, ATickFailingBehindAnUnfinishedOneFailsOnlyItsOwnEventsOnceTheDeviceSaysTheFirstFinished) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}}).status.ok());
  faults_->slow_ticks = true;
  faults_->failing_tick_in = 2;  // the first tick takes A's 3 and B's 1, the second A's 4 and fails
  const StreamOutcome failed = daemon_.Stream({{Event("A", 2, 3), Event("A", 3, 4), Event("A", 4, 5),
                                                Event("B", 0, 1)}});
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(failed.status.error_message(), HasSubstr("2 events of this call were not processed: 'A' from seq 4"));
  EXPECT_EQ(failed.acked.at("A"), 3u);
  EXPECT_EQ(failed.acked.at("B"), 1u);
  std::map<std::string, v1::StreamInfo> streams = daemon_.Streams();
  EXPECT_EQ(streams["A"].processed_events(), 3u);
  EXPECT_EQ(streams["B"].processed_events(), 1u);
  EXPECT_THAT(streams["A"].stopped(), HasSubstr("instrument 'A' stopped at seq 4 when the device failed its tick"));
  EXPECT_EQ(daemon_.ReadConvictions("A").convictions_size(), 3);
}

// While the device runs a tick, ListStreams counts its events pending, not processed: its processed_events and end_seq
// move with the acknowledgements, so they never take back an event (a tick found not finite drops its entries).
TEST_F(StreamFailureTest, ListStreamsCountsATicksEventsProcessedOnlyOnceTheDeviceFinishedIt) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}}).status.ok());
  faults_->slow_ticks = true;
  faults_->hold_ticks = true;
  StreamOutcome held;
  std::thread call([&] { held = daemon_.Stream({{Event("A", 2, 3), Event("B", 0, 1)}}); });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (faults_->ticks_held == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(faults_->ticks_held, 1) << "the batcher never waited for the tick";
  std::map<std::string, v1::StreamInfo> streams = daemon_.Streams();
  EXPECT_EQ(streams["A"].processed_events(), 2u);
  EXPECT_EQ(streams["A"].pending_events(), 1u);
  EXPECT_EQ(streams["A"].end_seq(), 3u);
  EXPECT_EQ(streams["A"].last_accepted_seq(), 3u);
  EXPECT_EQ(streams["B"].processed_events(), 0u);
  EXPECT_EQ(streams["B"].pending_events(), 1u);
  faults_->hold_ticks = false;
  call.join();
  ASSERT_TRUE(held.status.ok()) << held.status.error_message();
  streams = daemon_.Streams();
  EXPECT_EQ(streams["A"].processed_events(), 3u);
  EXPECT_EQ(streams["A"].pending_events(), 0u);
  EXPECT_EQ(streams["A"].end_seq(), 4u);
  EXPECT_EQ(streams["B"].processed_events(), 1u);
}

// From the moment a tick takes its events from the queues until the device has finished it, ForwardStepInto included,
// ListStreams counts them pending and the drain unread: a drain that began meanwhile would otherwise find nothing left
// to read back and exit before the tick's convictions could be read.
TEST_F(StreamFailureTest, ATicksEventsAreCountedWhileItLaunches) {
  faults_->hold_launch = true;
  StreamOutcome held;
  std::thread call([&] { held = daemon_.Stream({{Event("A", 0, 1)}}); });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (faults_->launches_held == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(faults_->launches_held, 1) << "the tick never launched";
  const v1::StreamInfo launching = daemon_.Streams()["A"];
  EXPECT_EQ(launching.processed_events(), 0u);
  EXPECT_EQ(launching.pending_events(), 1u);
  const server::StreamBatcher::Unread unread = daemon_.streams().NotReadBack();
  EXPECT_FALSE(unread.none());
  EXPECT_EQ(unread.convictions, 1u);
  faults_->hold_launch = false;
  call.join();
  ASSERT_TRUE(held.status.ok()) << held.status.error_message();
  EXPECT_EQ(daemon_.Streams()["A"].processed_events(), 1u);
  EXPECT_EQ(daemon_.streams().NotReadBack().convictions, 1u);
}

// SetNormalizer keeps the streams, and their queued events had been checked under the normalizer before it: ticked
// under the new one, an event within the bound before went beyond it (its feature 0 at 1e17 standard deviations) and
// the model ran on it, its conviction acknowledged. Its instrument now stops at its first event not processed, its
// queued events dropped and counted, and the call is told where it resumes.
TEST_F(StreamFailureTest, ANormalizerThatPutsQueuedEventsBeyondTheBoundStopsTheirInstrument) {
  constexpr int kEvents = 40, kFirstFar = 35;  // the worker takes 16 streaming jobs, then SetNormalizer's
  std::vector<v1::StreamEvent> events;
  for (int i = 0; i < kEvents; ++i) {
    events.push_back(Event("A", i % 8, i + 1));
    if (i + 1 >= kFirstFar) events.back().mutable_features()->set_features(0, 1e10f);  // 1e10 from the identity's
  }
  faults_->hold_launch = true;
  // As on a GPU: the ticks launched while others follow are not finished yet when they launch, so the ticks before
  // the stop wait for a tick after it, which then has no event to take.
  faults_->slow_ticks = true;
  StreamOutcome outcome;
  std::thread call([&] {
    outcome = daemon_.Stream({{events[0]}, std::vector<v1::StreamEvent>(events.begin() + 1, events.end())});
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (faults_->launches_held == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(faults_->launches_held, 1) << "the tick never launched";
  while (daemon_.Streams()["A"].pending_events() < kEvents && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(daemon_.Streams()["A"].pending_events(), static_cast<uint64_t>(kEvents));
  v1::SetNormalizerRequest set;
  for (int f = 0; f < config_.n_features; ++f) {
    set.mutable_normalizer()->add_mean(0.f);
    set.mutable_normalizer()->add_inv_std(f == 0 ? 1e7f : 1.f);
  }
  const int queued_before = daemon_.worker().queued_jobs();
  grpc::Status normalized;
  std::thread setter([&] { normalized = daemon_.Call(&v1::Perception::Stub::SetNormalizer, set); });
  while (daemon_.worker().queued_jobs() == queued_before && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  faults_->hold_launch = false;
  call.join();
  setter.join();
  ASSERT_TRUE(normalized.ok()) << normalized.error_message();
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << outcome.status.error_message();
  ASSERT_EQ(outcome.acked.count("A"), 1u) << outcome.status.error_message();
  const uint64_t stop = outcome.acked.at("A") + 1;
  ASSERT_LT(stop, static_cast<uint64_t>(kFirstFar)) << "SetNormalizer ran after the far events' ticks";
  EXPECT_THAT(outcome.status.error_message(),
              HasSubstr(absl::StrCat(kEvents + 1 - stop, " events of this call were not processed. instrument 'A' "
                                     "stopped at seq ", stop, ": its event of seq ", kFirstFar, ", queued when "
                                     "SetNormalizer replaced the normalizer, is beyond what the model takes under the "
                                     "new one (feature 0 is 1e+10, 1e+17 standard deviations")));
  EXPECT_THAT(outcome.status.error_message(),
              HasSubstr(absl::StrCat("it takes no events until ResetStream, SeedStream or CloseStream, then from seq ",
                                     stop)));
  const v1::StreamInfo stopped = daemon_.Streams()["A"];
  EXPECT_EQ(stopped.processed_events(), stop - 1);
  EXPECT_EQ(stopped.pending_events(), 0u);
  EXPECT_EQ(stopped.next_seq(), stop);
  EXPECT_THAT(stopped.stopped(), HasSubstr(absl::StrCat("stopped at seq ", stop)));
  EXPECT_EQ(daemon_.Metric("perception_stream_events_dropped_total{reason=\"standardized_bound\"}"),
            static_cast<double>(kEvents + 1 - stop));
  // After a reset it takes the events from the stop on, those within the bound.
  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  const std::vector<v1::StreamEvent> resumed(events.begin() + static_cast<std::ptrdiff_t>(stop - 1),
                                             events.begin() + kFirstFar - 1);
  const StreamOutcome again = daemon_.Stream({resumed});
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.acked.at("A"), static_cast<uint64_t>(kFirstFar - 1));
}

// A tick fails while one before it, still unfinished, holds an output that was not finite, found only when the failure
// makes the batcher wait for the device: the instrument stops where its output went non-finite, and the failed tick's
// later event of it fails with that stop, so that the call and ListStreams name the seq its log resumes from.
TEST_F(StreamFailureTest, AnOutputFoundNotFiniteAsATickFailsStopsItsInstrumentWhereTheOutputWent) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}}).status.ok());
  faults_->nonfinite_entry = 2;  // seq 3
  faults_->nonfinite_slot = daemon_.Streams()["A"].slot();
  faults_->slow_ticks = true;
  faults_->failing_tick_in = 2;  // the first tick takes A's 3 and B's 1, the second A's 4 and fails
  const StreamOutcome failed = daemon_.Stream({{Event("A", 2, 3), Event("A", 3, 4), Event("B", 0, 1)}});
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << failed.status.error_message();
  EXPECT_THAT(failed.status.error_message(), HasSubstr("2 events of this call were not processed. instrument 'A' "
                                                       "stopped at seq 3: the model's output"));
  EXPECT_THAT(failed.status.error_message(), Not(HasSubstr("seq 4")));
  // Each dropped event counted once, under the stop that dropped it.
  EXPECT_EQ(daemon_.Metric("perception_stream_events_dropped_total{reason=\"nonfinite_output\"}"), 2);
  EXPECT_EQ(daemon_.Metric("perception_stream_events_dropped_total{reason=\"failed_tick\"}"), 0);
  EXPECT_EQ(failed.acked.count("A"), 0u);
  EXPECT_EQ(failed.acked.at("B"), 1u);
  std::map<std::string, v1::StreamInfo> streams = daemon_.Streams();
  EXPECT_EQ(streams["A"].processed_events(), 2u);
  EXPECT_EQ(streams["A"].end_seq(), 3u);
  EXPECT_EQ(streams["A"].last_accepted_seq(), 2u);
  EXPECT_THAT(streams["A"].stopped(), HasSubstr("then from seq 3"));
  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  faults_->slow_ticks = false;
  const StreamOutcome resumed = daemon_.Stream({{Event("A", 2, 3)}});
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  EXPECT_EQ(resumed.acked.at("A"), 3u);
}

// An output found not finite while the ticks are still running, by a check that does not wait, stops its instrument
// and with it every event that was to follow; the ticks still running are then waited for, so that the other
// instrument's event in them is acknowledged now rather than by whatever streaming work comes next.
TEST_F(StreamFailureTest, AStopThatLeavesNoTickToFollowStillWaitsForTheTicksRunning) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}}).status.ok());
  faults_->nonfinite_entry = 2;  // seq 3
  faults_->nonfinite_unwaited = true;
  faults_->nonfinite_slot = daemon_.Streams()["A"].slot();
  faults_->slow_ticks = true;
  const StreamOutcome stopped = daemon_.Stream({{Event("A", 2, 3), Event("A", 3, 4), Event("B", 0, 1)}});
  EXPECT_EQ(stopped.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << stopped.status.error_message();
  EXPECT_THAT(stopped.status.error_message(), HasSubstr("instrument 'A' stopped at seq 3"));
  EXPECT_EQ(stopped.acked.at("B"), 1u);
  EXPECT_EQ(daemon_.Streams()["B"].processed_events(), 1u);
}

// A device that cannot say whether the ticks it was given finished: their events are not acknowledged, their log
// entries leave the logs, and their instruments stop at the first of them, as after a failed tick.
TEST_F(StreamFailureTest, TicksTheDeviceCannotSayFinishedFailTheirEventsAndLeaveNoEntries) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}}).status.ok());
  faults_->ticks_unknown = true;
  const StreamOutcome failed = daemon_.Stream({{Event("A", 2, 3), Event("A", 3, 4), Event("B", 0, 1)}});
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(failed.status.error_message(), HasSubstr("an injected error asking which ticks finished"));
  EXPECT_THAT(failed.status.error_message(), HasSubstr("3 events of this call were not processed: 'A' from seq 3, "
                                                       "'B' from seq 1"));
  EXPECT_TRUE(failed.acked.empty()) << "nothing of the call is known processed";
  faults_->ticks_unknown = false;
  std::map<std::string, v1::StreamInfo> streams = daemon_.Streams();
  EXPECT_EQ(streams["A"].processed_events(), 2u) << "the entry of seq 3 left the log";
  EXPECT_EQ(streams["A"].end_seq(), 3u);
  EXPECT_EQ(streams["A"].last_accepted_seq(), 2u);
  EXPECT_EQ(streams["B"].processed_events(), 0u);
  EXPECT_THAT(streams["A"].stopped(), HasSubstr("instrument 'A' stopped at seq 3 when the device failed its tick"));
  EXPECT_EQ(daemon_.ReadConvictions("A").convictions_size(), 2);
  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  const StreamOutcome resumed = daemon_.Stream({{Event("A", 2, 3)}});
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  EXPECT_EQ(resumed.acked.at("A"), 3u);
}

// A request a call sends while its failed tick is being reported is refused, as the tick stopped its instrument; the
// call still ends with the failure's status, which says where the instrument resumes, the refusal added to it.
TEST_F(StreamFailureTest, ARequestRefusedWhileTheFailureIsOnItsWayLeavesTheFailureTheCallsStatus) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1)}}).status.ok());
  faults_->failing_ticks = 1;
  hold_failure_notices_ = true;
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  const auto call = daemon_.stub().Stream(&context);
  v1::StreamRequest failing, refused;
  *failing.add_events() = Event("A", 1, 2);
  *refused.add_events() = Event("A", 2, 3);
  ASSERT_TRUE(call->Write(failing));
  ASSERT_TRUE(failure_stopped_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(call->Write(refused));
  call->WritesDone();
  const grpc::Status status = FinishUnacknowledged(*call);
  EXPECT_EQ(RefusedAsStopped(), 1) << "the second request was read, and refused, before the failure's notice";
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(kFailedFromTwo));
  EXPECT_THAT(status.error_message(), HasSubstr("Besides, a request of this call was refused: event 0 (instrument "
                                                "'A', seq 3): instrument 'A' stopped at seq 2"));
}

// A drain that reaches a call before its failed tick's notice (a lost device begins one as it fails the ticks) leaves
// the failure the call's status, which says where each instrument resumes, the drain added to it.
TEST_F(StreamFailureTest, ADrainThatReachesTheCallFirstLeavesTheFailureTheCallsStatus) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1)}}).status.ok());
  faults_->failing_ticks = 1;
  drain_before_failure_notices_ = true;
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  const auto call = daemon_.stub().Stream(&context);
  v1::StreamRequest failing;
  *failing.add_events() = Event("A", 1, 2);
  ASSERT_TRUE(call->Write(failing));
  const grpc::Status status = FinishUnacknowledged(*call);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(kFailedFromTwo));
  EXPECT_THAT(status.error_message(), HasSubstr("Besides, the call stopped reading its requests when the daemon began "
                                                "to drain: perceptiond is draining before it exits"));
}

// A seed the device fails after writing the slot: a live stream stops (its state is neither the old one nor the
// seeded one) until it is reset; a stream the seed opened is closed again, its slot zeroed for the next owner.
TEST_F(StreamFailureTest, ASeedTheDeviceFailsStopsALiveStreamAndLeavesNoNewOne) {
  const StreamOutcome first = daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}});
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  faults_->failing_seeds = 1;
  const grpc::Status failed = Seed("A", 2, 6);
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::INTERNAL) << failed.error_message();
  EXPECT_THAT(daemon_.Streams()["A"].stopped(),
              HasSubstr("instrument 'A' stopped when its seed failed (an injected seed failure)"));
  // The field names where the stream resumes, as a failed tick's does (ListStreams' proto says so).
  EXPECT_THAT(daemon_.Streams()["A"].stopped(),
              HasSubstr("until ResetStream, SeedStream or CloseStream, then from seq 3"));
  const StreamOutcome refused = daemon_.Stream({{Event("A", 2, 3)}});
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("its state is not the one its events led to"));
  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  const StreamOutcome resumed = daemon_.Stream({{Event("A", 2, 3), Event("A", 3, 4)}});
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  const v1::ReadConvictionsResponse log = daemon_.ReadConvictions("A");
  ASSERT_EQ(log.seqs_size(), 4);
  std::vector<float> expected = Offline("A", 0, 2);
  const std::vector<float> after_reset = Offline("A", 2, 4);
  expected.insert(expected.end(), after_reset.begin(), after_reset.end());
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(log.convictions(i), expected[i], 1e-6) << "seq " << i + 1;

  faults_->failing_seeds = 1;
  EXPECT_EQ(Seed("B", 0, 4).error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(daemon_.Streams().count("B"), 0u) << "the failed seed's own stream is closed";
  const StreamOutcome fresh = daemon_.Stream({{Event("B", 0, 1), Event("B", 1, 2)}});
  ASSERT_TRUE(fresh.status.ok()) << fresh.status.error_message();
  const v1::ReadConvictionsResponse b = daemon_.ReadConvictions("B");
  ASSERT_EQ(b.seqs_size(), 2);
  const std::vector<float> from_zero = Offline("B", 0, 2);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(b.convictions(i), from_zero[i], 1e-6) << "B seq " << i + 1;
}

// A seed that fails on a new instrument whose slot then cannot be zeroed: the stream stays open (the slot must not
// pass to another instrument with this state) and stopped, so that its events do not step from what the seed left.
TEST_F(StreamFailureTest, AFailedSeedWhoseSlotCannotBeZeroedLeavesItsNewStreamStopped) {
  faults_->failing_seeds = 1;
  faults_->seed_failure_fails_reset = true;
  EXPECT_EQ(Seed("C", 0, 4).error_code(), grpc::StatusCode::INTERNAL);
  std::map<std::string, v1::StreamInfo> streams = daemon_.Streams();
  ASSERT_EQ(streams.count("C"), 1u) << "the slot, not zeroed, stays the instrument's";
  EXPECT_THAT(streams["C"].stopped(),
              HasSubstr("instrument 'C' stopped when its seed failed (an injected seed failure)"));
  EXPECT_THAT(streams["C"].stopped(), HasSubstr("then from any seq (none yet)"));
  const StreamOutcome refused = daemon_.Stream({{Event("C", 0, 1)}});
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(daemon_.ResetStream("C").ok());
  const StreamOutcome fresh = daemon_.Stream({{Event("C", 0, 1)}});
  ASSERT_TRUE(fresh.status.ok()) << fresh.status.error_message();
  EXPECT_EQ(fresh.acked.at("C"), 1u);
}

// Where streaming cannot start, the device never held the instruments of the failed tick: they close (no slot is kept,
// nothing is stopped), their next events try again, and the model can be replaced at once.
TEST_F(StreamFailureTest, AModelThatCannotStreamClosesTheStreamsItFailedAndCanBeReplaced) {
  faults_->refuse_streaming = true;
  ASSERT_TRUE(InitModel().ok());
  const StreamOutcome failed = daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}});
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(failed.status.error_message(),
              HasSubstr("streaming could not start (this model's streaming step is not supported); 2 events of this "
                        "call were not processed: 'A' from seq 1. Nothing of them reached the device, and each "
                        "instrument named was closed"));
  EXPECT_EQ(daemon_.Streams().count("A"), 0u);
  const StreamOutcome again = daemon_.Stream({{Event("A", 0, 5)}});
  EXPECT_EQ(again.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(again.status.error_message(), HasSubstr("streaming could not start")) << "tried again, not stopped";

  faults_->refuse_streaming = false;
  const grpc::Status replaced = InitModel();
  ASSERT_TRUE(replaced.ok()) << replaced.error_message();
  const StreamOutcome streamed = daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}});
  ASSERT_TRUE(streamed.status.ok()) << streamed.status.error_message();
  const v1::ReadConvictionsResponse log = daemon_.ReadConvictions("A");
  ASSERT_EQ(log.seqs_size(), 2);
  const std::vector<float> expected = Offline("A", 0, 2);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(log.convictions(i), expected[i], 1e-6) << "seq " << i + 1;
}

// Slots and logs that do not fit (a --stream_log_entries too large for the device) end the call RESOURCE_EXHAUSTED,
// as the flags' own refusals do, and hold no slot: once memory is found the same instruments stream from their start.
TEST_F(StreamFailureTest, StreamingWithoutTheMemoryItNeedsIsResourceExhaustedAndHoldsNoSlot) {
  faults_->streaming_out_of_memory = true;
  const StreamOutcome failed = daemon_.Stream({{Event("A", 0, 1), Event("B", 0, 1), Event("A", 1, 2)}});
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << failed.status.error_message();
  EXPECT_THAT(failed.status.error_message(),
              HasSubstr("streaming could not start (cannot allocate the streams' states and conviction logs: out of "
                        "memory); 3 events of this call were not processed: 'A' from seq 1, 'B' from seq 1"));
  EXPECT_TRUE(daemon_.Streams().empty());

  faults_->streaming_out_of_memory = false;
  const StreamOutcome streamed = daemon_.Stream({{Event("A", 0, 1), Event("B", 0, 1), Event("A", 1, 2)}});
  ASSERT_TRUE(streamed.status.ok()) << streamed.status.error_message();
  EXPECT_EQ(streamed.acked.at("A"), 2u);
  EXPECT_EQ(daemon_.ReadConvictions("B").seqs_size(), 1);
}

// A start of streaming that fails closes the instruments it took events of, and its calls hear of it once the lock is
// let go. A request one of them sent meanwhile reopened a closed instrument at its own first seq from a zero state:
// the events before it were lost, and their resend, which the failure's status invites, was refused as repeated. It
// is refused now (a failure that clears, as here, would otherwise have streamed it), the call ends with the failure,
// and the instrument streams from its first event again.
TEST_F(StreamFailureTest, ARequestReadWhileAFailedStartIsOnItsWayReopensNoInstrument) {
  faults_->streaming_out_of_memory = true;
  hold_failure_notices_ = true;
  hold_until_call_ended_ = true;
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  const auto call = daemon_.stub().Stream(&context);
  v1::StreamRequest failing, next;
  *failing.add_events() = Event("A", 0, 1);
  *next.add_events() = Event("A", 1, 2);
  ASSERT_TRUE(call->Write(failing));
  ASSERT_TRUE(failure_stopped_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  faults_->streaming_out_of_memory = false;
  ASSERT_TRUE(call->Write(next));
  call->WritesDone();
  const grpc::Status status = FinishUnacknowledged(*call);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("streaming could not start (cannot allocate the streams' states and "
                                                "conviction logs: out of memory); 1 events of this call were not "
                                                "processed: 'A' from seq 1"));
  EXPECT_THAT(status.error_message(), HasSubstr("Besides, a request of this call was refused: event 0 (instrument "
                                                "'A', seq 2): this call's earlier events were not processed"));
  EXPECT_EQ(Refused("call_ended"), 1);
  EXPECT_TRUE(daemon_.Streams().empty()) << "A was not opened again at seq 2";

  const StreamOutcome resent = daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}});
  ASSERT_TRUE(resent.status.ok()) << resent.status.error_message();
  EXPECT_EQ(resent.acked.at("A"), 2u);
}

// A seed job that runs the host out of memory outside the parts' own guards (here configuring streaming, which its
// first job does) answers RESOURCE_EXHAUSTED and gives the slot back: before, the stream it opened stayed "being
// seeded", refusing every event, reset, close and seed until the daemon restarted.
TEST_F(StreamFailureTest, ASeedWhoseJobRunsTheHostOutOfMemoryGivesItsSlotBack) {
  faults_->streaming_throws = true;
  EXPECT_EQ(Seed("A", 0, 4).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(daemon_.Streams().count("A"), 0u) << "the stream the seed opened is closed";
  ASSERT_TRUE(Seed("A", 0, 4).ok());
  const StreamOutcome streamed = daemon_.Stream({{Event("A", 4, 1)}});
  ASSERT_TRUE(streamed.status.ok()) << streamed.status.error_message();
}

// An instrument stopped at its very first event (nothing of it processed) resumes from that event after a reset, as
// its stop says: a later number would skip events. ListStreams names the number it takes next (none for a stream
// that has taken no event, which takes any).
TEST_F(StreamFailureTest, AnInstrumentStoppedAtItsFirstEventResumesFromThatEventAfterAReset) {
  ASSERT_TRUE(Seed("B", 0, 4).ok());
  EXPECT_FALSE(daemon_.Streams()["B"].has_next_seq()) << "no event yet: any number";
  faults_->failing_ticks = 1;
  const StreamOutcome failed = daemon_.Stream({{Event("A", 0, 10)}});
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL) << failed.status.error_message();
  EXPECT_THAT(daemon_.Streams()["A"].stopped(), HasSubstr("then from seq 10"));
  EXPECT_FALSE(daemon_.Streams()["A"].has_last_accepted_seq()) << "every event it took was dropped";
  EXPECT_EQ(daemon_.Streams()["A"].next_seq(), 10u);
  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  const StreamOutcome skipping = daemon_.Stream({{Event("A", 0, 12)}});
  EXPECT_EQ(skipping.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(skipping.status.error_message(), HasSubstr("sequence number 12 out of order, expected 10 (skipped)"));
  const StreamOutcome resumed = daemon_.Stream({{Event("A", 0, 10), Event("A", 1, 11)}});
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  EXPECT_EQ(resumed.acked.at("A"), 11u);
  EXPECT_EQ(daemon_.Streams()["A"].next_seq(), 12u);
  const v1::ReadConvictionsResponse log = daemon_.ReadConvictions("A");
  ASSERT_EQ(log.seqs_size(), 2);
  EXPECT_EQ(log.first_seq(), 10u);
}

// A LOBSTER stream's Δt comes from the exchange's whole nanoseconds also a month after its first event: the daemon
// handed the featurizer seconds in a double, whose nanoseconds rounded from 2^51 ns (26 days) on, so a 1 ms Δt there
// came out 0.999999 ms (another float than the file's, or a client's own features', for the same events).
TEST_F(StreamFailureTest, ALobsterStreamsDtIsExactAMonthAfterItsFirstEvent) {
  ASSERT_NO_FATAL_FAILURE(InitLobsterModel(1));
  constexpr int64_t kFirst = 1'340'265'600'000'000'000;   // 2012-06-21 00:00 UTC
  constexpr int64_t kMonth = 2'419'200'000'000'002;        // 28 days and 2 ns
  std::vector<v1::StreamEvent> events;
  for (const int64_t after : {int64_t{0}, kMonth, kMonth + 1'000'000}) {
    v1::StreamEvent& event = events.emplace_back();
    event.set_instrument("L");
    event.set_seq(events.size());
    event.set_exchange_time_ns(kFirst + after);
    for (const int64_t value : {2'239'500 + static_cast<int64_t>(events.size()) * 100, int64_t{100}, int64_t{2'231'800},
                                int64_t{300}}) {
      event.mutable_lobster()->add_book(value);
    }
    event.mutable_lobster()->set_type(1);
    event.mutable_lobster()->set_direction(-1);
  }
  const StreamOutcome streamed = daemon_.Stream({events});
  ASSERT_TRUE(streamed.status.ok()) << streamed.status.error_message();
  absl::MutexLock lock(&faults_->mu);
  EXPECT_EQ(faults_->dt_ticked, (std::vector<float>{0.f, static_cast<float>(static_cast<double>(kMonth) * 1e-9),
                                                    static_cast<float>(1'000'000 * 1e-9)}));
}

// ResetStream and SeedStream start the stream afresh, its times included: a feed replayed on one clock (epoch
// nanoseconds) and then streamed on another (nanoseconds after midnight) was refused after the reset, and its seed
// window too, for times more than 1e9 s from the first clock's first event (a review).
TEST_F(StreamFailureTest, AResetOrSeededStreamTakesItsFirstEventOnAnotherClock) {
  ASSERT_NO_FATAL_FAILURE(InitLobsterModel(1));
  const auto row = [](uint64_t seq, int64_t time_ns) {
    v1::StreamEvent event;
    event.set_instrument("L");
    event.set_seq(seq);
    event.set_exchange_time_ns(time_ns);
    for (const int64_t value : {int64_t{2'239'500}, int64_t{100}, int64_t{2'231'800}, int64_t{300}}) {
      event.mutable_lobster()->add_book(value);
    }
    event.mutable_lobster()->set_type(1);
    event.mutable_lobster()->set_direction(-1);
    return event;
  };
  constexpr int64_t kEpoch = 1'700'000'000'000'000'000, kAfterMidnight = 34'200'000'000'000;
  ASSERT_TRUE(daemon_.Stream({{row(1, kEpoch), row(2, kEpoch + 1'000)}}).status.ok());
  ASSERT_TRUE(daemon_.ResetStream("L").ok());
  const StreamOutcome after_reset = daemon_.Stream({{row(3, kAfterMidnight), row(4, kAfterMidnight + 5'000)}});
  ASSERT_TRUE(after_reset.status.ok()) << after_reset.status.error_message();
  const grpc::Status seeded = daemon_.SeedStream("L", {row(0, kEpoch), row(0, kEpoch + 2'000)});
  ASSERT_TRUE(seeded.ok()) << seeded.error_message();
  const StreamOutcome after_seed = daemon_.Stream({{row(5, kEpoch + 3'000)}});
  ASSERT_TRUE(after_seed.status.ok()) << after_seed.status.error_message();
  absl::MutexLock lock(&faults_->mu);
  EXPECT_EQ(faults_->dt_ticked, (std::vector<float>{0.f, 1e-6f, 0.f, 5e-6f, 1e-6f}))
      << "each first event's Δt 0, the others' from their own clock";
}

// perceptionctl's seed-window check reads ListStreams' next_seq: onto an instrument stopped at its first event (seq
// 10), a seeded stream that would start elsewhere is refused before anything is sent, and one that starts there
// streams.
TEST_F(StreamFailureTest, ASeedWindowOntoAnInstrumentStoppedAtItsFirstEventMustStartWhereItStopped) {
  ASSERT_NO_FATAL_FAILURE(InitLobsterModel(10));
  client::PerceptionClient client(daemon_.target());
  client::StreamOptions options = AaplOptions();
  options.count = 1;
  options.start_seq = 10;
  faults_->failing_ticks = 1;
  EXPECT_EQ(client::StreamLobster(client, options).code(), absl::StatusCode::kInternal);
  ASSERT_EQ(daemon_.Streams()["AAPL"].next_seq(), 10u);
  ASSERT_TRUE(daemon_.ResetStream("AAPL").ok());
  options.seed_window = 5;
  options.count = 10;
  options.start_seq = 20;  // (the stream after the window would start at 25)
  const absl::Status refused = client::StreamLobster(client, options);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("instrument AAPL takes seq 10 next, but the stream after the seed window "
                                           "would start at 25 (--start_seq 5 continues it, the files' event 5 "
                                           "taking seq 10)"));
  options.start_seq = 5;
  const absl::Status streamed = client::StreamLobster(client, options);
  ASSERT_TRUE(streamed.ok()) << streamed;
  EXPECT_EQ(daemon_.Streams()["AAPL"].next_seq(), 15u);
}

// perceptionctl's seed-window check onto a stopped instrument with events: it advised "stream without it to continue
// (--start_seq N)", which the stopped instrument would refuse too. It now says the instrument is stopped and that
// --reseed seeds it again; with --reseed, the seeded stream resumes where the instrument stopped.
TEST_F(StreamFailureTest, ASeedWindowOntoAStoppedInstrumentSaysItIsStoppedAndTakesReseed) {
  ASSERT_NO_FATAL_FAILURE(InitLobsterModel(10));
  client::PerceptionClient client(daemon_.target());
  client::StreamOptions options = AaplOptions();
  ASSERT_NO_FATAL_FAILURE(StreamThreeThenStopAtFour(client, options));
  options.first = 2;  // events 2 and 3 seed it, 4 to 6 stream as seq 4 to 6
  options.count = 5;
  options.start_seq = 2;
  options.seed_window = 2;
  const absl::Status refused = client::StreamLobster(client, options);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("instrument AAPL is stopped (instrument 'AAPL' stopped at seq 4"));
  EXPECT_THAT(refused.message(), HasSubstr("pass --reseed to let --seed-window seed it again, the stream after the "
                                           "window starting at seq 4"));
  options.reseed = true;
  const absl::Status reseeded = client::StreamLobster(client, options);
  ASSERT_TRUE(reseeded.ok()) << reseeded;
  EXPECT_EQ(daemon_.Streams()["AAPL"].next_seq(), 7u);
  EXPECT_TRUE(daemon_.Streams()["AAPL"].stopped().empty());
}

// perceptionctl's numbering check onto a stopped instrument: the --start_seq it names would be refused as well, the
// instrument being stopped, so it says so and names the reset; after the reset that run streams.
TEST_F(StreamFailureTest, AStreamThatWouldNotContinueAStoppedInstrumentNamesTheResetToo) {
  ASSERT_NO_FATAL_FAILURE(InitLobsterModel(10));
  client::PerceptionClient client(daemon_.target());
  client::StreamOptions options = AaplOptions();
  ASSERT_NO_FATAL_FAILURE(StreamThreeThenStopAtFour(client, options));
  options.start_seq = 1;
  const absl::Status refused = client::StreamLobster(client, options);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("instrument AAPL takes seq 4 next, but this run would start at seq 1"));
  EXPECT_THAT(refused.message(), HasSubstr(". It is stopped as well (instrument 'AAPL' stopped at seq 4"));
  EXPECT_THAT(refused.message(), HasSubstr("either run needs `perceptionctl streams reset AAPL` first"));
  ASSERT_TRUE(daemon_.ResetStream("AAPL").ok());
  options.start_seq = 4;
  const absl::Status streamed = client::StreamLobster(client, options);
  ASSERT_TRUE(streamed.ok()) << streamed;
  EXPECT_EQ(daemon_.Streams()["AAPL"].next_seq(), 5u);
}

// An instrument stopped at its first event has no state to lose: a seed window that resumes where it stopped needs no
// --reseed (the check for stopped instruments with events must not catch it).
TEST_F(StreamFailureTest, ASeedWindowOntoAnInstrumentStoppedAtItsFirstEventNeedsNoReseed) {
  ASSERT_NO_FATAL_FAILURE(InitLobsterModel(10));
  client::PerceptionClient client(daemon_.target());
  client::StreamOptions options = AaplOptions();
  options.count = 1;
  options.start_seq = 10;
  faults_->failing_ticks = 1;
  EXPECT_EQ(client::StreamLobster(client, options).code(), absl::StatusCode::kInternal);
  ASSERT_FALSE(daemon_.Streams()["AAPL"].stopped().empty());
  options.seed_window = 5;
  options.count = 10;
  options.start_seq = 5;  // the stream after the window starts at 10, where it stopped
  const absl::Status seeded = client::StreamLobster(client, options);
  ASSERT_TRUE(seeded.ok()) << seeded;
  EXPECT_EQ(daemon_.Streams()["AAPL"].next_seq(), 15u);
}

// A ReadConvictions whose caller stopped waiting while its job ran (here its deadline passed while the job waited for
// the device) leaves the convictions unread: the drain, which waits for every conviction to be read back, still waits
// for them.
TEST_F(StreamFailureTest, AReadWhoseCallerStoppedWaitingLeavesItsConvictionsUnread) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}}).status.ok());
  ASSERT_EQ(daemon_.streams().NotReadBack().convictions, 2u);
  faults_->hold_ticks = true;  // (the read's job waits in its CheckTicks for the ticks to finish, after it started)
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(2);
  std::thread release([&] {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (faults_->ticks_held == 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
    std::this_thread::sleep_until(deadline + std::chrono::milliseconds(300));
    faults_->hold_ticks = false;
  });
  grpc::ClientContext context;
  context.set_deadline(deadline);
  v1::ReadConvictionsRequest request;
  request.set_instrument("A");
  v1::ReadConvictionsResponse response;
  const grpc::Status status = daemon_.stub().ReadConvictions(&context, request, &response);
  release.join();
  ASSERT_EQ(faults_->ticks_held, 1) << "the read's job started before the deadline";
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_TRUE(daemon_.ResetStream("A").ok());  // (a job queued behind the read's: that one has finished)
  EXPECT_EQ(daemon_.streams().NotReadBack().convictions, 2u) << "the caller never got them";
  EXPECT_EQ(daemon_.ReadConvictions("A").seqs_size(), 2);
  EXPECT_EQ(daemon_.streams().NotReadBack().convictions, 0u);
}

// Two calls stream one instrument and its tick fails: each call is told where the instrument resumes (its first event
// not processed, the first call's), not the call's own first event.
TEST_F(StreamFailureTest, EveryCallOfAStoppedInstrumentIsToldWhereItResumes) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1)}}).status.ok());
  faults_->hold_launch = true;
  faults_->failing_ticks = 1;
  StreamOutcome first, second;
  std::thread first_call([&] { first = daemon_.Stream({{Event("A", 1, 2)}}); });
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (faults_->launches_held == 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  std::thread second_call([&] { second = daemon_.Stream({{Event("A", 2, 3)}}); });
  while (daemon_.Streams()["A"].last_accepted_seq() != 3u && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(faults_->launches_held, 1);
  EXPECT_EQ(daemon_.Streams()["A"].last_accepted_seq(), 3u) << "the second call's event waits behind the held tick";
  faults_->hold_launch = false;
  first_call.join();
  second_call.join();
  EXPECT_THAT(first.status.error_message(), HasSubstr(kFailedFromTwo));
  EXPECT_THAT(second.status.error_message(), HasSubstr("1 events of this call were not processed: 'A' from seq 2"));
  EXPECT_THAT(daemon_.Streams()["A"].stopped(), HasSubstr("then from seq 2"));
}

// A call whose instrument A was stopped (an output not finite) and whose instrument B's tick then fails is told of
// both: B's stop and its events not processed are named after A's.
TEST_F(StreamFailureTest, ASecondFailureOfACallIsNamedAfterTheFirst) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1)}}).status.ok());
  faults_->nonfinite_entry = 1;  // A's seq 2
  faults_->nonfinite_unwaited = true;
  faults_->nonfinite_slot = daemon_.Streams()["A"].slot();
  faults_->slow_ticks = true;
  faults_->failing_tick_in = 2;  // tick 1: A's seq 2 and B's 1; tick 2: B's 2 fails
  const StreamOutcome out = daemon_.Stream(
      {{Event("A", 1, 2), Event("A", 2, 3), Event("B", 0, 1), Event("B", 1, 2), Event("B", 2, 3)}});
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << out.status.error_message();
  EXPECT_THAT(out.status.error_message(), HasSubstr("instrument 'A' stopped at seq 2: the model's output"));
  EXPECT_THAT(out.status.error_message(),
              HasSubstr(". Then the device failed a streaming tick (an injected device error); 2 events of this call "
                        "were not processed: 'B' from seq 2"));
  EXPECT_THAT(daemon_.Streams()["B"].stopped(), HasSubstr("instrument 'B' stopped at seq 2"));
}

// A request that a call's read takes in after the call's failure (the read was under way) is neither processed nor
// refused event by event: the call's status names its events as not taken, each instrument from its first.
TEST_F(StreamFailureTest, ARequestReadAfterTheCallsFailureIsNamedAsNotTaken) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1)}}).status.ok());
  faults_->nonfinite_entry = 1;  // A's seq 2
  faults_->nonfinite_unwaited = true;
  faults_->nonfinite_slot = daemon_.Streams()["A"].slot();
  faults_->slow_ticks = true;
  faults_->hold_ticks = true;  // the last tick's wait holds the call open after A's stop reached it
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  const auto call = daemon_.stub().Stream(&context);
  v1::StreamRequest first, later;
  for (const v1::StreamEvent& event : {Event("A", 1, 2), Event("A", 2, 3), Event("B", 0, 1), Event("B", 1, 2)}) {
    *first.add_events() = event;
  }
  ASSERT_TRUE(call->Write(first));
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (faults_->ticks_held == 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(faults_->ticks_held, 1);
  *later.add_events() = Event("B", 2, 3);
  *later.add_events() = Event("B", 3, 4);
  ASSERT_TRUE(call->Write(later));
  const auto not_taken = [&] {
    return daemon_.Metric("perception_stream_events_rejected_total{reason=\"call_ended\"}");
  };
  while (not_taken() < 2 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(not_taken(), 2) << "read after A's stop, and counted";
  faults_->hold_ticks = false;
  call->WritesDone();
  std::map<std::string, uint64_t> acked;
  for (v1::StreamResponse response; call->Read(&response);) {
    for (const v1::InstrumentAck& ack : response.acks()) acked[ack.instrument()] = ack.last_seq();
  }
  const grpc::Status status = call->Finish();
  EXPECT_EQ(acked["B"], 2u);
  EXPECT_EQ(daemon_.Streams()["B"].last_accepted_seq(), 2u);
  EXPECT_THAT(status.error_message(), HasSubstr("instrument 'A' stopped at seq 2"));
  EXPECT_THAT(status.error_message(), HasSubstr(". 2 events of this call read after that were not taken: 'B' from "
                                                "seq 3"));
}

}  // namespace
}  // namespace perception::testing
