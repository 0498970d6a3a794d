// PerceptionNet on one CUDA device: every buffer of the training step sized once at construction, and the step —
// staged inputs in, forward, masked BCE, backward, clip + AdamW, report out — enqueued on one stream with no host
// synchronization, no allocation and no host-side read, and from its second run at a shape on, replayed as one
// captured CUDA graph (ARCHITECTURE.md, "Warmup → capture → replay").
// The GPU counterpart of CpuReference + ClipAndAdamW; engine/cuda_backend.cc adapts it to the Backend interface.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cpu_reference.h"
#include "engine/cuda_blas.h"
#include "engine/cuda_memory.h"
#include "engine/optimizer.h"
#include "engine/param_layout.h"
#include "kernels/cfc.h"
#include "kernels/column_sum.h"
#include "kernels/conv.h"
#include "kernels/gemm_tf32x3.h"
#include "kernels/norms.h"
#include "kernels/optimizer.h"
#include "kernels/ssm.h"
#include "kernels/step_report.h"

namespace perception {

// `optimizer` as the optimizer kernel reads it (kernels::LaunchClipAdamW).
kernels::AdamWConfig DeviceAdamW(const OptimizerConfig& optimizer);

class NcclCommunicator;

struct CudaModelOptions {
  // The linear-layer products' arithmetic (engine/cuda_blas.h); the other kernels stay float32.
  Precision precision = Precision::kFloat32;
  // Training steps as CUDA graphs (see EnqueueTrainStep); false enqueues every step kernel by kernel, for debugging.
  bool graphs = true;
  // Data-parallel training (engine/nccl_communicator.h): when set, every training step sums the loss partials and
  // then the gradients over the ranks, inside the step (and its graph), before clipping and AdamW; Wait watches the
  // communicator so a dead or stalled peer fails the step instead of hanging it.
  std::shared_ptr<NcclCommunicator> communicator;
};

class CudaModel {
 public:
  // Validates the config against the kernels' limits, creates the stream and cuBLAS handle, allocates everything
  // (two device allocations and one pinned) and uploads `params` (layout.total_size() floats).
  static absl::StatusOr<std::unique_ptr<CudaModel>> Create(const ModelConfig& config, const OptimizerConfig& optimizer,
                                                           std::span<const float> params,
                                                           CudaModelOptions options = {});
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ParamLayout& layout() const { return layout_; }
  const ModelConfig& config() const { return layout_.config(); }
  cudaStream_t stream() const { return stream_; }
  // The parameters in device memory, current as of the work queued on stream().
  const float* device_params() const { return params_; }
  const std::string& device_name() const { return device_name_; }
  Precision precision() const { return precision_; }
  // The data-parallel communicator, or null.
  NcclCommunicator* communicator() const { return communicator_.get(); }

  // Host work only: copies `batch` (at most config.batch windows of at most config.window events) into one of two
  // pinned input slots. Up to two batches may be staged ahead of the Enqueues that take them: each Enqueue takes the
  // oldest staged batch not yet taken (whether it then runs or refuses it), or with none staged since, the one taken
  // last again (so one staged batch can be trained on repeatedly). A training step that finds a second batch staged
  // behind its own, of the config's (batch, window), copies that one to the device beside its compute, so the step
  // that takes it next starts on it at once (with none staged, a step copies its own batch in first). A third batch
  // before a step has taken one is refused (FAILED_PRECONDITION). If work enqueued since the last Wait() may still be
  // copying from the slot being written, it waits for the stream first (never the case after Wait()).
  absl::Status StageBatch(const BatchView<float>& batch);
  // Forgets every staged batch, taken or not: the next Enqueue needs a StageBatch first.
  void DropStagedBatches();

  // Asynchronous device work on stream(). EnqueueTrainStep and EnqueueGradients need a staged batch of the config's
  // exact (batch, window); EnqueueGradients leaves the gradients on the device instead of taking the optimizer step.
  // EnqueueEvaluate runs the forward and the loss over the staged batch; with `carry_state` the sequences start from
  // the carried per-sequence state and leave their final state there (ResetStreamState zeroes it).
  //
  // EnqueueTrainStep is warmup → capture → replay, per (batch, window) in a small cache of graphs: the first step at
  // a shape runs eagerly (cuBLAS and lazy state settle), later ones are one cudaGraphLaunch of a graph captured on
  // its first use. A shape holds up to eight graphs, one per way a step uses the input slots (which slot it trains
  // on, whether it copies that batch in, whether it copies the next staged batch in beside its compute; see
  // StageBatch). The graph copies the staged inputs in and the report out itself; the learning rate and bias
  // corrections come from the device step counter, so schedules advance under replay. Every replay checks that the
  // graph's shape is the staged one and that the buffers it was captured over are still the model's (INTERNAL
  // otherwise: never a replay over other memory). Training shapes other than the config's (batch, window) are refused
  // with INVALID_ARGUMENT naming both: the backward pass and its column-sum tables are built for exactly that shape,
  // so the cache holds the graphs of one shape today and is keyed by shape so that more can be added. With graphs off
  // every step is eager (the same copies, the same bits). CUDA events around each step's launch give its device time
  // (Wait reads them).
  absl::Status EnqueueTrainStep();
  // The training step's device work enqueued kernel by kernel: what an eager step runs and what a capture records.
  // No events, no counters (for benchmarks that capture it themselves). It takes its batch as EnqueueTrainStep does,
  // except inside a stream capture, which runs nothing: there it records the step on the batch it would take.
  absl::Status EnqueueTrainStepEagerly();
  void set_use_graphs(bool use_graphs) { use_graphs_ = use_graphs; }
  bool use_graphs() const { return use_graphs_; }
  // Counts of eager steps, captures and replays, and the device time of the steps waited for.
  const TrainingCounters& training_counters() const { return counters_; }
  absl::Status EnqueueGradients();
  absl::Status EnqueueEvaluate(bool carry_state);
  absl::Status ResetStreamState();

  // Waits for the stream and returns the report of the last Enqueue (loss and mask count always; gradient norm and
  // step after EnqueueTrainStep). After EnqueueEvaluate, StagedLogits() then holds the logits of the batch it took. After a training step
  // it also reads that step's CUDA events into training_counters(): they completed with the stream, so the read
  // stalls nothing. (A training step not waited for before the next is enqueued stays untimed.)
  absl::StatusOr<kernels::StepReport> Wait();
  std::span<const float> StagedLogits() const;

  // Synchronous copies, for checkpoints and tests.
  absl::StatusOr<std::vector<float>> DownloadParams() const;
  absl::StatusOr<std::vector<float>> DownloadGrads() const;
  absl::StatusOr<std::vector<float>> DownloadExpAvg() const;
  absl::StatusOr<std::vector<float>> DownloadExpAvgSq() const;
  absl::StatusOr<int64_t> DownloadStep() const;
  absl::Status Upload(std::span<const float> params, std::span<const float> exp_avg,
                      std::span<const float> exp_avg_sq, int64_t step);

  // Device bytes held by the model's buffers (activations, gradients, optimizer state, scratch, cuBLAS workspace).
  size_t device_bytes() const { return device_bytes_; }
  // FLOPs of every cuBLAS product issued so far.
  double gemm_flops() const { return blas_->flops() + grad_blas_->flops() + layer_grad_blas_->flops(); }

 private:
  // One Mamba2 layer's forward activations, and the gradients the column sums read at the end of the step.
  struct Layer {
    float *rstd = nullptr, *r = nullptr, *zx = nullptr, *xbc = nullptr, *y = nullptr;
    float *rstd_gate = nullptr, *yn = nullptr;
    float *dr = nullptr, *dyn = nullptr, *dzx = nullptr, *ssm_partials = nullptr, *conv_partials = nullptr;
    float *norm_partials = nullptr, *mixer_norm_partials = nullptr;  // the norm backwards' weight-gradient partials
  };
  // The carried per-sequence state of config.batch sequences (MODEL.md §3): [conv: L][B][W−1][E+2N], then
  // [ssm: L][B][Hh][P][N], then [cfc: B][C]. A carried evaluation reads `in` and writes `out`, then copies it to `in`.
  struct StreamStates {
    size_t conv_per_layer = 0, ssm_per_layer = 0, cfc = 0;
    int layers = 0;
    float *in = nullptr, *out = nullptr;
    size_t floats() const { return layers * (conv_per_layer + ssm_per_layer) + cfc; }
    float* Conv(float* base, int l) const { return base + l * conv_per_layer; }
    float* Ssm(float* base, int l) const { return base + layers * conv_per_layer + l * ssm_per_layer; }
    float* Cfc(float* base) const { return base + layers * (conv_per_layer + ssm_per_layer); }
  };

  // One input slot: a batch's pinned staging and its copy on the device (see StageBatch).
  struct InputSlot {
    float *x = nullptr, *dt = nullptr, *labels = nullptr, *mask = nullptr;
    float *x_host = nullptr, *dt_host = nullptr, *labels_host = nullptr, *mask_host = nullptr;
    int batch = 0, window = 0;      // the staged batch's shape (0: nothing staged here yet)
    bool on_device = false;         // a copy of the staged batch into the device buffers is enqueued
    bool read_since_wait = false;   // work enqueued since the last Wait may still copy from the pinned buffers
  };
  // How one Enqueue uses the slots: the slot of the batch it runs on, whether it copies that batch in first, and the
  // slot whose batch it copies in beside its compute for the next step (-1: none).
  struct InputPlan {
    int slot = 0;
    bool copy = true;
    int prefetch = -1;
    int variant() const { return slot * 4 + (copy ? 2 : 0) + (prefetch >= 0 ? 1 : 0); }
  };
  static constexpr int kPlanVariants = 8;
  // The buffers a training graph reads and writes, by address: both slots' pinned staging and device inputs, the
  // pinned report, the parameters, gradients, moments and step counter, and the base of every arena (activations,
  // tables, cuBLAS workspace). A graph replays only over the set it was captured with.
  using BufferSet = std::array<const void*, 20>;
  // The cached training graphs of one shape: the eager steps seen at it, and by InputPlan::variant() the executables
  // once captured and the buffers each was captured over.
  struct TrainGraph {
    int batch = 0, window = 0;
    int64_t eager_steps = 0;
    std::array<cudaGraphExec_t, kPlanVariants> exec{};
    std::array<BufferSet, kPlanVariants> buffers{};
  };
  // Tests swap a staging buffer through this peer to check that a replay over other memory is refused.
  friend class CudaModelTestPeer;

  CudaModel(const ModelConfig& config, const OptimizerConfig& optimizer);
  absl::Status Initialize(std::span<const float> params, const CudaModelOptions& options);
  void ReserveBuffers();
  absl::Status BuildTables();

  // The batch the next Enqueue takes (see StageBatch) and its copies; `prefetch`: a training step, which copies the
  // next staged batch in if it can.
  absl::StatusOr<InputPlan> PlanInputs(bool prefetch) const;
  // Takes the planned batch off the staged ones, its slots' device copies current once `enqueued`.
  void TakeBatch(const InputPlan& plan, bool enqueued);
  absl::Status RequireFullBatch(const InputPlan& plan) const;
  // EnqueueTrainStep's work on `plan`'s batch: the checks, then a graph launch or an eager step, between the events.
  // `enqueued` turns true once the step's work is on the stream, even where a later call (its stop event) fails: the
  // step then runs and reads its inputs all the same.
  absl::Status LaunchTrainStep(const InputPlan& plan, bool& enqueued);
  // EnqueueTrainStepEagerly and EnqueueGradients: the work on the batch they take (none inside a capture).
  absl::Status EnqueueTakingBatch(bool optimizer_step);
  // The full-batch forward, loss, backward and gradient all-reduce, then (optimizer_step) clipping and AdamW, on
  // `plan`'s inputs.
  absl::Status EnqueueTrainingWork(const InputPlan& plan, bool optimizer_step);
  BufferSet CurrentBuffers() const;
  absl::Status CaptureTrainStep(TrainGraph& graph, const InputPlan& plan);
  absl::Status CheckReplay(const TrainGraph& graph, const InputPlan& plan) const;
  absl::Status CopyInputsIn(const InputPlan& plan, int rows);
  // Of `slot`'s staged batch, the first `rows` events' features (x) to the device on `stream`; and their Δt, labels
  // and mask.
  absl::Status CopyFeaturesIn(const InputSlot& slot, size_t rows, cudaStream_t stream);
  absl::Status CopyTargetsIn(const InputSlot& slot, size_t rows, cudaStream_t stream);
  absl::Status PrefetchInputs(InputSlot& next, bool behind_own_copies);
  // The weights' TF32 parts for this step's products on layer_grad_stream_, forked from the main stream here;
  // layer_grad_done_ marks them.
  absl::Status SplitWeightsBeside();
  absl::Status ForwardAndLoss(const InputPlan& plan, int batch, int window, bool carry_state, bool with_gradient);
  // `plain_norm`: its RMSNorm launches plain (it is right behind a join with another stream; see ForwardAndLoss).
  absl::Status LayerForward(int l, int batch, int window, bool carry_state, bool plain_norm = false);
  absl::Status PackCfcAndCountMask(int batch, int window);
  absl::Status CfcForward(int batch, int window, bool carry_state);
  absl::Status HeadForward(int rows, bool with_gradient);
  absl::Status Backward();
  absl::Status HeadBackward(int rows);
  absl::Status HeadInputGradient(int rows);
  absl::Status CfcBackward(int rows);
  absl::Status LayerBackward(int l, int rows);
  absl::Status ForkGradients();
  absl::Status MarkGradients();
  absl::Status AwaitGradients();
  absl::Status SumGradientsOverRanks();
  absl::Status OptimizerStep();

  kernels::ConvInput ConvInputOf(int l, int batch, int window, const float* state_in) const;
  kernels::SsmInput SsmInputOf(int l, int batch, int window, const float* state_in) const;
  kernels::CfcWeights CfcWeightsOf() const;
  kernels::CfcShape CfcShapeOf(int batch, int window) const;
  kernels::NormOutputLayer HeadOutputLayer() const;  // head_out, folded into the GRN LayerNorm's kernels
  const float* param(int tensor) const { return params_ + layout_.tensor(tensor).offset; }
  float* grad(int tensor) const { return grads_ + layout_.tensor(tensor).offset; }
  // A weight's TF32 parts for the 3×TF32 kernels (null where the products do not run on them).
  const kernels::Tf32x3Planes* planes(int tensor) const {
    return weight_planes_ != nullptr ? &planes_of_[tensor] : nullptr;
  }
  absl::StatusOr<std::vector<float>> DownloadFloats(const float* device) const;

  ParamLayout layout_;
  kernels::AdamWConfig adamw_;
  std::string device_name_;
  Precision precision_ = Precision::kFloat32;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Blas> blas_;
  // The weight-gradient products' stream and handle (the cuBLAS workspace's second part), and the events that
  // fork it from and join it to stream_ (see ForkGradients).
  cudaStream_t grad_stream_ = nullptr;
  std::unique_ptr<Blas> grad_blas_;
  cudaEvent_t fork_ = nullptr, grads_done_ = nullptr;
  // Each layer's out_proj weight gradient, the one the main stream waits for inside the backward, on a stream and
  // handle (the workspace's third part) of its own, so the wait is for it alone (see LayerBackward). In the forward,
  // the weights' TF32 split beside the standardization when the batch is on the device already (ForwardAndLoss).
  cudaStream_t layer_grad_stream_ = nullptr;
  std::unique_ptr<Blas> layer_grad_blas_;
  cudaEvent_t layer_fork_ = nullptr, layer_grad_done_ = nullptr;
  // The next batch's copy beside a training step (see PrefetchInputs), and the events around it.
  cudaStream_t prefetch_stream_ = nullptr;
  cudaEvent_t prefetch_fork_ = nullptr, prefetch_done_ = nullptr;
  std::shared_ptr<NcclCommunicator> communicator_;
  CudaArena buffers_{MemoryKind::kDevice}, tables_{MemoryKind::kDevice}, pinned_{MemoryKind::kPinnedHost};
  size_t device_bytes_ = 0;
  // The input slots. current_ holds the oldest staged batch not yet taken, or with none (queued_ == 0) the one taken
  // last; with two staged (queued_ == 2) the other slot holds the newer one.
  std::array<InputSlot, 2> slots_;
  int current_ = 0, queued_ = 0;
  int logits_rows_ = 0;  // events of the batch the last EnqueueEvaluate took

  // Warmup → capture → replay: graphs by (batch, window), the events around each step's launch, the counters.
  bool use_graphs_ = true;
  // Whether the step's streams differ in priority (by precision, see Initialize), which the graph's nodes then keep.
  bool node_priorities_ = false;
  std::map<std::pair<int, int>, TrainGraph> train_graphs_;
  cudaEvent_t step_start_ = nullptr, step_stop_ = nullptr;
  bool step_timing_pending_ = false;
  TrainingCounters counters_;

  // Parameters, gradients and AdamW moments in the flat layout; the step counter, the norm partials.
  float *params_ = nullptr, *grads_ = nullptr, *exp_avg_ = nullptr, *exp_avg_sq_ = nullptr;
  int64_t* step_ = nullptr;
  double* norm_partials_ = nullptr;
  double* loss_partials_ = nullptr;
  double* mask_count_ = nullptr;
  std::byte* blas_workspace_ = nullptr;

  // The device inputs of the work being enqueued (one slot's, set by ForwardAndLoss); pinned logits and report for the
  // host. The kernels write the report straight into its pinned memory, which the device addresses as its own
  // (unified addressing): a copy node after the optimizer ended every step ~7.5 µs later (H200, small 3xtf32,
  // bench/step_timeline: the copy engine starts ~5.4 µs after the kernel it waits for, then copies for 2.1 µs).
  float *x_ = nullptr, *dt_ = nullptr, *labels_ = nullptr, *mask_ = nullptr;
  float* logits_host_ = nullptr;
  kernels::StepReport* report_host_ = nullptr;

  // Forward activations. h_[l] is the residual stream entering layer l (h_[L] leaves the last layer).
  float* xn_ = nullptr;
  std::vector<float*> h_;
  std::vector<Layer> layers_;
  float *rstd_f_ = nullptr, *head_in_ = nullptr;  // head_in_ = [s ; c_t], [rows, D + C]
  float *cfc_packed_ = nullptr, *cfc_u_ = nullptr, *bb_pre_ = nullptr, *bb_ = nullptr, *gates_ = nullptr;
  float* c_prev_ = nullptr;
  float *pre2_ = nullptr, *e2_ = nullptr, *e1_ = nullptr, *gate_pre_ = nullptr, *value_ = nullptr;
  float *pre_ln_ = nullptr, *ln_rstd_ = nullptr, *nhat_ = nullptr, *g_ = nullptr, *logits_ = nullptr;

  // Backward. d_head_in_ holds d [s ; c_t]; its s half becomes d s once the CfC's share is added.
  float *dlogits_ = nullptr, *d_pre_ln_ = nullptr, *d_gate_pre_ = nullptr, *d_value_ = nullptr;
  float *de1_ = nullptr, *d_pre2_ = nullptr, *d_head_in_ = nullptr, *dp_ = nullptr, *dbb_pre_ = nullptr;
  // Per sequence, the sums over its steps of dp_'s and dbb_pre_'s columns ([batch, 4C + K]): the CfC biases'
  // gradients before the sum over the batch.
  float* cfc_bias_sums_ = nullptr;
  // The GRN's gradients d_gate_pre_ and d_value_ live in d_gate_value_, d_pre_ln_ and d_pre2_ in d_skip_fc2_, each
  // [rows, 2G]: side by side (leading dimension head_ld_ = 2G) where stacked_head_ or fused_head_, so that the gate's
  // and value's products (backward data where stacked_head_, weight gradients where fused_head_) run as one with the
  // pair concatenated, and the skip's and fc2's too (HeadBackward); else one after the other, dense (head_ld_ = G),
  // separate products. Set in Initialize, after the allocation.
  float *d_gate_value_ = nullptr, *d_skip_fc2_ = nullptr;
  int head_ld_ = 0;
  bool stacked_head_ = false;
  // Where G and H allow (kernels/grn_head.h): the head from fc2's and skip's outputs to d pre2 and d pre_ln in one
  // launch (HeadForward), instead of the ELU, fc1, gate and value products, the LayerNorm's forward and backward and
  // the backward-data products through gate, value, fc1 and the ELU.
  bool fused_head_ = false;
  // Where fused_head_: the stacked weight gradients [W_gate; W_value] ([2G, G]) and [W_skip; W_fc2] ([2G, D + C]),
  // before HeadBackward copies them into their tensors.
  float* head_weight_grads_ = nullptr;
  float* head_out_partials_ = nullptr;  // where fused_head_: head_out's weight gradient in partial sums
  // Where both stacked_head_ and fused_head_ (small under 3xtf32 and tf32): skip's and fc2's forward as one product
  // of 2G outputs from the stack's planes, [W_skip; W_fc2], so that head_in is read once and the tiles are twice as
  // wide; pre_ln_ and pre2_ side by side in its output (leading dimension 2G), fc2's bias added by the GRN head kernel
  // as it reads pre2 (HeadForward).
  bool stacked_forward_head_ = false;
  // Where stacked_head_ alone: G floats of −0, the skip's bias in the forward's batched fc2 + skip launch.
  float* neg_zero_bias_ = nullptr;
  float* cfc_heads_grad_ = nullptr;  // the four CfC heads' weight gradients of one product, [4C, K]
  float* dh_ = nullptr;                                    // d residual stream, walking down the layers
  float *dy_ = nullptr, *dxs_ = nullptr, *dbc_ = nullptr;  // each layer's scan-backward scratch
  // Per-block gradient partials of the norm backwards: norm_f's weight; the GRN norm's weight and bias and the
  // gate's and value's biases; the embedding's bias (the column sums of layer 0's d residual stream).
  float *norm_f_partials_ = nullptr, *grn_partials_ = nullptr, *embed_bias_partials_ = nullptr;
  float* ssm_scratch_ = nullptr;  // the chunked scan backward's boundary states and adjoints (windows over 64 steps)
  StreamStates states_;

  // Device tables, built once: column sums (the gradients that sum over events), AdamW chunks. head_sums_ are the
  // head's and the CfC's, whose inputs are final once norm_f's backward has run: they run on grad_stream_ beside the
  // layers' backward; sums_ are the layers' and the embedding's, at the end of the backward.
  std::vector<kernels::AdamWChunk> chunks_host_;
  kernels::ColumnSumBatch sums_, head_sums_;
  kernels::AdamWChunk* chunks_ = nullptr;

  // Where the products run on the 3×TF32 kernels: the weights' TF32 big and small parts, as stored and transposed,
  // split once a step at the start of the forward (kernels::Tf32x3Planes) rather than in every block of every
  // product. Four planes of the flat layout's size, each parameter's parts at its offset in each: the gate and value
  // weights' batch keeps its stride. planes_of_ by tensor index; split_jobs_ the device table of the split.
  float* weight_planes_ = nullptr;
  size_t plane_floats_ = 0;
  // The `tf32` precision: the tensor-core products outside Blas in plain TF32 too (the scan's, SsmInputOf; the
  // CfC's, CfcShapeOf; the GRN head's, HeadForward).
  bool plain_tf32_ = false;
  std::vector<kernels::Tf32x3Planes> planes_of_;
  // Where stacked_head_: the transposed planes of the stacks [W_gate; W_value] and [W_skip; W_fc2] (planes-only
  // Tf32x3Planes, [in, 2G]), in weight_planes_ past the four planes; those four weights' own transposed planes point
  // into them (ld_t = 2G).
  kernels::Tf32x3Planes gate_value_planes_, skip_fc2_planes_;
  // Where stacked_forward_head_: the stack [W_skip; W_fc2]'s big and small planes ([2G, D + C]), past those; the two
  // weights' own big and small planes point into it.
  kernels::Tf32x3Planes skip_fc2_forward_planes_;
  std::vector<kernels::Tf32x3SplitJob> split_jobs_host_;
  kernels::Tf32x3SplitJob* split_jobs_ = nullptr;
  int split_rows_ = 0, split_cols_ = 0;
};

}  // namespace perception
