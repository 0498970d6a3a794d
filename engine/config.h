// ModelConfig: the shape of PerceptionNet v1 (MODEL.md §7), its named presets, JSON form and validation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace perception {

struct ModelConfig {
  int n_features = 40;   // F
  int d_model = 128;     // D
  int n_layers = 2;      // L
  int expand = 2;
  int headdim = 64;      // P
  int d_state = 32;      // N
  int d_conv = 4;        // W
  int cfc_units = 64;    // C
  int cfc_backbone = 128;// K
  int grn_hidden = 64;   // G
  int n_horizons = 5;    // H
  std::vector<int> horizons = {10, 20, 50, 100, 200};  // in events, length H
  int window = 64;       // T: training window length in events
  int batch = 256;       // B: training batch size
  int warmup = 16;       // leading window positions masked out of the loss (MODEL.md §1.2)

  int d_inner() const { return expand * d_model; }                 // E
  int n_heads() const { return d_inner() / headdim; }              // Hh
  int conv_dim() const { return d_inner() + 2 * d_state; }         // E + 2N
  int in_proj_dim() const { return 2 * d_inner() + 2 * d_state + n_heads(); }
  int head_input() const { return d_model + cfc_units; }           // D + C
  // Per-stream state sizes of the step path (MODEL.md §3).
  int conv_state_size() const { return (d_conv - 1) * conv_dim(); }
  int ssm_state_size() const { return n_heads() * headdim * d_state; }

  bool operator==(const ModelConfig&) const = default;
};

// The presets of MODEL.md §7: "tiny", "small" (alias "default") and "large".
absl::StatusOr<ModelConfig> NamedConfig(const std::string& name);
std::vector<std::string> NamedConfigNames();

// Every invariant the engine relies on, with a message naming the offending field; also bounds the sizes the
// dimensions multiply to (the parameters, a state, a training batch's activations), so none overflows.
absl::Status ValidateConfig(const ModelConfig& config);
// MODEL.md §4's trained parameters (ParamLayout::trained_count), counted in int64 from any dimensions.
int64_t TrainedParameterCount(const ModelConfig& config);

// JSON with the keys of MODEL.md §7 plus window, batch and warmup. Parsing validates.
std::string ConfigToJson(const ModelConfig& config);
absl::StatusOr<ModelConfig> ConfigFromJson(const std::string& json);

// The largest value of any config field (ValidateConfig).
inline constexpr int kMaxConfigDimension = 1 << 16;

// LOBSTER input with `levels` book levels has 4·levels + 8 features (MODEL.md §1.1).
constexpr int LobsterFeatureCount(int levels) { return 4 * levels + 8; }
// The most levels whose feature count a config can hold.
inline constexpr int kMaxLobsterLevels = (kMaxConfigDimension - 8) / 4;

}  // namespace perception
