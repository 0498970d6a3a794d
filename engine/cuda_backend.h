// The CUDA backend: PerceptionNet trained and evaluated on one GPU behind the Backend interface (engine/backend.h).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cuda_model.h"

namespace perception {

// OK when a CUDA device can be used; otherwise FAILED_PRECONDITION naming what is missing, e.g.
// "no CUDA device: cudaGetDeviceCount returned cudaErrorNoDevice (no CUDA-capable device is detected)".
absl::Status CudaDeviceAvailable();

// A backend on the current CUDA device; everything it needs is allocated here, nothing afterwards (CUDA graphs are
// instantiated on the second training step at a shape; options.graphs = false keeps every step eager).
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const ModelConfig& config, const OptimizerConfig& optimizer,
                                                         std::vector<float> params, CudaModelOptions options = {});

}  // namespace perception
