// SeedStream's window stepped in several device jobs, through the service in process: other instruments' ticks run
// between the parts, the parts end where one pass would, the instrument is held for the seed meanwhile, the window
// runs under one weights version (a seed waits for a publication other seeds held back), and a seed whose client
// stops waiting, or whose weights change, stops part way;
// and a stream's first event takes Δt 0, as a seed window's first does.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "engine/cpu_reference.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "tests/batch_message.h"
#include "tests/forwarding_backend.h"
#include "tests/in_process_daemon.h"
#include "tests/test_util.h"

namespace perception::testing {
namespace {

using ::testing::HasSubstr;

// What the backend was asked to do, in order: each AdvanceSlot's event count, and 0 for each streaming tick.
struct DeviceCalls {
  std::atomic<int> part_sleep_ms{0};  // each AdvanceSlot takes at least this long, as a long part on a device would
  absl::Mutex mu;
  std::vector<int> calls ABSL_GUARDED_BY(mu);

  void Record(int call) {
    absl::MutexLock lock(&mu);
    calls.push_back(call);
  }
  std::vector<int> Seen() {
    absl::MutexLock lock(&mu);
    return calls;
  }
};

class RecordingBackend final : public ForwardingBackend {
 public:
  RecordingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<DeviceCalls> calls)
      : ForwardingBackend(std::move(inner)), calls_(std::move(calls)) {}

  absl::Status AdvanceSlot(int slot, std::span<const float> x, std::span<const float> dt) override {
    absl::SleepFor(absl::Milliseconds(calls_->part_sleep_ms.load()));
    calls_->Record(static_cast<int>(dt.size()));
    return ForwardingBackend::AdvanceSlot(slot, x, dt);
  }
  absl::Status ForwardStepInto(const StreamTick& tick) override {
    calls_->Record(0);
    return ForwardingBackend::ForwardStepInto(tick);
  }

 private:
  const std::shared_ptr<DeviceCalls> calls_;
};

class SeedPartsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.InitTinyModel(kSeed).ok()); }

  // Seeds the instrument with its series' first `events` events.
  grpc::Status Seed(const std::string& instrument, int events, v1::SeedStreamResponse* response = nullptr,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    v1::SeedStreamRequest request;
    request.set_instrument(instrument);
    for (int t = 0; t < events; ++t) *request.add_events() = Event(instrument, t, 0);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    v1::SeedStreamResponse ignored;
    return daemon_.stub().SeedStream(&context, request, response == nullptr ? &ignored : response);
  }

  // Event `t` of the instrument's random series, with sequence number `seq`.
  v1::StreamEvent Event(const std::string& instrument, int t, uint64_t seq) const {
    return FeatureEvent(instrument == "A" ? a_ : b_, config_.n_features, t, instrument, seq);
  }

  // The events the backend has been asked to step in seed parts so far, and in how many parts.
  std::pair<int, int> PartsSeen() {
    int events = 0, parts = 0;
    for (const int call : calls_->Seen()) {
      events += call;
      parts += call > 0;
    }
    return {events, parts};
  }

  // Waits (up to 30 s) until a seed's first part has run.
  void AwaitFirstPart() {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (PartsSeen().second == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_GT(PartsSeen().second, 0);
  }

  // Convictions of A's events [0, n) streamed from a zero state, by the model on the CPU, the first with `first_dt`.
  std::vector<float> Offline(int n, float first_dt = 0.f) const {
    const std::unique_ptr<Backend> model = MakeCpuBackend(config_, OptimizerConfig{}, InitialParams(config_, kSeed));
    const int F = config_.n_features, H = config_.n_horizons;
    std::vector<float> dt(a_.dt.begin(), a_.dt.begin() + n);
    dt[0] = first_dt;
    std::vector<float> logits(static_cast<size_t>(n) * H);
    EXPECT_TRUE(model->ForwardStream(std::span<const float>(a_.x).first(n * F), dt, logits).ok());
    std::vector<float> convictions;
    for (int i = 0; i < n; ++i) {
      convictions.push_back(Conviction<float>(std::span<const float>(logits).subspan(i * H, H)));
    }
    return convictions;
  }

  static constexpr uint64_t kSeed = 7;
  static constexpr int kWindow = 200;  // a seed of 16 events, then one a part (--stream_seed_job_us 1): 185 parts
  const ModelConfig config_ = *NamedConfig("tiny");
  const RandomBatch a_ = MakeRandomBatch(config_, 1, kWindow + 2, 41), b_ = MakeRandomBatch(config_, 1, 4, 42);
  const std::shared_ptr<DeviceCalls> calls_ = std::make_shared<DeviceCalls>();
  InProcessDaemon daemon_{[calls = calls_](std::unique_ptr<Backend> backend) -> std::unique_ptr<Backend> {
                            return std::make_unique<RecordingBackend>(std::move(backend), calls);
                          },
                          "seed_parts_checkpoints", [] {
                            server::StreamOptions options;
                            options.seed_job_time = absl::Microseconds(1);
                            return options;
                          }()};
};

TEST_F(SeedPartsTest, ALongWindowSteppedInPartsContinuesLikeTheConcatenation) {
  v1::SeedStreamResponse seeded;
  const grpc::Status status = Seed("A", kWindow, &seeded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(seeded.events(), kWindow);
  EXPECT_GT(seeded.device_seconds(), 0);
  const std::vector<int> parts = calls_->Seen();
  ASSERT_GT(parts.size(), 1u) << "one job for the whole window";
  EXPECT_EQ(parts.front(), 16) << "the first part is a few events";
  EXPECT_EQ(PartsSeen().first, kWindow);

  const StreamOutcome streamed = daemon_.Stream({{Event("A", kWindow, 1), Event("A", kWindow + 1, 2)}});
  ASSERT_TRUE(streamed.status.ok()) << streamed.status.error_message();
  const v1::ReadConvictionsResponse log = daemon_.ReadConvictions("A");
  ASSERT_EQ(log.convictions_size(), 2);
  const std::vector<float> expected = Offline(kWindow + 2);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(log.convictions(i), expected[kWindow + i], 1e-6) << "seq " << i + 1;
}

TEST_F(SeedPartsTest, AnotherInstrumentsEventsAreProcessedBetweenTheParts) {
  calls_->part_sleep_ms = 5;  // ~1 s for the window
  std::thread seeding([&] { EXPECT_TRUE(Seed("A", kWindow).ok()); });
  AwaitFirstPart();
  const StreamOutcome b = daemon_.Stream({{Event("B", 0, 1)}, {Event("B", 1, 2)}, {Event("B", 2, 3)}});
  const int parts_when_b_was_done = PartsSeen().second;
  seeding.join();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(b.acked.at("B"), 3u);
  EXPECT_LT(parts_when_b_was_done, PartsSeen().second) << "B's events waited for the whole window";
  const std::vector<int> seen = calls_->Seen();
  const auto tick = std::find(seen.begin(), seen.end(), 0);
  ASSERT_NE(tick, seen.end());
  EXPECT_NE(std::find_if(tick, seen.end(), [](int call) { return call > 0; }), seen.end())
      << "a part of the seed ran after B's first tick";
}

// While a seed runs, the instrument refuses its events, resets, closes and other seeds, and ListStreams says why
// (`seeding`) until the seed has answered.
TEST_F(SeedPartsTest, TheInstrumentBeingSeededRefusesItsEventsResetsClosesAndOtherSeeds) {
  calls_->part_sleep_ms = 5;
  std::thread seeding([&] { EXPECT_TRUE(Seed("A", kWindow).ok()); });
  AwaitFirstPart();
  EXPECT_TRUE(daemon_.Streams()["A"].seeding());
  const grpc::Status reset = daemon_.ResetStream("A");
  EXPECT_EQ(reset.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(reset.error_message(), HasSubstr("instrument 'A' is being seeded"));
  v1::CloseStreamRequest close;
  close.set_instrument("A");
  const grpc::Status closed = daemon_.Call(&v1::Perception::Stub::CloseStream, close);
  EXPECT_EQ(closed.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(closed.error_message(), HasSubstr("is being seeded"));
  const grpc::Status again = Seed("A", 3);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(again.error_message(), HasSubstr("is being seeded"));
  const StreamOutcome event = daemon_.Stream({{Event("A", kWindow, 1)}});
  EXPECT_EQ(event.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(event.status.error_message(), HasSubstr("is being seeded"));
  const int parts_before_the_end = PartsSeen().second;
  seeding.join();
  EXPECT_LT(parts_before_the_end, PartsSeen().second) << "the seed had ended before the refusals";
  EXPECT_EQ(PartsSeen().first, kWindow) << "the refused second seed stepped nothing";
  EXPECT_FALSE(daemon_.Streams()["A"].seeding());
  const StreamOutcome after = daemon_.Stream({{Event("A", kWindow, 1)}});
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_NEAR(daemon_.ReadConvictions("A").convictions(0), Offline(kWindow + 1)[kWindow], 1e-6);
}

TEST_F(SeedPartsTest, ATrainingStepDuringTheSeedIsPublishedAfterIt) {
  calls_->part_sleep_ms = 5;
  ASSERT_TRUE(daemon_.Stream({{Event("B", 0, 1)}}).status.ok());  // streaming configured: steps publish
  v1::SeedStreamResponse seeded;
  std::thread seeding([&] { EXPECT_TRUE(Seed("A", kWindow, &seeded).ok()); });
  AwaitFirstPart();
  v1::TrainStepRequest step;
  *step.mutable_batch() = BatchMessage(MakeRandomBatch(config_, config_.batch, config_.window, 43), config_);
  const grpc::Status trained = daemon_.Call(&v1::Perception::Stub::TrainStep, step);
  ASSERT_TRUE(trained.ok()) << trained.error_message();
  const int parts_after_the_step = PartsSeen().second;
  seeding.join();
  EXPECT_LT(parts_after_the_step, PartsSeen().second) << "the step did not run during the seed";
  v1::GetStatusResponse status;
  grpc::ClientContext context;
  ASSERT_TRUE(daemon_.stub().GetStatus(&context, v1::GetStatusRequest(), &status).ok());
  EXPECT_EQ(seeded.weights_version(), status.model().weights_version() - 1) << "the window ran before the step";
  EXPECT_EQ(status.streaming().weights_version(), status.model().weights_version()) << "published after the seed";
}

// Seeds that overlap one another must not hold training's publications back for good: a seed asked for while a
// publication waits for another seed's hold starts once that seed has finished and the weights are published.
TEST_F(SeedPartsTest, ASeedAskedForWhileAPublicationWaitsStartsAfterIt) {
  calls_->part_sleep_ms = 5;
  ASSERT_TRUE(daemon_.Stream({{Event("B", 0, 1)}}).status.ok());  // streaming configured: steps publish
  v1::SeedStreamResponse first, second;
  std::thread seeding([&] { EXPECT_TRUE(Seed("A", kWindow, &first).ok()); });
  AwaitFirstPart();
  v1::TrainStepRequest step;
  *step.mutable_batch() = BatchMessage(MakeRandomBatch(config_, config_.batch, config_.window, 44), config_);
  ASSERT_TRUE(daemon_.Call(&v1::Perception::Stub::TrainStep, step).ok());
  const grpc::Status seeded = Seed("C", 3, &second);
  seeding.join();
  ASSERT_TRUE(seeded.ok()) << seeded.error_message();
  EXPECT_EQ(second.weights_version(), first.weights_version() + 1) << "C ran under the step's weights, published first";
}

TEST_F(SeedPartsTest, ASetNormalizerDuringTheSeedAbortsItAndClosesTheStreamItOpened) {
  calls_->part_sleep_ms = 5;
  grpc::Status seeded;
  std::thread seeding([&] { seeded = Seed("A", kWindow); });
  AwaitFirstPart();
  v1::SetNormalizerRequest normalize;
  for (int f = 0; f < config_.n_features; ++f) {
    normalize.mutable_normalizer()->add_mean(0.25f);
    normalize.mutable_normalizer()->add_inv_std(2.f);
  }
  const grpc::Status normalized = daemon_.Call(&v1::Perception::Stub::SetNormalizer, normalize);
  seeding.join();
  ASSERT_TRUE(normalized.ok()) << normalized.error_message();
  EXPECT_EQ(seeded.error_code(), grpc::StatusCode::ABORTED) << seeded.error_message();
  EXPECT_THAT(seeded.error_message(), HasSubstr("the weights streaming reads changed (SetNormalizer"));
  EXPECT_LT(PartsSeen().first, kWindow);
  EXPECT_EQ(daemon_.Streams().count("A"), 0u) << "the seed's own stream is closed";
}

// A client that stops waiting was told the seed failed: the rest of the window is not stepped for it, and the live
// stream the seed had begun to overwrite stops. (Cancelled once the seed runs: a deadline could pass before its first
// part under a slow sanitizer run, and then nothing would have been seeded or stopped.)
TEST_F(SeedPartsTest, ASeedWhoseClientCancelsStopsPartWayAndStopsTheLiveStream) {
  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1)}}).status.ok());
  calls_->part_sleep_ms = 5;
  v1::SeedStreamRequest request;
  request.set_instrument("A");
  for (int t = 0; t < kWindow; ++t) *request.add_events() = Event("A", t, 0);
  grpc::ClientContext context;
  v1::SeedStreamResponse response;
  grpc::Status cancelled;
  std::thread seeding([&] { cancelled = daemon_.stub().SeedStream(&context, request, &response); });
  AwaitFirstPart();
  context.TryCancel();
  seeding.join();
  EXPECT_EQ(cancelled.error_code(), grpc::StatusCode::CANCELLED) << cancelled.error_message();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (daemon_.Streams()["A"].stopped().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  const std::string stopped = daemon_.Streams()["A"].stopped();
  EXPECT_THAT(stopped, HasSubstr("instrument 'A' stopped when its seed failed (the window was cut off after"));
  EXPECT_THAT(stopped, HasSubstr("the client cancelled the call or went away"));
  EXPECT_THAT(stopped, HasSubstr("then from seq 2"));
  EXPECT_LT(PartsSeen().first, kWindow) << "the rest of the window was stepped for nobody";
  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  EXPECT_TRUE(daemon_.Stream({{Event("A", 0, 2)}}).status.ok());
}

// MODEL.md §1: Δt is 0 for a stream's first event. A seed window's first is taken so; a streamed first event, and the
// first after ResetStream, must be too, or the same events would give other convictions by the call they came in.
TEST_F(SeedPartsTest, AStreamsFirstEventAndTheFirstAfterAResetTakeDtZeroWhateverTheyCarry) {
  v1::StreamEvent first = Event("A", 0, 1);
  first.mutable_features()->set_dt(30.f);
  ASSERT_TRUE(daemon_.Stream({{first}}).status.ok());
  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  first.set_seq(2);
  ASSERT_TRUE(daemon_.Stream({{first}, {Event("A", 1, 3)}}).status.ok());
  const v1::ReadConvictionsResponse log = daemon_.ReadConvictions("A");
  ASSERT_EQ(log.convictions_size(), 3);
  const std::vector<float> expected = Offline(2);
  EXPECT_NEAR(log.convictions(0), expected[0], 1e-6) << "the first event, as with Δt 0";
  EXPECT_NEAR(log.convictions(1), expected[0], 1e-6) << "the first after the reset, as with Δt 0";
  EXPECT_NEAR(log.convictions(2), expected[1], 1e-6) << "the next keeps its own Δt";
  EXPECT_GT(std::fabs(Offline(1, /*first_dt=*/30.f)[0] - expected[0]), 1e-4) << "Δt matters to a first event";
}

}  // namespace
}  // namespace perception::testing
