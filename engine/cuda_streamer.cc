// CUDA streaming: device-resident slot states and conviction logs, staged ticks, the step kernels of each tick.
#include "engine/cuda_streamer.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/cuda_check.h"
#include "engine/status_macros.h"

namespace perception {
namespace {

// Index of a value in one of the shape tables, or -1.
template <size_t N>
int IndexOf(const std::array<int, N>& values, int value) {
  const auto it = std::find(values.begin(), values.end(), value);
  return it == values.end() ? -1 : static_cast<int>(it - values.begin());
}

}  // namespace

CudaStreamer::CudaStreamer(const ParamLayout& layout, int slots, int64_t log_entries_per_slot)
    : layout_(layout), slots_(slots), log_entries_(log_entries_per_slot), slot_seen_(new bool[slots]()) {}

std::pair<uint32_t, uint32_t> ResidentStampsToRead(uint32_t first, uint32_t end, uint32_t posted, uint32_t slots) {
  // Event k's slot is rewritten by event k + slots, which is not posted yet where k is at most `slots` back.
  const uint32_t first_back = posted - first, end_back = posted - end;
  if (end_back >= slots) return {end, end};
  return {first_back > slots ? posted - slots : first, end};
}

std::vector<StreamLaunchShape> ClusterShapesByEstimate(int n, const PerClusterShape<kernels::StreamShapeFit>& fits,
                                                       const PerClusterShape<float>& group_us) {
  std::vector<std::pair<float, StreamLaunchShape>> estimates;
  for (size_t gi = 0; gi < kStreamGroupSizes.size(); ++gi) {
    for (size_t ci = 0; ci < kStreamClusterSizes.size(); ++ci) {
      const int max_clusters = fits[gi][ci].max_clusters;
      if (max_clusters <= 0) continue;
      const int groups = (n + kStreamGroupSizes[gi] - 1) / kStreamGroupSizes[gi];
      estimates.push_back({group_us[gi][ci] * ((groups + max_clusters - 1) / max_clusters),
                           {kStreamGroupSizes[gi], kStreamClusterSizes[ci]}});
    }
  }
  // Stable: of equal estimates, the shape listed first (fewer events a group, then smaller clusters) comes first.
  std::stable_sort(estimates.begin(), estimates.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<StreamLaunchShape> shapes;
  for (const auto& [us, shape] : estimates) shapes.push_back(shape);
  return shapes;
}

CudaStreamer::~CudaStreamer() {
  // Errors cannot be reported from a destructor; the handles are released either way.
  if (stream_) {
    StopResident().IgnoreError();
    cudaStreamSynchronize(stream_);
  }
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  auto destroy = [](std::map<int, TickGraph>& graphs) {
    for (auto& [bucket, graph] : graphs) Destroy(graph);
  };
  for (auto& per_read : graphs_) {
    for (auto& per_staging : per_read) destroy(per_staging);
  }
  destroy(inline_graphs_);
  for (Staging& s : staging_) {
    if (s.copied) cudaEventDestroy(s.copied);
    if (s.consumed) cudaEventDestroy(s.consumed);
  }
  if (published_ready_) cudaEventDestroy(published_ready_);
  if (published_copied_) cudaEventDestroy(published_copied_);
  if (resident_.left) cudaEventDestroy(resident_.left);
  if (tick_started_) cudaEventDestroy(tick_started_);
  for (const QueuedTick& tick : unfinished_ticks_) {
    if (tick.finished) cudaEventDestroy(tick.finished);
    if (tick.started) cudaEventDestroy(tick.started);
  }
  for (cudaEvent_t event : spare_tick_events_) cudaEventDestroy(event);
  for (cudaEvent_t event : spare_timing_events_) cudaEventDestroy(event);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<CudaStreamer>> CudaStreamer::Create(const ParamLayout& layout, int slots,
                                                                   int64_t log_entries_per_slot) {
  if (slots <= 0 || log_entries_per_slot <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("streaming needs slots (", slots, ") and log entries per slot (",
                                                   log_entries_per_slot, ") > 0"));
  }
  if (layout.config().n_layers > kernels::kStreamMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat("the streaming kernel supports at most ", kernels::kStreamMaxLayers,
                                                   " layers, the model has ", layout.config().n_layers));
  }
  std::unique_ptr<CudaStreamer> streamer(new CudaStreamer(layout, slots, log_entries_per_slot));
  RETURN_IF_ERROR(streamer->Initialize());
  return streamer;
}

absl::Status CudaStreamer::Initialize() {
  const ModelConfig& c = layout_.config();
  int least_priority = 0, greatest_priority = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
  // Live inference goes ahead of training work queued on other streams.
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest_priority));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&copy_stream_, cudaStreamNonBlocking, greatest_priority));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&published_ready_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&published_copied_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&resident_.left, cudaEventDisableTiming));

  const size_t S = slots_, H = c.n_horizons;
  const size_t conv = ConvFloatsPerSlot(), ssm = SsmFloatsPerSlot();
  device_.Reserve(&published_, layout_.total_size());
  const size_t pack_size = kernels::StreamPackSize(WeightsAt(published_));
  if (pack_size == 0) {
    return absl::InvalidArgumentError("the streaming kernel does not support this model's dimensions");
  }
  device_.Reserve(&pack_, pack_size);
  device_.Reserve(&state_.conv, S * conv);
  device_.Reserve(&state_.ssm, S * ssm);
  device_.Reserve(&state_.cfc, S * c.cfc_units);
  device_.Reserve(&state_.probs, S * H);
  device_.Reserve(&state_.log_convictions, S * log_entries_);
  device_.Reserve(&state_.log_probs, S * log_entries_ * H);
  device_.Reserve(&wide_.h, S * c.d_model);
  device_.Reserve(&wide_.bcdt, S * (2 * c.d_state + c.n_heads()));
  device_.Reserve(&wide_.y, S * c.d_inner());
  device_.Reserve(&wide_.slots, S);
  device_.Reserve(&wide_.dt, S);
  device_.Reserve(&wide_.log, S);
  const size_t staging_bytes = StagedLayout(slots_, slots_).bytes;
  for (Staging& s : staging_) {
    pinned_.Reserve(&s.host, staging_bytes);
    device_.Reserve(&s.device, staging_bytes);
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s.consumed, cudaEventDisableTiming));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(s.copied, copy_stream_));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(s.consumed, stream_));
  }
  pinned_.Reserve(&resident_.ring, kResidentRing);
  pinned_.Reserve(&resident_.done, 1);
  device_.Reserve(&state_.first_nonfinite, S);
  pinned_.Reserve(&state_.nonfinite_seen, 1);
  pinned_.Reserve(&seed_not_finite_, 1);
  RETURN_IF_ERROR(device_.Allocate());
  RETURN_IF_ERROR(pinned_.Allocate());
  state_.log_entries = log_entries_;
  state_.log_reciprocal = kernels::StreamLogReciprocal(log_entries_);
  weights_ = WeightsAt(published_);

  int device = 0;
  cudaDeviceProp properties{};
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, device));
  max_shared_bytes_ = properties.sharedMemPerBlockOptin;
  sm_count_ = properties.multiProcessorCount;
  l2_bytes_ = properties.l2CacheSize;
  CUDA_RETURN_IF_ERROR(kernels::PrepareStreamStep(max_shared_bytes_));
  wide_fits_ = kernels::StreamWideFits(weights_, max_shared_bytes_);
  resident_fits_ = kernels::StreamResidentFits(weights_, max_shared_bytes_);
  if (resident_fits_) RETURN_IF_ERROR(SizeResidentStamps(kResidentStamps));
  for (size_t gi = 0; gi < kStreamGroupSizes.size(); ++gi) {
    for (size_t ci = 0; ci < kStreamClusterSizes.size(); ++ci) {
      kernels::StreamShapeFit& fit = fits_[gi][ci];
      const cudaError_t error = kernels::FitStreamStep(weights_, kStreamGroupSizes[gi], kStreamClusterSizes[ci],
                                                       max_shared_bytes_, &fit);
      // Clusters above 8 blocks are optional hardware: a device without them refuses the query, which only rules
      // the shape out.
      if (error != cudaSuccess && kStreamClusterSizes[ci] > 8) {
        cudaGetLastError();
        fit = kernels::StreamShapeFit{};
        continue;
      }
      CUDA_RETURN_IF_ERROR_OF(error, "kernels::FitStreamStep");
    }
  }
  RETURN_IF_ERROR(TimeGroups());
  RETURN_IF_ERROR(TimeBuckets());
  if (!Supports(ShapeFor(1))) {
    return absl::InvalidArgumentError(absl::StrCat("the streaming step of this model does not fit the ",
                                                   properties.sharedMemPerBlockOptin,
                                                   " bytes of shared memory a block may use on this device"));
  }
  return absl::OkStatus();
}

kernels::StreamWeights CudaStreamer::WeightsAt(const float* params) const {
  const ModelConfig& c = layout_.config();
  const ParamLayout& l = layout_;
  auto at = [&](int tensor) { return params + l.tensor(tensor).offset; };
  kernels::StreamWeights w{};
  w.F = c.n_features;
  w.D = c.d_model;
  w.L = c.n_layers;
  w.E = c.d_inner();
  w.P = c.headdim;
  w.Hh = c.n_heads();
  w.N = c.d_state;
  w.W = c.d_conv;
  w.C = c.cfc_units;
  w.K = c.cfc_backbone;
  w.G = c.grn_hidden;
  w.H = c.n_horizons;
  w.norm_mean = at(l.norm_mean);
  w.norm_inv_std = at(l.norm_inv_std);
  w.embed_w = at(l.embed.weight);
  w.embed_b = at(l.embed.bias);
  for (int i = 0; i < c.n_layers; ++i) {
    const LayerTensors& t = l.layers[i];
    w.layers[i] = {at(t.norm), at(t.in_proj), at(t.conv_weight), at(t.conv_bias), at(t.dt_bias),
                   at(t.a_log), at(t.d),    at(t.mixer_norm),  at(t.out_proj)};
  }
  w.norm_f = at(l.norm_f);
  w.backbone_w = at(l.cfc_backbone.weight);
  w.backbone_b = at(l.cfc_backbone.bias);
  w.ff1_w = at(l.cfc_ff1.weight);
  w.ff1_b = at(l.cfc_ff1.bias);
  w.ff2_w = at(l.cfc_ff2.weight);
  w.ff2_b = at(l.cfc_ff2.bias);
  w.time_a_w = at(l.cfc_time_a.weight);
  w.time_a_b = at(l.cfc_time_a.bias);
  w.time_b_w = at(l.cfc_time_b.weight);
  w.time_b_b = at(l.cfc_time_b.bias);
  w.fc2_w = at(l.grn_fc2.weight);
  w.fc2_b = at(l.grn_fc2.bias);
  w.fc1_w = at(l.grn_fc1.weight);
  w.fc1_b = at(l.grn_fc1.bias);
  w.gate_w = at(l.grn_gate.weight);
  w.gate_b = at(l.grn_gate.bias);
  w.value_w = at(l.grn_value.weight);
  w.value_b = at(l.grn_value.bias);
  w.skip_w = at(l.grn_skip);
  w.ln_w = at(l.grn_norm.weight);
  w.ln_b = at(l.grn_norm.bias);
  w.out_w = at(l.head_out.weight);
  w.out_b = at(l.head_out.bias);
  return w;
}

absl::Status CudaStreamer::Publish(const float* device_params, cudaStream_t source) {
  RETURN_IF_ERROR(StopResident());  // a running cluster holds the weights it loaded at its launch
  CUDA_RETURN_IF_ERROR(cudaEventRecord(published_ready_, source));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, published_ready_, 0));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(published_, device_params, layout_.total_size() * sizeof(float),
                                       cudaMemcpyDeviceToDevice, stream_));
  // The copy waits behind every tick already queued on this stream; the source's next optimizer step must not
  // overwrite the parameters before it has read them, or the published set would mix two steps.
  CUDA_RETURN_IF_ERROR(cudaEventRecord(published_copied_, stream_));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(source, published_copied_, 0));
  return Pack();
}

absl::Status CudaStreamer::Pack() {
  if (std::exchange(fail_next_pack_, false)) return absl::InternalError("building the stream pack failed (a test's)");
  CUDA_RETURN_IF_ERROR(kernels::PackStreamWeights(weights_, pack_, stream_));
  return absl::OkStatus();
}

absl::Status CudaStreamer::PublishFromHost(std::span<const float> params) {
  if (params.size() != layout_.total_size()) {
    return absl::InvalidArgumentError(absl::StrCat("PublishFromHost: ", params.size(), " floats for a layout of ",
                                                   layout_.total_size()));
  }
  RETURN_IF_ERROR(StopResident());
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(published_, params.data(), params.size_bytes(), cudaMemcpyHostToDevice, stream_));
  RETURN_IF_ERROR(Pack());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaStreamer::CheckSlot(int slot) const {
  if (slot >= 0 && slot < slots_) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat("slot ", slot, " is outside [0, ", slots_, ")"));
}

absl::Status CudaStreamer::CheckTick(const StreamTick& tick) {
  const size_t n = tick.size();
  if (n > static_cast<size_t>(slots_) || tick.x.size() != n * layout_.config().n_features || tick.slots.size() != n ||
      tick.log_indices.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("forward_step_into: x, dt, slots and log_indices disagree on the "
                                                   "event count, or the tick has more than ", slots_, " events"));
  }
  for (size_t i = 0; i < n; ++i) {
    RETURN_IF_ERROR(CheckSlot(tick.slots[i]));
    if (tick.log_indices[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("forward_step_into: log entry number ", tick.log_indices[i],
                                                     " is negative"));
    }
  }
  absl::Status status = absl::OkStatus();
  for (size_t i = 0; i < n && status.ok(); ++i) {
    if (slot_seen_[tick.slots[i]]) {
      status = absl::InvalidArgumentError(absl::StrCat("forward_step_into: slot ", tick.slots[i], " twice in one tick"));
    }
    slot_seen_[tick.slots[i]] = true;
  }
  for (int32_t slot : tick.slots) slot_seen_[slot] = false;
  return status;
}

void CudaStreamer::Destroy(TickGraph& graph) {
  // (Null handles, from a failed capture, would leave an error for the next launch's check to find.)
  if (graph.exec) cudaGraphExecDestroy(graph.exec);
  if (graph.graph) cudaGraphDestroy(graph.graph);
  graph = TickGraph{};
}

kernels::StreamShapeFit CudaStreamer::Fit(StreamLaunchShape shape) const {
  const int g = IndexOf(kStreamGroupSizes, shape.events_per_group),
            c = IndexOf(kStreamClusterSizes, shape.cluster_size);
  return g < 0 || c < 0 ? kernels::StreamShapeFit{} : fits_[g][c];
}

bool CudaStreamer::OneWaveHoldsWeights(int n) const {
  return std::any_of(kStreamGroupSizes.begin(), kStreamGroupSizes.end(), [&](int group) {
    const kernels::StreamShapeFit fit = Fit({group, 1});
    return fit.weights_resident && (n + group - 1) / group <= fit.max_clusters;
  });
}

absl::Status CudaStreamer::TimeGroups() {
  kernels::StreamTickInput input{};
  input.logged = false;
  std::fill(std::begin(input.inline_dt), std::end(input.inline_dt), 1.f);
  for (int i = 0; i < kernels::kStreamInlineEvents; ++i) input.inline_slots[i] = i % slots_;
  std::vector<std::pair<size_t, size_t>> timed;
  std::vector<std::function<absl::Status()>> ticks;
  for (size_t gi = 0; gi < kStreamGroupSizes.size(); ++gi) {
    for (size_t ci = 0; ci < kStreamClusterSizes.size(); ++ci) {
      const StreamLaunchShape shape{kStreamGroupSizes[gi], kStreamClusterSizes[ci]};
      if (!Supports(shape)) continue;
      timed.push_back({gi, ci});
      ticks.push_back([this, input, shape]() mutable {
        input.n = shape.events_per_group;
        return EnqueueTick(input, shape);
      });
    }
  }
  ASSIGN_OR_RETURN(const std::vector<float> us, MedianDeviceUs(ticks));
  for (size_t i = 0; i < timed.size(); ++i) group_us_[timed[i].first][timed[i].second] = us[i];
  const int touched = std::min<int>(slots_, kernels::kStreamInlineEvents);
  for (int slot = 0; slot < touched; ++slot) RETURN_IF_ERROR(ResetSlot(slot));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> CudaStreamer::MedianDeviceUs(std::span<const std::function<absl::Status()>> runs) {
  constexpr int kWarmups = 2, kTimed = 7;
  std::vector<cudaEvent_t> events(2 * kTimed * runs.size(), nullptr);
  auto event_at = [&](int round, size_t run) { return &events[2 * (round * runs.size() + run)]; };
  absl::StatusOr<std::vector<float>> us = [&]() -> absl::StatusOr<std::vector<float>> {
    for (int round = 0; round < kWarmups; ++round) {
      for (const auto& run : runs) RETURN_IF_ERROR(run());
    }
    for (cudaEvent_t& event : events) CUDA_RETURN_IF_ERROR(cudaEventCreate(&event));
    // The host queues every timed run while a callback holds the stream, so that each one's events enclose its
    // device work alone, back to back with the others (as bench_stream times ticks), not a launch into an idle device.
    CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(
        stream_, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(3)); }, nullptr));
    for (int round = 0; round < kTimed; ++round) {
      for (size_t r = 0; r < runs.size(); ++r) {
        CUDA_RETURN_IF_ERROR(cudaEventRecord(event_at(round, r)[0], stream_));
        RETURN_IF_ERROR(runs[r]());
        CUDA_RETURN_IF_ERROR(cudaEventRecord(event_at(round, r)[1], stream_));
      }
    }
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    std::vector<float> medians;
    for (size_t r = 0; r < runs.size(); ++r) {
      std::array<float, kTimed> ms{};
      for (int round = 0; round < kTimed; ++round) {
        CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms[round], event_at(round, r)[0], event_at(round, r)[1]));
      }
      std::nth_element(ms.begin(), ms.begin() + kTimed / 2, ms.end());
      medians.push_back(1000.f * ms[kTimed / 2]);
    }
    return medians;
  }();
  for (cudaEvent_t event : events) {
    if (event) cudaEventDestroy(event);
  }
  return us;
}

absl::Status CudaStreamer::TimeBuckets() {
  Staging& s = staging_[0];
  const size_t F = layout_.config().n_features;
  int touched = 0;
  for (int n = 1, bucket = 0; bucket < slots_; n *= 2) {
    bucket = BucketFor(n);
    if (bucket >= kStreamWideFrom && !(wide_fits_ && OneWaveHoldsWeights(bucket))) break;
    const bool staged = !Inline(bucket);
    std::vector<StreamLaunchShape> candidates = ClusterShapesByEstimate(bucket, fits_, group_us_);
    if (candidates.size() > kStreamTimedClusterShapes) candidates.resize(kStreamTimedClusterShapes);
    if (staged && wide_fits_) candidates.push_back(kStreamWideShape);
    if (candidates.empty()) continue;
    if (candidates.size() == 1) {  // nothing to choose between: kept without timing, so ShapeFor need not estimate
      bucket_shapes_[bucket] = candidates.front();
      continue;
    }
    // A tick of the bucket's own size on slots 0..bucket−1, with every feature 0.5 and 1 s between events.
    const std::vector<float> x(bucket * F, 0.5f), dt(bucket, 1.f);
    std::vector<int32_t> slots(bucket);
    std::iota(slots.begin(), slots.end(), 0);
    const StreamTick tick{x, dt, slots, {}};
    kernels::StreamTickInput input{};
    if (staged) {
      // Timed back to back, as ticks that queue up run: read from the device.
      RETURN_IF_ERROR(StageTick(s, tick, bucket, StagedRead::kDevice));
      input = StagedInput(s, bucket, /*log=*/false, StagedRead::kDevice);
    } else {
      input = InlineInput(tick, bucket, /*log=*/false);
    }
    std::vector<TickGraph> graphs(candidates.size());
    const absl::StatusOr<std::vector<float>> us = [&]() -> absl::StatusOr<std::vector<float>> {
      std::vector<std::function<absl::Status()>> launches;
      for (size_t c = 0; c < candidates.size(); ++c) {
        RETURN_IF_ERROR(Capture(input, candidates[c], graphs[c]));
        launches.push_back([this, exec = graphs[c].exec]() -> absl::Status {
          CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream_));
          return absl::OkStatus();
        });
      }
      return MedianDeviceUs(launches);
    }();
    for (TickGraph& graph : graphs) Destroy(graph);
    if (staged) RETURN_IF_ERROR(ReleaseStaging(s, StagedRead::kDevice));
    RETURN_IF_ERROR(us.status());
    const size_t fastest = std::min_element(us->begin(), us->end()) - us->begin();
    bucket_shapes_[bucket] = candidates[fastest];
    for (size_t c = 0; c < candidates.size(); ++c) start_timings_.push_back({bucket, candidates[c], (*us)[c]});
    touched = std::max(touched, bucket);
  }
  for (int slot = 0; slot < touched; ++slot) RETURN_IF_ERROR(ResetSlot(slot));
  return absl::OkStatus();
}

StreamLaunchShape CudaStreamer::ShapeFor(int n) const {
  if (n >= kStreamWideFrom && wide_fits_ && !OneWaveHoldsWeights(n)) return kStreamWideShape;
  // Otherwise the shape that ran the bucket's whole tick fastest when the streamer started (TimeBuckets). The
  // estimate alone picked slow shapes where two were close (large's 32 events: 409 µs against 324, tiny's 16: 23.7
  // against 19.5, s16) and could not weigh the wide path: measured, large's 64 and 128 events take it (618 -> 453 µs,
  // 867 -> 533, H200, s17a). Where shapes run within a few µs of each other the start's
  // timing can pick either (small's 16 events, single events in clusters of 8 or of 4: 31.4 against 30.1–30.9 µs
  // with 2,048 slots, s17f).
  const auto measured = bucket_shapes_.find(BucketFor(n));
  if (measured != bucket_shapes_.end()) return measured->second;
  const std::vector<StreamLaunchShape> shapes = ClusterShapesByEstimate(n, fits_, group_us_);
  return shapes.empty() ? StreamLaunchShape{1, kStreamClusterSizes.back()} : shapes.front();
}

int CudaStreamer::BucketFor(int n) const {
  int bucket = 1;
  while (bucket < n) bucket *= 2;
  return std::min(bucket, slots_);
}

CudaStreamer::Staging& CudaStreamer::NextStaging(int* index) {
  *index = next_staging_;
  next_staging_ = 1 - next_staging_;
  return staging_[*index];
}

CudaStreamer::StagedAt CudaStreamer::StagedLayout(int padded, int n) const {
  const size_t P = padded, x = P * (sizeof(int64_t) + sizeof(float) + sizeof(int32_t));
  return {.log = 0,
          .dt = P * sizeof(int64_t),
          .slots = P * (sizeof(int64_t) + sizeof(float)),
          .x = x,
          .bytes = x + static_cast<size_t>(n) * layout_.config().n_features * sizeof(float)};
}

absl::StatusOr<CudaStreamer::StagedRead> CudaStreamer::StagedReadFor(const Staging& s) const {
  if (forced_read_) return *forced_read_;
  const cudaError_t state = cudaEventQuery(s.consumed);
  if (state == cudaErrorNotReady) return StagedRead::kDevice;
  CUDA_RETURN_IF_ERROR_OF(state, "cudaEventQuery(s.consumed)");
  return StagedRead::kPinned;
}

absl::Status CudaStreamer::StageTick(Staging& s, const StreamTick& tick, int padded, StagedRead read) {
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(s.copied));
  const size_t n = tick.size();
  const StagedAt at = StagedLayout(padded, static_cast<int>(n));
  auto* log = reinterpret_cast<int64_t*>(s.host + at.log);
  auto* dt = reinterpret_cast<float*>(s.host + at.dt);
  auto* slots = reinterpret_cast<int32_t*>(s.host + at.slots);
  std::memcpy(s.host + at.x, tick.x.data(), tick.x.size_bytes());
  std::memcpy(dt, tick.dt.data(), tick.dt.size_bytes());
  std::memcpy(slots, tick.slots.data(), tick.slots.size_bytes());
  if (!tick.log_indices.empty()) std::memcpy(log, tick.log_indices.data(), tick.log_indices.size_bytes());
  std::fill(dt + n, dt + padded, 0.f);
  std::fill(slots + n, slots + padded, -1);  // padding: the kernel skips negative slots
  std::fill(log + tick.log_indices.size(), log + padded, 0);  // (none given: all 0)
  if (read == StagedRead::kPinned) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_stream_, s.consumed, 0));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.device, s.host, at.bytes, cudaMemcpyHostToDevice, copy_stream_));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(s.copied, copy_stream_));
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, s.copied, 0));
  return absl::OkStatus();
}

absl::Status CudaStreamer::ReleaseStaging(Staging& s, StagedRead read) {
  if (read == StagedRead::kPinned) CUDA_RETURN_IF_ERROR(cudaEventRecord(s.copied, stream_));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(s.consumed, stream_));
  return absl::OkStatus();
}

bool CudaStreamer::Inline(int n) const {
  return n <= kernels::kStreamInlineEvents && n * layout_.config().n_features <= kernels::kStreamInlineFloats;
}

kernels::StreamTickInput CudaStreamer::InlineInput(const StreamTick& tick, int padded, bool log) const {
  kernels::StreamTickInput input{};
  input.n = padded;
  input.logged = log;
  const size_t n = tick.size();
  std::copy(tick.x.begin(), tick.x.end(), input.inline_x);
  std::copy(tick.dt.begin(), tick.dt.end(), input.inline_dt);
  std::copy(tick.slots.begin(), tick.slots.end(), input.inline_slots);
  std::fill(input.inline_slots + n, input.inline_slots + padded, -1);  // padding: the kernel skips negative slots
  if (log) std::copy(tick.log_indices.begin(), tick.log_indices.end(), input.inline_log);
  return input;
}

kernels::StreamTickInput CudaStreamer::StagedInput(const Staging& s, int padded, bool log, StagedRead read) const {
  const StagedAt at = StagedLayout(padded, padded);
  // Pinned memory is mapped: the kernels read it at its host address.
  const std::byte* base = read == StagedRead::kDevice ? s.device : s.host;
  kernels::StreamTickInput input{};
  input.n = padded;
  input.logged = log;
  input.x = reinterpret_cast<const float*>(base + at.x);
  input.dt = reinterpret_cast<const float*>(base + at.dt);
  input.slots = reinterpret_cast<const int32_t*>(base + at.slots);
  input.log_indices = reinterpret_cast<const int64_t*>(base + at.log);
  return input;
}

absl::Status CudaStreamer::EnqueueTick(const kernels::StreamTickInput& input, StreamLaunchShape shape) {
  if (shape.wide) {
    CUDA_RETURN_IF_ERROR(
        kernels::LaunchStreamWide(weights_, pack_, state_, wide_, input, max_shared_bytes_, sm_count_, l2_bytes_,
                                  stream_));
    return absl::OkStatus();
  }
  CUDA_RETURN_IF_ERROR(kernels::LaunchStreamStep(weights_, pack_, state_, input, shape.events_per_group,
                                                 shape.cluster_size, Fit(shape).max_clusters, max_shared_bytes_,
                                                 stream_));
  return absl::OkStatus();
}

absl::Status CudaStreamer::Step(const StreamTick& tick) {
  absl::Status status = StepQueued(tick);
  if (status.ok()) status = NoteTickQueued();
  tick_timing_due_ = false;
  if (tick_started_) TickEventPool(/*timing=*/true).push_back(std::exchange(tick_started_, nullptr));  // (failed tick)
  return status;
}

absl::StatusOr<cudaEvent_t> CudaStreamer::SpareTickEvent(bool timing) {
  std::vector<cudaEvent_t>& spare = TickEventPool(timing);
  cudaEvent_t event = nullptr;
  if (spare.empty()) {
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
  } else {
    event = spare.back();
    spare.pop_back();
  }
  return event;
}

absl::Status CudaStreamer::RecordTickStartIfDue() {
  if (!std::exchange(tick_timing_due_, false)) return absl::OkStatus();
  ASSIGN_OR_RETURN(tick_started_, SpareTickEvent(/*timing=*/true));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(tick_started_, stream_));
  return absl::OkStatus();
}

absl::Status CudaStreamer::NoteTickQueued() {
  // (A caller that never asks, a benchmark, still reuses the events of the ticks that finished.)
  if (unfinished_ticks_.size() >= kTicksRemembered) RETURN_IF_ERROR(ForgetFinishedTicks(/*all_finished=*/false));
  // A running resident step took this tick (every other path stops it), or it was empty and finishes with the
  // events posted before it.
  if (resident_.running) {
    unfinished_ticks_.push_back({resident_.posted, nullptr});
    return absl::OkStatus();
  }
  const bool timed = tick_started_ != nullptr;
  ASSIGN_OR_RETURN(cudaEvent_t finished, SpareTickEvent(timed));
  if (const cudaError_t recorded = cudaEventRecord(finished, stream_); recorded != cudaSuccess) {
    TickEventPool(timed).push_back(finished);
    CUDA_RETURN_IF_ERROR_OF(recorded, "cudaEventRecord(finished, stream_)");
  }
  unfinished_ticks_.push_back({std::nullopt, finished, std::exchange(tick_started_, nullptr)});
  return absl::OkStatus();
}

absl::Status CudaStreamer::ForgetFinishedTicks(bool all_finished) {
  while (!unfinished_ticks_.empty()) {
    QueuedTick& tick = unfinished_ticks_.front();
    if (!all_finished) {
      if (tick.answered.has_value()) {
        const uint32_t done = std::atomic_ref<uint32_t>(*resident_.done).load(std::memory_order_acquire);
        if (static_cast<int32_t>(*tick.answered - done) > 0) break;  // (modulo 2³², as WaitResidentAnswered)
      } else {
        const cudaError_t state = cudaEventQuery(tick.finished);
        if (state == cudaErrorNotReady) break;
        CUDA_RETURN_IF_ERROR_OF(state, "cudaEventQuery(a streaming tick's end)");
      }
    }
    if (tick.started) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, tick.started, tick.finished) == cudaSuccess) {
        if (tick_seconds_.size() < kTickTimesKept) tick_seconds_.push_back(ms * 1e-3);
      } else {
        // The tick's end was seen: a time that cannot be read loses only the sample (a lost device shows in every
        // other call), and its error must not stay behind for the next launch's check.
        cudaGetLastError();
      }
      TickEventPool(/*timing=*/true).push_back(tick.started);
    }
    if (tick.finished) TickEventPool(/*timing=*/tick.started != nullptr).push_back(tick.finished);
    unfinished_ticks_.pop_front();
  }
  return absl::OkStatus();
}

absl::Status CudaStreamer::StepQueued(const StreamTick& tick) {
  RETURN_IF_ERROR(CheckTick(tick));
  const int n = static_cast<int>(tick.size());
  if (n == 0) return absl::OkStatus();
  if (n == 1 && use_graphs_ && use_resident_ && resident_fits_) return PostResident(tick);
  RETURN_IF_ERROR(StopResident());
  tick_timing_due_ = time_ticks_every_ > 0 && launched_since_set_++ % time_ticks_every_ == 0;
  if (!use_graphs_) return StepEagerly(tick, ShapeFor(n));
  const int bucket = BucketFor(n);
  if (Inline(bucket)) {
    const kernels::StreamTickInput input = InlineInput(tick, bucket, /*log=*/true);
    TickGraph& graph = inline_graphs_[bucket];
    if (!graph.exec) RETURN_IF_ERROR(Capture(input, ShapeFor(bucket), graph));
    if (graph.pack != pack_ || graph.conv_state != state_.conv) {
      return absl::InternalError(absl::StrCat("the graph for ticks of ", bucket, " events was captured over other buffers"));
    }
    CUDA_RETURN_IF_ERROR(kernels::SetStreamStepTick(graph.exec, graph.node, input));
    RETURN_IF_ERROR(RecordTickStartIfDue());
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(graph.exec, stream_));
    return absl::OkStatus();
  }
  int index = 0;
  Staging& s = NextStaging(&index);
  ASSIGN_OR_RETURN(const StagedRead read, StagedReadFor(s));
  RETURN_IF_ERROR(StageTick(s, tick, bucket, read));
  const kernels::StreamTickInput input = StagedInput(s, bucket, /*log=*/true, read);
  TickGraph& graph = graphs_[static_cast<int>(read)][index][bucket];
  if (!graph.exec) RETURN_IF_ERROR(Capture(input, ShapeFor(bucket), graph));
  // Pointer stability: a replay must run over exactly the buffers it was captured with.
  if (graph.staging_x != input.x || graph.pack != pack_ || graph.conv_state != state_.conv) {
    return absl::InternalError(absl::StrCat("the graph for ticks of ", bucket, " events was captured over other buffers"));
  }
  RETURN_IF_ERROR(RecordTickStartIfDue());
  CUDA_RETURN_IF_ERROR(cudaGraphLaunch(graph.exec, stream_));
  return ReleaseStaging(s, read);
}

absl::Status CudaStreamer::Step(const StreamTick& tick, StreamLaunchShape shape) {
  RETURN_IF_ERROR(CheckTick(tick));
  if (tick.size() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(StopResident());
  return StepEagerly(tick, shape);
}

absl::Status CudaStreamer::PostResident(const StreamTick& tick) {
  if (resident_.running && resident_.posted - resident_.launch_first >= resident_launch_events_) {
    RETURN_IF_ERROR(StopResident());
  }
  if (!resident_.running) {
    // The cluster never leaves by itself (one that did could not tell the host which posted event it had not read):
    // the host stops it, also when the feed has gone quiet (StopResident).
    RETURN_IF_ERROR(ReadStoppedRuns());  // (early, before this run's events come round the ring)
    const kernels::StreamResidentQueue queue{
        resident_.ring,
        kResidentRing,
        resident_.done,
        std::numeric_limits<uint64_t>::max(),
        resident_.posted,
        time_ticks_every_ > 0 ? static_cast<kernels::StreamResidentStamp*>(resident_.stamp_memory.get()) : nullptr,
        resident_.stamp_slots};
    CUDA_RETURN_IF_ERROR(kernels::LaunchStreamResident(weights_, pack_, state_, queue, max_shared_bytes_, stream_));
    resident_.run_first = resident_.launch_first = resident_.posted;
    ++resident_.launches;
    resident_.run_stamped = queue.stamps != nullptr;
    resident_.running = true;
    resident_.since_yield = true;
  }
  RETURN_IF_ERROR(WaitForRingEntry());
  kernels::PostStreamResidentEvent(resident_.ring, kResidentRing, resident_.posted++, tick.slots[0], tick.dt[0],
                                   /*logged=*/true, tick.log_indices[0], tick.x.data(), layout_.config().n_features);
  return absl::OkStatus();
}

absl::Status CudaStreamer::StopResident() {
  if (!resident_.running) return absl::OkStatus();
  RETURN_IF_ERROR(WaitForRingEntry());
  kernels::PostStreamResidentEvent(resident_.ring, kResidentRing, resident_.posted++, -1, 0.f, false, 0, nullptr, 0);
  resident_.running = false;
  if (resident_.run_stamped) {
    const uint32_t stop = resident_.posted - 1;
    if (resident_.unread_runs.has_value()) {
      resident_.unread_runs->second = stop;
    } else {
      resident_.unread_runs.emplace(resident_.run_first, stop);
    }
  }
  CUDA_RETURN_IF_ERROR(cudaEventRecord(resident_.left, stream_));
  return absl::OkStatus();
}

absl::Status CudaStreamer::ReadStoppedRuns() {
  if (!resident_.unread_runs.has_value()) return absl::OkStatus();
  const cudaError_t state = cudaEventQuery(resident_.left);
  if (state == cudaErrorNotReady) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR_OF(state, "cudaEventQuery(the resident step's exit)");
  // The runs have left: their stamps in the ring are whole, up to those a later run may have rewritten.
  const auto [first, end] = *std::exchange(resident_.unread_runs, std::nullopt);
  KeepResidentTimes(first, end, /*running=*/false);
  return absl::OkStatus();
}

void CudaStreamer::ReadRunningStamps() {
  // (Stopped runs not read yet go first: the next stop extends their range over this run's events.)
  if (!resident_.running || !resident_.run_stamped || resident_.unread_runs.has_value()) return;
  const uint32_t answered = std::atomic_ref<uint32_t>(*resident_.done).load(std::memory_order_acquire);
  // The last answered event's done stamp is stored behind its answer; an earlier event's, by the same thread ahead of
  // a later answer, so at least an event's time (~9 µs) before it. Nothing orders those stores at system scope (a
  // fence there would cost every event): a stamp not yet whole as the host sees it (the slot's earlier event number,
  // its done time unset) is read again at the next check, or once the run has left. (A stamp seen part new, part old
  // in another way would pass unnoticed; the margin makes that unlikely, not impossible.)
  const uint32_t end = answered - 1;
  if (static_cast<int32_t>(end - resident_.run_first) <= 0) return;
  resident_.run_first = KeepResidentTimes(resident_.run_first, end, /*running=*/true);
}

uint32_t CudaStreamer::KeepResidentTimes(uint32_t first, uint32_t end, bool running) {
  const auto [from, to] = ResidentStampsToRead(first, end, resident_.posted, resident_.stamp_slots);
  const auto* stamps = static_cast<const kernels::StreamResidentStamp*>(resident_.stamp_memory.get());
  for (uint32_t k = from; k != to; ++k) {
    if (resident_seconds_.size() >= kTickTimesKept) return k;
    const kernels::StreamResidentStamp& s = stamps[k & (resident_.stamp_slots - 1)];
    if (static_cast<uint32_t>(s.event) == k && s.done_cycles != 0 && s.done_ns >= s.seen_ns) {
      resident_seconds_.push_back(static_cast<double>(s.done_ns - s.seen_ns) * 1e-9);
    } else if (running) {
      return k;
    }
  }
  return to;
}

absl::Status CudaStreamer::FaultResident() {
  if (!resident_.running) return absl::FailedPreconditionError("no resident streaming step is running");
  RETURN_IF_ERROR(WaitForRingEntry());
  kernels::PostStreamResidentEvent(resident_.ring, kResidentRing, resident_.posted++, kernels::kStreamResidentTrapSlot,
                                   0.f, false, 0, nullptr, 0);
  resident_.running = false;
  // The trap entry is never answered: the wait ends on the stream's error.
  RETURN_IF_ERROR(WaitResidentAnswered(resident_.posted));
  return absl::InternalError("the resident streaming step answered its trap entry");
}

absl::Status CudaStreamer::NumberResidentEventsFromForTest(uint32_t first) {
  RETURN_IF_ERROR(Quiesce());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  RETURN_IF_ERROR(ForgetFinishedTicks(/*all_finished=*/true));
  // The ring's entries as events first − kResidentRing … first − 1 left them (stops), so that none reads as an event
  // still to come; the answers up to them.
  for (uint32_t k = first - kResidentRing; k != first; ++k) {
    kernels::PostStreamResidentEvent(resident_.ring, kResidentRing, k, -1, 0.f, false, 0, nullptr, 0);
  }
  std::atomic_ref<uint32_t>(*resident_.done).store(first, std::memory_order_release);
  resident_.posted = first;
  // No stamp left over may carry one of the new numbers (a stop takes a number and stamps nothing).
  if (resident_.stamp_slots > 0) {
    auto* stamps = static_cast<kernels::StreamResidentStamp*>(resident_.stamp_memory.get());
    std::fill(stamps, stamps + resident_.stamp_slots, kernels::StreamResidentStamp{});
  }
  return absl::OkStatus();
}

absl::Status CudaStreamer::SizeResidentStamps(uint32_t slots) {
  if (!std::has_single_bit(slots)) {
    return absl::InvalidArgumentError(absl::StrCat("resident stamps: ", slots, " slots is not a power of two"));
  }
  RETURN_IF_ERROR(Quiesce());
  resident_.stamp_slots = 0;
  resident_.stamp_memory = CudaAllocation();
  ASSIGN_OR_RETURN(resident_.stamp_memory,
                   AllocateCuda(MemoryKind::kPinnedHost, slots * sizeof(kernels::StreamResidentStamp)));
  resident_.stamp_slots = slots;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<kernels::StreamResidentStamp>> CudaStreamer::TakeResidentStamps() {
  if (time_ticks_every_ == 0 || resident_.stamp_slots == 0) {
    return absl::FailedPreconditionError("the resident step stamps no events (set_time_ticks(0), or none fits)");
  }
  RETURN_IF_ERROR(Quiesce());
  auto* ring = static_cast<kernels::StreamResidentStamp*>(resident_.stamp_memory.get());
  std::vector<kernels::StreamResidentStamp> stamps(ring, ring + resident_.stamp_slots);
  std::fill(ring, ring + resident_.stamp_slots, kernels::StreamResidentStamp{});
  // Events are numbered modulo 2³² up to the stop just posted: an answered event's distance back from it orders the
  // stamps, and one farther back than the ring is a slot's leftover that no later event overwrote (a stop's slot).
  auto back = [&](const kernels::StreamResidentStamp& s) { return resident_.posted - static_cast<uint32_t>(s.event); };
  std::erase_if(stamps, [&](const kernels::StreamResidentStamp& s) {
    return s.done_cycles == 0 || back(s) > resident_.stamp_slots;
  });
  std::ranges::sort(stamps, std::greater<>(), back);
  return stamps;
}

absl::Status CudaStreamer::YieldTo(cudaStream_t other) {
  RETURN_IF_ERROR(StopResident());
  if (!resident_.since_yield) return absl::OkStatus();
  resident_.since_yield = false;
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(other, resident_.left, 0));
  return absl::OkStatus();
}

absl::Status CudaStreamer::Quiesce() {
  RETURN_IF_ERROR(StopResident());
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(resident_.left));  // (a never-recorded event: at once)
  return ReadStoppedRuns();
}

absl::Status CudaStreamer::WaitResidentAnswered(uint32_t count) {
  const std::atomic_ref<uint32_t> done(*resident_.done);
  // Counts are modulo 2³²: `count` is answered once done has reached it (count − done, a signed distance, ≤ 0).
  for (uint32_t spins = 1; static_cast<int32_t>(count - done.load(std::memory_order_acquire)) > 0; ++spins) {
    if (spins % 4096 != 0) continue;
    // The cluster cannot answer once it has failed, and leaves only at a stop: either way the wait is over.
    const cudaError_t state = cudaStreamQuery(stream_);
    if (state == cudaErrorNotReady) continue;
    CUDA_RETURN_IF_ERROR_OF(state, "cudaStreamQuery(the resident step's stream)");
    if (static_cast<int32_t>(count - done.load(std::memory_order_acquire)) > 0) {
      return absl::InternalError(absl::StrCat("the resident streaming step left with event ", count - 1,
                                              " unanswered (", done.load(), " answered)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaStreamer::WaitForRingEntry() {
  // The next event's entry last held the event kResidentRing before it, which must have been read.
  return WaitResidentAnswered(resident_.posted + 1 - kResidentRing);
}

absl::Status CudaStreamer::StepEagerly(const StreamTick& tick, StreamLaunchShape shape) {
  if (!Supports(shape)) {
    return absl::InvalidArgumentError(absl::StrCat("launch shape ", shape.events_per_group, " events per group, ",
                                                   shape.cluster_size, " blocks per cluster is not supported"));
  }
  const int n = static_cast<int>(tick.size());
  if (Inline(n)) {
    RETURN_IF_ERROR(RecordTickStartIfDue());
    return EnqueueTick(InlineInput(tick, n, /*log=*/true), shape);
  }
  return EnqueueStagedTick(tick, /*log=*/true, shape);
}

absl::Status CudaStreamer::EnqueueStagedTick(const StreamTick& tick, bool log, StreamLaunchShape shape) {
  const int n = static_cast<int>(tick.size());
  int index = 0;
  Staging& s = NextStaging(&index);
  ASSIGN_OR_RETURN(const StagedRead read, StagedReadFor(s));
  RETURN_IF_ERROR(StageTick(s, tick, n, read));
  RETURN_IF_ERROR(RecordTickStartIfDue());  // (Step's eager ticks; a seed's never)
  RETURN_IF_ERROR(EnqueueTick(StagedInput(s, n, log, read), shape));
  return ReleaseStaging(s, read);
}

absl::Status CudaStreamer::Capture(const kernels::StreamTickInput& input, StreamLaunchShape shape,
                                   TickGraph& graph) {
  const absl::Status captured = CaptureInto(input, shape, graph);
  if (!captured.ok()) Destroy(graph);  // not left for the next attempt to overwrite
  return captured;
}

absl::Status CudaStreamer::CaptureInto(const kernels::StreamTickInput& input, StreamLaunchShape shape,
                                       TickGraph& graph) {
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  const absl::Status enqueued = EnqueueTick(input, shape);
  const cudaError_t ended = cudaStreamEndCapture(stream_, &graph.graph);
  RETURN_IF_ERROR(enqueued);
  CUDA_RETURN_IF_ERROR_OF(ended, "cudaStreamEndCapture(stream_, &graph.graph)");
  // An inline tick's graph is the one kernel whose tick each replay replaces (ShapeFor never gives such ticks the
  // wide path).
  if (!input.x) {
    size_t nodes = 1;
    CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph.graph, &graph.node, &nodes));
    if (nodes != 1) return absl::InternalError(absl::StrCat("a tick graph has ", nodes, " nodes, expected one kernel"));
  }
  CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&graph.exec, graph.graph, 0));
  graph.staging_x = input.x;
  graph.pack = pack_;
  graph.conv_state = state_.conv;
  return absl::OkStatus();
}

size_t CudaStreamer::ConvFloatsPerSlot() const {
  return static_cast<size_t>(layout_.config().n_layers) * layout_.config().conv_state_size();
}

size_t CudaStreamer::SsmFloatsPerSlot() const {
  return static_cast<size_t>(layout_.config().n_layers) * layout_.config().ssm_state_size();
}

absl::Status CudaStreamer::ResetSlot(int slot) {
  RETURN_IF_ERROR(CheckSlot(slot));
  RETURN_IF_ERROR(StopResident());
  const ModelConfig& c = layout_.config();
  const size_t conv = ConvFloatsPerSlot(), ssm = SsmFloatsPerSlot();
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(state_.conv + slot * conv, 0, conv * sizeof(float), stream_));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(state_.ssm + slot * ssm, 0, ssm * sizeof(float), stream_));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(state_.cfc + slot * c.cfc_units, 0, c.cfc_units * sizeof(float), stream_));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(state_.first_nonfinite + slot, 0, sizeof(int64_t), stream_));
  return absl::OkStatus();
}

absl::Status CudaStreamer::AdvanceSlot(int slot, std::span<const float> x, std::span<const float> dt) {
  const size_t F = layout_.config().n_features;
  RETURN_IF_ERROR(CheckSlot(slot));
  if (dt.empty() || x.size() != dt.size() * F) {
    return absl::InvalidArgumentError(absl::StrCat("AdvanceSlot: ", dt.size(), " events need x of ", dt.size() * F,
                                                   " floats, got ", x.size()));
  }
  RETURN_IF_ERROR(StopResident());  // the events below are launched ticks
  const int32_t slots[1] = {slot};
  for (size_t i = 0; i < dt.size(); ++i) {
    const StreamTick event{x.subspan(i * F, F), dt.subspan(i, 1), slots, {}};
    // Not logged: the states advance and nothing is logged, so the slot's earlier convictions stay intact.
    if (Inline(1)) {
      RETURN_IF_ERROR(EnqueueTick(InlineInput(event, 1, /*log=*/false), ShapeFor(1)));
      continue;
    }
    RETURN_IF_ERROR(EnqueueStagedTick(event, /*log=*/false, ShapeFor(1)));
  }
  std::atomic_ref<int>(*seed_not_finite_).store(0, std::memory_order_relaxed);
  CUDA_RETURN_IF_ERROR(kernels::CheckStreamSlotFinite(state_, slot, ConvFloatsPerSlot(), SsmFloatsPerSlot(),
                                                      layout_.config().cfc_units, seed_not_finite_, stream_));
  RETURN_IF_ERROR(Synchronize());
  if (std::atomic_ref<int>(*seed_not_finite_).load(std::memory_order_acquire) != 0) return SeedNotFiniteError();
  return absl::OkStatus();
}

absl::Status CudaStreamer::ReadLog(int slot, int64_t begin, int64_t count, std::span<float> convictions,
                                   std::span<float> probs) {
  const size_t H = layout_.config().n_horizons;
  if (slot < 0 || slot >= slots_ || begin < 0 || count < 0 || begin + count > log_entries_ ||
      convictions.size() != static_cast<size_t>(count) || (!probs.empty() && probs.size() != count * H)) {
    return absl::InvalidArgumentError(absl::StrCat("ReadLog: slot ", slot, " range [", begin, ", ", begin + count,
                                                   ") or output sizes do not fit a log of ", log_entries_));
  }
  RETURN_IF_ERROR(StopResident());
  const size_t first = static_cast<size_t>(slot) * log_entries_ + begin;
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(convictions.data(), state_.log_convictions + first, count * sizeof(float),
                                       cudaMemcpyDeviceToHost, stream_));
  if (!probs.empty()) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(probs.data(), state_.log_probs + first * H, probs.size_bytes(),
                                         cudaMemcpyDeviceToHost, stream_));
  }
  return Synchronize();
}

absl::Status CudaStreamer::ReadSlotProbabilities(int slot, std::span<float> probs) {
  const size_t H = layout_.config().n_horizons;
  if (slot < 0 || slot >= slots_ || probs.size() != H) {
    return absl::InvalidArgumentError(absl::StrCat("ReadSlotProbabilities: slot ", slot, " or output size"));
  }
  RETURN_IF_ERROR(StopResident());
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(probs.data(), state_.probs + slot * H, probs.size_bytes(), cudaMemcpyDeviceToHost, stream_));
  return Synchronize();
}

absl::StatusOr<TicksChecked> CudaStreamer::CheckTicks(bool wait_for_ticks) {
  TicksChecked checked;
  if (wait_for_ticks) RETURN_IF_ERROR(Synchronize());
  // Which ticks finished is settled before the word is read: a non-finite output of a finished tick is in it (the
  // kernels write the word before their tick's end; the resident step fences it ahead of its answer).
  RETURN_IF_ERROR(ForgetFinishedTicks(wait_for_ticks));
  RETURN_IF_ERROR(ReadStoppedRuns());
  ReadRunningStamps();
  if (std::atomic_ref<int>(*state_.nonfinite_seen).load(std::memory_order_acquire) != 0) {
    // Cleared before the copy: a tick that sets it again meanwhile has its slots in the copy, or in the next call's.
    std::atomic_ref<int>(*state_.nonfinite_seen).store(0, std::memory_order_relaxed);
    RETURN_IF_ERROR(StopResident());
    first_nonfinite_.resize(slots_);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(first_nonfinite_.data(), state_.first_nonfinite, slots_ * sizeof(int64_t),
                                         cudaMemcpyDeviceToHost, stream_));
    RETURN_IF_ERROR(Synchronize());
    RETURN_IF_ERROR(ForgetFinishedTicks(/*all_finished=*/true));
    for (int slot = 0; slot < slots_; ++slot) {
      if (first_nonfinite_[slot] == 0) continue;
      checked.nonfinite.push_back({slot, first_nonfinite_[slot] - 1});
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(state_.first_nonfinite + slot, 0, sizeof(int64_t), stream_));
    }
  }
  checked.unfinished = static_cast<int64_t>(unfinished_ticks_.size());
  checked.device_seconds.swap(tick_seconds_);
  checked.resident_seconds.swap(resident_seconds_);
  return checked;
}

absl::Status CudaStreamer::Synchronize() {
  if (resident_.running) return WaitResidentAnswered(resident_.posted);
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

}  // namespace perception
