// The CPU reference backend: loss and gradients from CpuReference, then clipping and AdamW, in float32.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"

namespace perception {
namespace {

// Long streams run in chunks of this many events so that activation memory stays bounded.
constexpr size_t kStreamChunk = 2048;

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
  const ParamLayout& layout() const override { return layout_; }

  absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>& batch) override {
    TrainStepResult result;
    result.loss = model_.LossAndGradients(params_, batch, grads_);
    result.step = ++step_;
    result.grad_norm = ClipAndAdamW<float>(layout_, optimizer_, step_, params_, grads_, exp_avg_, exp_avg_sq_);
    return result;
  }

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
    const size_t n = dt.size(), F = c.n_features, H = c.n_horizons;
    if (x.size() != n * F || logits.size() != n * H) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardStream: ", n, " events need x of ", n * F,
                                                     " and logits of ", n * H, " floats"));
    }
    std::vector<StreamState<float>> state = {StreamState<float>::Zero(c)};
    const std::vector<float> no_labels(kStreamChunk * H);  // Forward reads only x and dt
    for (size_t begin = 0; begin < n; begin += kStreamChunk) {
      const size_t len = std::min(kStreamChunk, n - begin);
      BatchView<float> chunk{1, static_cast<int>(len), x.subspan(begin * F, len * F), dt.subspan(begin, len),
                             std::span<const float>(no_labels).first(len * H),
                             std::span<const float>(no_labels).first(len * H)};
      model_.Forward(params_, chunk, logits.subspan(begin * H, len * H), state);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Checkpoint> ExportState() const override {
    return Checkpoint{layout_.config(), params_, exp_avg_, exp_avg_sq_, step_};
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

 private:
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
