// Chooses the backend for a device name; the CUDA backend exists only in builds with PERCEPTION_CUDA.
#include "engine/backend.h"

#include <cmath>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "engine/device_loss.h"
#include "engine/optimizer.h"
#include "engine/status_macros.h"

#if PERCEPTION_HAVE_CUDA
#include "engine/cuda_backend.h"
#include "engine/nccl_communicator.h"
#endif

namespace perception {
namespace {

absl::Status NoStreaming(const Backend& backend) {
  return absl::UnimplementedError(absl::StrCat("streaming is not available on device ", backend.device_name()));
}

}  // namespace

absl::Status SeedNotFiniteError() {
  return absl::FailedPreconditionError(
      "the seed window leads to a state that is not finite (float32 overflowed inside the model: its weights, or the "
      "window's features, are beyond what its arithmetic holds)");
}

absl::Status Backend::ConfigureStreaming(int, int64_t) { return NoStreaming(*this); }
absl::Status Backend::PublishWeights() { return NoStreaming(*this); }
absl::Status Backend::ForwardStepInto(const StreamTick&) { return NoStreaming(*this); }
absl::Status Backend::ResetSlot(int) { return NoStreaming(*this); }
absl::Status Backend::AdvanceSlot(int, std::span<const float>, std::span<const float>) { return NoStreaming(*this); }
absl::Status Backend::SeedSlot(int slot, std::span<const float> x, std::span<const float> dt) {
  RETURN_IF_ERROR(ResetSlot(slot));
  return AdvanceSlot(slot, x, dt);
}
absl::Status Backend::ReadLog(int, int64_t, int64_t, std::span<float>, std::span<float>) { return NoStreaming(*this); }
absl::Status Backend::ReadSlotProbabilities(int, std::span<float>) { return NoStreaming(*this); }
absl::StatusOr<TicksChecked> Backend::CheckTicks(bool) { return NoStreaming(*this); }

constexpr char kStepNotTakenPayload[] = "type.perception/step_not_taken";

absl::Status StepNotTakenError(const TrainStepResult& result) {
  // (A finite norm is refused for its size: StepApplies.)
  const std::string too_large = std::isfinite(result.grad_norm)
                                    ? absl::StrCat(", too large once clipped for float32's second moment (at most ",
                                                   LargestAppliedGradNorm<float>(), ": clip gradients, max_grad_norm)")
                                    : "";
  absl::Status not_taken = absl::FailedPreconditionError(absl::StrCat(
      "the batch's gradient norm is ", result.grad_norm, too_large, " (loss ", result.loss,
      "): the update was not applied, and the model stays at step ", result.step));
  not_taken.SetPayload(kStepNotTakenPayload, absl::Cord());
  return not_taken;
}

bool IsStepNotTaken(const absl::Status& status) { return status.GetPayload(kStepNotTakenPayload).has_value(); }

absl::Status Backend::InjectDeviceLoss() {
  NoteDeviceLost(absl::InternalError(absl::StrCat("a loss of ", device_name(), " injected by a test")));
  return DeviceLostStatus();
}

absl::StatusOr<std::string> NewDataParallelId() {
#if PERCEPTION_HAVE_CUDA
  return NewNcclUniqueId();
#else
  return absl::FailedPreconditionError("data-parallel training needs NCCL: this build has no CUDA backend");
#endif
}

absl::StatusOr<std::shared_ptr<NcclCommunicator>> JoinDataParallel(const std::string& unique_id,
                                                                   const DataParallelOptions& options) {
#if PERCEPTION_HAVE_CUDA
  RETURN_IF_ERROR(CudaDeviceAvailable());
  ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> communicator, NcclCommunicator::Create(unique_id, options));
  return std::shared_ptr<NcclCommunicator>(std::move(communicator));
#else
  return absl::FailedPreconditionError("data-parallel training needs NCCL: this build has no CUDA backend");
#endif
}

absl::Status DataParallelUsable(const NcclCommunicator& communicator) {
#if PERCEPTION_HAVE_CUDA
  return communicator.Usable();
#else
  (void)communicator;  // (none can exist without CUDA: JoinDataParallel refuses)
  return absl::OkStatus();
#endif
}

absl::Status CheckDeviceName(const std::string& device) {
  if (device == "cpu" || device == "cuda" || device == "auto") return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("unknown device '", device, "' (cpu, cuda, auto)"));
}

absl::Status CudaBackendAvailable() {
#if PERCEPTION_HAVE_CUDA
  return CudaDeviceAvailable();
#else
  return absl::FailedPreconditionError("this build has no CUDA backend (built with PERCEPTION_CUDA=OFF)");
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& device, const ModelConfig& config,
                                                     const OptimizerConfig& optimizer, std::vector<float> params,
                                                     std::shared_ptr<NcclCommunicator> communicator,
                                                     std::optional<Precision> precision) {
  RETURN_IF_ERROR(CheckDeviceName(device));
  if (communicator != nullptr && device == "cpu") {
    return absl::FailedPreconditionError("data-parallel training runs on NCCL, which the CPU backend cannot join");
  }
  const auto cpu = [&]() -> absl::StatusOr<std::unique_ptr<Backend>> {
    if (precision.value_or(DefaultPrecision(/*cuda=*/false)) != Precision::kFloat32) {
      return absl::FailedPreconditionError(absl::StrCat("precision ", PrecisionName(*precision),
                                                        " is the CUDA backend's; the CPU backend computes in fp32"));
    }
    return MakeCpuBackend(config, optimizer, std::move(params));
  };
  if (device == "cpu") return cpu();
  const absl::Status available = CudaBackendAvailable();
#if PERCEPTION_HAVE_CUDA
  if (available.ok()) {
    const CudaModelOptions options{.precision = precision.value_or(DefaultPrecision(/*cuda=*/true)),
                                   .communicator = communicator};
    return MakeCudaBackend(config, optimizer, std::move(params), options);
  }
#endif
  if (device == "cuda" || communicator != nullptr) return available;
  return cpu();
}

}  // namespace perception
