// Checks of request contents that need no model: the daemon's limits, shapes against data sizes, value ranges.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/config.h"
#include "engine/dataset.h"
#include "perception/v1/perception.pb.h"

namespace perception::server {

// What the daemon refuses beyond (its flags).
struct Limits {
  int64_t max_message_bytes = 0;
  int max_batch = 0;    // windows per batch
  int max_window = 0;   // events per window
  int queue_depth = 0;  // jobs waiting for the device, per priority
};

// A batch is well formed: 1 <= batch <= max_batch and 1 <= window <= max_window (RESOURCE_EXHAUSTED beyond the
// limits), positive n_features and n_horizons, every array of the size its shape gives, x and dt finite,
// dt >= 0, labels and mask in {0, 1}. The message names the field, and for a bad value its index and position.
// With a `normalizer` of the batch's feature count (the model's), every feature also lies within
// kMaxStandardizedFeature of its mean once standardized (CheckBatchStandardizedRange's refusal), checked in the same
// pass over x.
absl::Status ValidateBatch(const v1::Batch& batch, const Limits& limits, const Normalizer* normalizer = nullptr);

// A model's training shape fits the limits, its batches within --max_message_bytes (RESOURCE_EXHAUSTED otherwise).
absl::Status CheckTrainingShapeWithinLimits(const ModelConfig& config, const Limits& limits);

}  // namespace perception::server
