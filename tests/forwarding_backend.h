// A Backend for test decorators to derive from: forwards every call to a real backend unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "engine/backend.h"

namespace perception::testing {

// Every virtual of Backend is forwarded to `inner`: one left out would run Backend's default instead. A decorator
// overrides the calls it watches or changes and calls this class's version for the rest of their work.
class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  std::string device_name() const override { return inner_->device_name(); }
  Precision precision() const override { return inner_->precision(); }
  int64_t memory_bytes() const override { return inner_->memory_bytes(); }
  const ParamLayout& layout() const override { return inner_->layout(); }
  absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>& batch) override { return inner_->TrainStep(batch); }
  absl::StatusOr<TrainStepResult> TrainStepWithNext(const BatchView<float>& batch,
                                                    const BatchView<float>& next) override {
    return inner_->TrainStepWithNext(batch, next);
  }
  absl::StatusOr<TrainStepResult> TrainStepStagingNext(const BatchView<float>& batch,
                                                       const BatchView<float>& next) override {
    return inner_->TrainStepStagingNext(batch, next);
  }
  void ForgetStagedNext() override { inner_->ForgetStagedNext(); }
  int64_t step() const override { return inner_->step(); }
  TrainingCounters training_counters() const override { return inner_->training_counters(); }
  void set_use_graphs(bool use_graphs) override { inner_->set_use_graphs(use_graphs); }
  void set_stream_resident(bool resident) override { inner_->set_stream_resident(resident); }
  void set_stream_tick_timing(int every) override { inner_->set_stream_tick_timing(every); }
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
  absl::Status AdvanceSlot(int slot, std::span<const float> x, std::span<const float> dt) override {
    return inner_->AdvanceSlot(slot, x, dt);
  }
  absl::Status ReadLog(int slot, int64_t begin, int64_t count, std::span<float> convictions,
                       std::span<float> probs) override {
    return inner_->ReadLog(slot, begin, count, convictions, probs);
  }
  absl::Status ReadSlotProbabilities(int slot, std::span<float> probs) override {
    return inner_->ReadSlotProbabilities(slot, probs);
  }
  absl::StatusOr<TicksChecked> CheckTicks(bool wait_for_ticks) override { return inner_->CheckTicks(wait_for_ticks); }

 private:
  const std::unique_ptr<Backend> inner_;
};

}  // namespace perception::testing
