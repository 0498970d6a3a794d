// A model whose float32 arithmetic overflows on one instrument's event, through the service in process: the
// instrument stops at that event with the reason, no conviction that is not finite can be read back, the other
// instruments stream on, and after a reset the instrument takes its events again from the one that overflowed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "engine/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "tests/batch_message.h"
#include "tests/forwarding_backend.h"
#include "tests/in_process_daemon.h"
#include "tests/test_util.h"

namespace perception::testing {
namespace {

using ::testing::HasSubstr;

// The model as InitModel made it, with its embedding's weights scaled by 1e30: finite, and a checkpoint would hold
// them. A feature standardized to 1e9 then makes the embedding infinite and the event's logits NaN, well inside the
// daemon's bound on standardized features (1e16); features of the usual size stay finite through the norms.
// `slow_device` answers CheckTicks as a device still running every tick since the last wait would: each unfinished,
// none of their outputs found yet. The batcher must then hold their acknowledgements until a wait finds them.
class OverflowingBackend final : public ForwardingBackend {
 public:
  OverflowingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<std::atomic<bool>> slow_device)
      : ForwardingBackend(std::move(inner)), slow_device_(std::move(slow_device)) {
    Checkpoint state = ForwardingBackend::ExportState().value();
    const ParamLayout& layout = ForwardingBackend::layout();
    const TensorSpec& embed = layout.tensor(layout.embed.weight);
    for (size_t i = embed.offset; i < embed.offset + embed.size; ++i) state.params[i] *= 1e30f;
    EXPECT_TRUE(ForwardingBackend::ImportState(state).ok());
  }
  absl::Status ForwardStepInto(const StreamTick& tick) override {
    RETURN_IF_ERROR(ForwardingBackend::ForwardStepInto(tick));
    ++running_;
    return absl::OkStatus();
  }
  absl::StatusOr<TicksChecked> CheckTicks(bool wait_for_ticks) override {
    if (*slow_device_ && !wait_for_ticks) return TicksChecked{running_, {}, {}, {}};
    running_ = 0;
    return ForwardingBackend::CheckTicks(wait_for_ticks);
  }

 private:
  const std::shared_ptr<std::atomic<bool>> slow_device_;
  int64_t running_ = 0;
};

class StreamNonFiniteTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.InitTinyModel(5).ok()); }

  // Event `t` of the instrument's random series as its event `seq`; `overflow`: every feature 1e9 instead.
  v1::StreamEvent Event(const std::string& instrument, int t, uint64_t seq, bool overflow = false) const {
    v1::StreamEvent event = FeatureEvent(instrument == "A" ? a_ : b_, config_.n_features, t, instrument, seq);
    if (overflow) {
      for (float& f : *event.mutable_features()->mutable_features()) f = 1e9f;
    }
    return event;
  }

  static void ExpectAllFinite(const v1::ReadConvictionsResponse& log, const std::string& what) {
    for (const float c : log.convictions()) EXPECT_TRUE(std::isfinite(c)) << what << ": " << c;
  }

  // After A stopped at seq 2 (found at the latest by this read): its log ends before it, its next events are
  // refused, and after a reset it takes seq 2 again and streams finite convictions.
  void ExpectStoppedAtTwoThenResumed() {
    const v1::ReadConvictionsResponse a = daemon_.ReadConvictions("A");
    EXPECT_EQ(a.convictions_size(), 1);
    EXPECT_EQ(a.end_seq(), 2u);
    ExpectAllFinite(a, "A");
    std::map<std::string, v1::StreamInfo> streams = daemon_.Streams();
    EXPECT_EQ(streams["A"].processed_events(), 1u);
    EXPECT_EQ(streams["A"].end_seq(), 2u);
    EXPECT_EQ(streams["A"].last_accepted_seq(), 1u) << "the events dropped are no longer accepted";
    EXPECT_EQ(streams["A"].pending_events(), 0u);
    EXPECT_THAT(streams["A"].stopped(), HasSubstr(kStoppedAtTwo));
    const v1::ReadConvictionsResponse b = daemon_.ReadConvictions("B");
    EXPECT_EQ(b.convictions_size(), 3);
    ExpectAllFinite(b, "B");
    EXPECT_EQ(daemon_.Metric("perception_stream_nonfinite_outputs_total"), 1);
    EXPECT_EQ(daemon_.Metric("perception_stream_events_total"), 4) << "A's first event and B's three, not those dropped";
    EXPECT_EQ(daemon_.Metric("perception_stream_event_latency_seconds_count"), 4);
    EXPECT_EQ(daemon_.Metric("perception_stream_events_dropped_total{reason=\"nonfinite_output\"}"), 3)
        << "A's seq 2 to 4";
    EXPECT_EQ(daemon_.Metric("perception_stream_events_dropped_total{reason=\"failed_tick\"}"), 0);

    const StreamOutcome refused = daemon_.Stream({{Event("A", 4, 5)}});
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(refused.status.error_message(), HasSubstr(kStoppedAtTwo));

    ASSERT_TRUE(daemon_.ResetStream("A").ok());
    EXPECT_EQ(daemon_.Streams()["A"].stopped(), "");
    StreamOutcome resumed = daemon_.Stream({{Event("A", 1, 2), Event("A", 2, 3)}});
    ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
    EXPECT_EQ(resumed.acked["A"], 3u);
    const v1::ReadConvictionsResponse again = daemon_.ReadConvictions("A");
    EXPECT_EQ(again.first_seq(), 1u);
    EXPECT_EQ(again.convictions_size(), 3);
    ExpectAllFinite(again, "A after the reset");
  }

  static constexpr char kSeedNotFinite[] = "the seed window leads to a state that is not finite";
  static constexpr char kStoppedAtTwo[] =
      "instrument 'A' stopped at seq 2: the model's output for that event was not finite (float32 overflowed inside "
      "the model";
  const ModelConfig config_ = *NamedConfig("tiny");
  const RandomBatch a_ = MakeRandomBatch(config_, 1, 8, 31), b_ = MakeRandomBatch(config_, 1, 8, 32);
  const std::shared_ptr<std::atomic<bool>> slow_device_ = std::make_shared<std::atomic<bool>>(false);
  InProcessDaemon daemon_{[slow_device = slow_device_](std::unique_ptr<Backend> backend) -> std::unique_ptr<Backend> {
                            return std::make_unique<OverflowingBackend>(std::move(backend), slow_device);
                          },
                          "stream_nonfinite_checkpoints"};
};

// Found after the tick that overflowed: that event and A's events queued behind it fail the call, B's are processed.
TEST_F(StreamNonFiniteTest, AnInstrumentWhoseOutputOverflowsStopsThereAndItsCallSaysWhy) {
  StreamOutcome outcome = daemon_.Stream({{Event("A", 0, 1), Event("B", 0, 1), Event("A", 1, 2, /*overflow=*/true),
                                          Event("B", 1, 2), Event("A", 2, 3), Event("A", 3, 4), Event("B", 2, 3)}});
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("3 events of this call were not processed."));
  EXPECT_THAT(outcome.status.error_message(), HasSubstr(kStoppedAtTwo));
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("then from seq 2"));
  EXPECT_LE(outcome.acked["A"], 1u);
  ExpectStoppedAtTwoThenResumed();
}

// Found only once the device had finished the ticks after it too (the last tick waits): the entries were logged, but
// no event is acknowledged before its tick is known finished, so the overflowing one and A's later ones fail the call
// as above, and every event of B is acknowledged.
TEST_F(StreamNonFiniteTest, AnEventIsAcknowledgedOnlyOnceItsTickFinishedSoAnOverflowFoundLateStillFailsItsCall) {
  *slow_device_ = true;
  StreamOutcome outcome = daemon_.Stream({{Event("A", 0, 1), Event("B", 0, 1), Event("A", 1, 2, /*overflow=*/true),
                                          Event("B", 1, 2), Event("A", 2, 3), Event("A", 3, 4), Event("B", 2, 3)}});
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("3 events of this call were not processed."));
  EXPECT_THAT(outcome.status.error_message(), HasSubstr(kStoppedAtTwo));
  EXPECT_LE(outcome.acked["A"], 1u);
  EXPECT_EQ(outcome.acked["B"], 3u);
  ExpectStoppedAtTwoThenResumed();
}

// A seed window that overflows the model's arithmetic: the seed is refused, a stream it opened is closed again, and
// a live stream whose state it overwrote stops there until a reset, after which it streams finite convictions.
TEST_F(StreamNonFiniteTest, ASeedWhoseStateIsNotFiniteIsRefusedAndStopsTheStreamItOverwrote) {
  const std::vector<v1::StreamEvent> overflowing = {Event("A", 0, 0), Event("A", 1, 0, /*overflow=*/true),
                                                    Event("A", 2, 0)};
  const grpc::Status opened = daemon_.SeedStream("C", overflowing);
  EXPECT_EQ(opened.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(opened.error_message(), HasSubstr(kSeedNotFinite));
  EXPECT_EQ(daemon_.Streams().count("C"), 0u) << "the stream the seed opened is closed again";

  ASSERT_TRUE(daemon_.Stream({{Event("A", 0, 1), Event("A", 1, 2)}}).status.ok());
  const grpc::Status overwritten = daemon_.SeedStream("A", overflowing);
  EXPECT_EQ(overwritten.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(daemon_.Streams()["A"].stopped(), HasSubstr(absl::StrCat("instrument 'A' stopped when its seed failed (",
                                                                       kSeedNotFinite)));
  const StreamOutcome refused = daemon_.Stream({{Event("A", 2, 3)}});
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(daemon_.ResetStream("A").ok());
  const StreamOutcome resumed = daemon_.Stream({{Event("A", 2, 3), Event("A", 3, 4)}});
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  const v1::ReadConvictionsResponse log = daemon_.ReadConvictions("A");
  EXPECT_EQ(log.convictions_size(), 4);
  ExpectAllFinite(log, "A after the reset");
  EXPECT_TRUE(daemon_.SeedStream("A", {Event("A", 4, 0), Event("A", 5, 0)}).ok()) << "a finite window seeds";
}

}  // namespace
}  // namespace perception::testing
