// The PerceptionNet v1 checkpoint (MODEL.md §6): parameters, AdamW moments and step in one safetensors file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/optimizer.h"

namespace perception {

// The `format` metadata value that marks a PerceptionNet v1 checkpoint.
inline constexpr char kCheckpointFormat[] = "perception-v1";

// Everything a checkpoint holds.
struct Checkpoint {
  ModelConfig config;
  std::vector<float> params;  // ParamLayout(config).total_size() floats, layout order, padding zero
  std::vector<float> exp_avg, exp_avg_sq;  // same size as params; zero on buffers and padding
  int64_t step = 0;                        // optimizer steps taken
  // The settings the moments were built under; stored where given, absent from checkpoints written without them.
  std::optional<OptimizerConfig> optimizer;
};

// File contents: one F32 tensor per ParamLayout tensor (normalizer buffers included), then
// `optim.exp_avg.<name>` and `optim.exp_avg_sq.<name>` for every trained tensor, then `optim.step`
// of shape [1]; metadata `format` = kCheckpointFormat, `config` = ConfigToJson(config) and `step`, and `optimizer` =
// OptimizerToJson(optimizer) where the checkpoint has one (not in MODEL.md §6: readers may ignore it).
// `optim.step` holds the step as a float, exact only below 2^24, so that PyTorch code can read it
// as a tensor; the `step` metadata holds it exactly as a decimal string and is what Load returns.
// Padding and the moments of the buffers are not stored. Sizes are validated against the layout, and the step
// against [0, 2^53), before anything is written, and the file is replaced atomically.
absl::Status SaveCheckpoint(const std::string& path, const Checkpoint& checkpoint);

// Reads and validates a whole checkpoint: format, config, every expected tensor present with its
// exact shape, no other tensor, every value finite, `optim.exp_avg_sq` >= 0, a normalizer ValidateNormalizer
// accepts, a metadata step in [0, 2^53) and `optim.step` consistent with it. Returns the checkpoint complete or an
// error (DATA_LOSS for a file that is not a valid checkpoint) naming the problem, never a partial result.
absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& path);

}  // namespace perception
