// The device worker: the one thread that owns the model host (and so the device), fed by a bounded job queue.
#pragma once

#include <array>
#include <chrono>
#include <deque>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/host_allocation.h"
#include "grpcpp/server_context.h"
#include "server/model_host.h"

namespace perception::server {

// Which queued work the device runs first: a lower value first, FIFO within one priority. Each priority has its
// own bound, so one kind of work cannot take the other's slots. Live streaming (the stream batcher's ticks, its
// seeds, reads, resets and closes) goes ahead of training and model management; so that a continuous feed
// cannot stall training for good, one waiting training job runs after every kStreamingRun streaming jobs.
enum class JobPriority { kStreaming, kTraining };
inline constexpr int kJobPriorities = 2;
inline constexpr int kStreamingRun = 16;

// Why a job queued for a client's call must not run: DEADLINE_EXCEEDED once the call's deadline has passed, CANCELLED
// once the client cancelled it or went away; OK while the client still waits, and always for a null `caller` (work
// the daemon queues for itself). The client has its answer then, so work done afterwards would be a change it was
// told had failed.
absl::Status CallerGone(const grpc::ServerContextBase* caller);

class DeviceWorker {
 public:
  // Runs on the worker thread with exclusive use of the model host.
  using Job = absl::AnyInvocable<void(ModelHost&) &&>;

  // What the worker runs once the device has had no job for the idle period after the last one.
  using IdleJob = absl::AnyInvocable<void(ModelHost&)>;

  // Starts the thread; at most `queue_depth` bounded jobs wait per priority. Once no job has come for `idle_period`
  // after the last one, `on_idle` runs (once per pause; by default ModelHost::ReleaseIdleDevice); an infinite period
  // never.
  DeviceWorker(std::unique_ptr<ModelHost> host, int queue_depth, absl::Duration idle_period = absl::InfiniteDuration(),
               IdleJob on_idle = ReleaseIdleDevice);
  ~DeviceWorker();  // Stop()

  // Queues `job`; every accepted job runs, in order within its priority. RESOURCE_EXHAUSTED when that priority
  // already has `queue_depth` bounded jobs waiting, UNAVAILABLE after Stop. An unbounded job (`bounded` false: the
  // stream batcher's ticks and seed parts, which it keeps few of and must never lose) is always taken and takes no
  // bounded job's place: a tick waiting at --queue_depth=1 would otherwise refuse every ResetStream and CloseStream.
  absl::Status Enqueue(JobPriority priority, Job job, bool bounded = true);

  // Queues `work` (ModelHost& → absl::Status or absl::StatusOr<T>) and waits for its result; a refusal to queue
  // is returned as the result. Work that runs the host out of memory (a model or a batch the host cannot hold: a
  // std::bad_alloc) answers RESOURCE_EXHAUSTED instead of ending the daemon; what it allocated is freed as it
  // unwinds. With a `caller`, the work is skipped, and CallerGone's status returned, when the job
  // starts after the client stopped waiting; a deadline that passes while the work runs does not stop it. `bounded`
  // as for Enqueue.
  template <typename Work>
  std::invoke_result_t<Work&, ModelHost&> Run(JobPriority priority, Work work,
                                              const grpc::ServerContextBase* caller = nullptr, bool bounded = true);

  // The model host's status as of the last finished job; any thread, never waits for the device.
  HostStatus status() const;
  int queued_jobs() const;
  // How long the job the device runs now (the idle job included) has been running; zero between jobs and while the
  // job waits on its peers (PeerWait). Measured on the monotonic clock: a step of the wall clock (NTP, a manual set)
  // neither fakes a stall nor hides one.
  absl::Duration busy_for() const;

  // Held by a job, on the worker thread, while it waits for other ranks rather than for the device (the data-parallel
  // join, which waits up to --collective_timeout for a rank still starting): busy_for() reads zero meanwhile, so that
  // neither the stall watch nor perception_device_job_seconds takes a slow peer for a hung kernel. The job's clock
  // starts again when it is released.
  class PeerWait {
   public:
    explicit PeerWait(DeviceWorker& worker);
    ~PeerWait();
    PeerWait(const PeerWait&) = delete;
    PeerWait& operator=(const PeerWait&) = delete;

   private:
    DeviceWorker& worker_;
  };

  // Refuses new jobs, runs those already queued, then ends the thread. Idempotent.
  void Stop();

  // status() from now on: `host`'s status (the worker thread's host_). Each job's end publishes it; a job that answers
  // its client itself (a Train stream's step) publishes before it answers, so that the client finds its change there.
  void PublishStatus(const ModelHost& host);

 private:
  void Loop();
  static void ReleaseIdleDevice(ModelHost& host);

  mutable absl::Mutex mu_;
  struct QueuedJob {
    Job job;
    bool bounded = true;
  };
  std::array<std::deque<QueuedJob>, kJobPriorities> queues_ ABSL_GUARDED_BY(mu_);
  std::array<int, kJobPriorities> bounded_waiting_ ABSL_GUARDED_BY(mu_) = {};  // the bounded jobs of queues_
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int streaming_run_ ABSL_GUARDED_BY(mu_) = 0;  // streaming jobs run in a row while training jobs waited
  // None between jobs and while the job waits on its peers.
  std::optional<std::chrono::steady_clock::time_point> job_started_ ABSL_GUARDED_BY(mu_);
  HostStatus status_ ABSL_GUARDED_BY(mu_);
  const int queue_depth_;
  const absl::Duration idle_period_;
  IdleJob on_idle_;  // used by the worker thread only
  const std::unique_ptr<ModelHost> host_;  // used by the worker thread only
  std::thread thread_;
};

template <typename Work>
std::invoke_result_t<Work&, ModelHost&> DeviceWorker::Run(JobPriority priority, Work work,
                                                          const grpc::ServerContextBase* caller, bool bounded) {
  using Result = std::invoke_result_t<Work&, ModelHost&>;
  std::promise<Result> done;
  std::future<Result> result = done.get_future();
  // `work` and `done` outlive the job: this call waits for it below. The status is published before the reply, so
  // that a caller who has its reply (a model loaded, a step taken) finds it in status() at once.
  const absl::Status queued = Enqueue(priority, [this, &work, &done, caller](ModelHost& host) {
    if (absl::Status gone = CallerGone(caller); !gone.ok()) {
      done.set_value(std::move(gone));
      return;
    }
    Result result = RunOrExhausted("what this call needs", [&] { return work(host); });
    PublishStatus(host);
    done.set_value(std::move(result));
  }, bounded);
  if (!queued.ok()) return queued;
  return result.get();
}

}  // namespace perception::server
