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

// The three training entry points of Backend.
enum class TrainEntry { kTrainStep, kTrainStepWithNext, kTrainStepStagingNext };

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

// Forwards every Backend call to `inner` unchanged, each training entry point to the same entry point, after
// recording it in `log` and sleeping `step_delay` (which lets a test make steps slow enough for later batches of a
// stream to queue behind them). Every virtual of Backend is forwarded: one left out would run its default instead.
class RecordingBackend final : public Backend {
 public:
  RecordingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<TrainCallLog> log,
                   absl::Duration step_delay = absl::ZeroDuration())
      : inner_(std::move(inner)), log_(std::move(log)), step_delay_(step_delay) {}

  absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>& batch) override {
    Record(TrainEntry::kTrainStep, batch, nullptr);
    return inner_->TrainStep(batch);
  }
  absl::StatusOr<TrainStepResult> TrainStepWithNext(const BatchView<float>& batch,
                                                    const BatchView<float>& next) override {
    Record(TrainEntry::kTrainStepWithNext, batch, &next);
    return inner_->TrainStepWithNext(batch, next);
  }
  absl::StatusOr<TrainStepResult> TrainStepStagingNext(const BatchView<float>& batch,
                                                       const BatchView<float>& next) override {
    Record(TrainEntry::kTrainStepStagingNext, batch, &next);
    return inner_->TrainStepStagingNext(batch, next);
  }

  std::string device_name() const override { return inner_->device_name(); }
  Precision precision() const override { return inner_->precision(); }
  int64_t memory_bytes() const override { return inner_->memory_bytes(); }
  const ParamLayout& layout() const override { return inner_->layout(); }
  TrainingCounters training_counters() const override { return inner_->training_counters(); }
  void set_use_graphs(bool use_graphs) override { inner_->set_use_graphs(use_graphs); }
  void set_stream_resident(bool resident) override { inner_->set_stream_resident(resident); }
  absl::Status QuiesceDevice() override { return inner_->QuiesceDevice(); }
  absl::StatusOr<bool> ReleaseIdleDevice() override { return inner_->ReleaseIdleDevice(); }
  absl::StatusOr<double> Evaluate(const BatchView<float>& batch, std::span<float> logits) override {
    return inner_->Evaluate(batch, logits);
  }
  absl::Status ForwardStream(std::span<const float> x, std::span<const float> dt, std::span<float> logits) override {
    return inner_->ForwardStream(x, dt, logits);
  }
  absl::StatusOr<Checkpoint> ExportState() const override { return inner_->ExportState(); }
  absl::Status ImportState(const Checkpoint& checkpoint) override { return inner_->ImportState(checkpoint); }
  absl::Status ConfigureStreaming(int slots, int64_t log_entries_per_slot) override {
    return inner_->ConfigureStreaming(slots, log_entries_per_slot);
  }
  absl::Status PublishWeights() override { return inner_->PublishWeights(); }
  absl::Status ForwardStepInto(const StreamTick& tick) override { return inner_->ForwardStepInto(tick); }
  absl::Status ResetSlot(int slot) override { return inner_->ResetSlot(slot); }
  absl::Status SeedSlot(int slot, std::span<const float> x, std::span<const float> dt) override {
    return inner_->SeedSlot(slot, x, dt);
  }
  absl::Status ReadLog(int slot, int64_t begin, int64_t count, std::span<float> convictions,
                       std::span<float> probs) override {
    return inner_->ReadLog(slot, begin, count, convictions, probs);
  }
  absl::Status ReadSlotProbabilities(int slot, std::span<float> probs) override {
    return inner_->ReadSlotProbabilities(slot, probs);
  }

 private:
  void Record(TrainEntry entry, const BatchView<float>& batch, const BatchView<float>* next) {
    log_->Add({entry, BatchContents::Of(batch),
               next != nullptr ? std::optional(BatchContents::Of(*next)) : std::nullopt});
    if (step_delay_ > absl::ZeroDuration()) absl::SleepFor(step_delay_);
  }

  const std::unique_ptr<Backend> inner_;
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
