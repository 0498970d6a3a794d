// The device worker's idle job: when it runs (once per pause in the work, never while jobs keep coming), and that
// every queued job still runs around it; its status as a caller sees it once a job has answered; the stall watch.
#include "server/device_worker.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <new>
#include <optional>
#include <thread>
#include <utility>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "engine/config.h"
#include "engine/optimizer.h"
#include "server/metrics.h"
#include "server/model_host.h"
#include "server/stall_watch.h"
#include "tests/in_process_daemon.h"

namespace perception::server {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

// A worker over a CPU model host (no model) whose idle job counts its runs.
struct CountingWorker {
  explicit CountingWorker(absl::Duration idle_period)
      : worker(std::make_unique<ModelHost>("cpu", metrics), /*queue_depth=*/8, idle_period,
               [this](ModelHost&) { idle_runs.fetch_add(1); }) {}

  absl::Status RunJob() {
    return worker.Run(JobPriority::kStreaming, [this](ModelHost&) {
      jobs.fetch_add(1);
      return absl::OkStatus();
    });
  }
  // Polls until the idle job has run `runs` times, for at most `limit`.
  bool AwaitIdleRuns(int runs, milliseconds limit) const {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (idle_runs.load() < runs && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(milliseconds(2));
    }
    return idle_runs.load() >= runs;
  }

  ServerMetrics metrics;
  std::atomic<int> idle_runs{0};
  std::atomic<int> jobs{0};
  DeviceWorker worker;  // last: its thread stops before the counters go
};

TEST(DeviceWorkerTest, TheIdleJobRunsOnceAfterEachPauseInTheWorkAndNeverBeforeAnyWork) {
  CountingWorker w(absl::Milliseconds(30));
  std::this_thread::sleep_for(milliseconds(150));
  EXPECT_EQ(w.idle_runs.load(), 0) << "no job has run yet: nothing to release";

  ASSERT_TRUE(w.RunJob().ok());
  ASSERT_TRUE(w.AwaitIdleRuns(1, milliseconds(5000)));
  std::this_thread::sleep_for(milliseconds(150));
  EXPECT_EQ(w.idle_runs.load(), 1) << "one run per pause, not one per period";

  ASSERT_TRUE(w.RunJob().ok());
  ASSERT_TRUE(w.RunJob().ok());
  ASSERT_TRUE(w.AwaitIdleRuns(2, milliseconds(5000)));
  std::this_thread::sleep_for(milliseconds(150));
  EXPECT_EQ(w.idle_runs.load(), 2);
  EXPECT_EQ(w.jobs.load(), 3);
}

// A model the host could not hold (an InitModel's config within the limits on a small machine) threw std::bad_alloc
// on the worker thread, which ended the daemon unsaved: the call answers RESOURCE_EXHAUSTED and the worker goes on.
TEST(DeviceWorkerTest, WorkThatRunsTheHostOutOfMemoryIsRefusedAndTheWorkerGoesOn) {
  CountingWorker w(absl::InfiniteDuration());
  const absl::StatusOr<int> refused =
      w.worker.Run(JobPriority::kTraining, [](ModelHost&) -> absl::StatusOr<int> { throw std::bad_alloc(); });
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("out of host memory"));
  ASSERT_TRUE(w.RunJob().ok());
  EXPECT_EQ(w.jobs.load(), 1);
}

TEST(DeviceWorkerTest, TheIdleJobWaitsWhileJobsKeepComing) {
  // Jobs 5 ms apart for 0.6 s against a 400 ms idle period: no pause is long enough.
  CountingWorker w(absl::Milliseconds(400));
  for (int i = 0; i < 120; ++i) {
    ASSERT_TRUE(w.RunJob().ok());
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_EQ(w.idle_runs.load(), 0);
  EXPECT_TRUE(w.AwaitIdleRuns(1, milliseconds(5000))) << "the pause after the last job";
  EXPECT_EQ(w.jobs.load(), 120);
}

TEST(DeviceWorkerTest, AnInfiniteIdlePeriodNeverRunsTheIdleJob) {
  CountingWorker w(absl::InfiniteDuration());
  ASSERT_TRUE(w.RunJob().ok());
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(w.idle_runs.load(), 0);
}

TEST(DeviceWorkerTest, StopReturnsWhileAPauseIsBeingTimed) {
  CountingWorker w(absl::Seconds(30));
  ASSERT_TRUE(w.RunJob().ok());
  const auto start = std::chrono::steady_clock::now();
  w.worker.Stop();  // the worker is timing a 30 s pause: Stop must not wait for it
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(w.idle_runs.load(), 0);
  EXPECT_EQ(w.worker.Enqueue(JobPriority::kTraining, [](ModelHost&) {}).code(), absl::StatusCode::kUnavailable);
}

// Jobs still queued when Stop comes run before it returns, in both priorities: a queued job's caller (Run) gets its
// result, never a broken promise, at shutdown.
TEST(DeviceWorkerTest, StopRunsTheJobsQueuedBehindARunningOne) {
  CountingWorker w(absl::InfiniteDuration());
  absl::Notification held, release;
  ASSERT_TRUE(w.worker
                  .Enqueue(JobPriority::kTraining,
                           [&](ModelHost&) {
                             held.Notify();
                             release.WaitForNotification();
                           })
                  .ok());
  held.WaitForNotification();
  constexpr int kQueued = 6;
  for (int i = 0; i < kQueued; ++i) {
    const JobPriority priority = i % 2 == 0 ? JobPriority::kStreaming : JobPriority::kTraining;
    ASSERT_TRUE(w.worker.Enqueue(priority, [&](ModelHost&) { w.jobs.fetch_add(1); }).ok());
  }
  std::thread stopper([&] { w.worker.Stop(); });
  while (w.worker.Enqueue(JobPriority::kStreaming, [](ModelHost&) {}).code() != absl::StatusCode::kUnavailable) {
    std::this_thread::sleep_for(milliseconds(1));  // until Stop has begun: from then on nothing new is taken
  }
  EXPECT_EQ(w.jobs.load(), 0) << "the queue waits behind the held job";
  release.Notify();
  stopper.join();
  EXPECT_EQ(w.jobs.load(), kQueued);
}

// Only jobs queued for calls count against --queue_depth: the stream batcher's own (a tick, a seed's next part) take no
// call's place. At a depth of 1 a waiting tick made every ResetStream and CloseStream answer RESOURCE_EXHAUSTED.
TEST(DeviceWorkerTest, UnboundedJobsTakeNoPlaceOfTheBoundedOnes) {
  ServerMetrics metrics;
  std::atomic<int> jobs{0};
  testing::WorkerGate first, streaming_again, training_again;  // outlive the worker, whose jobs wait on them
  DeviceWorker worker(std::make_unique<ModelHost>("cpu", metrics), /*queue_depth=*/1);
  ASSERT_NO_FATAL_FAILURE(first.Hold(worker, JobPriority::kStreaming));
  const auto count = [&](ModelHost&) { jobs.fetch_add(1); };
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(worker.Enqueue(JobPriority::kStreaming, count, /*bounded=*/false).ok());
  }
  EXPECT_TRUE(worker.Enqueue(JobPriority::kStreaming, count).ok()) << "three unbounded jobs filled a queue of 1";
  const absl::Status second = worker.Enqueue(JobPriority::kStreaming, count);
  EXPECT_EQ(second.code(), absl::StatusCode::kResourceExhausted) << second;
  EXPECT_THAT(second.message(), HasSubstr("the device queue is full (1 calls' jobs waiting)"));
  EXPECT_TRUE(worker.Enqueue(JobPriority::kTraining, count).ok()) << "each priority has its own bound";
  EXPECT_TRUE(worker.Enqueue(JobPriority::kStreaming, count, /*bounded=*/false).ok());
  EXPECT_EQ(worker.queued_jobs(), 6);
  first.Open();
  // Once the bounded jobs have run, each priority's place is free again, and one only.
  while (worker.queued_jobs() > 0) std::this_thread::sleep_for(milliseconds(1));
  EXPECT_EQ(jobs.load(), 6);
  for (const auto& [priority, gate] : {std::pair{JobPriority::kStreaming, &streaming_again},
                                       std::pair{JobPriority::kTraining, &training_again}}) {
    ASSERT_NO_FATAL_FAILURE(gate->Hold(worker, priority));
    EXPECT_TRUE(worker.Enqueue(priority, count).ok());
    EXPECT_EQ(worker.Enqueue(priority, count).code(), absl::StatusCode::kResourceExhausted);
    gate->Open();
    while (worker.queued_jobs() > 0) std::this_thread::sleep_for(milliseconds(1));
  }
  worker.Stop();
  EXPECT_EQ(jobs.load(), 8);
}

// A caller that has its job's reply finds the job's effect in status() (perceptionctl load, then status): the status
// is published before the reply, not after it, where a GetStatus between the two saw the model before the job.
TEST(DeviceWorkerTest, StatusShowsAJobsEffectOnceItsReplyIsIn) {
  ServerMetrics metrics;
  DeviceWorker worker(std::make_unique<ModelHost>("cpu", metrics), /*queue_depth=*/8);
  EXPECT_FALSE(worker.status().model.has_value());
  const ModelConfig config = *NamedConfig("tiny");
  for (int i = 0; i < 200; ++i) {
    const absl::Status initialized = worker.Run(JobPriority::kTraining, [&](ModelHost& host) {
      return host.Init(config, OptimizerConfig{}, /*seed=*/i, std::nullopt, /*replace=*/true);
    });
    ASSERT_TRUE(initialized.ok()) << initialized;
    const HostStatus status = worker.status();
    ASSERT_TRUE(status.model.has_value()) << "after " << i << " inits";
    EXPECT_EQ(status.model->weights_version, i + 1) << "the status of the job before";
    EXPECT_EQ(status.precision, "fp32");
  }
}

// The default idle job (ModelHost::ReleaseIdleDevice) on a host with no model, and one with a CPU model, which holds
// nothing on a device: nothing to release, no error, nothing counted.
TEST(DeviceWorkerTest, ReleasingAnIdleHostWithoutADeviceIsANoOp) {
  ServerMetrics metrics;
  ModelHost host("cpu", metrics);
  EXPECT_TRUE(host.ReleaseIdleDevice().ok());
  ASSERT_TRUE(host.Init(*NamedConfig("tiny"), OptimizerConfig{}, 7, std::nullopt, /*replace=*/false).ok());
  EXPECT_TRUE(host.ReleaseIdleDevice().ok());
  EXPECT_THAT(metrics.Render(), HasSubstr("\nperception_stream_resident_idle_stops_total 0\n"));
}


// A job that does not end (a hung kernel) is reported once it passes the limit, and its end once it ends.
TEST(StallWatchTest, AJobRunningPastTheLimitIsReportedOnceAndItsEndToo) {
  ServerMetrics metrics;
  DeviceWorker worker(std::make_unique<ModelHost>("cpu", metrics), /*queue_depth=*/8);
  EXPECT_EQ(worker.busy_for(), absl::ZeroDuration()) << "no job runs";
  std::atomic<int> stalls{0}, recoveries{0};
  std::atomic<bool> reported_past_the_limit{false};
  StallWatch watch(worker, absl::Milliseconds(100), absl::Milliseconds(5),
                   [&](absl::Duration busy) {
                     reported_past_the_limit = busy > absl::Milliseconds(100);
                     stalls.fetch_add(1);
                   },
                   [&] { recoveries.fetch_add(1); });
  ASSERT_TRUE(worker.Run(JobPriority::kTraining, [](ModelHost&) { return absl::OkStatus(); }).ok());
  absl::Notification started, release;
  ASSERT_TRUE(worker
                  .Enqueue(JobPriority::kTraining,
                           [&](ModelHost&) {
                             started.Notify();
                             release.WaitForNotification();
                           })
                  .ok());
  started.WaitForNotification();  // the worker may take the job a few milliseconds after Enqueue returns
  std::this_thread::sleep_for(milliseconds(400));
  EXPECT_EQ(stalls.load(), 1) << "one report for the one stalled job";
  EXPECT_TRUE(reported_past_the_limit.load());
  EXPECT_EQ(recoveries.load(), 0);
  EXPECT_GE(worker.busy_for(), absl::Milliseconds(400));
  release.Notify();
  const auto end = std::chrono::steady_clock::now() + milliseconds(5000);
  while (recoveries.load() == 0 && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(milliseconds(2));
  EXPECT_EQ(recoveries.load(), 1);
  EXPECT_EQ(stalls.load(), 1);
}

// A job waiting on its peers (the data-parallel join) is not a stalled device: busy_for reads zero while it waits,
// and the job's clock starts again once the wait ends.
TEST(StallWatchTest, AJobWaitingOnItsPeersIsNotBusy) {
  ServerMetrics metrics;
  DeviceWorker worker(std::make_unique<ModelHost>("cpu", metrics), /*queue_depth=*/8);
  absl::Notification waiting, stop_waiting, waited, release;
  ASSERT_TRUE(worker
                  .Enqueue(JobPriority::kTraining,
                           [&](ModelHost&) {
                             {
                               const DeviceWorker::PeerWait peers(worker);
                               waiting.Notify();
                               stop_waiting.WaitForNotification();
                             }
                             waited.Notify();
                             release.WaitForNotification();
                           })
                  .ok());
  waiting.WaitForNotification();
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_EQ(worker.busy_for(), absl::ZeroDuration()) << "waiting on peers";
  const auto stopped_waiting = std::chrono::steady_clock::now();
  stop_waiting.Notify();
  waited.WaitForNotification();
  std::this_thread::sleep_for(milliseconds(50));
  const absl::Duration busy = worker.busy_for();
  EXPECT_GE(busy, absl::Milliseconds(50)) << "busy again after the wait";
  EXPECT_LE(busy, absl::FromChrono(std::chrono::steady_clock::now() - stopped_waiting)) << "timed from the wait's end";
  release.Notify();
}

}  // namespace
}  // namespace perception::server
