// The device time of streaming ticks, through the service in process: every time the backend's CheckTicks reports
// reaches perception_stream_tick_device_seconds once, under its path (launched ticks, the resident step's lone events),
// a backend that reports none (the CPU's) leaves it empty, and the daemon's timing period (--stream_tick_timing)
// reaches each model's backend.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "engine/backend.h"
#include "engine/config.h"
#include "engine/status_macros.h"
#include "tests/batch_message.h"
#include "tests/forwarding_backend.h"
#include "tests/in_process_daemon.h"
#include "tests/test_util.h"

namespace perception::testing {
namespace {

// What the timing backend reported, for the test to compare with the metric, by path.
struct Reported {
  std::atomic<int64_t> ticks{0}, microseconds{0};
  std::atomic<int64_t> lone_events{0}, lone_microseconds{0};
  std::atomic<int> timing_every{-1};  // what set_stream_tick_timing was given last
};

// Times the i-th tick forwarded (from 1) at i µs, reported by the CheckTicks that finds it finished, as the CUDA
// backend reports its device times: a tick of one event as the resident step's, the others as launched ticks'. The CPU
// backend under it finishes each tick before answering.
class TimingBackend final : public ForwardingBackend {
 public:
  TimingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<Reported> reported)
      : ForwardingBackend(std::move(inner)), reported_(std::move(reported)) {}

  void set_stream_tick_timing(int every) override {
    reported_->timing_every = every;
    ForwardingBackend::set_stream_tick_timing(every);
  }
  absl::Status ForwardStepInto(const StreamTick& tick) override {
    RETURN_IF_ERROR(ForwardingBackend::ForwardStepInto(tick));
    forwarded_.push_back(tick.size());
    return absl::OkStatus();
  }
  absl::StatusOr<TicksChecked> CheckTicks(bool wait_for_ticks) override {
    ASSIGN_OR_RETURN(TicksChecked checked, ForwardingBackend::CheckTicks(wait_for_ticks));
    EXPECT_TRUE(checked.device_seconds.empty() && checked.resident_seconds.empty()) << "the CPU has no device time";
    for (; timed_ < forwarded_.size(); ++timed_) {
      const int64_t us = static_cast<int64_t>(timed_) + 1;
      const bool lone = forwarded_[timed_] == 1;
      (lone ? checked.resident_seconds : checked.device_seconds).push_back(us * 1e-6);
      ++(lone ? reported_->lone_events : reported_->ticks);
      (lone ? reported_->lone_microseconds : reported_->microseconds) += us;
    }
    return checked;
  }

 private:
  const std::shared_ptr<Reported> reported_;
  std::vector<size_t> forwarded_;  // each tick's events
  size_t timed_ = 0;
};

class StreamDeviceTimeTest : public ::testing::Test {
 protected:
  // Two instruments' random series, `events` events each, in one call, then A's next `lone` events one call each (a
  // tick of one event each): every event processed.
  void StreamEvents(InProcessDaemon& daemon, int events, int lone) {
    ASSERT_TRUE(daemon.InitTinyModel(3).ok());
    std::vector<v1::StreamEvent> request;
    for (int t = 0; t < events; ++t) {
      request.push_back(FeatureEvent(a_, config_.n_features, t, "A", t + 1));
      request.push_back(FeatureEvent(b_, config_.n_features, t, "B", t + 1));
    }
    const StreamOutcome outcome = daemon.Stream({request});
    ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
    EXPECT_EQ(outcome.acked.at("A"), static_cast<uint64_t>(events));
    EXPECT_EQ(outcome.acked.at("B"), static_cast<uint64_t>(events));
    for (int t = events; t < events + lone; ++t) {
      const StreamOutcome one = daemon.Stream({{FeatureEvent(a_, config_.n_features, t, "A", t + 1)}});
      ASSERT_TRUE(one.status.ok()) << one.status.error_message();
    }
  }

  const ModelConfig config_ = *NamedConfig("tiny");
  const RandomBatch a_ = MakeRandomBatch(config_, 1, 8, 41), b_ = MakeRandomBatch(config_, 1, 8, 42);
};

TEST_F(StreamDeviceTimeTest, EveryTickTimeTheBackendReportsIsObservedOnce) {
  const auto reported = std::make_shared<Reported>();
  InProcessDaemon daemon(
      [reported](std::unique_ptr<Backend> inner) {
        return std::make_unique<TimingBackend>(std::move(inner), reported);
      },
      "stream_device_time_checkpoints");
  StreamEvents(daemon, 6, 2);
  EXPECT_EQ(reported->timing_every.load(), kStreamTickTimingEvery) << "the default";
  EXPECT_GE(reported->ticks.load() + reported->lone_events.load(), 8) << "at most the two instruments share a tick";
  EXPECT_GE(reported->lone_events.load(), 2) << "A's last two events, one call each";
  EXPECT_EQ(daemon.Metric("perception_stream_tick_device_seconds_count{path=\"launched\"}"), reported->ticks.load());
  EXPECT_NEAR(daemon.Metric("perception_stream_tick_device_seconds_sum{path=\"launched\"}"),
              reported->microseconds.load() * 1e-6, 1e-12);
  EXPECT_EQ(daemon.Metric("perception_stream_tick_device_seconds_count{path=\"resident\"}"),
            reported->lone_events.load());
  EXPECT_NEAR(daemon.Metric("perception_stream_tick_device_seconds_sum{path=\"resident\"}"),
              reported->lone_microseconds.load() * 1e-6, 1e-12);
  EXPECT_EQ(daemon.Metric("perception_stream_events_total"), 14);
}

TEST_F(StreamDeviceTimeTest, TheDaemonsTimingPeriodReachesTheBackend) {
  const auto reported = std::make_shared<Reported>();
  server::StreamOptions options;
  options.device.tick_timing_every = 0;
  InProcessDaemon daemon(
      [reported](std::unique_ptr<Backend> inner) {
        return std::make_unique<TimingBackend>(std::move(inner), reported);
      },
      "stream_device_time_off_checkpoints", options);
  ASSERT_TRUE(daemon.InitTinyModel(3).ok());
  EXPECT_EQ(reported->timing_every.load(), 0);
}

TEST_F(StreamDeviceTimeTest, ABackendWithoutADeviceTimesNoTick) {
  InProcessDaemon daemon([](std::unique_ptr<Backend> inner) { return inner; }, "stream_device_time_cpu_checkpoints");
  StreamEvents(daemon, 4, 1);
  EXPECT_EQ(daemon.Metric("perception_stream_events_total"), 9);
  EXPECT_EQ(daemon.Metric("perception_stream_tick_device_seconds_count{path=\"launched\"}"), 0);
  EXPECT_EQ(daemon.Metric("perception_stream_tick_device_seconds_count{path=\"resident\"}"), 0);
}

}  // namespace
}  // namespace perception::testing
