// The compute backend interface: one owner of the model's parameters and optimizer state on one device.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "engine/checkpoint.h"
#include "engine/cpu_reference.h"
#include "engine/optimizer.h"
#include "engine/param_layout.h"

namespace perception {

struct TrainStepResult {
  double loss = 0;       // masked BCE of the batch, before the update
  double grad_norm = 0;  // global gradient norm, before clipping
  int64_t step = 0;      // optimizer steps taken, this one included
};

// Implemented by the CPU reference backend and the CUDA backend; the daemon's device worker and the offline
// command line drive either through it. Not thread-safe: one thread owns a backend.
class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu", or the device's name for CUDA (e.g. "cuda:0 NVIDIA H200").
  virtual std::string device_name() const = 0;
  virtual const ParamLayout& layout() const = 0;
  const ModelConfig& config() const { return layout().config(); }

  // One optimizer step on `batch`, whose shape must match the backend's config (batch, window).
  virtual absl::StatusOr<TrainStepResult> TrainStep(const BatchView<float>& batch) = 0;
  // Masked BCE of `batch` under the current parameters; logits [B,T,H] written when non-empty.
  virtual absl::StatusOr<double> Evaluate(const BatchView<float>& batch, std::span<float> logits) = 0;

  // The sequence path over ONE stream of n events from a zero state: x [n,F], dt [n] → logits [n,H]. Any n;
  // a backend may run it in chunks with the state carried, which is the same function.
  virtual absl::Status ForwardStream(std::span<const float> x, std::span<const float> dt, std::span<float> logits) = 0;

  // Parameters, moments and step, as a checkpoint holds them.
  virtual absl::StatusOr<Checkpoint> ExportState() const = 0;
  // Replaces parameters, moments and step; the checkpoint's config must equal the backend's.
  virtual absl::Status ImportState(const Checkpoint& checkpoint) = 0;
};

// The CPU reference as a backend (float32), `threads` workers over the batch (0: one per core).
std::unique_ptr<Backend> MakeCpuBackend(const ModelConfig& config, const OptimizerConfig& optimizer,
                                        std::vector<float> params, int threads = 0);

// The backend for `device`: "cpu", "cuda" (an error naming what is missing when this build has no CUDA backend
// or the machine no CUDA device) or "auto" (CUDA when a device is present, else the CPU).
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& device, const ModelConfig& config,
                                                     const OptimizerConfig& optimizer, std::vector<float> params);

}  // namespace perception
