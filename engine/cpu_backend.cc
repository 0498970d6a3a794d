// The CPU reference backend: loss and gradients from CpuReference, then clipping and AdamW, in float32.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <span>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/host_allocation.h"
#include "engine/status_macros.h"

namespace perception {
namespace {

// Long streams run in chunks of this many events so that activation memory stays bounded.
constexpr size_t kStreamChunk = 2048;

bool AllFinite(std::span<const float> values) {
  return std::all_of(values.begin(), values.end(), [](float v) { return std::isfinite(v); });
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(const ModelConfig& config, const OptimizerConfig& optimizer, std::vector<float> params, int threads)
      : layout_(config),
        optimizer_(optimizer),
        model_(layout_, threads),
        params_(std::move(params)),
        grads_(layout_.total_size()),
        exp_avg_(layout_.total_size()),
        exp_avg_sq_(layout_.total_size()) {}

  std::string device_name() const override { return "cpu"; }
  int64_t memory_bytes() const override {
    return static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE);
  }
  const ParamLayout& layout() const override { return layout_; }

  absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>& batch) override {
    TrainStepResult result;
    result.loss = model_.LossAndGradients(params_, batch, grads_);
    result.grad_norm = ClipAndAdamW<float>(layout_, optimizer_, step_ + 1, params_, grads_, exp_avg_, exp_avg_sq_);
    if (!StepApplies<float>(result.grad_norm, optimizer_)) {
      result.step = step_;
      return StepNotTakenError(result);
    }
    result.step = ++step_;
    return result;
  }

  int64_t step() const override { return step_; }

  absl::StatusOr<double> Evaluate(const BatchView<float>& batch, std::span<float> logits) override {
    if (logits.empty()) {
      scratch_logits_.resize(batch.labels.size());
      logits = scratch_logits_;
    }
    model_.Forward(params_, batch, logits);
    return CpuReference<float>::MaskedBce(logits, batch.labels, batch.mask);
  }

  absl::Status ForwardStream(std::span<const float> x, std::span<const float> dt, std::span<float> logits) override {
    const ModelConfig& c = layout_.config();
    if (x.size() != dt.size() * c.n_features || logits.size() != dt.size() * c.n_horizons) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardStream: ", dt.size(), " events need x of ",
                                                     dt.size() * c.n_features, " and logits of ",
                                                     dt.size() * c.n_horizons, " floats"));
    }
    StreamState<float> state = StreamState<float>::Zero(c);
    RunStream(params_, x, dt, state, logits);
    return absl::OkStatus();
  }

  absl::StatusOr<Checkpoint> ExportState() const override {
    return Checkpoint{layout_.config(), params_, exp_avg_, exp_avg_sq_, step_, std::nullopt};
  }

  absl::Status ImportState(const Checkpoint& checkpoint) override {
    if (!(checkpoint.config == layout_.config())) {
      return absl::FailedPreconditionError("checkpoint config differs from the backend's model config");
    }
    params_ = checkpoint.params;
    exp_avg_ = checkpoint.exp_avg;
    exp_avg_sq_ = checkpoint.exp_avg_sq;
    step_ = checkpoint.step;
    return absl::OkStatus();
  }

  absl::Status ConfigureStreaming(int slots, int64_t log_entries_per_slot) override {
    if (slots <= 0 || log_entries_per_slot <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("streaming needs slots (", slots, ") and log entries per slot (",
                                                     log_entries_per_slot, ") > 0"));
    }
    const size_t H = layout_.config().n_horizons;
    const size_t entries = static_cast<size_t>(slots) * static_cast<size_t>(log_entries_per_slot);
    // Built aside, so that a configuration the host cannot hold leaves the last one (or none) whole.
    std::vector<StreamState<float>> states;
    std::vector<float> probs, convictions, log_probs;
    RETURN_IF_ERROR(AllocateOrExhausted(
        absl::StrCat("the streams' states and conviction logs (", slots, " slots of ", log_entries_per_slot,
                     " entries; perceptiond --stream_slots, --stream_log_entries)"),
        [&] {
          states.assign(slots, StreamState<float>::Zero(layout_.config()));
          probs.assign(slots * H, 0.f);
          convictions.assign(entries, 0.f);
          log_probs.assign(entries * H, 0.f);
        }));
    slots_ = std::move(states);
    slot_probs_ = std::move(probs);
    log_entries_ = log_entries_per_slot;
    log_convictions_ = std::move(convictions);
    log_probs_ = std::move(log_probs);
    first_nonfinite_.assign(slots, std::nullopt);
    return PublishWeights();
  }

  absl::Status PublishWeights() override {
    published_ = params_;
    return absl::OkStatus();
  }

  absl::Status ForwardStepInto(const StreamTick& tick) override {
    RETURN_IF_ERROR(ValidateTick(tick));
    const size_t n = tick.size(), H = layout_.config().n_horizons;
    tick_states_.clear();
    for (int32_t slot : tick.slots) tick_states_.push_back(&slots_[slot]);
    tick_logits_.resize(n * H);
    model_.StepMany(published_, tick.x, tick.dt, tick_states_, tick_logits_);
    for (size_t i = 0; i < n; ++i) {
      const std::span<const float> logits(&tick_logits_[i * H], H);
      const int slot = tick.slots[i];
      const size_t entry = static_cast<size_t>(slot) * log_entries_ + tick.log_indices[i] % log_entries_;
      for (size_t h = 0; h < H; ++h) {
        const float p = 1.f / (1.f + std::exp(-logits[h]));
        slot_probs_[slot * H + h] = p;
        log_probs_[entry * H + h] = p;
      }
      log_convictions_[entry] = Conviction<float>(logits);
      if (!AllFinite(logits) && !first_nonfinite_[slot]) first_nonfinite_[slot] = tick.log_indices[i];
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TicksChecked> CheckTicks(bool /*wait_for_ticks*/) override {
    TicksChecked checked;  // every tick has finished
    for (size_t slot = 0; slot < first_nonfinite_.size(); ++slot) {
      if (!first_nonfinite_[slot]) continue;
      checked.nonfinite.push_back({static_cast<int>(slot), *first_nonfinite_[slot]});
      first_nonfinite_[slot].reset();
    }
    return checked;
  }

  absl::Status ResetSlot(int slot) override {
    RETURN_IF_ERROR(CheckSlot(slot));
    slots_[slot] = StreamState<float>::Zero(layout_.config());
    first_nonfinite_[slot].reset();
    return absl::OkStatus();
  }

  absl::Status AdvanceSlot(int slot, std::span<const float> x, std::span<const float> dt) override {
    RETURN_IF_ERROR(CheckSlot(slot));
    const ModelConfig& c = layout_.config();
    if (dt.empty() || x.size() != dt.size() * c.n_features) {
      return absl::InvalidArgumentError(absl::StrCat("AdvanceSlot: ", dt.size(), " events need x of ",
                                                     dt.size() * c.n_features, " floats, got ", x.size()));
    }
    StreamState<float>& state = slots_[slot];
    std::vector<float> logits(dt.size() * c.n_horizons);
    RunStream(published_, x, dt, state, logits);
    const bool finite = AllFinite(state.conv) && AllFinite(state.ssm) && AllFinite(state.cfc);
    return finite ? absl::OkStatus() : SeedNotFiniteError();
  }

  absl::Status ReadLog(int slot, int64_t begin, int64_t count, std::span<float> convictions,
                       std::span<float> probs) override {
    RETURN_IF_ERROR(CheckSlot(slot));
    const size_t H = layout_.config().n_horizons;
    if (begin < 0 || count < 0 || begin + count > log_entries_ || convictions.size() != static_cast<size_t>(count) ||
        (!probs.empty() && probs.size() != count * H)) {
      return absl::InvalidArgumentError(absl::StrCat("ReadLog: range [", begin, ", ", begin + count,
                                                     ") or output sizes do not fit a log of ", log_entries_));
    }
    const size_t first = static_cast<size_t>(slot) * log_entries_ + begin;
    std::copy_n(log_convictions_.begin() + first, count, convictions.begin());
    if (!probs.empty()) std::copy_n(log_probs_.begin() + first * H, count * H, probs.begin());
    return absl::OkStatus();
  }

  absl::Status ReadSlotProbabilities(int slot, std::span<float> probs) override {
    RETURN_IF_ERROR(CheckSlot(slot));
    const size_t H = layout_.config().n_horizons;
    if (probs.size() != H) return absl::InvalidArgumentError("ReadSlotProbabilities: probs must hold H floats");
    std::copy_n(slot_probs_.begin() + slot * H, H, probs.begin());
    return absl::OkStatus();
  }

 private:
  // The sequence path over one stream with `state` carried, in bounded chunks.
  void RunStream(std::span<const float> params, std::span<const float> x, std::span<const float> dt,
                 StreamState<float>& state, std::span<float> logits) const {
    const size_t n = dt.size(), F = layout_.config().n_features, H = layout_.config().n_horizons;
    const std::vector<float> no_labels(kStreamChunk * H);  // Forward reads only x and dt
    for (size_t begin = 0; begin < n; begin += kStreamChunk) {
      const size_t len = std::min(kStreamChunk, n - begin);
      BatchView<float> chunk{1, static_cast<int>(len), x.subspan(begin * F, len * F), dt.subspan(begin, len),
                             std::span<const float>(no_labels).first(len * H),
                             std::span<const float>(no_labels).first(len * H)};
      model_.Forward(params, chunk, logits.subspan(begin * H, len * H), std::span<StreamState<float>>(&state, 1));
    }
  }

  absl::Status CheckSlot(int slot) const {
    if (slot >= 0 && static_cast<size_t>(slot) < slots_.size()) return absl::OkStatus();
    return absl::OutOfRangeError(absl::StrCat("slot ", slot, " is outside [0, ", slots_.size(), ")"));
  }

  absl::Status ValidateTick(const StreamTick& tick) {
    const size_t n = tick.size();
    if (tick.x.size() != n * layout_.config().n_features || tick.slots.size() != n || tick.log_indices.size() != n) {
      return absl::InvalidArgumentError("forward_step_into: x, dt, slots and log_indices disagree on the event count");
    }
    slot_seen_.assign(slots_.size(), false);
    for (size_t i = 0; i < n; ++i) {
      RETURN_IF_ERROR(CheckSlot(tick.slots[i]));
      if (slot_seen_[tick.slots[i]]) {
        return absl::InvalidArgumentError(absl::StrCat("forward_step_into: slot ", tick.slots[i], " twice in one tick"));
      }
      slot_seen_[tick.slots[i]] = true;
      if (tick.log_indices[i] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("forward_step_into: log entry number ", tick.log_indices[i],
                                                       " is negative"));
      }
    }
    return absl::OkStatus();
  }

  std::vector<float> published_;
  std::vector<StreamState<float>> slots_;
  std::vector<float> slot_probs_, log_convictions_, log_probs_;
  int64_t log_entries_ = 0;
  std::vector<std::optional<int64_t>> first_nonfinite_;  // by slot: CheckTicks' entry numbers
  std::vector<StreamState<float>*> tick_states_;
  std::vector<float> tick_logits_;
  std::vector<bool> slot_seen_;

  ParamLayout layout_;
  OptimizerConfig optimizer_;
  CpuReference<float> model_;
  std::vector<float> params_, grads_, exp_avg_, exp_avg_sq_, scratch_logits_;
  int64_t step_ = 0;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(const ModelConfig& config, const OptimizerConfig& optimizer,
                                        std::vector<float> params, int threads) {
  return std::make_unique<CpuBackend>(config, optimizer, std::move(params), threads);
}

}  // namespace perception
