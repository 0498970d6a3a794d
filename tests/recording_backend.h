// A Backend decorator for tests: forwards every call to a real backend and records each training call's entry
// point and the contents of its batches, so that tests can see which batch a caller handed on as `next`.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/backend.h"
#include "tests/forwarding_backend.h"

namespace perception::testing {

// A batch's shape and values, copied out of a view so that they can be compared once the view's buffers are gone.
struct BatchContents {
  int batch = 0, window = 0;
  std::vector<float> x, dt, labels, mask;

  static BatchContents Of(const BatchView<float>& view) {
    const auto copy = [](std::span<const float> values) { return std::vector<float>(values.begin(), values.end()); };
    return {view.batch, view.window, copy(view.x), copy(view.dt), copy(view.labels), copy(view.mask)};
  }
  bool operator==(const BatchContents&) const = default;
};

// The three training entry points of Backend, and ForgetStagedNext (no batch: the one a step before gave as `next`).
enum class TrainEntry { kTrainStep, kTrainStepWithNext, kTrainStepStagingNext, kForgetStagedNext };

struct TrainCall {
  TrainEntry entry = TrainEntry::kTrainStep;
  BatchContents batch;
  std::optional<BatchContents> next;  // the `next` argument of the entry points that take one
};

// The training calls recorded so far, in call order. Thread-safe: the device worker's thread records while the test's
// thread may read.
class TrainCallLog {
 public:
  void Add(TrainCall call) {
    absl::MutexLock lock(&mu_);
    calls_.push_back(std::move(call));
  }
  std::vector<TrainCall> calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<TrainCall> calls_ ABSL_GUARDED_BY(mu_);
};

// Forwards every Backend call to `inner` unchanged, each training entry point to the same entry point, after recording
// it in `log` and sleeping `step_delay` (which lets a test make steps slow enough for later batches of a stream to
// queue behind them); ForgetStagedNext is recorded too, without the sleep.
class RecordingBackend final : public ForwardingBackend {
 public:
  RecordingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<TrainCallLog> log,
                   absl::Duration step_delay = absl::ZeroDuration())
      : ForwardingBackend(std::move(inner)), log_(std::move(log)), step_delay_(step_delay) {}

  absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>& batch) override {
    Record(TrainEntry::kTrainStep, batch, nullptr);
    return ForwardingBackend::TrainStep(batch);
  }
  absl::StatusOr<TrainStepResult> TrainStepWithNext(const BatchView<float>& batch,
                                                    const BatchView<float>& next) override {
    Record(TrainEntry::kTrainStepWithNext, batch, &next);
    return ForwardingBackend::TrainStepWithNext(batch, next);
  }
  absl::StatusOr<TrainStepResult> TrainStepStagingNext(const BatchView<float>& batch,
                                                       const BatchView<float>& next) override {
    Record(TrainEntry::kTrainStepStagingNext, batch, &next);
    return ForwardingBackend::TrainStepStagingNext(batch, next);
  }
  void ForgetStagedNext() override {
    log_->Add({TrainEntry::kForgetStagedNext, {}, std::nullopt});
    ForwardingBackend::ForgetStagedNext();
  }

 private:
  void Record(TrainEntry entry, const BatchView<float>& batch, const BatchView<float>* next) {
    log_->Add({entry, BatchContents::Of(batch),
               next != nullptr ? std::optional(BatchContents::Of(*next)) : std::nullopt});
    if (step_delay_ > absl::ZeroDuration()) absl::SleepFor(step_delay_);
  }

  const std::shared_ptr<TrainCallLog> log_;
  const absl::Duration step_delay_;
};

// A ModelHost::BackendDecorator: every backend the host makes records into `log`, each step slowed by `step_delay`.
inline auto RecordTrainCalls(std::shared_ptr<TrainCallLog> log, absl::Duration step_delay = absl::ZeroDuration()) {
  return [log = std::move(log), step_delay](std::unique_ptr<Backend> backend) -> std::unique_ptr<Backend> {
    return std::make_unique<RecordingBackend>(std::move(backend), log, step_delay);
  };
}

// Whether `call` is a plain TrainStep, with no `next`, on exactly `batch`'s contents.
inline bool IsPlainTrainStepOn(const TrainCall& call, const BatchView<float>& batch) {
  return call.entry == TrainEntry::kTrainStep && !call.next.has_value() && call.batch == BatchContents::Of(batch);
}

// Index of the batch in `candidates` whose contents equal `contents`; -1 when none does. Tests compare indices
// rather than contents so that a failure names batches instead of printing their values.
inline int IndexOfBatch(const BatchContents& contents, const std::vector<BatchContents>& candidates) {
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i] == contents) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace perception::testing
