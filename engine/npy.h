// Writes float32 arrays in NumPy's .npy format (version 1.0), for logits and features handed to Python.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace perception {

// Writes `data` as a C-order little-endian float32 array of the given shape; atomically (temp file + rename).
absl::Status WriteNpy(const std::string& path, std::span<const float> data, const std::vector<int64_t>& shape);

}  // namespace perception
