// The device worker: the one thread that owns the model host (and so the device), fed by a bounded job queue.
#pragma once

#include <array>
#include <deque>
#include <future>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/model_host.h"

namespace perception::server {

// Which queued work the device runs first: a lower value first, FIFO within one priority. Each priority has its
// own bound, so one kind of work cannot take the other's slots. Live streaming (the stream batcher's ticks, its
// seeds, reads, resets and closes) goes ahead of training and model management; so that a continuous feed
// cannot stall training for good, one waiting training job runs after every kStreamingRun streaming jobs.
enum class JobPriority { kStreaming, kTraining };
inline constexpr int kJobPriorities = 2;
inline constexpr int kStreamingRun = 16;

class DeviceWorker {
 public:
  // Runs on the worker thread with exclusive use of the model host.
  using Job = absl::AnyInvocable<void(ModelHost&) &&>;

  // What the worker runs once the device has had no job for the idle period after the last one.
  using IdleJob = absl::AnyInvocable<void(ModelHost&)>;

  // Starts the thread; at most `queue_depth` jobs wait per priority. Once no job has come for `idle_period` after the
  // last one, `on_idle` runs (once per pause; by default ModelHost::ReleaseIdleDevice); an infinite period never.
  DeviceWorker(std::unique_ptr<ModelHost> host, int queue_depth, absl::Duration idle_period = absl::InfiniteDuration(),
               IdleJob on_idle = ReleaseIdleDevice);
  ~DeviceWorker();  // Stop()

  // Queues `job`; every accepted job runs, in order within its priority. RESOURCE_EXHAUSTED when that priority's
  // queue is full (unless `bounded` is false: the stream batcher, which keeps at most one tick queued, must never
  // lose one), UNAVAILABLE after Stop.
  absl::Status Enqueue(JobPriority priority, Job job, bool bounded = true);

  // Queues `work` (ModelHost& → absl::Status or absl::StatusOr<T>) and waits for its result; a refusal to queue
  // is returned as the result.
  template <typename Work>
  std::invoke_result_t<Work&, ModelHost&> Run(JobPriority priority, Work work);

  // The model host's status as of the last finished job; any thread, never waits for the device.
  HostStatus status() const;
  int queued_jobs() const;
  // How long the job the device runs now (the idle job included) has been running at `now`; zero between jobs.
  absl::Duration busy_for(absl::Time now) const;

  // Refuses new jobs, runs those already queued, then ends the thread. Idempotent.
  void Stop();

 private:
  void Loop();
  // status() from now on: `host`'s status (the worker thread's host_).
  void PublishStatus(const ModelHost& host);
  static void ReleaseIdleDevice(ModelHost& host);

  mutable absl::Mutex mu_;
  std::array<std::deque<Job>, kJobPriorities> queues_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int streaming_run_ ABSL_GUARDED_BY(mu_) = 0;  // streaming jobs run in a row while training jobs waited
  absl::Time job_started_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();  // InfiniteFuture between jobs
  HostStatus status_ ABSL_GUARDED_BY(mu_);
  const int queue_depth_;
  const absl::Duration idle_period_;
  IdleJob on_idle_;  // used by the worker thread only
  const std::unique_ptr<ModelHost> host_;  // used by the worker thread only
  std::thread thread_;
};

template <typename Work>
std::invoke_result_t<Work&, ModelHost&> DeviceWorker::Run(JobPriority priority, Work work) {
  using Result = std::invoke_result_t<Work&, ModelHost&>;
  std::promise<Result> done;
  std::future<Result> result = done.get_future();
  // `work` and `done` outlive the job: this call waits for it below. The status is published before the reply, so
  // that a caller who has its reply (a model loaded, a step taken) finds it in status() at once.
  const absl::Status queued = Enqueue(priority, [this, &work, &done](ModelHost& host) {
    Result result = work(host);
    PublishStatus(host);
    done.set_value(std::move(result));
  });
  if (!queued.ok()) return queued;
  return result.get();
}

}  // namespace perception::server
