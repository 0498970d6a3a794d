// The model the training benchmarks run (bench_train, step_timeline): a named config, its parameters from seed 1, one
// random full batch (seed 2) staged and a second (seed 3) to alternate with, so every tool times the same steps on the
// same data.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda_model.h"
#include "engine/status_macros.h"
#include "tests/test_util.h"

namespace perception {

// The benchmarks' random full batches: 0 is the one MakeBenchModel stages; 1 the other that timings alternate with,
// so that no step trains on a batch already on the device unless the step before copied it in.
inline testing::RandomBatch BenchBatch(const ModelConfig& config, int index) {
  return testing::MakeRandomBatch(config, config.batch, config.window, 2 + index);
}

// graphs = false: the first steps run eagerly until set_use_graphs(true) (bench_train times both modes).
inline absl::StatusOr<std::unique_ptr<CudaModel>> MakeBenchModel(const ModelConfig& config, Precision precision,
                                                                 bool graphs) {
  CudaModelOptions options;
  options.precision = precision;
  options.graphs = graphs;
  ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model,
                   CudaModel::Create(config, OptimizerConfig{}, testing::InitialParams(config, 1), options));
  RETURN_IF_ERROR(model->StageBatch(BenchBatch(config, 0).view()));  // copied into the model's pinned staging
  return model;
}

}  // namespace perception
