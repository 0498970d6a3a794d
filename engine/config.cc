// ModelConfig presets, validation and JSON round trip.
#include "engine/config.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/json_object.h"
#include "engine/status_macros.h"

namespace perception {
namespace {

ModelConfig Tiny() {
  ModelConfig c;
  c.n_features = 6;
  c.d_model = 8;
  c.n_layers = 2;
  c.expand = 2;
  c.headdim = 4;
  c.d_state = 3;
  c.d_conv = 4;
  c.cfc_units = 5;
  c.cfc_backbone = 7;
  c.grn_hidden = 6;
  c.n_horizons = 3;
  c.horizons = {10, 20, 50};
  c.window = 9;
  c.batch = 2;
  c.warmup = 2;
  return c;
}

ModelConfig Large() {
  ModelConfig c;
  c.n_features = 48;
  c.d_model = 512;
  c.n_layers = 4;
  c.expand = 2;
  c.headdim = 64;
  c.d_state = 64;
  c.d_conv = 4;
  c.cfc_units = 128;
  c.cfc_backbone = 256;
  c.grn_hidden = 128;
  c.n_horizons = 5;
  c.horizons = {10, 20, 50, 100, 200};
  c.window = 256;
  c.batch = 64;
  c.warmup = 16;
  return c;
}

// kMaxConfigDimension bounds every dimension and d_inner, so that a row's width (in_proj's 2E + 2N + Hh at most)
// fits an int; these bound what they multiply to: the weights (1 GiB of float32; with their gradient and two
// moments, 4), one instrument's SSM state, and the widest activation of a training batch, each an int count with
// room to spare.
constexpr int64_t kMaxParameters = int64_t{1} << 28;
constexpr int64_t kMaxStateFloats = int64_t{1} << 26;
constexpr int64_t kMaxActivationFloats = int64_t{1} << 30;

// The widest row of any activation or gradient buffer of a training batch, in floats: in_proj's output, the input,
// the head's input [h ; c], the CfC's four gate pre-activations, the head's fused pair of G-wide products, the
// logits, and the SSM's per-head B and C gradients. In int64: the backends multiply it by batch*window.
int64_t WidestActivationRow(const ModelConfig& c) {
  const int64_t E = int64_t{c.expand} * c.d_model, N = c.d_state, Hh = E / c.headdim;
  return std::max({2 * E + 2 * N + Hh, int64_t{c.n_features}, int64_t{c.d_model} + c.cfc_units,
                   4 * int64_t{c.cfc_units}, 2 * int64_t{c.grn_hidden}, int64_t{c.n_horizons}, Hh * 2 * N});
}

absl::Status WithinSizeLimits(const ModelConfig& c) {
  const int64_t E = int64_t{c.expand} * c.d_model;
  if (E > kMaxConfigDimension) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: d_inner = expand*d_model = ", E, " must be at most ", kMaxConfigDimension));
  }
  if (const int64_t params = TrainedParameterCount(c); params > kMaxParameters) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", params, " parameters, more than the ", kMaxParameters, " the daemon holds"));
  }
  if (E * c.d_state > kMaxStateFloats) {
    return absl::InvalidArgumentError(absl::StrCat("config: an SSM state of d_inner*d_state = ", E * c.d_state,
                                                   " floats a layer is more than ", kMaxStateFloats));
  }
  const int64_t rows = int64_t{c.batch} * c.window, widest = WidestActivationRow(c);
  if (rows * widest > kMaxActivationFloats) {
    return absl::InvalidArgumentError(absl::StrCat("config: batch*window = ", rows, " rows of up to ", widest,
                                                   " floats is more than ", kMaxActivationFloats,
                                                   " floats of activations"));
  }
  return absl::OkStatus();
}

absl::Status PositiveAndBounded(const char* field, int value) {
  if (value > 0 && value <= kMaxConfigDimension) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("config: ", field, " must be in [1, ", kMaxConfigDimension, "], got ", value));
}

// A JSON integer as an int, or nothing where it lies outside int's range (get<int>() would wrap it silently).
std::optional<int> IntOf(const nlohmann::json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t unsigned_value = value.get<uint64_t>();
    if (unsigned_value > static_cast<uint64_t>(std::numeric_limits<int>::max())) return std::nullopt;
    return static_cast<int>(unsigned_value);
  }
  const int64_t signed_value = value.get<int64_t>();
  if (signed_value < std::numeric_limits<int>::min() || signed_value > std::numeric_limits<int>::max()) {
    return std::nullopt;
  }
  return static_cast<int>(signed_value);
}

}  // namespace

int64_t TrainedParameterCount(const ModelConfig& c) {
  const int64_t F = c.n_features, D = c.d_model, E = int64_t{c.expand} * D, N = c.d_state, W = c.d_conv;
  const int64_t Hh = E / c.headdim, C = c.cfc_units, K = c.cfc_backbone, G = c.grn_hidden, H = c.n_horizons;
  const int64_t in_proj = 2 * E + 2 * N + Hh, conv = E + 2 * N;
  const int64_t layer = D + in_proj * D + conv * (W + 1) + 3 * Hh + E + D * E;
  const int64_t cfc = K * (D + C + 1) + 4 * C * (K + 1);
  const int64_t head = 2 * G * (D + C) + G + 3 * G * (G + 1) + 2 * G + H * (G + 1);
  return D * (F + 1) + c.n_layers * layer + D + cfc + head;
}

std::vector<std::string> NamedConfigNames() { return {"tiny", "small", "large"}; }

absl::StatusOr<ModelConfig> NamedConfig(const std::string& name) {
  if (name == "tiny") return Tiny();
  if (name == "small" || name == "default") return ModelConfig{};
  if (name == "large") return Large();
  return absl::InvalidArgumentError(absl::StrCat("unknown config '", name, "' (known: ",
                                                 absl::StrJoin(NamedConfigNames(), ", "), ")"));
}

absl::Status ValidateConfig(const ModelConfig& c) {
  const std::pair<const char*, int> fields[] = {
      {"n_features", c.n_features}, {"d_model", c.d_model},       {"n_layers", c.n_layers},
      {"expand", c.expand},         {"headdim", c.headdim},       {"d_state", c.d_state},
      {"d_conv", c.d_conv},         {"cfc_units", c.cfc_units},   {"cfc_backbone", c.cfc_backbone},
      {"grn_hidden", c.grn_hidden}, {"n_horizons", c.n_horizons}, {"window", c.window},
      {"batch", c.batch}};
  for (const auto& [field, value] : fields) {
    if (absl::Status s = PositiveAndBounded(field, value); !s.ok()) return s;
  }
  RETURN_IF_ERROR(WithinSizeLimits(c));
  if (c.d_inner() % c.headdim != 0) {
    return absl::InvalidArgumentError(absl::StrCat("config: d_inner = expand*d_model = ", c.d_inner(),
                                                   " is not divisible by headdim ", c.headdim));
  }
  if (static_cast<int>(c.horizons.size()) != c.n_horizons) {
    return absl::InvalidArgumentError(absl::StrCat("config: horizons has ", c.horizons.size(),
                                                   " entries but n_horizons is ", c.n_horizons));
  }
  for (int k : c.horizons) {
    if (k <= 0) return absl::InvalidArgumentError(absl::StrCat("config: horizon ", k, " must be positive"));
  }
  if (c.warmup < 0 || c.warmup >= c.window) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: warmup ", c.warmup, " must be in [0, window=", c.window, ")"));
  }
  return absl::OkStatus();
}

std::string ConfigToJson(const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["n_features"] = c.n_features;
  j["d_model"] = c.d_model;
  j["n_layers"] = c.n_layers;
  j["expand"] = c.expand;
  j["headdim"] = c.headdim;
  j["d_state"] = c.d_state;
  j["d_conv"] = c.d_conv;
  j["cfc_units"] = c.cfc_units;
  j["cfc_backbone"] = c.cfc_backbone;
  j["grn_hidden"] = c.grn_hidden;
  j["n_horizons"] = c.n_horizons;
  j["horizons"] = c.horizons;
  j["window"] = c.window;
  j["batch"] = c.batch;
  j["warmup"] = c.warmup;
  return j.dump();
}

absl::StatusOr<ModelConfig> ConfigFromJson(const std::string& text) {
  ASSIGN_OR_RETURN(const nlohmann::json j, ParseJsonObject(text, "config"));
  ModelConfig c;
  auto read_int = [&](const char* key, int& out, bool required) -> absl::Status {
    auto it = j.find(key);
    if (it == j.end()) {
      return required ? absl::InvalidArgumentError(absl::StrCat("config: missing key '", key, "'"))
                      : absl::OkStatus();
    }
    if (!it->is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat("config: '", key, "' must be an integer"));
    }
    const std::optional<int> value = IntOf(*it);
    if (!value.has_value()) return absl::InvalidArgumentError(absl::StrCat("config: '", key, "' is out of range"));
    out = *value;
    return absl::OkStatus();
  };
  const std::pair<const char*, int*> required[] = {
      {"n_features", &c.n_features}, {"d_model", &c.d_model},       {"n_layers", &c.n_layers},
      {"expand", &c.expand},         {"headdim", &c.headdim},       {"d_state", &c.d_state},
      {"d_conv", &c.d_conv},         {"cfc_units", &c.cfc_units},   {"cfc_backbone", &c.cfc_backbone},
      {"grn_hidden", &c.grn_hidden}, {"n_horizons", &c.n_horizons}};
  for (const auto& [key, field] : required) {
    if (absl::Status s = read_int(key, *field, true); !s.ok()) return s;
  }
  const std::pair<const char*, int*> optional[] = {
      {"window", &c.window}, {"batch", &c.batch}, {"warmup", &c.warmup}};
  for (const auto& [key, field] : optional) {
    if (absl::Status s = read_int(key, *field, false); !s.ok()) return s;
  }
  auto horizons = j.find("horizons");
  if (horizons == j.end() || !horizons->is_array()) {
    return absl::InvalidArgumentError("config: 'horizons' must be a list of event counts");
  }
  c.horizons.clear();
  for (const auto& k : *horizons) {
    if (!k.is_number_integer()) return absl::InvalidArgumentError("config: horizons must be integers");
    const std::optional<int> horizon = IntOf(k);
    if (!horizon.has_value()) return absl::InvalidArgumentError("config: 'horizons' is out of range");
    c.horizons.push_back(*horizon);
  }
  if (absl::Status s = ValidateConfig(c); !s.ok()) return s;
  return c;
}

}  // namespace perception
