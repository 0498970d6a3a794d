// The compute backend interface: one owner of the model's parameters and optimizer state on one device.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/checkpoint.h"
#include "engine/cpu_reference.h"
#include "engine/optimizer.h"
#include "engine/param_layout.h"
#include "engine/precision.h"

namespace perception {

struct TrainStepResult {
  double loss = 0;       // masked BCE of the batch, before the update
  double grad_norm = 0;  // global gradient norm, before clipping
  int64_t step = 0;      // optimizer steps taken, this one included
};

// A step whose gradient norm is not finite is not taken (ClipAndAdamW): the backends answer it with this error
// (FAILED_PRECONDITION, naming the norm, the loss and the step the model stays at) instead of a result.
absl::Status StepNotTakenError(const TrainStepResult& result);
// Whether a training step's error is StepNotTakenError's (a payload marks it: other failures answer
// FAILED_PRECONDITION too).
bool IsStepNotTaken(const absl::Status& status);

// How a backend's training steps ran and what they cost on the device, for the daemon's metrics. The CUDA backend
// keeps it (engine/cuda_model.h); other backends report zeros.
struct TrainingCounters {
  int64_t eager_steps = 0;        // steps enqueued kernel by kernel: the first at each shape, all with graphs off
  int64_t graph_captures = 0;     // training-step graphs captured, one per (batch, window) trained at
  int64_t graph_replays = 0;      // steps run as one cudaGraphLaunch of a captured graph
  int64_t timed_steps = 0;        // steps whose device time was read (every step waited for before the next)
  double last_step_seconds = 0;   // device time of the latest timed step: CUDA events recorded around its launch
  double total_step_seconds = 0;  // summed over the timed steps
  int64_t replica_checks = 0;     // data-parallel parameter checksums compared across ranks (all equal)
};

// One tick of the streaming path: n events, at most one per slot, each with the number of its entry in that slot's
// log, whose conviction and probabilities go to ring position number mod log_entries_per_slot (the caller keeps the
// log's bookkeeping; see StreamTable).
struct StreamTick {
  std::span<const float> x;              // [n, F] raw features
  std::span<const float> dt;             // [n] seconds since the slot's previous event
  std::span<const int32_t> slots;        // [n] distinct slot indices
  std::span<const int64_t> log_indices;  // [n] entry numbers, ≥ 0
  size_t size() const { return dt.size(); }
};

// A streamed event whose logits came out not finite: its slot, and its entry number in the slot's log.
struct NonFiniteOutput {
  int slot;
  int64_t entry;
  bool operator==(const NonFiniteOutput&) const = default;
};

// What Backend::CheckTicks learned about the ticks ForwardStepInto queued.
struct TicksChecked {
  // The latest `unfinished` ForwardStepInto calls may still be running on the device. Every earlier one has finished,
  // and its non-finite outputs are in `nonfinite`, this answer's or an earlier one's.
  int64_t unfinished = 0;
  // The logged events whose logits came out not finite, the first of each slot since the slot was last reported, reset
  // or seeded; a tick still unfinished may be among them.
  std::vector<NonFiniteOutput> nonfinite;
  // The device time in seconds of each launched tick found finished since the last call, in order: CUDA events
  // recorded on the device's stream just before the tick's work and just after it (the CUDA backend). Lone events
  // that the resident step took have no launch and are not among them; backends without a device report none.
  std::vector<double> device_seconds;
  // The device time in seconds of each lone event the resident step took (the CUDA backend), in order: its stamps on
  // the device's global timer, from its ring entry found to just before its answer's store; reported while the run of
  // the resident step that took it goes on, once a later event is answered, or else once that run has stopped (an idle
  // release, any other request) and left, where the stamp ring still holds it (the last 1,024 events posted); at most
  // 4,096 a call on either path.
  std::vector<double> resident_seconds;
};

// One launched streaming tick in this many is timed on the device by default: a timing CUDA event costs the CUDA
// stream 1.2–1.5 µs more than a plain one (~2 µs behind a tick of 1,024 events; H200, bench/RESULTS.md, the
// fifty-first session).
constexpr int kStreamTickTimingEvery = 16;

// AdvanceSlot's (and SeedSlot's) answer where the window leads to a state that is not finite (FAILED_PRECONDITION).
absl::Status SeedNotFiniteError();

// Implemented by the CPU reference backend and the CUDA backend; the daemon's device worker and the offline
// command line drive either through it. Not thread-safe: one thread owns a backend.
class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu", or the device's name for CUDA (e.g. "cuda:0 NVIDIA H200").
  virtual std::string device_name() const = 0;
  // The arithmetic of the linear-layer products (engine/precision.h); the CPU backend's is fp32.
  virtual Precision precision() const { return Precision::kFloat32; }
  // Total memory of the device in bytes (the host's for the CPU backend); 0 when the backend cannot tell.
  virtual int64_t memory_bytes() const { return 0; }
  virtual const ParamLayout& layout() const = 0;
  const ModelConfig& config() const { return layout().config(); }

  // One optimizer step on `batch`, whose shape must match the backend's config (batch, window).
  virtual absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>& batch) = 0;
  // TrainStep(batch) for a caller that holds its next step's batch already: a backend may take `next` (read during
  // this call) to the device meanwhile; the CUDA backend's step copies it in beside its compute, so the next step
  // starts on it at once instead of on a copy over the host link. The next call is then given that batch at the
  // same address (its contents were taken here); a batch elsewhere, or an Evaluate or ForwardStream in between,
  // costs only that head start. The default ignores `next`. The backend knows the batch by its address alone, so a
  // caller must give its next TrainStep that very batch, unchanged, while it is still alive; the backend forgets it
  // at its next training step, evaluation or sequence forward, whichever batch that is given, so a batch freed after
  // that call cannot be taken for a later one at its address.
  virtual absl::StatusOr<TrainStepResult> TrainStepWithNext(const BatchView<float>& batch,
                                                            const BatchView<float>& /*next*/) {
    return TrainStep(batch);
  }
  // The same contract, for a caller whose host work around a step is the bound (the daemon's Train stream): the CUDA
  // backend stages `next` into pinned memory while the device runs this step, rather than before its launch, and the
  // next step then copies it in itself. The default ignores `next`.
  virtual absl::StatusOr<TrainStepResult> TrainStepStagingNext(const BatchView<float>& batch,
                                                               const BatchView<float>& /*next*/) {
    return TrainStep(batch);
  }
  // The caller will not train the batch it last gave as `next` (the step was dropped): the backend forgets it, as
  // its next training step, evaluation or sequence forward would, before the batch is freed.
  virtual void ForgetStagedNext() {}
  // Optimizer steps applied to the parameters: the step of the last update. A training step can fail after its update
  // was applied (the data-parallel replica check runs after it), so its caller reads here whether the weights moved.
  virtual int64_t step() const = 0;
  // Training-step metrics (see TrainingCounters); zeros where the backend keeps none.
  virtual TrainingCounters training_counters() const { return {}; }
  // CUDA graphs for the training step and the streaming ticks (on by default); off enqueues the same work kernel by
  // kernel, for debugging. A backend without graphs ignores it.
  virtual void set_use_graphs(bool /*use_graphs*/) {}
  // Lone streaming events through a resident step where the backend has one (CUDA, small: engine/cuda_streamer.h;
  // on by default), instead of a launch per tick. A backend without one ignores it.
  virtual void set_stream_resident(bool /*resident*/) {}
  // How CheckTicks times the streaming ticks on the device (TicksChecked::device_seconds, resident_seconds): one
  // launched tick in `every` (kStreamTickTimingEvery by default), and, unless `every` is 0, every lone event the
  // resident step takes. A backend without a device ignores it.
  virtual void set_stream_tick_timing(int /*every*/) {}
  // Leaves nothing of this backend running on the device between calls (CUDA: a resident streaming step is stopped
  // and waited for; the next lone event starts it again), before work that may wait for the whole device, such as
  // creating another backend.
  virtual absl::Status QuiesceDevice() { return absl::OkStatus(); }
  // Frees what this backend holds on the device only to answer the next request sooner, when requests have paused
  // (CUDA: a running resident streaming step is stopped, not waited for; it answers every event posted before, and
  // the next lone event starts another); true when it stopped something. A backend that holds nothing ignores it.
  virtual absl::StatusOr<bool> ReleaseIdleDevice() { return false; }
  // Masked BCE of `batch` under the current parameters; logits [B,T,H] written when non-empty.
  virtual absl::StatusOr<double> Evaluate(const BatchView<float>& batch, std::span<float> logits) = 0;

  // The sequence path over ONE stream of n events from a zero state: x [n,F], dt [n] → logits [n,H]. Any n;
  // a backend may run it in chunks with the state carried, which is the same function.
  virtual absl::Status ForwardStream(std::span<const float> x, std::span<const float> dt, std::span<float> logits) = 0;

  // Parameters, moments and step, as a checkpoint holds them.
  virtual absl::StatusOr<Checkpoint> ExportState() const = 0;
  // Replaces parameters, moments and step; the checkpoint's config must equal the backend's.
  virtual absl::Status ImportState(const Checkpoint& checkpoint) = 0;

  // ---- Streaming (MODEL.md §3): per-instrument state slots, read against a published copy of the weights. ----
  // Allocates `slots` zeroed state slots and their conviction logs (`log_entries_per_slot` entries of conviction
  // and H probabilities each), and publishes the current weights. Called once, before any other streaming call.
  virtual absl::Status ConfigureStreaming(int slots, int64_t log_entries_per_slot);
  // Streaming reads the weights as of the last call: a whole set, never one half-way through an update.
  virtual absl::Status PublishWeights();
  // One step path event per listed slot (forward_step_into): states updated in place, probabilities written to
  // the slot's probability row and, with the conviction of MODEL.md §2.8, to its log at the given index.
  virtual absl::Status ForwardStepInto(const StreamTick& tick);
  // Zeroes one slot's state.
  virtual absl::Status ResetSlot(int slot);
  // Carries one slot's state through x [n,F], dt [n] (n >= 1) as the sequence path does, logging nothing: a window
  // stepped in parts ends in the state of the whole. Where the state it reaches is not finite (float32 overflowed
  // inside the model), the slot holds it and SeedNotFiniteError is returned.
  virtual absl::Status AdvanceSlot(int slot, std::span<const float> x, std::span<const float> dt);
  // The sequence path's final state over the window from a zero state: ResetSlot, then AdvanceSlot.
  absl::Status SeedSlot(int slot, std::span<const float> x, std::span<const float> dt);
  // Copies log entries [begin, begin + count) of `slot` (no wrap: the caller splits a wrapped range) into
  // convictions [count] and, when non-empty, probs [count, H].
  virtual absl::Status ReadLog(int slot, int64_t begin, int64_t count, std::span<float> convictions,
                               std::span<float> probs);
  // The latest probabilities of `slot`, [H].
  virtual absl::Status ReadSlotProbabilities(int slot, std::span<float> probs);
  // Which ForwardStepInto calls have finished on the device, and the logged events whose logits came out not finite
  // (float32 overflowed inside the model, which MODEL.md's math does not: weights or features beyond what its
  // arithmetic holds). Such a slot's state is not finite either, so its later events are not finite too. CUDA learns
  // of both without waiting for the device (an event behind each tick, a word its ticks set in mapped host memory),
  // copying the slots' findings only when that word is set; with `wait_for_ticks` it waits for every tick first, so
  // that none is unfinished. The CPU backend's ticks have finished when ForwardStepInto returns.
  virtual absl::StatusOr<TicksChecked> CheckTicks(bool wait_for_ticks);

  // For tests of the daemon's lost-device path: loses the device as a sticky error would (the CUDA backend by a trap,
  // inside the running resident step if there is one, else in a kernel of its own; others by recording the loss) and
  // returns what every later device call of the process will.
  virtual absl::Status InjectDeviceLoss();
};

// The CPU reference as a backend (float32), `threads` workers over the batch (0: one per core; a training step uses
// at most CpuReference::kGradientGroups, so that its bits do not depend on the machine).
std::unique_ptr<Backend> MakeCpuBackend(const ModelConfig& config, const OptimizerConfig& optimizer,
                                        std::vector<float> params, int threads = 0);

class NcclCommunicator;

// One rank of a data-parallel job: N daemons, one GPU each, joined by one NCCL communicator.
struct DataParallelOptions {
  int rank = 0;
  int world_size = 1;
  // How long joining, and any wait for a step with collectives in it, may take before the communicator is aborted.
  absl::Duration timeout = absl::Seconds(60);
  // Every this many optimizer steps the ranks compare a checksum of their parameters (0: never).
  int64_t check_every = 100;
};

// Rank 0's side of the bootstrap: a new NCCL unique id (opaque bytes) to hand to the other ranks. NCCL listens for
// them in this process. FAILED_PRECONDITION in a build without CUDA.
absl::StatusOr<std::string> NewDataParallelId();
// Joins the job named by `unique_id` on the current CUDA device; DEADLINE_EXCEEDED when the others do not all join
// within options.timeout. FAILED_PRECONDITION without a CUDA device or CUDA build.
absl::StatusOr<std::shared_ptr<NcclCommunicator>> JoinDataParallel(const std::string& unique_id,
                                                                   const DataParallelOptions& options);

// OK until `communicator` was aborted (a peer failed or stalled during a step); then FAILED_PRECONDITION with the
// reason (NcclCommunicator::Usable).
absl::Status DataParallelUsable(const NcclCommunicator& communicator);

// OK for the device names MakeBackend takes (cpu, cuda, auto); INVALID_ARGUMENT naming them otherwise.
absl::Status CheckDeviceName(const std::string& device);
// OK where MakeBackend can build the CUDA backend (the one "auto" then resolves to); otherwise FAILED_PRECONDITION
// naming what is missing: the CUDA backend in this build, or a CUDA device on this machine.
absl::Status CudaBackendAvailable();

// The backend for `device`: "cpu", "cuda" (an error naming what is missing when this build has no CUDA backend
// or the machine no CUDA device) or "auto" (CUDA when a device is present, else the CPU). With a `communicator`
// the backend is one rank of a data-parallel job (engine/nccl_communicator.h), which only CUDA can be. `precision`
// is the CUDA backend's product arithmetic, nullopt the device's default (DefaultPrecision: 3xtf32 on CUDA, fp32 on
// the CPU); a backend that resolves to the CPU refuses any but kFloat32.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& device, const ModelConfig& config,
                                                     const OptimizerConfig& optimizer, std::vector<float> params,
                                                     std::shared_ptr<NcclCommunicator> communicator = nullptr,
                                                     std::optional<Precision> precision = Precision::kFloat32);

}  // namespace perception
