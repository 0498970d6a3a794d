// PerceptionNet's training step on the GPU: buffers, the forward and backward pipelines (kernels and cuBLAS, in the
// order of engine/cpu_reference.cc), the gradient column sums and the optimizer.
#include "engine/cuda_model.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "engine/cuda_check.h"
#include "engine/nccl_communicator.h"
#include "engine/status_macros.h"
#include "kernels/grn_head.h"
#include "kernels/loss.h"
#include "kernels/norms.h"
#include "kernels/pointwise.h"

namespace perception {
namespace {

// cuBLAS's recommended workspace on Hopper for each of the three streams' handles (split-K partials live there); set
// once, so no product allocates.
constexpr size_t kBlasWorkspaceBytes = 32u << 20;

// The config's sizes under MODEL.md's names.
struct Dims {
  explicit Dims(const ModelConfig& c)
      : F(c.n_features), D(c.d_model), L(c.n_layers), E(c.d_inner()), P(c.headdim), Hh(c.n_heads()), N(c.d_state),
        W(c.d_conv), cd(c.conv_dim()), zd(c.in_proj_dim()), C(c.cfc_units), K(c.cfc_backbone), G(c.grn_hidden),
        H(c.n_horizons), DC(c.head_input()) {}
  int F, D, L, E, P, Hh, N, W, cd, zd, C, K, G, H, DC;
};

absl::Status CheckKernelLimits(const ModelConfig& c) {
  if (c.d_state > kernels::kMaxSsmState) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend: d_state ", c.d_state, " exceeds the scan's limit of ",
                                                   kernels::kMaxSsmState));
  }
  if (c.d_conv > kernels::kMaxConvWidth) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend: d_conv ", c.d_conv, " exceeds the conv's limit of ",
                                                   kernels::kMaxConvWidth));
  }
  for (const int width : {c.d_model, c.d_inner(), c.grn_hidden}) {
    if (width > kernels::kMaxNormWidth) {
      return absl::InvalidArgumentError(absl::StrCat("CUDA backend: a normalized width of ", width,
                                                     " exceeds the norms' limit of ", kernels::kMaxNormWidth));
    }
  }
  if (c.headdim > kernels::kMaxSsmHeaddim) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend: headdim ", c.headdim, " exceeds the scan's limit of ",
                                                   kernels::kMaxSsmHeaddim));
  }
  return absl::OkStatus();
}

// Every trained tensor cut into pieces of at most kAdamWChunkFloats: one optimizer block each.
std::vector<kernels::AdamWChunk> AdamWChunks(const ParamLayout& layout) {
  std::vector<kernels::AdamWChunk> chunks;
  for (const TensorSpec& t : layout.tensors()) {
    if (!t.trained) continue;
    for (size_t begin = 0; begin < t.size; begin += kernels::kAdamWChunkFloats) {
      chunks.push_back({t.offset + begin, static_cast<int>(std::min<size_t>(kernels::kAdamWChunkFloats, t.size - begin)),
                        t.weight_decay ? 1 : 0});
    }
  }
  return chunks;
}

// Host data in on `stream`, ordered before the kernels that read it: a plain cudaMemcpy runs on the legacy default
// stream, which the model's non-blocking streams do not wait for, and from pageable memory it may return before the
// copy has landed. The callers synchronize `stream` once their copies are queued.
template <typename T>
absl::Status CopyToDevice(T* device, std::type_identity_t<std::span<const T>> host, cudaStream_t stream) {
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device, host.data(), host.size_bytes(), cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

// What is queued on `waiter` from here on runs after the work queued on `source` so far (`event` marks it).
absl::Status WaitForStream(cudaStream_t waiter, cudaStream_t source, cudaEvent_t event) {
  CUDA_RETURN_IF_ERROR(cudaEventRecord(event, source));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(waiter, event));
  return absl::OkStatus();
}

}  // namespace

kernels::AdamWConfig DeviceAdamW(const OptimizerConfig& o) {
  kernels::AdamWConfig c;
  c.lr = o.lr;
  c.beta1 = o.beta1;
  c.beta2 = o.beta2;
  c.eps = o.eps;
  c.weight_decay = o.weight_decay;
  c.max_grad_norm = o.max_grad_norm;
  c.largest_applied_grad_norm = LargestAppliedGradNorm<float>();
  c.warmup_cosine = o.schedule == LrSchedule::kWarmupCosine;
  c.warmup_steps = o.warmup_steps;
  c.total_steps = o.total_steps;
  c.min_lr = o.min_lr;
  return c;
}

CudaModel::CudaModel(const ModelConfig& config, const OptimizerConfig& optimizer)
    : layout_(config), adamw_(DeviceAdamW(optimizer)), chunks_host_(AdamWChunks(layout_)) {}

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const ModelConfig& config,
                                                             const OptimizerConfig& optimizer,
                                                             std::span<const float> params,
                                                             CudaModelOptions options) {
  RETURN_IF_ERROR(ValidateConfig(config));
  RETURN_IF_ERROR(CheckKernelLimits(config));
  RETURN_IF_ERROR(ValidateOptimizerConfig(optimizer));
  std::unique_ptr<CudaModel> model(new CudaModel(config, optimizer));
  if (params.size() != model->layout_.total_size()) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend: ", params.size(), " parameters given, the layout has ",
                                                   model->layout_.total_size()));
  }
  RETURN_IF_ERROR(model->Initialize(params, options));
  return model;
}

CudaModel::~CudaModel() {
  // Destruction cannot report errors: finish the queued work, then release the graphs, events and handle before the
  // stream.
  if (stream_) cudaStreamSynchronize(stream_);
  for (auto& [shape, graph] : train_graphs_) {
    for (cudaGraphExec_t exec : graph.exec) {
      if (exec) cudaGraphExecDestroy(exec);
    }
  }
  for (cudaStream_t stream : {grad_stream_, layer_grad_stream_, prefetch_stream_}) {
    if (stream) cudaStreamSynchronize(stream);
  }
  for (cudaEvent_t event :
       {step_start_, step_stop_, fork_, grads_done_, layer_fork_, layer_grad_done_, prefetch_fork_, prefetch_done_}) {
    if (event) cudaEventDestroy(event);
  }
  blas_.reset();
  grad_blas_.reset();
  layer_grad_blas_.reset();
  if (prefetch_stream_) cudaStreamDestroy(prefetch_stream_);
  if (layer_grad_stream_) cudaStreamDestroy(layer_grad_stream_);
  if (grad_stream_) cudaStreamDestroy(grad_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

absl::Status CudaModel::Initialize(std::span<const float> params, const CudaModelOptions& options) {
  int device = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  cudaDeviceProp properties;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, device));
  device_name_ = absl::StrCat("cuda:", device, " ", properties.name);
  precision_ = options.precision;
  // The step's streams at one priority or one of them a level above the others, by precision, and the graph keeps
  // each captured node's priority: where two streams have blocks waiting for SMs, the higher one's go first. H200,
  // small, µs a step, alternating within each call:
  // - tf32: the main stream, which carries the chain of data gradients, above the weight gradients' streams
  //   (783.5–785.2 -> 776.0–780.7, 788.7–789.8 -> 781.6–783.4 and 784.2–788.7 -> 782.0–783.8 in three calls; the
  //   gradients' streams above instead 777.9–780.2 -> 786.2–790.4);
  // - fp32: the weight gradients' streams above the main stream (1,334.9–1,337.3 -> 1,322.8–1,328.6; the main stream
  //   above instead 1,336.4–1,338.3 -> 1,386.1–1,386.9);
  // - 3xtf32: one priority (the main stream above: 945.5 / 948.5 -> 966.9 / 968.1; the gradients' above:
  //   942.7–950.9 -> 955.2–955.8).
  // The streamer's stream (engine/cuda_streamer.cc) stays above all of them.
  int least_priority = 0, greatest_priority = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
  const int raised = greatest_priority < least_priority ? least_priority - 1 : least_priority;
  const int chain_priority = options.precision == Precision::kTf32 ? raised : least_priority;
  const int gradient_priority = options.precision == Precision::kFloat32 ? raised : least_priority;
  node_priorities_ = chain_priority != gradient_priority;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, chain_priority));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&step_start_));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&step_stop_));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&grad_stream_, cudaStreamNonBlocking, gradient_priority));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&grads_done_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&layer_grad_stream_, cudaStreamNonBlocking, gradient_priority));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&layer_fork_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&layer_grad_done_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&prefetch_stream_, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&prefetch_fork_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&prefetch_done_, cudaEventDisableTiming));
  use_graphs_ = options.graphs;
  plain_tf32_ = options.precision == Precision::kTf32;
  communicator_ = options.communicator;
  // Padded to whole 16-byte units: each plane starts aligned for the kernels' tensor copies.
  plane_floats_ = Blas::UsesTf32x3Kernels(options.precision, properties) ? (layout_.total_size() + 3) / 4 * 4 : 0;
  ReserveBuffers();
  RETURN_IF_ERROR(buffers_.Allocate());
  RETURN_IF_ERROR(pinned_.Allocate());
  {
    const Dims d(config());
    const size_t M = static_cast<size_t>(config().batch) * config().window;
    const bool side_by_side = stacked_head_ || fused_head_;
    head_ld_ = side_by_side ? 2 * d.G : d.G;
    const size_t second = side_by_side ? d.G : M * d.G;  // the second gradient's offset in its pair's buffer
    d_gate_pre_ = d_gate_value_;
    d_value_ = d_gate_value_ + second;
    d_pre_ln_ = d_skip_fc2_;
    d_pre2_ = d_skip_fc2_ + second;
    if (stacked_forward_head_) pre2_ = pre_ln_ + d.G;
    if (neg_zero_bias_ != nullptr) {
      const std::vector<float> neg_zero(d.G, -0.f);
      RETURN_IF_ERROR(CopyToDevice(neg_zero_bias_, neg_zero, stream_));
      CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    }
  }
  ASSIGN_OR_RETURN(blas_, Blas::Create(stream_, blas_workspace_, kBlasWorkspaceBytes, options.precision));
  ASSIGN_OR_RETURN(grad_blas_,
                   Blas::Create(grad_stream_, blas_workspace_ + kBlasWorkspaceBytes, kBlasWorkspaceBytes, options.precision));
  ASSIGN_OR_RETURN(layer_grad_blas_, Blas::Create(layer_grad_stream_, blas_workspace_ + 2 * kBlasWorkspaceBytes,
                                                  kBlasWorkspaceBytes, options.precision));
  RETURN_IF_ERROR(BuildTables());
  device_bytes_ = buffers_.bytes() + tables_.bytes();
  RETURN_IF_ERROR(CopyToDevice(params_, params, stream_));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

void CudaModel::ReserveBuffers() {
  const ModelConfig& c = config();
  const Dims d(c);
  const size_t M = static_cast<size_t>(c.batch) * c.window, total = layout_.total_size();
  const size_t norm_partial_rows = kernels::NormPartialRows(c.batch * c.window);
  CudaArena& a = buffers_;
  a.Reserve(&params_, total);
  a.Reserve(&grads_, total);
  a.Reserve(&exp_avg_, total);
  a.Reserve(&exp_avg_sq_, total);
  a.Reserve(&step_, 1);
  a.Reserve(&norm_partials_, chunks_host_.size());
  a.Reserve(&loss_partials_, kernels::kMaskedBceBlocks);
  a.Reserve(&mask_count_, 1);
  a.Reserve(&blas_workspace_, 3 * kBlasWorkspaceBytes);
  // Where the products run on the 3×TF32 kernels, the GRN's backward-data products in stacks (see HeadBackward):
  // the stacks' transposed big and small planes, [G, 2G] (gate, value) and [D + C, 2G] (skip, fc2).
  // Only shapes the kernels take (not tiny's GRN of 6); HeadBackward checks the operands too.
  stacked_head_ = plane_floats_ > 0 && Blas::Tf32x3KernelsTakeBackwardData(d.G, 2 * d.G) &&
                  Blas::Tf32x3KernelsTakeBackwardData(d.DC, 2 * d.G);
  fused_head_ = kernels::GrnHeadSupports(d.G, d.H);
  stacked_forward_head_ = stacked_head_ && fused_head_;
  const size_t stacked_plane_floats = (stacked_head_ ? 2 * static_cast<size_t>(2 * d.G) * (d.G + d.DC) : 0) +
                                      (stacked_forward_head_ ? 2 * static_cast<size_t>(2 * d.G) * d.DC : 0);
  if (plane_floats_ > 0) a.Reserve(&weight_planes_, 4 * plane_floats_ + stacked_plane_floats);

  for (InputSlot& slot : slots_) {
    a.Reserve(&slot.x, M * d.F);
    a.Reserve(&slot.dt, M);
    a.Reserve(&slot.labels, M * d.H);
    a.Reserve(&slot.mask, M * d.H);
  }
  a.Reserve(&xn_, M * d.F);
  h_.assign(d.L + 1, nullptr);
  for (float*& h : h_) a.Reserve(&h, M * d.D);
  layers_.assign(d.L, Layer{});
  for (Layer& layer : layers_) {
    a.Reserve(&layer.rstd, M);
    a.Reserve(&layer.r, M * d.D);
    a.Reserve(&layer.zx, M * d.zd);
    a.Reserve(&layer.xbc, M * d.cd);
    a.Reserve(&layer.y, M * d.E);
    a.Reserve(&layer.rstd_gate, M);
    a.Reserve(&layer.yn, M * d.E);
    a.Reserve(&layer.dr, M * d.D);
    a.Reserve(&layer.dyn, M * d.E);
    a.Reserve(&layer.dzx, M * d.zd);
    a.Reserve(&layer.ssm_partials, M * 2 * d.Hh);
    a.Reserve(&layer.conv_partials, static_cast<size_t>(c.batch) * (d.cd * d.W + d.cd));
    a.Reserve(&layer.norm_partials, norm_partial_rows * d.D);
    a.Reserve(&layer.mixer_norm_partials, norm_partial_rows * d.E);
  }
  a.Reserve(&rstd_f_, M);
  a.Reserve(&head_in_, M * d.DC);
  a.Reserve(&cfc_packed_, kernels::CfcPackedFloats(CfcShapeOf(c.batch, c.window)));
  a.Reserve(&cfc_u_, M * d.K);
  a.Reserve(&bb_pre_, M * d.K);
  a.Reserve(&bb_, M * d.K);
  a.Reserve(&gates_, M * 3 * d.C);
  a.Reserve(&c_prev_, M * d.C);
  for (float** buffer : {&e2_, &e1_, &g_}) a.Reserve(buffer, M * d.G);
  if (stacked_forward_head_) {
    a.Reserve(&pre_ln_, M * 2 * d.G);  // pre2_ beside it (Initialize)
  } else {
    for (float** buffer : {&pre2_, &pre_ln_}) a.Reserve(buffer, M * d.G);
  }
  if (!fused_head_) {  // the separate head kernels' (kernels/grn_head.h keeps them in registers)
    for (float** buffer : {&gate_pre_, &value_, &nhat_}) a.Reserve(buffer, M * d.G);
    a.Reserve(&ln_rstd_, M);
  }
  if (stacked_head_ && !stacked_forward_head_) a.Reserve(&neg_zero_bias_, d.G);
  if (fused_head_) {
    a.Reserve(&head_weight_grads_, 2 * d.G * (d.G + d.DC));
    a.Reserve(&head_out_partials_, static_cast<size_t>(kernels::GrnHeadOutputPartialRows(M)) * d.H * d.G);
  }
  a.Reserve(&logits_, M * d.H);

  a.Reserve(&dlogits_, M * d.H);
  a.Reserve(&d_gate_value_, M * 2 * d.G);
  a.Reserve(&d_skip_fc2_, M * 2 * d.G);
  a.Reserve(&de1_, M * d.G);
  a.Reserve(&d_head_in_, M * d.DC);
  a.Reserve(&dp_, M * 4 * d.C);
  a.Reserve(&dbb_pre_, M * d.K);
  a.Reserve(&cfc_bias_sums_, static_cast<size_t>(config().batch) * (4 * d.C + d.K));
  a.Reserve(&cfc_heads_grad_, kernels::kCfcHeads * d.C * d.K);
  a.Reserve(&dh_, M * d.D);
  a.Reserve(&dy_, M * d.E);
  a.Reserve(&dxs_, M * d.E);
  a.Reserve(&dbc_, M * d.Hh * 2 * d.N);
  a.Reserve(&norm_f_partials_, norm_partial_rows * d.D);
  a.Reserve(&embed_bias_partials_, norm_partial_rows * d.D);
  a.Reserve(&grn_partials_, norm_partial_rows * 4 * d.G);
  a.Reserve(&ssm_scratch_, kernels::SsmBackwardScratchFloats(c.batch, c.window, d.Hh, d.P, d.N));

  states_.layers = d.L;
  states_.conv_per_layer = static_cast<size_t>(c.batch) * c.conv_state_size();
  states_.ssm_per_layer = static_cast<size_t>(c.batch) * c.ssm_state_size();
  states_.cfc = static_cast<size_t>(c.batch) * d.C;
  a.Reserve(&states_.in, states_.floats());
  a.Reserve(&states_.out, states_.floats());

  CudaArena& p = pinned_;
  for (InputSlot& slot : slots_) {
    p.Reserve(&slot.x_host, M * d.F);
    p.Reserve(&slot.dt_host, M);
    p.Reserve(&slot.labels_host, M * d.H);
    p.Reserve(&slot.mask_host, M * d.H);
  }
  p.Reserve(&logits_host_, M * d.H);
  p.Reserve(&report_host_, 1);
}

absl::Status CudaModel::BuildTables() {
  const ModelConfig& c = config();
  const Dims d(c);
  const int M = c.batch * c.window, P = kernels::NormPartialRows(M);
  const ParamLayout& pl = layout_;
  // Every gradient that is a sum over events: out[c] = Σ_rows a·b·row_scale (engine/cpu_reference.cc's `+=` loops).
  std::vector<kernels::ColumnSumJob> jobs, head_jobs;
  auto sum_into = [&](std::vector<kernels::ColumnSumJob>& to, int tensor, const float* a, int lda, int cols,
                      int rows = 0) { to.push_back({a, lda, nullptr, 0, nullptr, rows ? rows : M, cols, grad(tensor)}); };
  auto sum = [&](int tensor, const float* a, int lda, int cols, int rows = 0) {
    sum_into(jobs, tensor, a, lda, cols, rows);
  };
  auto head_sum = [&](int tensor, const float* a, int lda, int cols, int rows = 0) {
    sum_into(head_jobs, tensor, a, lda, cols, rows);
  };
  sum(pl.embed.bias, embed_bias_partials_, d.D, d.D, P);
  for (int l = 0; l < d.L; ++l) {
    const LayerTensors& lt = pl.layers[l];
    const Layer& a = layers_[l];
    const int conv_ld = d.cd * d.W + d.cd;
    sum(lt.norm, a.norm_partials, d.D, d.D, P);
    sum(lt.conv_weight, a.conv_partials, conv_ld, d.cd * d.W, c.batch);
    sum(lt.conv_bias, a.conv_partials + d.cd * d.W, conv_ld, d.cd, c.batch);
    sum(lt.dt_bias, a.dzx + d.E + d.cd, d.zd, d.Hh);
    sum(lt.a_log, a.ssm_partials, 2 * d.Hh, d.Hh);
    sum(lt.d, a.ssm_partials + d.Hh, 2 * d.Hh, d.Hh);
    sum(lt.mixer_norm, a.mixer_norm_partials, d.E, d.E, P);
  }
  head_sum(pl.norm_f, norm_f_partials_, d.D, d.D, P);
  // The CfC's biases from its backward's per-sequence sums: 256 rows for small instead of 16,384, 24 MB less read
  // beside the layers' backward (H200, small 3xtf32, alternating: 1,000.6–1,002.4 against 1,009.8–1,012.1 µs a step
  // prefetching; bench/RESULTS.md, the thirteenth session).
  const int cfc_sums_ld = 4 * d.C + d.K;
  head_sum(pl.cfc_backbone.bias, cfc_bias_sums_ + 4 * d.C, cfc_sums_ld, d.K, c.batch);
  const LinearTensors cfc_heads[kernels::kCfcHeads] = {pl.cfc_ff1, pl.cfc_ff2, pl.cfc_time_a, pl.cfc_time_b};
  for (int j = 0; j < kernels::kCfcHeads; ++j) {
    head_sum(cfc_heads[j].bias, cfc_bias_sums_ + j * d.C, cfc_sums_ld, d.C, c.batch);
  }
  head_sum(pl.grn_fc2.bias, d_pre2_, head_ld_, d.G);
  head_sum(pl.grn_fc1.bias, de1_, d.G, d.G);
  head_sum(pl.grn_gate.bias, grn_partials_ + 2 * d.G, 4 * d.G, d.G, P);
  head_sum(pl.grn_value.bias, grn_partials_ + 3 * d.G, 4 * d.G, d.G, P);
  head_sum(pl.grn_norm.weight, grn_partials_, 4 * d.G, d.G, P);
  head_sum(pl.grn_norm.bias, grn_partials_ + d.G, 4 * d.G, d.G, P);
  head_sum(pl.head_out.bias, dlogits_, d.H, d.H);
  if (fused_head_) {
    head_sum(pl.head_out.weight, head_out_partials_, d.H * d.G, d.H * d.G, kernels::GrnHeadOutputPartialRows(M));
    // HeadBackward copies the stacked gate and value weight gradients out as two rows of one strided copy.
    if (layout_.tensor(pl.grn_value.weight).offset < layout_.tensor(pl.grn_gate.weight).offset + d.G * d.G) {
      return absl::InternalError("the GRN value weight does not follow the gate weight in the parameter layout");
    }
  }

  struct Staged {
    const std::vector<kernels::ColumnSumJob>* jobs;
    kernels::ColumnSumPlan plan;
    kernels::ColumnSumBatch* batch;
    kernels::ColumnSumJob* device_jobs = nullptr;
    kernels::ColumnSumTile* tiles = nullptr;
    kernels::ColumnSumFinish* finishes = nullptr;
  };
  Staged staged[] = {{&jobs, kernels::PlanColumnSums(jobs), &sums_},
                     {&head_jobs, kernels::PlanColumnSums(head_jobs), &head_sums_}};
  for (Staged& s : staged) {
    tables_.Reserve(&s.device_jobs, s.jobs->size());
    tables_.Reserve(&s.tiles, s.plan.tiles.size());
    tables_.Reserve(&s.finishes, s.plan.finishes.size());
    tables_.Reserve(&s.batch->partials, s.plan.partial_floats);
  }
  tables_.Reserve(&chunks_, chunks_host_.size());
  // Every weight whose Forward or BackwardData may run on the 3×TF32 kernels.
  planes_of_.assign(layout_.tensors().size(), kernels::Tf32x3Planes{});
  if (weight_planes_ != nullptr) {
    std::vector<int> weights = {pl.embed.weight,    pl.cfc_backbone.weight, pl.grn_fc2.weight, pl.grn_fc1.weight,
                                pl.grn_gate.weight, pl.grn_value.weight,    pl.grn_skip};
    for (const LayerTensors& lt : pl.layers) weights.insert(weights.end(), {lt.in_proj, lt.out_proj});
    // The stacks' transposed planes: [in, 2G] each, the first weight's columns, then the second's.
    struct Stack {
      int first, second, in;
      kernels::Tf32x3Planes* planes;
    };
    const Stack stacks[] = {{pl.grn_gate.weight, pl.grn_value.weight, d.G, &gate_value_planes_},
                            {pl.grn_skip, pl.grn_fc2.weight, d.DC, &skip_fc2_planes_}};
    float* next_stack = weight_planes_ + 4 * plane_floats_;  // (ReserveBuffers put the stacks past the four planes)
    for (const Stack& stack : stacks) {
      if (!stacked_head_) break;
      const size_t floats = static_cast<size_t>(stack.in) * 2 * d.G;
      *stack.planes = {nullptr, nullptr, next_stack, next_stack + floats, 2 * d.G, stack.in};
      next_stack += 2 * floats;
    }
    if (stacked_forward_head_) {
      const size_t floats = static_cast<size_t>(2 * d.G) * d.DC;
      skip_fc2_forward_planes_ = {next_stack, next_stack + floats, nullptr, nullptr, 2 * d.G, d.DC};
    }
    for (const int tensor : weights) {
      const TensorSpec& spec = layout_.tensor(tensor);
      float* at[4];
      for (int kind = 0; kind < 4; ++kind) at[kind] = weight_planes_ + kind * plane_floats_ + spec.offset;
      const int rows = static_cast<int>(spec.shape[0]), cols = static_cast<int>(spec.shape[1]);
      int ld_t = 0;
      for (const Stack& stack : stacks) {
        if (!stacked_head_ || (tensor != stack.first && tensor != stack.second)) continue;
        if (rows != d.G || cols != stack.in) return absl::InternalError("a GRN weight's shape is not [G, in]");
        const int column = tensor == stack.first ? 0 : d.G;
        at[2] = const_cast<float*>(stack.planes->big_t) + column;
        at[3] = const_cast<float*>(stack.planes->small_t) + column;
        ld_t = 2 * d.G;
      }
      if (stacked_forward_head_ && (tensor == pl.grn_skip || tensor == pl.grn_fc2.weight)) {
        const size_t row = tensor == pl.grn_skip ? 0 : d.G;  // [W_skip; W_fc2], as the transposed stack
        at[0] = const_cast<float*>(skip_fc2_forward_planes_.big) + row * d.DC;
        at[1] = const_cast<float*>(skip_fc2_forward_planes_.small) + row * d.DC;
      }
      split_jobs_host_.push_back({param(tensor), rows, cols, at[0], at[1], at[2], at[3], ld_t});
      planes_of_[tensor] = {at[0], at[1], at[2], at[3], rows, cols, ld_t};
      split_rows_ = std::max(split_rows_, rows);
      split_cols_ = std::max(split_cols_, cols);
    }
    tables_.Reserve(&split_jobs_, split_jobs_host_.size());
  }
  RETURN_IF_ERROR(tables_.Allocate());
  RETURN_IF_ERROR(CopyToDevice(chunks_, chunks_host_, stream_));
  if (split_jobs_ != nullptr) RETURN_IF_ERROR(CopyToDevice(split_jobs_, split_jobs_host_, stream_));
  for (Staged& s : staged) {
    RETURN_IF_ERROR(CopyToDevice(s.device_jobs, *s.jobs, stream_));
    RETURN_IF_ERROR(CopyToDevice(s.tiles, s.plan.tiles, stream_));
    RETURN_IF_ERROR(CopyToDevice(s.finishes, s.plan.finishes, stream_));
    s.batch->jobs = s.device_jobs;
    s.batch->tiles = s.tiles;
    s.batch->tile_count = static_cast<int>(s.plan.tiles.size());
    s.batch->finishes = s.finishes;
    s.batch->finish_count = static_cast<int>(s.plan.finishes.size());
  }
  return absl::OkStatus();
}

absl::Status CudaModel::StageBatch(const BatchView<float>& batch) {
  const ModelConfig& c = config();
  if (batch.batch < 1 || batch.batch > c.batch || batch.window < 1 || batch.window > c.window) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend: a batch of (", batch.batch, ", ", batch.window,
                                                   ") does not fit the buffers sized for (", c.batch, ", ", c.window,
                                                   ")"));
  }
  const size_t rows = static_cast<size_t>(batch.batch) * batch.window;
  if (batch.x.size() != rows * c.n_features || batch.dt.size() != rows || batch.labels.size() != rows * c.n_horizons ||
      batch.mask.size() != rows * c.n_horizons) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend: batch arrays do not match (", batch.batch, ", ",
                                                   batch.window, "): x ", batch.x.size(), ", dt ", batch.dt.size(),
                                                   ", labels ", batch.labels.size(), ", mask ", batch.mask.size()));
  }
  if (queued_ == 2) {
    return absl::FailedPreconditionError(
        "CUDA backend: two batches are staged already; a step must take the older before a third is staged");
  }
  // With nothing staged, a batch staged while a step that reads the current slot runs (Backend::TrainStepStagingNext)
  // takes the other slot if no step reads that one, instead of waiting for the step.
  if (queued_ == 0 && slots_[current_].read_since_wait && !slots_[1 - current_].read_since_wait) {
    current_ = 1 - current_;
  }
  InputSlot& slot = slots_[queued_ == 0 ? current_ : 1 - current_];
  if (slot.read_since_wait) {  // a step not waited for may still be copying this slot's previous batch in
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    for (InputSlot& each : slots_) each.read_since_wait = false;
  }
  std::memcpy(slot.x_host, batch.x.data(), batch.x.size_bytes());
  std::memcpy(slot.dt_host, batch.dt.data(), batch.dt.size_bytes());
  std::memcpy(slot.labels_host, batch.labels.data(), batch.labels.size_bytes());
  std::memcpy(slot.mask_host, batch.mask.data(), batch.mask.size_bytes());
  slot.batch = batch.batch;
  slot.window = batch.window;
  slot.on_device = false;
  ++queued_;
  return absl::OkStatus();
}

void CudaModel::DropStagedBatches() {
  queued_ = 0;
  for (InputSlot& slot : slots_) slot.batch = slot.window = 0;
}

absl::StatusOr<CudaModel::InputPlan> CudaModel::PlanInputs(bool prefetch) const {
  const InputSlot& in = slots_[current_];
  if (in.batch == 0) return absl::FailedPreconditionError("CUDA backend: no batch staged");
  InputPlan plan{current_, !in.on_device, -1};
  // Only a full batch: the graphs' copy sizes are the config's.
  const InputSlot& next = slots_[1 - current_];
  if (prefetch && queued_ == 2 && next.batch == config().batch && next.window == config().window) {
    plan.prefetch = 1 - current_;
  }
  return plan;
}

void CudaModel::TakeBatch(const InputPlan& plan, bool enqueued) {
  if (enqueued) {  // a replay's copies, which no ForwardAndLoss marked
    InputSlot& in = slots_[plan.slot];
    in.on_device = true;
    in.read_since_wait |= plan.copy;
    if (plan.prefetch >= 0) slots_[plan.prefetch].on_device = slots_[plan.prefetch].read_since_wait = true;
  }
  if (queued_ > 0 && --queued_ == 1) current_ = 1 - current_;  // the newer batch is the oldest now
}

absl::Status CudaModel::RequireFullBatch(const InputPlan& plan) const {
  const InputSlot& in = slots_[plan.slot];
  if (in.batch != config().batch || in.window != config().window) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend: a training step needs the configured (batch, window) = (",
                                                   config().batch, ", ", config().window, "), the staged batch is (",
                                                   in.batch, ", ", in.window, ")"));
  }
  return absl::OkStatus();
}

// ---- training step: warmup → capture → replay ----

absl::Status CudaModel::EnqueueTrainStep() {
  ASSIGN_OR_RETURN(const InputPlan plan, PlanInputs(/*prefetch=*/true));
  bool enqueued = false;
  const absl::Status launched = LaunchTrainStep(plan, enqueued);
  TakeBatch(plan, enqueued);
  return launched;
}

absl::Status CudaModel::LaunchTrainStep(const InputPlan& plan, bool& enqueued) {
  RETURN_IF_ERROR(RequireFullBatch(plan));  // refuses any other training shape, naming both
  if (communicator_) RETURN_IF_ERROR(communicator_->Usable());  // an aborted job's graph must not replay
  step_timing_pending_ = false;                         // the previous step was not waited for: it stays untimed
  const InputSlot& in = slots_[plan.slot];
  const auto [entry, added] = train_graphs_.try_emplace({in.batch, in.window});
  TrainGraph& graph = entry->second;
  if (added) {
    graph.batch = in.batch;
    graph.window = in.window;
  }
  const bool replay = use_graphs_ && graph.eager_steps > 0;
  const cudaGraphExec_t& exec = graph.exec[plan.variant()];
  if (replay && !exec) RETURN_IF_ERROR(CaptureTrainStep(graph, plan));
  if (replay) RETURN_IF_ERROR(CheckReplay(graph, plan));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(step_start_, stream_));
  if (replay) {
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream_));
    ++counters_.graph_replays;
  } else {
    RETURN_IF_ERROR(EnqueueTrainingWork(plan, /*optimizer_step=*/true));
    ++graph.eager_steps;
    ++counters_.eager_steps;
  }
  enqueued = true;
  CUDA_RETURN_IF_ERROR(cudaEventRecord(step_stop_, stream_));
  step_timing_pending_ = true;
  return absl::OkStatus();
}

CudaModel::BufferSet CudaModel::CurrentBuffers() const {
  // Both slots' pinned staging and device inputs; the pinned report; optimizer state; the activation arena (h_[0]),
  // the table arena (its first table, then chunks_) and the cuBLAS workspace.
  const InputSlot &a = slots_[0], &b = slots_[1];
  return {a.x_host,     a.dt_host, a.labels_host, a.mask_host, a.x,     b.x_host, b.dt_host,
          b.labels_host, b.mask_host, b.x,         report_host_, params_, grads_,   exp_avg_,
          exp_avg_sq_,  step_,     h_[0],         sums_.jobs,  chunks_, blas_workspace_};
}

absl::Status CudaModel::CaptureTrainStep(TrainGraph& graph, const InputPlan& plan) {
  // Thread-local capture mode, as the streamer's: nothing of this thread may synchronize or allocate meanwhile.
  cudaGraph_t captured = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  const absl::Status enqueued = EnqueueTrainingWork(plan, /*optimizer_step=*/true);
  const cudaError_t ended = cudaStreamEndCapture(stream_, &captured);
  if (!enqueued.ok() || ended != cudaSuccess) {
    if (captured) cudaGraphDestroy(captured);
    RETURN_IF_ERROR(enqueued);
    CUDA_RETURN_IF_ERROR_OF(ended, "cudaStreamEndCapture(stream_, &captured)");
  }
  const cudaError_t instantiated = cudaGraphInstantiate(&graph.exec[plan.variant()], captured,
                                                         node_priorities_ ? cudaGraphInstantiateFlagUseNodePriority : 0);
  cudaGraphDestroy(captured);
  CUDA_RETURN_IF_ERROR_OF(instantiated, "cudaGraphInstantiate(the training step)");
  graph.buffers[plan.variant()] = CurrentBuffers();
  ++counters_.graph_captures;
  return absl::OkStatus();
}

absl::Status CudaModel::CheckReplay(const TrainGraph& graph, const InputPlan& plan) const {
  const InputSlot& in = slots_[plan.slot];
  if (graph.batch != in.batch || graph.window != in.window) {
    return absl::InternalError(absl::StrCat("CUDA backend: the training graph captured for (batch, window) = (",
                                            graph.batch, ", ", graph.window, ") was about to replay a batch of (",
                                            in.batch, ", ", in.window, ")"));
  }
  const BufferSet now = CurrentBuffers(), &captured = graph.buffers[plan.variant()];
  for (size_t i = 0; i < now.size(); ++i) {
    if (now[i] != captured[i]) {
      return absl::InternalError(absl::StrCat(
          "CUDA backend: the training graph for (batch, window) = (", graph.batch, ", ", graph.window,
          ") was captured over other buffers (buffer ", i, " was 0x",
          absl::Hex(reinterpret_cast<uintptr_t>(captured[i])), ", is 0x",
          absl::Hex(reinterpret_cast<uintptr_t>(now[i])), "); refusing to replay"));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaModel::EnqueueTrainStepEagerly() { return EnqueueTakingBatch(/*optimizer_step=*/true); }

absl::Status CudaModel::EnqueueGradients() { return EnqueueTakingBatch(/*optimizer_step=*/false); }

absl::Status CudaModel::EnqueueTakingBatch(bool optimizer_step) {
  ASSIGN_OR_RETURN(const InputPlan plan, PlanInputs(/*prefetch=*/true));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream_, &capture));
  const absl::Status enqueued = EnqueueTrainingWork(plan, optimizer_step);
  if (capture == cudaStreamCaptureStatusNone) TakeBatch(plan, enqueued.ok());  // a capture runs nothing
  return enqueued;
}

absl::Status CudaModel::EnqueueTrainingWork(const InputPlan& plan, bool optimizer_step) {
  RETURN_IF_ERROR(RequireFullBatch(plan));
  RETURN_IF_ERROR(
      ForwardAndLoss(plan, config().batch, config().window, /*carry_state=*/false, /*with_gradient=*/true));
  RETURN_IF_ERROR(Backward());
  RETURN_IF_ERROR(SumGradientsOverRanks());
  if (optimizer_step) RETURN_IF_ERROR(OptimizerStep());
  if (plan.prefetch >= 0) CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, prefetch_done_));
  return absl::OkStatus();
}

absl::Status CudaModel::EnqueueEvaluate(bool carry_state) {
  ASSIGN_OR_RETURN(const InputPlan plan, PlanInputs(/*prefetch=*/false));
  const InputSlot& in = slots_[plan.slot];
  const int batch = in.batch, window = in.window;
  const absl::Status enqueued = [&]() -> absl::Status {
    RETURN_IF_ERROR(ForwardAndLoss(plan, batch, window, carry_state, /*with_gradient=*/false));
    if (carry_state) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(states_.in, states_.out, states_.floats() * sizeof(float),
                                           cudaMemcpyDeviceToDevice, stream_));
    }
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits_host_, logits_, static_cast<size_t>(batch) * window *
                                         config().n_horizons * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    return absl::OkStatus();
  }();
  TakeBatch(plan, enqueued.ok());
  logits_rows_ = enqueued.ok() ? batch * window : 0;
  return enqueued;
}

absl::Status CudaModel::ResetStreamState() {
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(states_.in, 0, states_.floats() * sizeof(float), stream_));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(states_.out, 0, states_.floats() * sizeof(float), stream_));
  return absl::OkStatus();
}

absl::StatusOr<kernels::StepReport> CudaModel::Wait() {
  if (communicator_) {  // a step with collectives in it: a dead peer must fail it, not hang it
    RETURN_IF_ERROR(communicator_->Synchronize(stream_));
  } else {
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));  // the one synchronization of a step
  }
  for (InputSlot& slot : slots_) slot.read_since_wait = false;
  if (step_timing_pending_) {  // both events completed with the stream: reading them waits for nothing
    step_timing_pending_ = false;
    float ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, step_start_, step_stop_));
    counters_.last_step_seconds = ms * 1e-3;
    counters_.total_step_seconds += ms * 1e-3;
    ++counters_.timed_steps;
  }
  return *report_host_;
}

std::span<const float> CudaModel::StagedLogits() const {
  return {logits_host_, static_cast<size_t>(logits_rows_) * config().n_horizons};
}

// ---- forward ----

kernels::ConvInput CudaModel::ConvInputOf(int l, int batch, int window, const float* state_in) const {
  const Dims d(config());
  const LayerTensors& lt = layout_.layers[l];
  return {batch, window, d.cd, d.W, layers_[l].zx + d.E, d.zd, param(lt.conv_weight), param(lt.conv_bias), state_in};
}

kernels::SsmInput CudaModel::SsmInputOf(int l, int batch, int window, const float* state_in) const {
  const Dims d(config());
  const LayerTensors& lt = layout_.layers[l];
  return {batch, window, d.Hh, d.P, d.N, layers_[l].xbc, d.cd, layers_[l].zx + d.E + d.cd, d.zd,
          param(lt.dt_bias), param(lt.a_log), param(lt.d), state_in, plain_tf32_};
}

kernels::CfcWeights CudaModel::CfcWeightsOf() const {
  const ParamLayout& pl = layout_;
  return {param(pl.cfc_backbone.weight),
          {param(pl.cfc_ff1.weight), param(pl.cfc_ff2.weight), param(pl.cfc_time_a.weight), param(pl.cfc_time_b.weight)},
          {param(pl.cfc_ff1.bias), param(pl.cfc_ff2.bias), param(pl.cfc_time_a.bias), param(pl.cfc_time_b.bias)}};
}

kernels::CfcShape CudaModel::CfcShapeOf(int batch, int window) const {
  const Dims d(config());
  return {batch, window, d.D, d.C, d.K, plain_tf32_};
}

// The batch in from its pinned staging unless a step before copied it in already: x on the main stream, which starts
// on it at once; dt, labels and mask, which nothing reads before the CfC, behind it on grad_stream_ (the copies share
// the host link: x goes first), beside the layers (H200, small: 19 µs a step off the main stream). Leaves grad_stream_
// forked.
absl::Status CudaModel::CopyInputsIn(const InputPlan& plan, int rows) {
  InputSlot& in = slots_[plan.slot];
  if (plan.copy) {
    in.read_since_wait = true;
    RETURN_IF_ERROR(CopyFeaturesIn(in, rows, stream_));
  }
  RETURN_IF_ERROR(ForkGradients());
  if (plan.copy) RETURN_IF_ERROR(CopyTargetsIn(in, rows, grad_stream_));
  return absl::OkStatus();
}

absl::Status CudaModel::CopyFeaturesIn(const InputSlot& slot, size_t rows, cudaStream_t stream) {
  return CopyToDevice(slot.x, {slot.x_host, rows * config().n_features}, stream);
}

absl::Status CudaModel::CopyTargetsIn(const InputSlot& slot, size_t rows, cudaStream_t stream) {
  const size_t H = config().n_horizons;
  RETURN_IF_ERROR(CopyToDevice(slot.dt, {slot.dt_host, rows}, stream));
  RETURN_IF_ERROR(CopyToDevice(slot.labels, {slot.labels_host, rows * H}, stream));
  return CopyToDevice(slot.mask, {slot.mask_host, rows * H}, stream);
}

// The next step's batch in beside this step's compute, so that step starts on it at once instead of on a copy over
// the host link (H200, small: x alone took 49.9 µs at the head of every step's chain, bench/step_timeline). On a
// stream of its own, forked from the main stream where ForwardAndLoss calls it and, where this step copied its own
// batch in (`behind_own_copies`), behind those copies too (grads_done_ is past them), as they share the host link;
// EnqueueTrainingWork joins it at the step's end. The previous step, which may have read these device buffers, ended
// before this one began.
absl::Status CudaModel::PrefetchInputs(InputSlot& next, bool behind_own_copies) {
  const size_t rows = static_cast<size_t>(config().batch) * config().window;
  next.read_since_wait = true;
  RETURN_IF_ERROR(WaitForStream(prefetch_stream_, stream_, prefetch_fork_));
  if (behind_own_copies) CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(prefetch_stream_, grads_done_));
  RETURN_IF_ERROR(CopyFeaturesIn(next, rows, prefetch_stream_));
  RETURN_IF_ERROR(CopyTargetsIn(next, rows, prefetch_stream_));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(prefetch_done_, prefetch_stream_));
  return absl::OkStatus();
}

absl::Status CudaModel::SplitWeightsBeside() {
  RETURN_IF_ERROR(WaitForStream(layer_grad_stream_, stream_, layer_fork_));
  CUDA_RETURN_IF_ERROR(kernels::LaunchTf32x3SplitWeights(split_jobs_, static_cast<int>(split_jobs_host_.size()),
                                                         split_rows_, split_cols_, layer_grad_stream_));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(layer_grad_done_, layer_grad_stream_));
  return absl::OkStatus();
}

absl::Status CudaModel::ForwardAndLoss(const InputPlan& plan, int batch, int window, bool carry_state,
                                       bool with_gradient) {
  const Dims d(config());
  const int rows = batch * window;
  const InputSlot& in = slots_[plan.slot];
  x_ = in.x;
  dt_ = in.dt;
  labels_ = in.labels;
  mask_ = in.mask;
  // The weights' TF32 parts for this step's products (the optimizer changed the weights since the last split) run
  // beside the main stream. Where the step copies its own batch in, they fork before x's copy and run beside it; the
  // embedding's product, which that copy holds back anyway, then splits its own weight instead of reading the parts
  // (the same bits), and the main stream joins the split only before layer 0's RMSNorm. This layout and
  // LayerBackward's order together against neither, alternating (H200, small, own copy): 3xtf32 1,073–1,079 against
  // 1,085–1,090 µs a step, fp32 1,473 / 1,475 against 1,495 / 1,498 (bench/RESULTS.md, the thirteenth session).
  const bool splits = split_jobs_ != nullptr;
  if (splits && plan.copy) RETURN_IF_ERROR(SplitWeightsBeside());
  RETURN_IF_ERROR(CopyInputsIn(plan, rows));
  // Without a split nothing waits behind them, so they start at once, beside the standardization and the first
  // product (see the launch below).
  if (!splits) RETURN_IF_ERROR(PackCfcAndCountMask(batch, window));
  // With the batch on the device already nothing holds the standardization back: the split runs beside it, and the
  // embedding reads the parts, so it waits for both (H200, small 3xtf32, prefetching: 1,033–1,034 against 1,046–1,048
  // µs a step with the split before it on the main stream, the tenth session).
  const bool split_beside_standardization = splits && !plan.copy;
  if (split_beside_standardization) RETURN_IF_ERROR(SplitWeightsBeside());
  CUDA_RETURN_IF_ERROR(kernels::LaunchStandardize(x_, param(layout_.norm_mean), param(layout_.norm_inv_std), rows, d.F,
                                                  xn_, stream_));
  if (split_beside_standardization) CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, layer_grad_done_));
  // From here to the head's LayerNorm the forward is one chain of kernels on the main stream, each launched as the
  // programmatic dependent of the one ahead (kernels/common.cuh): it launches while that one ends and waits for it
  // before it reads anything, so the gaps between them close. Not the backward: there, blocks parked at their wait
  // starved the weight gradients' stream beside it (an earlier session measured every kernel so launched slower).
  // A kernel right behind a join with another stream launches plain: what it reads before its wait (a product's
  // weight planes, the CfC's packed weights) may come from that stream, and a captured join need not be a full
  // dependency once the launch is programmatic.
  RETURN_IF_ERROR(blas_->Forward(rows, d.F, d.D, xn_, d.F, param(layout_.embed.weight), d.F,
                                 param(layout_.embed.bias), 0.f, h_[0], d.D, {},
                                 plan.copy ? nullptr : planes(layout_.embed.weight),
                                 /*programmatic=*/!split_beside_standardization));
  // With a split, the CfC's packing and the mask count are captured after the embedding: captured ahead of the split
  // and the standardization, the split ran only after the mask count (one block, ~9 µs) and the embedding started 20
  // µs into the step instead of 9 (H200, small, prefetching: 3xtf32 968–975 -> 961–964 µs a step, tf32 830 -> 825;
  // bench/RESULTS.md, the twenty-sixth session). fp32 has no split; there, captured here, they ran beside cuBLAS's
  // first product instead (fp32, five runs alternating: 1,377–1,384 µs a step captured ahead, 1,381–1,388 here; the
  // twenty-seventh session).
  if (splits) RETURN_IF_ERROR(PackCfcAndCountMask(batch, window));
  const bool split_joins_layer0 = splits && plan.copy;
  if (split_joins_layer0) CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, layer_grad_done_));
  // The next batch's copy forks here: forked at the step's start it took ~13 µs more a step (H200, small 3xtf32,
  // prefetching: 1,059 against 1,046–1,048 µs; after the layers' forward or at the backward's start, 1,046–1,048).
  if (plan.prefetch >= 0) RETURN_IF_ERROR(PrefetchInputs(slots_[plan.prefetch], plan.copy));
  for (int l = 0; l < d.L; ++l) {
    RETURN_IF_ERROR(LayerForward(l, batch, window, carry_state, /*plain_norm=*/l == 0 && split_joins_layer0));
  }
  CUDA_RETURN_IF_ERROR(kernels::LaunchRmsNormForward(h_[d.L], d.D, param(layout_.norm_f), rows, d.D, head_in_, d.DC,
                                                     rstd_f_, nullptr, stream_, /*programmatic=*/true));
  RETURN_IF_ERROR(CfcForward(batch, window, carry_state));  // past its wait for grad_stream_'s copies and count
  // Data parallel: the loss is the masked mean over the GLOBAL batch, so the mask count is summed over the ranks
  // before the head divides by it (each rank's d logits is then m·(σ − y)/(global Σm), its share of the global
  // gradient, and the gradient sum over ranks is exactly that gradient), and the loss's partials before the report.
  const bool all_ranks = with_gradient && communicator_;
  if (all_ranks) RETURN_IF_ERROR(communicator_->SumInPlace(mask_count_, 1, stream_));
  RETURN_IF_ERROR(HeadForward(rows, with_gradient));
  // Nothing of a training step reads the reported loss: on one rank it is summed on grad_stream_, beside the
  // backward, which joins it at the end.
  cudaStream_t loss_stream = stream_;
  if (with_gradient && !communicator_) {
    RETURN_IF_ERROR(ForkGradients());
    loss_stream = grad_stream_;
  }
  CUDA_RETURN_IF_ERROR(
      kernels::LaunchMaskedBcePartials(logits_, labels_, mask_, rows * d.H, loss_partials_, loss_stream));
  if (all_ranks) RETURN_IF_ERROR(communicator_->SumInPlace(loss_partials_, kernels::kMaskedBceBlocks, stream_));
  CUDA_RETURN_IF_ERROR(kernels::LaunchMaskedBceReport(loss_partials_, mask_count_, report_host_, loss_stream));
  return absl::OkStatus();
}

// On grad_stream_, the CfC's weight packing (it reads only parameters) and the mask count that d logits divides by
// (it reads only the batch); the CfC joins them (CfcForward).
absl::Status CudaModel::PackCfcAndCountMask(int batch, int window) {
  CUDA_RETURN_IF_ERROR(kernels::LaunchCfcPackWeights(CfcWeightsOf(), CfcShapeOf(batch, window), cfc_packed_,
                                                     grad_stream_));
  const int mask_values = batch * window * config().n_horizons;
  CUDA_RETURN_IF_ERROR(kernels::LaunchMaskCount(mask_, mask_values, mask_count_, grad_stream_));
  return MarkGradients();
}

absl::Status CudaModel::LayerForward(int l, int batch, int window, bool carry_state, bool plain_norm) {
  const Dims d(config());
  const int rows = batch * window;
  const LayerTensors& lt = layout_.layers[l];
  const Layer& a = layers_[l];
  CUDA_RETURN_IF_ERROR(kernels::LaunchRmsNormForward(h_[l], d.D, param(lt.norm), rows, d.D, a.r, d.D, a.rstd,
                                                     h_[l + 1], stream_, /*programmatic=*/!plain_norm));
  RETURN_IF_ERROR(blas_->Forward(rows, d.D, d.zd, a.r, d.D, param(lt.in_proj), d.D, nullptr, 0.f, a.zx, d.zd, {},
                                 planes(lt.in_proj), /*programmatic=*/true));
  // The conv is its own launch: formed in the SSM forward's staging instead (the same bits, with and without B/C
  // shared over a cluster of the heads), that one kernel took 42–46 µs against 13.5 + 25.3 µs for the two (H200,
  // small): the conv's SiLU work joins every block's serial staging, which the forward's 4 blocks a multiprocessor
  // do not hide.
  const kernels::ConvInput conv = ConvInputOf(l, batch, window, carry_state ? states_.Conv(states_.in, l) : nullptr);
  CUDA_RETURN_IF_ERROR(kernels::LaunchConvForward(conv, a.xbc, carry_state ? states_.Conv(states_.out, l) : nullptr,
                                                  stream_, /*programmatic=*/true));
  const kernels::SsmInput ssm = SsmInputOf(l, batch, window, carry_state ? states_.Ssm(states_.in, l) : nullptr);
  CUDA_RETURN_IF_ERROR(kernels::LaunchSsmScanForward(ssm, a.y, carry_state ? states_.Ssm(states_.out, l) : nullptr,
                                                     stream_, /*programmatic=*/true));
  // The gated norm is its own launch too: folded into the SSM forward's epilogue (a cluster of the heads exchanging
  // the rows' sums of squares), that kernel took 39–40 µs against 25.3 + 14.2 µs for the two (H200, small).
  CUDA_RETURN_IF_ERROR(kernels::LaunchGatedRmsNormForward(a.y, a.zx, d.zd, param(lt.mixer_norm), rows, d.E, a.yn,
                                                          a.rstd_gate, stream_, /*programmatic=*/true));
  return blas_->Forward(rows, d.E, d.D, a.yn, d.E, param(lt.out_proj), d.E, nullptr, 1.f, h_[l + 1], d.D, {},
                        planes(lt.out_proj), /*programmatic=*/true);
}

absl::Status CudaModel::CfcForward(int batch, int window, bool carry_state) {
  const Dims d(config());
  const kernels::CfcShape shape = CfcShapeOf(batch, window);
  RETURN_IF_ERROR(blas_->Forward(batch * window, d.D, d.K, head_in_, d.DC, param(layout_.cfc_backbone.weight), d.DC,
                                 param(layout_.cfc_backbone.bias), 0.f, cfc_u_, d.K, {},
                                 planes(layout_.cfc_backbone.weight), /*programmatic=*/true));
  const kernels::CfcActivations act{bb_pre_, bb_, gates_, head_in_ + d.D, d.DC, c_prev_};
  // The packed weights and the mask count (ForwardAndLoss): the CfC, which reads the weights before its wait, launches
  // plain behind this join (see ForwardAndLoss), so they are complete for it and for everything after it.
  RETURN_IF_ERROR(AwaitGradients());
  CUDA_RETURN_IF_ERROR(kernels::LaunchCfcForward(shape, cfc_packed_, cfc_u_, dt_,
                                                 carry_state ? states_.Cfc(states_.in) : nullptr, act,
                                                 carry_state ? states_.Cfc(states_.out) : nullptr, stream_));
  return absl::OkStatus();
}

kernels::NormOutputLayer CudaModel::HeadOutputLayer() const {
  return {param(layout_.head_out.weight), param(layout_.head_out.bias), config().n_horizons};
}

absl::Status CudaModel::HeadForward(int rows, bool with_gradient) {
  const Dims d(config());
  const ParamLayout& pl = layout_;
  // The forward's chain goes on (ForwardAndLoss), but for the first product where the ranks' mask count was summed
  // ahead of it.
  const bool after_cfc = !(with_gradient && communicator_);
  if (stacked_forward_head_) {
    // [pre_ln | pre2] = head_in · [W_skip; W_fc2]ᵀ from the stack's planes alone (the weights are not adjacent in
    // the parameters, so only the 3×TF32 kernels can run it), without a bias: the GRN head kernel adds fc2's.
    if (!blas_->ForwardOnTf32x3Kernels(d.DC, 2 * d.G, head_in_, d.DC, param(pl.grn_skip), d.DC)) {
      return absl::InternalError("the stacked skip + fc2 forward product without the 3xTF32 kernels");
    }
    RETURN_IF_ERROR(blas_->Forward(rows, d.DC, 2 * d.G, head_in_, d.DC, param(pl.grn_skip), d.DC, nullptr, 0.f,
                                   pre_ln_, 2 * d.G, {}, &skip_fc2_forward_planes_, after_cfc));
  } else {
    // Where stacked_head_, fc2 and skip, which read the same head_in, as one batched launch (skip's weight and
    // output one stride past fc2's). The skip has no bias: its share of the batch adds −0 (neg_zero_bias_), which
    // leaves every value as it is, bit for bit (+0 would turn −0 into +0).
    const BlasBatch fc2_and_skip = stacked_head_ ? BlasBatch{.count = 2,
                                                             .w = param(pl.grn_skip) - param(pl.grn_fc2.weight),
                                                             .y = pre_ln_ - pre2_,
                                                             .bias = neg_zero_bias_ - param(pl.grn_fc2.bias)}
                                                 : BlasBatch{};
    RETURN_IF_ERROR(blas_->Forward(rows, d.DC, d.G, head_in_, d.DC, param(pl.grn_fc2.weight), d.DC,
                                   param(pl.grn_fc2.bias), 0.f, pre2_, d.G, fc2_and_skip, planes(pl.grn_fc2.weight),
                                   after_cfc));
  }
  const kernels::LogitGradient grad{labels_, mask_, mask_count_, with_gradient ? dlogits_ : nullptr};
  if (fused_head_) {
    if (!stacked_head_) {
      RETURN_IF_ERROR(blas_->Forward(rows, d.DC, d.G, head_in_, d.DC, param(pl.grn_skip), d.DC, nullptr, 0.f, pre_ln_,
                                     d.G, {}, planes(pl.grn_skip), /*programmatic=*/true));
    }
    const kernels::GrnHeadWeights weights{param(pl.grn_fc1.weight),  param(pl.grn_fc1.bias),   param(pl.grn_gate.weight),
                                          param(pl.grn_gate.bias),   param(pl.grn_value.weight), param(pl.grn_value.bias),
                                          param(pl.grn_norm.weight), param(pl.grn_norm.bias),   HeadOutputLayer(),
                                          stacked_forward_head_ ? param(pl.grn_fc2.bias) : nullptr};
    const kernels::GrnHeadBackward backward{d_pre_ln_,        d_gate_pre_, d_value_, d_pre2_, head_ld_, de1_,
                                            grn_partials_,    head_out_partials_};
    const kernels::GrnHeadForward forward{pre2_, pre_ln_, e2_, e1_, g_, logits_, stacked_forward_head_ ? 2 * d.G : 0};
    CUDA_RETURN_IF_ERROR(kernels::LaunchGrnHead(rows, d.G, weights, forward, grad, backward, plain_tf32_, stream_,
                                                /*programmatic=*/true));
    return absl::OkStatus();
  }
  CUDA_RETURN_IF_ERROR(kernels::LaunchEluForward(pre2_, rows * d.G, e2_, stream_, /*programmatic=*/true));
  RETURN_IF_ERROR(blas_->Forward(rows, d.G, d.G, e2_, d.G, param(pl.grn_fc1.weight), d.G, param(pl.grn_fc1.bias), 0.f,
                                 e1_, d.G, {}, planes(pl.grn_fc1.weight), /*programmatic=*/true));
  // Gate and value read the same e1: one batched launch (value's weight and output one stride past gate's).
  RETURN_IF_ERROR(blas_->Forward(rows, d.G, d.G, e1_, d.G, param(pl.grn_gate.weight), d.G, param(pl.grn_gate.bias),
                                 0.f, gate_pre_, d.G,
                                 {.count = 2,
                                  .w = param(pl.grn_value.weight) - param(pl.grn_gate.weight),
                                  .y = value_ - gate_pre_,
                                  .bias = param(pl.grn_value.bias) - param(pl.grn_gate.bias)},
                                 planes(pl.grn_gate.weight), /*programmatic=*/true));
  if (!stacked_head_) {
    RETURN_IF_ERROR(blas_->Forward(rows, d.DC, d.G, head_in_, d.DC, param(pl.grn_skip), d.DC, nullptr, 0.f, pre_ln_,
                                   d.G, {}, planes(pl.grn_skip), /*programmatic=*/true));
  }
  // head_out's outputs and their gradient from the g the LayerNorm holds in registers: no product launch (cuBLAS's
  // took 5.6 µs in the step) and no loss launch on the main stream before the backward.
  CUDA_RETURN_IF_ERROR(kernels::LaunchGrnGateLayerNormForward(pre_ln_, gate_pre_, value_, param(pl.grn_norm.weight),
                                                              param(pl.grn_norm.bias), HeadOutputLayer(), grad, rows,
                                                              d.G, nhat_, g_, ln_rstd_, logits_, stream_,
                                                              /*programmatic=*/true));
  return absl::OkStatus();
}

// ---- backward (always the full configured batch) ----

// The weight gradients run on grad_stream_ (grad_blas_): nothing on the main stream reads them before the optimizer,
// so they overlap the chain of data gradients instead of lengthening it. ForkGradients lets grad_stream_ start on
// what the main stream has produced so far; the main stream waits (AwaitGradients) for what grad_stream_ had marked
// (MarkGradients) before it overwrites an input of a queued weight gradient, and before the optimizer. The one weight
// gradient the main stream waits for inside the backward, each layer's out_proj (LayerBackward), runs on
// layer_grad_stream_ instead.
absl::Status CudaModel::ForkGradients() { return WaitForStream(grad_stream_, stream_, fork_); }

absl::Status CudaModel::MarkGradients() {
  CUDA_RETURN_IF_ERROR(cudaEventRecord(grads_done_, grad_stream_));
  return absl::OkStatus();
}

absl::Status CudaModel::AwaitGradients() {
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, grads_done_));
  return absl::OkStatus();
}

absl::Status CudaModel::Backward() {
  const Dims d(config());
  const int rows = config().batch * config().window;
  RETURN_IF_ERROR(HeadBackward(rows));
  RETURN_IF_ERROR(CfcBackward(rows));
  CUDA_RETURN_IF_ERROR(kernels::LaunchRmsNormBackward(h_[d.L], d.D, param(layout_.norm_f), rstd_f_, d_head_in_, d.DC,
                                                      rows, d.D, /*accumulate=*/false, dh_, d.D, norm_f_partials_,
                                                      /*dv_partials=*/nullptr, stream_));
  // The head's and the CfC's sums are final here: off the main stream, beside the layers' backward.
  RETURN_IF_ERROR(ForkGradients());
  CUDA_RETURN_IF_ERROR(kernels::LaunchColumnSums(head_sums_, grad_stream_));
  for (int l = d.L - 1; l >= 0; --l) RETURN_IF_ERROR(LayerBackward(l, rows));
  RETURN_IF_ERROR(ForkGradients());
  RETURN_IF_ERROR(grad_blas_->BackwardWeight(rows, d.F, d.D, dh_, d.D, xn_, d.F, grad(layout_.embed.weight), d.F));
  CUDA_RETURN_IF_ERROR(kernels::LaunchColumnSums(sums_, stream_));
  RETURN_IF_ERROR(MarkGradients());
  return AwaitGradients();
}

absl::Status CudaModel::HeadBackward(int rows) {
  const Dims d(config());
  const ParamLayout& pl = layout_;
  const int ld = head_ld_;  // of d_pre_ln_, d_gate_pre_, d_value_ and d_pre2_
  RETURN_IF_ERROR(ForkGradients());
  if (fused_head_) {
    // HeadForward's one launch formed every gradient down to d pre2 and d pre_ln, and head_out's weight gradient in
    // partial sums (the head's column sums add them up). The pairs sit side by side: gate's and value's weight
    // gradients run as one product over [d gate_pre | d value], skip's and fc2's as one over [d pre_ln | d pre2],
    // then copies put them into their tensors. As six products, all queued at once on grad_stream_ beside the CfC
    // backward, they held up that stream's layers behind them (H200, small 3xtf32, prefetching: 1,044–1,045 µs a
    // step against 989–990 paired).
    const size_t gg = static_cast<size_t>(d.G) * d.G, gdc = static_cast<size_t>(d.G) * d.DC;
    float* gate_value = head_weight_grads_;  // [2G, G]
    float* skip_fc2 = head_weight_grads_ + 2 * gg;  // [2G, D + C]
    RETURN_IF_ERROR(grad_blas_->BackwardWeight(rows, d.G, 2 * d.G, d_gate_pre_, ld, e1_, d.G, gate_value, d.G));
    RETURN_IF_ERROR(grad_blas_->BackwardWeight(rows, d.G, d.G, de1_, d.G, e2_, d.G, grad(pl.grn_fc1.weight), d.G));
    RETURN_IF_ERROR(grad_blas_->BackwardWeight(rows, d.DC, 2 * d.G, d_pre_ln_, ld, head_in_, d.DC, skip_fc2, d.DC));
    const ptrdiff_t gate_to_value = grad(pl.grn_value.weight) - grad(pl.grn_gate.weight);  // ≥ G·G (BuildTables)
    CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(grad(pl.grn_gate.weight), gate_to_value * sizeof(float), gate_value,
                                           gg * sizeof(float), gg * sizeof(float), 2, cudaMemcpyDeviceToDevice,
                                           grad_stream_));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(grad(pl.grn_skip), skip_fc2, gdc * sizeof(float), cudaMemcpyDeviceToDevice,
                                         grad_stream_));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(grad(pl.grn_fc2.weight), skip_fc2 + gdc, gdc * sizeof(float),
                                         cudaMemcpyDeviceToDevice, grad_stream_));
    return HeadInputGradient(rows);
  }
  RETURN_IF_ERROR(grad_blas_->BackwardWeight(rows, d.G, d.H, dlogits_, d.H, g_, d.G, grad(pl.head_out.weight), d.G));
  CUDA_RETURN_IF_ERROR(kernels::LaunchGrnGateLayerNormBackward(dlogits_, HeadOutputLayer(), nhat_, ln_rstd_,
                                                               param(pl.grn_norm.weight), gate_pre_, value_, rows,
                                                               d.G, d_pre_ln_, d_gate_pre_, d_value_, ld,
                                                               grn_partials_, stream_));
  RETURN_IF_ERROR(ForkGradients());
  RETURN_IF_ERROR(
      grad_blas_->BackwardWeight(rows, d.DC, d.G, d_pre_ln_, ld, head_in_, d.DC, grad(pl.grn_skip), d.DC));
  RETURN_IF_ERROR(
      grad_blas_->BackwardWeight(rows, d.G, d.G, d_value_, ld, e1_, d.G, grad(pl.grn_value.weight), d.G));
  RETURN_IF_ERROR(
      grad_blas_->BackwardWeight(rows, d.G, d.G, d_gate_pre_, ld, e1_, d.G, grad(pl.grn_gate.weight), d.G));
  // The stack's product where the 3×TF32 kernels take it (the weight passed is the stack's first, for the checks;
  // the kernel reads the planes alone); else each weight's own product (from its own planes, at ld_t 2G where
  // stacked_head_).
  const bool stack_gate_value = stacked_head_ && blas_->BackwardDataOnTf32x3Kernels(d.G, 2 * d.G, d_gate_pre_, ld,
                                                                                    param(pl.grn_gate.weight), d.G);
  if (stack_gate_value) {
    // de1 = [d gate_pre | d value] · [W_gate; W_value]: one product over K = 2G.
    RETURN_IF_ERROR(blas_->BackwardData(rows, d.G, 2 * d.G, d_gate_pre_, ld, param(pl.grn_gate.weight), d.G, 0.f,
                                        de1_, d.G, &gate_value_planes_));
  } else {
    RETURN_IF_ERROR(blas_->BackwardData(rows, d.G, d.G, d_value_, ld, param(pl.grn_value.weight), d.G, 0.f, de1_,
                                        d.G, planes(pl.grn_value.weight)));
    RETURN_IF_ERROR(blas_->BackwardData(rows, d.G, d.G, d_gate_pre_, ld, param(pl.grn_gate.weight), d.G, 1.f, de1_,
                                        d.G, planes(pl.grn_gate.weight)));
  }
  RETURN_IF_ERROR(ForkGradients());
  RETURN_IF_ERROR(grad_blas_->BackwardWeight(rows, d.G, d.G, de1_, d.G, e2_, d.G, grad(pl.grn_fc1.weight), d.G));
  RETURN_IF_ERROR(blas_->BackwardData(rows, d.G, d.G, de1_, d.G, param(pl.grn_fc1.weight), d.G, 0.f, d_pre2_, ld,
                                      planes(pl.grn_fc1.weight)));
  CUDA_RETURN_IF_ERROR(kernels::LaunchEluBackwardRows(pre2_, d.G, d_pre2_, ld, rows, d.G, d_pre2_, ld, stream_));
  RETURN_IF_ERROR(ForkGradients());
  RETURN_IF_ERROR(
      grad_blas_->BackwardWeight(rows, d.DC, d.G, d_pre2_, ld, head_in_, d.DC, grad(pl.grn_fc2.weight), d.DC));
  return HeadInputGradient(rows);
}

// d head_in = d pre_ln · W_skip + d pre2 · W_fc2: one product over K = 2G where the 3×TF32 kernels take the stack.
absl::Status CudaModel::HeadInputGradient(int rows) {
  const Dims d(config());
  const ParamLayout& pl = layout_;
  const int ld = head_ld_;
  const bool stack_skip_fc2 = stacked_head_ && blas_->BackwardDataOnTf32x3Kernels(d.DC, 2 * d.G, d_pre_ln_, ld,
                                                                                  param(pl.grn_skip), d.DC);
  if (stack_skip_fc2) {
    return blas_->BackwardData(rows, d.DC, 2 * d.G, d_pre_ln_, ld, param(pl.grn_skip), d.DC, 0.f, d_head_in_, d.DC,
                               &skip_fc2_planes_);
  }
  RETURN_IF_ERROR(blas_->BackwardData(rows, d.DC, d.G, d_pre_ln_, ld, param(pl.grn_skip), d.DC, 0.f, d_head_in_, d.DC,
                                      planes(pl.grn_skip)));
  return blas_->BackwardData(rows, d.DC, d.G, d_pre2_, ld, param(pl.grn_fc2.weight), d.DC, 1.f, d_head_in_, d.DC,
                             planes(pl.grn_fc2.weight));
}

absl::Status CudaModel::CfcBackward(int rows) {
  const Dims d(config());
  const ParamLayout& pl = layout_;
  const kernels::CfcShape shape = CfcShapeOf(config().batch, config().window);
  CUDA_RETURN_IF_ERROR(kernels::LaunchCfcBackward(shape, cfc_packed_, dt_, gates_, bb_pre_, d_head_in_ + d.D, d.DC, dp_,
                                                  dbb_pre_, stream_, cfc_bias_sums_));
  const int heads[kernels::kCfcHeads] = {pl.cfc_ff1.weight, pl.cfc_ff2.weight, pl.cfc_time_a.weight,
                                         pl.cfc_time_b.weight};
  RETURN_IF_ERROR(ForkGradients());
  // The four heads' weight gradients as one product dp[rows, 4C]ᵀ · bb (one k = rows reduction instead of four),
  // then one strided copy into the four tensors, which the layout keeps a bias apart.
  RETURN_IF_ERROR(grad_blas_->BackwardWeight(rows, d.K, kernels::kCfcHeads * d.C, dp_, 4 * d.C, bb_, d.K,
                                             cfc_heads_grad_, d.K));
  const size_t head_floats = static_cast<size_t>(d.C) * d.K;
  for (int j = 1; j < kernels::kCfcHeads; ++j) {
    if (grad(heads[j]) - grad(heads[j - 1]) != grad(heads[1]) - grad(heads[0])) {
      return absl::InternalError("the CfC head weights are not evenly spaced in the parameter layout");
    }
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(grad(heads[0]), (grad(heads[1]) - grad(heads[0])) * sizeof(float),
                                         cfc_heads_grad_, head_floats * sizeof(float), head_floats * sizeof(float),
                                         kernels::kCfcHeads, cudaMemcpyDeviceToDevice, grad_stream_));
  float* d_backbone = grad(pl.cfc_backbone.weight);  // [K, D + C]: the s columns, then W_c's
  RETURN_IF_ERROR(grad_blas_->BackwardWeight(rows, d.D, d.K, dbb_pre_, d.K, head_in_, d.DC, d_backbone, d.DC));
  RETURN_IF_ERROR(grad_blas_->BackwardWeight(rows, d.C, d.K, dbb_pre_, d.K, c_prev_, d.C, d_backbone + d.D, d.DC));
  return blas_->BackwardData(rows, d.D, d.K, dbb_pre_, d.K, param(pl.cfc_backbone.weight), d.DC, 1.f, d_head_in_,
                             d.DC, planes(pl.cfc_backbone.weight));
}

absl::Status CudaModel::LayerBackward(int l, int rows) {
  const Dims d(config());
  const LayerTensors& lt = layout_.layers[l];
  const Layer& a = layers_[l];
  RETURN_IF_ERROR(
      blas_->BackwardData(rows, d.E, d.D, dh_, d.D, param(lt.out_proj), d.E, 0.f, a.dyn, d.E, planes(lt.out_proj)));
  // The last read of dh_ before this layer's RMSNorm backward adds to it, so the main stream waits for it there. On
  // grad_stream_ it queued behind every weight gradient issued before it (the head's, the later layer's in_proj),
  // and the wait with it (H200, small 3xtf32: the last layer's RMSNorm backward started 35.6 µs after the main
  // stream's work before it had ended, bench/step_timeline); on a stream of its own it starts at once. It starts
  // behind the data gradient above rather than beside it, where the two products took the SMs from each other and
  // the main stream's next kernel waited for theirs (H200, small 3xtf32, prefetching, this order alone: 1,016–1,023
  // against 1,025–1,033 µs a step, alternating; see also ForwardAndLoss).
  RETURN_IF_ERROR(WaitForStream(layer_grad_stream_, stream_, layer_fork_));
  RETURN_IF_ERROR(layer_grad_blas_->BackwardWeight(rows, d.E, d.D, dh_, d.D, a.yn, d.E, grad(lt.out_proj), d.E));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(layer_grad_done_, layer_grad_stream_));
  CUDA_RETURN_IF_ERROR(kernels::LaunchGatedRmsNormBackward(a.dyn, a.rstd_gate, param(lt.mixer_norm), a.y, a.zx, d.zd,
                                                           rows, d.E, dy_, a.dzx, d.zd, a.mixer_norm_partials,
                                                           stream_));
  const kernels::SsmGrad ssm_grad{dxs_, dbc_, a.dzx + d.E + d.cd, d.zd, a.ssm_partials, ssm_scratch_};
  CUDA_RETURN_IF_ERROR(kernels::LaunchSsmScanBackward(SsmInputOf(l, config().batch, config().window, nullptr), dy_,
                                                      ssm_grad, stream_));
  const kernels::ConvOutputGrad conv_grad{dxs_, d.E, dbc_, d.Hh};
  CUDA_RETURN_IF_ERROR(kernels::LaunchConvBackward(ConvInputOf(l, config().batch, config().window, nullptr), conv_grad,
                                                   a.dzx + d.E, d.zd, a.conv_partials, stream_));
  // in_proj's weight gradient and data product both wait for d zx. Under fp32 the data product goes first and the
  // weight gradient follows it on grad_stream_ (H200, small, alternating: 1,367.2–1,368.4 -> 1,336.4–1,338.3 µs a
  // step; layer 0's alone 1,338.7–1,345.6); under 3xtf32 and tf32 that order was the slower (950.7–953.2 ->
  // 972.6–973.4, 788.7–789.8 -> 801.1–802.9).
  auto weight_gradient = [&]() -> absl::Status {
    RETURN_IF_ERROR(ForkGradients());
    return grad_blas_->BackwardWeight(rows, d.D, d.zd, a.dzx, d.zd, a.r, d.D, grad(lt.in_proj), d.D);
  };
  const bool data_before_weight_gradient = precision_ == Precision::kFloat32;
  if (!data_before_weight_gradient) RETURN_IF_ERROR(weight_gradient());
  RETURN_IF_ERROR(
      blas_->BackwardData(rows, d.D, d.zd, a.dzx, d.zd, param(lt.in_proj), d.D, 0.f, a.dr, d.D, planes(lt.in_proj)));
  if (data_before_weight_gradient) RETURN_IF_ERROR(weight_gradient());
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, layer_grad_done_));  // joins layer_grad_stream_ back, too
  // Layer 0's RMSNorm backward writes the final d residual stream, whose column sums are the embedding's bias
  // gradient.
  CUDA_RETURN_IF_ERROR(kernels::LaunchRmsNormBackward(h_[l], d.D, param(lt.norm), a.rstd, a.dr, d.D, rows, d.D,
                                                      /*accumulate=*/true, dh_, d.D, a.norm_partials,
                                                      l == 0 ? embed_bias_partials_ : nullptr, stream_));
  return absl::OkStatus();
}

// Between the backward and the clip: the sum of every rank's gradient share (see ForwardAndLoss), so all ranks clip
// by the same norm and apply the same AdamW update to the same parameters.
absl::Status CudaModel::SumGradientsOverRanks() {
  if (!communicator_) return absl::OkStatus();
  return communicator_->SumInPlace(grads_ + layout_.trained_begin(), layout_.total_size() - layout_.trained_begin(),
                                   stream_);
}

absl::Status CudaModel::OptimizerStep() {
  const int chunks = static_cast<int>(chunks_host_.size());
  CUDA_RETURN_IF_ERROR(kernels::LaunchClipAdamW(chunks_, chunks, norm_partials_, step_, adamw_, params_, grads_,
                                                exp_avg_, exp_avg_sq_, report_host_, stream_));
  return absl::OkStatus();
}

// ---- host copies ----

absl::StatusOr<std::vector<float>> CudaModel::DownloadFloats(const float* device) const {
  std::vector<float> host(layout_.total_size());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(host.data(), device, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return host;
}

absl::StatusOr<std::vector<float>> CudaModel::DownloadParams() const { return DownloadFloats(params_); }
absl::StatusOr<std::vector<float>> CudaModel::DownloadGrads() const { return DownloadFloats(grads_); }
absl::StatusOr<std::vector<float>> CudaModel::DownloadExpAvg() const { return DownloadFloats(exp_avg_); }
absl::StatusOr<std::vector<float>> CudaModel::DownloadExpAvgSq() const { return DownloadFloats(exp_avg_sq_); }

absl::StatusOr<int64_t> CudaModel::DownloadStep() const {
  int64_t step = 0;
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(&step, step_, sizeof(step), cudaMemcpyDeviceToHost));
  return step;
}

absl::Status CudaModel::Upload(std::span<const float> params, std::span<const float> exp_avg,
                               std::span<const float> exp_avg_sq, int64_t step) {
  const size_t n = layout_.total_size();
  if (params.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend: uploads need ", n, " floats per array, got ",
                                                   params.size(), ", ", exp_avg.size(), ", ", exp_avg_sq.size()));
  }
  RETURN_IF_ERROR(CopyToDevice(params_, params, stream_));
  RETURN_IF_ERROR(CopyToDevice(exp_avg_, exp_avg, stream_));
  RETURN_IF_ERROR(CopyToDevice(exp_avg_sq_, exp_avg_sq, stream_));
  RETURN_IF_ERROR(CopyToDevice(step_, std::span<const int64_t>(&step, 1), stream_));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

}  // namespace perception
