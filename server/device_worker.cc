// The device worker's queue and loop.
#include "server/device_worker.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace perception::server {

absl::Status CallerGone(const grpc::ServerContextBase* caller) {
  if (caller == nullptr) return absl::OkStatus();
  // The deadline is read from the clock: gRPC may not have noticed it yet when the job starts.
  if (std::chrono::system_clock::now() >= caller->deadline()) {
    return absl::DeadlineExceededError("not run: the call's deadline passed while it waited for the device");
  }
  if (caller->IsCancelled()) return absl::CancelledError("not run: the client cancelled the call or went away");
  return absl::OkStatus();
}

DeviceWorker::DeviceWorker(std::unique_ptr<ModelHost> host, int queue_depth, absl::Duration idle_period,
                           IdleJob on_idle)
    : status_(host->Status()),
      queue_depth_(queue_depth),
      idle_period_(idle_period),
      on_idle_(std::move(on_idle)),
      host_(std::move(host)),
      thread_(&DeviceWorker::Loop, this) {}

void DeviceWorker::ReleaseIdleDevice(ModelHost& host) {
  const absl::Status released = host.ReleaseIdleDevice();
  if (!released.ok()) spdlog::warn("releasing the idle device: {}", released.ToString());
}

DeviceWorker::~DeviceWorker() { Stop(); }

absl::Status DeviceWorker::Enqueue(JobPriority priority, Job job, bool bounded) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the device worker has stopped");
  int& bounded_waiting = bounded_waiting_[static_cast<int>(priority)];
  if (bounded && bounded_waiting >= queue_depth_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the device queue is full (", queue_depth_, " calls' jobs waiting); retry later"));
  }
  queues_[static_cast<int>(priority)].push_back({std::move(job), bounded});
  if (bounded) ++bounded_waiting;
  return absl::OkStatus();
}

HostStatus DeviceWorker::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

void DeviceWorker::PublishStatus(const ModelHost& host) {
  HostStatus status = host.Status();
  absl::MutexLock lock(&mu_);
  status_ = std::move(status);
}

int DeviceWorker::queued_jobs() const {
  absl::MutexLock lock(&mu_);
  int jobs = 0;
  for (const std::deque<QueuedJob>& queue : queues_) jobs += static_cast<int>(queue.size());
  return jobs;
}

absl::Duration DeviceWorker::busy_for() const {
  absl::MutexLock lock(&mu_);
  if (!job_started_) return absl::ZeroDuration();
  return absl::FromChrono(std::chrono::steady_clock::now() - *job_started_);
}

DeviceWorker::PeerWait::PeerWait(DeviceWorker& worker) : worker_(worker) {
  absl::MutexLock lock(&worker_.mu_);
  worker_.job_started_.reset();
}

DeviceWorker::PeerWait::~PeerWait() {
  absl::MutexLock lock(&worker_.mu_);
  worker_.job_started_ = std::chrono::steady_clock::now();
}

void DeviceWorker::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void DeviceWorker::Loop() {
  bool worked_since_idle = false;  // a job has run since on_idle last ran
  while (true) {
    Job job;
    bool idle = false;
    {
      absl::MutexLock lock(&mu_);
      const auto has_work_or_stops = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stopping_) return true;
        for (const std::deque<QueuedJob>& queue : queues_) {
          if (!queue.empty()) return true;
        }
        return false;
      };
      idle = !mu_.AwaitWithTimeout(absl::Condition(&has_work_or_stops),
                                   worked_since_idle ? idle_period_ : absl::InfiniteDuration());
      if (!idle) {
        std::deque<QueuedJob>& streaming = queues_[static_cast<int>(JobPriority::kStreaming)];
        std::deque<QueuedJob>& training = queues_[static_cast<int>(JobPriority::kTraining)];
        const bool training_turn = !training.empty() && (streaming.empty() || streaming_run_ >= kStreamingRun);
        const int taken = static_cast<int>(training_turn || streaming.empty() ? JobPriority::kTraining
                                                                                 : JobPriority::kStreaming);
        std::deque<QueuedJob>& queue = queues_[taken];
        if (!queue.empty()) {
          job = std::move(queue.front().job);
          if (queue.front().bounded) --bounded_waiting_[taken];
          queue.pop_front();
          streaming_run_ = &queue == &streaming && !training.empty() ? streaming_run_ + 1 : 0;
        }
        if (!job) return;  // stopping, and nothing is left to run
      }
      job_started_ = std::chrono::steady_clock::now();
    }
    if (idle) {
      worked_since_idle = false;
      on_idle_(*host_);
    } else {
      std::move(job)(*host_);
      worked_since_idle = true;
      PublishStatus(*host_);
    }
    absl::MutexLock lock(&mu_);
    job_started_.reset();
  }
}

}  // namespace perception::server
