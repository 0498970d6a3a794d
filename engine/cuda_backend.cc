// The Backend interface over CudaModel: shape checks, training steps replayed as CUDA graphs (CudaModel's warmup →
// capture → replay), batching of evaluations into the configured batch, streams in chunks of the window with the
// state carried, and checkpoints in and out.
#include "engine/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "engine/cuda_check.h"
#include "engine/cuda_streamer.h"
#include "engine/nccl_communicator.h"
#include "engine/status_macros.h"
#include "kernels/trap.h"

namespace perception {
namespace {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(std::unique_ptr<CudaModel> model) : model_(std::move(model)) {}

  std::string device_name() const override { return model_->device_name(); }
  Precision precision() const override { return model_->precision(); }
  const ParamLayout& layout() const override { return model_->layout(); }

  absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>& batch) override {
    return Train(batch, nullptr, NextStaging::kBeforeLaunch);
  }
  absl::StatusOr<TrainStepResult> TrainStepWithNext(const BatchView<float>& batch,
                                                    const BatchView<float>& next) override {
    return Train(batch, &next, NextStaging::kBeforeLaunch);
  }
  absl::StatusOr<TrainStepResult> TrainStepStagingNext(const BatchView<float>& batch,
                                                       const BatchView<float>& next) override {
    return Train(batch, &next, NextStaging::kDuringStep);
  }

  void ForgetStagedNext() override { DropNext(); }
  int64_t step() const override { return step_; }

  TrainingCounters training_counters() const override {
    TrainingCounters counters = model_->training_counters();
    counters.replica_checks = replica_checks_;
    return counters;
  }
  // One switch for the training graphs and the streaming ticks' graphs.
  void set_use_graphs(bool use_graphs) override {
    model_->set_use_graphs(use_graphs);
    if (streamer_) streamer_->set_use_graphs(use_graphs);
  }
  void set_stream_resident(bool resident) override {
    stream_resident_ = resident;
    if (streamer_) streamer_->set_use_resident(resident);
  }
  void set_stream_tick_timing(int every) override {
    stream_tick_timing_ = every;
    if (streamer_) streamer_->set_time_ticks(every);
  }
  absl::Status InjectDeviceLoss() override {
    // A running resident step faults itself. Otherwise a trapping kernel runs alone: the daemon runs nothing beside
    // the resident step (every other device job stops it first), and on the H200 a trap launched beside it never
    // ended its synchronization (bench/RESULTS.md, s37b). The stream is never destroyed: after the trap no CUDA call
    // of the process can succeed.
    if (streamer_ && streamer_->resident_running()) return streamer_->FaultResident();
    RETURN_IF_ERROR(QuiesceDevice());
    cudaStream_t stream = nullptr;
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_RETURN_IF_ERROR(kernels::LaunchTrap(stream));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::InternalError("the trapping kernel ended without an error");
  }
  absl::Status QuiesceDevice() override { return streamer_ ? streamer_->Quiesce() : absl::OkStatus(); }
  absl::StatusOr<bool> ReleaseIdleDevice() override {
    if (!streamer_ || !streamer_->resident_running()) return false;
    RETURN_IF_ERROR(streamer_->StopResident());
    return true;
  }

  // Groups of at most config.batch windows; windows longer than the model's run in chunks of its window, each
  // window's state carried from chunk to chunk. The loss is the masked mean over the batch.
  absl::StatusOr<double> Evaluate(const BatchView<float>& batch, std::span<float> logits) override {
    DropNext();
    RETURN_IF_ERROR(YieldStreaming());
    const ModelConfig& c = config();
    const size_t F = c.n_features, H = c.n_horizons, T = batch.window;
    const size_t n = static_cast<size_t>(batch.batch) * T;
    if (batch.batch < 1 || batch.window < 1) {
      return absl::InvalidArgumentError(absl::StrCat("Evaluate: a batch of (", batch.batch, ", ", batch.window, ")"));
    }
    if (batch.x.size() < n * F || batch.dt.size() < n || batch.labels.size() < n * H || batch.mask.size() < n * H) {
      return absl::InvalidArgumentError("Evaluate: batch arrays are shorter than its shape");
    }
    if (!logits.empty() && logits.size() != n * H) {
      return absl::InvalidArgumentError(absl::StrCat("Evaluate: logits hold ", logits.size(), " floats, need ", n * H));
    }
    const bool chunked = batch.window > c.window;
    double loss_sum = 0, mask_count = 0;
    for (int first = 0; first < batch.batch; first += c.batch) {
      const int count = std::min(c.batch, batch.batch - first);
      if (chunked) RETURN_IF_ERROR(model_->ResetStreamState());
      for (int t0 = 0; t0 < batch.window; t0 += c.window) {
        const int len = std::min(c.window, batch.window - t0);
        const BatchView<float> chunk =
            chunked ? GatherChunk(batch, first, count, t0, len) : Windows(batch, first, count);
        RETURN_IF_ERROR(model_->StageBatch(chunk));
        RETURN_IF_ERROR(model_->EnqueueEvaluate(/*carry_state=*/chunked));
        ASSIGN_OR_RETURN(const kernels::StepReport report, model_->Wait());
        loss_sum += report.loss_sum;
        mask_count += report.mask_count;
        if (logits.empty()) continue;
        const std::span<const float> staged = model_->StagedLogits();
        for (int w = 0; w < count; ++w) {  // window w's events t0 .. t0 + len of the chunk
          std::ranges::copy(staged.subspan(static_cast<size_t>(w) * len * H, len * H),
                            logits.begin() + ((first + w) * T + t0) * H);
        }
      }
    }
    return loss_sum / std::max(mask_count, 1.0);
  }

  // One sequence: Evaluate's one window of n events, in chunks of the model's window with the state carried.
  absl::Status ForwardStream(std::span<const float> x, std::span<const float> dt, std::span<float> logits) override {
    const ModelConfig& c = config();
    const size_t n = dt.size(), F = c.n_features, H = c.n_horizons;
    if (x.size() != n * F || logits.size() != n * H) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardStream: ", n, " events need x of ", n * F,
                                                     " and logits of ", n * H, " floats"));
    }
    if (n == 0) return absl::OkStatus();
    const std::vector<float> no_labels(n * H);  // the forward ignores labels and mask
    return Evaluate({1, static_cast<int>(n), x, dt, no_labels, no_labels}, logits).status();
  }

  absl::StatusOr<Checkpoint> ExportState() const override {
    Checkpoint checkpoint{config(), {}, {}, {}, 0, std::nullopt};
    ASSIGN_OR_RETURN(checkpoint.params, model_->DownloadParams());
    ASSIGN_OR_RETURN(checkpoint.exp_avg, model_->DownloadExpAvg());
    ASSIGN_OR_RETURN(checkpoint.exp_avg_sq, model_->DownloadExpAvgSq());
    ASSIGN_OR_RETURN(checkpoint.step, model_->DownloadStep());
    return checkpoint;
  }

  absl::Status ImportState(const Checkpoint& checkpoint) override {
    if (!(checkpoint.config == config())) {
      return absl::FailedPreconditionError("checkpoint config differs from the backend's model config");
    }
    RETURN_IF_ERROR(model_->Upload(checkpoint.params, checkpoint.exp_avg, checkpoint.exp_avg_sq, checkpoint.step));
    step_ = checkpoint.step;
    return absl::OkStatus();
  }

  // Streaming runs on its own high-priority stream over a published copy of the weights (engine/cuda_streamer.h).
  absl::Status ConfigureStreaming(int slots, int64_t log_entries_per_slot) override {
    ASSIGN_OR_RETURN(streamer_, CudaStreamer::Create(layout(), slots, log_entries_per_slot));
    streamer_->set_use_graphs(model_->use_graphs());
    streamer_->set_use_resident(stream_resident_);
    streamer_->set_time_ticks(stream_tick_timing_);
    return PublishWeights();
  }
  absl::Status PublishWeights() override {
    RETURN_IF_ERROR(RequireStreaming());
    return streamer_->Publish(model_->device_params(), model_->stream());
  }
  absl::Status ForwardStepInto(const StreamTick& tick) override {
    RETURN_IF_ERROR(RequireStreaming());
    return streamer_->Step(tick);
  }
  absl::Status ResetSlot(int slot) override {
    RETURN_IF_ERROR(RequireStreaming());
    return streamer_->ResetSlot(slot);
  }
  absl::Status AdvanceSlot(int slot, std::span<const float> x, std::span<const float> dt) override {
    RETURN_IF_ERROR(RequireStreaming());
    return streamer_->AdvanceSlot(slot, x, dt);
  }
  absl::Status ReadLog(int slot, int64_t begin, int64_t count, std::span<float> convictions,
                       std::span<float> probs) override {
    RETURN_IF_ERROR(RequireStreaming());
    return streamer_->ReadLog(slot, begin, count, convictions, probs);
  }
  absl::Status ReadSlotProbabilities(int slot, std::span<float> probs) override {
    RETURN_IF_ERROR(RequireStreaming());
    return streamer_->ReadSlotProbabilities(slot, probs);
  }
  absl::StatusOr<TicksChecked> CheckTicks(bool wait_for_ticks) override {
    RETURN_IF_ERROR(RequireStreaming());
    return streamer_->CheckTicks(wait_for_ticks);
  }

 private:
  // Windows [first, first + count) of `batch`, whole: contiguous in its arrays.
  BatchView<float> Windows(const BatchView<float>& batch, int first, int count) const {
    const size_t F = config().n_features, H = config().n_horizons;
    const size_t begin = static_cast<size_t>(first) * batch.window, events = static_cast<size_t>(count) * batch.window;
    return {count, batch.window, batch.x.subspan(begin * F, events * F), batch.dt.subspan(begin, events),
            batch.labels.subspan(begin * H, events * H), batch.mask.subspan(begin * H, events * H)};
  }

  // Events [t0, t0 + len) of windows [first, first + count), copied together into the chunk buffers.
  BatchView<float> GatherChunk(const BatchView<float>& batch, int first, int count, int t0, int len) {
    const size_t F = config().n_features, H = config().n_horizons, events = static_cast<size_t>(count) * len;
    chunk_x_.resize(events * F);
    chunk_dt_.resize(events);
    chunk_labels_.resize(events * H);
    chunk_mask_.resize(events * H);
    for (int w = 0; w < count; ++w) {
      const size_t from = static_cast<size_t>(first + w) * batch.window + t0, to = static_cast<size_t>(w) * len;
      std::ranges::copy(batch.x.subspan(from * F, len * F), chunk_x_.begin() + to * F);
      std::ranges::copy(batch.dt.subspan(from, len), chunk_dt_.begin() + to);
      std::ranges::copy(batch.labels.subspan(from * H, len * H), chunk_labels_.begin() + to * H);
      std::ranges::copy(batch.mask.subspan(from * H, len * H), chunk_mask_.begin() + to * H);
    }
    return {count, len, chunk_x_, chunk_dt_, chunk_labels_, chunk_mask_};
  }

  absl::Status CheckTrainingShape(const BatchView<float>& batch) const {
    const ModelConfig& c = config();
    if (batch.batch != c.batch || batch.window != c.window) {
      return absl::InvalidArgumentError(absl::StrCat("TrainStep: batch shape (", batch.batch, ", ", batch.window,
                                                     ") differs from the backend's (batch, window) = (", c.batch, ", ",
                                                     c.window, ")"));
    }
    return absl::OkStatus();
  }

  // Where a step stages the batch given for the step after it: before its launch, so that its graph copies that
  // batch in beside its compute (TrainStepWithNext), or after, into pinned memory while the device runs the step,
  // which the next step then copies in itself (TrainStepStagingNext).
  enum class NextStaging { kBeforeLaunch, kDuringStep };

  // Stage → enqueue → wait. With `next`, it is staged for the following step (`staging` says when), which trains on
  // it if it is given the batch at the same address; any other call first forgets it.
  absl::StatusOr<TrainStepResult> Train(const BatchView<float>& batch, const BatchView<float>* next,
                                        NextStaging staging) {
    // Taken before anything can fail: a batch staged ahead is this call's or no one's.
    const bool staged_ahead = staged_next_ != nullptr && staged_next_ == batch.x.data();
    staged_next_ = nullptr;
    RETURN_IF_ERROR(CheckTrainingShape(batch));
    if (next) RETURN_IF_ERROR(CheckTrainingShape(*next));
    RETURN_IF_ERROR(YieldStreaming());
    if (!staged_ahead) {  // whatever a failed call left staged is not this step's
      model_->DropStagedBatches();
      RETURN_IF_ERROR(model_->StageBatch(batch));
    }
    if (next && staging == NextStaging::kBeforeLaunch) RETURN_IF_ERROR(model_->StageBatch(*next));
    RETURN_IF_ERROR(model_->EnqueueTrainStep());
    // Once enqueued the step runs: a `next` refused here (arrays that do not match its shape) is reported after the
    // step is waited for and counted, so that step() says it was applied (ModelHost::AfterFailedStep reads it).
    const absl::Status staged_during_step =
        next && staging == NextStaging::kDuringStep ? model_->StageBatch(*next) : absl::OkStatus();
    if (next && staged_during_step.ok()) staged_next_ = next->x.data();
    ASSIGN_OR_RETURN(const kernels::StepReport report, model_->Wait());
    step_ = report.step;  // applied, whatever the replica check finds
    const TrainStepResult result{report.loss, report.grad_norm, report.step};
    if (report.applied == 0) return StepNotTakenError(result);  // the optimizer refused it (StepApplies)
    RETURN_IF_ERROR(MaybeCheckReplicas(report.step));  // a collective: every rank runs it, whatever `next` was
    RETURN_IF_ERROR(staged_during_step);
    return result;
  }

  // What is staged is not the next call's: the batch a TrainStepWithNext or TrainStepStagingNext staged for the step
  // after it, or one a Train that failed after staging left behind (then staged_next_ is already null). Forget it, so
  // the model's next Enqueue takes what is staged for it; before, an Evaluate after such a failure scored the
  // training batch left staged and shifted its chunks by one.
  void DropNext() {
    model_->DropStagedBatches();
    staged_next_ = nullptr;
  }

  // Data parallel: every check_every steps the ranks compare a checksum of their parameters, which identical
  // updates keep bit-identical.
  absl::Status MaybeCheckReplicas(int64_t step) {
    NcclCommunicator* communicator = model_->communicator();
    if (communicator == nullptr || communicator->check_every() == 0 || step % communicator->check_every() != 0) {
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(const std::vector<float> params, model_->DownloadParams());
    RETURN_IF_ERROR(communicator->CheckReplicas(params, step, model_->stream()));
    ++replica_checks_;
    return absl::OkStatus();
  }

  // A training step or an evaluation takes the whole device: a resident streaming step (which holds a cluster of
  // multiprocessors between lone events) is stopped first, and the model's stream waits until it has left.
  absl::Status YieldStreaming() {
    return streamer_ ? streamer_->YieldTo(model_->stream()) : absl::OkStatus();
  }

  absl::Status RequireStreaming() const {
    if (streamer_) return absl::OkStatus();
    return absl::FailedPreconditionError("streaming is not configured on this backend (ConfigureStreaming first)");
  }

  std::unique_ptr<CudaModel> model_;
  std::unique_ptr<CudaStreamer> streamer_;
  int64_t replica_checks_ = 0;
  int64_t step_ = 0;  // the device's step counter as of the last completed step or import (step())
  bool stream_resident_ = true;
  int stream_tick_timing_ = kStreamTickTimingEvery;
  // x of the batch the last TrainStepWithNext or TrainStepStagingNext staged as `next`, if any.
  const float* staged_next_ = nullptr;
  std::vector<float> chunk_x_, chunk_dt_, chunk_labels_, chunk_mask_;  // Evaluate's chunks of long windows
};

}  // namespace

absl::Status CudaDeviceAvailable() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // leave no error behind for the next runtime call to report
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device: cudaGetDeviceCount returned ",
                                                      cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
  }
  if (count == 0) return absl::FailedPreconditionError("no CUDA device: cudaGetDeviceCount found none");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const ModelConfig& config, const OptimizerConfig& optimizer,
                                                         std::vector<float> params, CudaModelOptions options) {
  ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model, CudaModel::Create(config, optimizer, params, options));
  return std::make_unique<CudaBackend>(std::move(model));
}

}  // namespace perception
