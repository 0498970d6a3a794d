// The model the training benchmarks run (bench_train, step_timeline): a named config, its parameters from seed 1 and
// one random full batch (seed 2) staged, so every tool times the same step on the same data.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda_model.h"
#include "engine/status_macros.h"
#include "tests/test_util.h"

namespace perception {

// graphs = false: the first steps run eagerly until set_use_graphs(true) (bench_train times both modes).
inline absl::StatusOr<std::unique_ptr<CudaModel>> MakeBenchModel(const ModelConfig& config, Precision precision,
                                                                 bool graphs) {
  const ParamLayout layout(config);
  std::vector<float> params(layout.total_size());
  InitializeParameters(layout, 1, params);
  CudaModelOptions options;
  options.precision = precision;
  options.graphs = graphs;
  ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model, CudaModel::Create(config, OptimizerConfig{}, params, options));
  const auto batch = testing::MakeRandomBatch(config, config.batch, config.window, 2);
  RETURN_IF_ERROR(model->StageBatch(batch.view()));  // copied into the model's pinned staging
  return model;
}

}  // namespace perception
