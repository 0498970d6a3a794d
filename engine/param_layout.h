// The parameter layout of PerceptionNet v1: every tensor of MODEL.md §4 as a named view into one flat buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"

namespace perception {

enum class InitKind {
  kUniform,   // U(-bound, +bound)
  kConstant,  // every element = value
  kDtBias,    // softplus^-1(dt), dt = exp(U(ln 1e-3, ln 1e-1))
  kALog,      // ln U(1, 16)
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset = 0;  // in floats, into the flat buffer; a multiple of kTensorAlignment
  size_t size = 0;    // element count
  bool trained = true;       // false for the normalizer buffers
  bool weight_decay = false;  // AdamW decoupled decay applies (MODEL.md §4)
  InitKind init = InitKind::kUniform;
  float init_value = 0.f;  // the bound for kUniform, the value for kConstant
};

// Named views of one layer's Mamba2 block, by index into ParamLayout::tensors().
struct LayerTensors {
  int norm, in_proj, conv_weight, conv_bias, dt_bias, a_log, d, mixer_norm, out_proj;
};
struct LinearTensors {
  int weight, bias;
};

class ParamLayout {
 public:
  // Tensors start on 16-byte boundaries so that device code may use vector loads on any view.
  static constexpr size_t kTensorAlignment = 4;

  explicit ParamLayout(const ModelConfig& config);

  const ModelConfig& config() const { return config_; }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  const TensorSpec& tensor(int index) const { return tensors_[index]; }
  absl::StatusOr<int> Find(const std::string& name) const;

  // Total floats in the flat buffer (padding between tensors included, always zero).
  size_t total_size() const { return total_size_; }
  // The trained tensors occupy [trained_begin(), total_size()); the normalizer buffers come first.
  size_t trained_begin() const { return trained_begin_; }
  // Number of trained scalars (no padding, no buffers): 318,685 for `small` with F = 40.
  size_t trained_count() const { return trained_count_; }

  int norm_mean = -1, norm_inv_std = -1;
  LinearTensors embed{};
  std::vector<LayerTensors> layers;
  int norm_f = -1;
  LinearTensors cfc_backbone{}, cfc_ff1{}, cfc_ff2{}, cfc_time_a{}, cfc_time_b{};
  LinearTensors grn_fc2{}, grn_fc1{}, grn_gate{}, grn_value{};
  int grn_skip = -1;
  LinearTensors grn_norm{};  // weight, bias of the layer norm
  LinearTensors head_out{};

 private:
  int Add(std::string name, std::vector<int64_t> shape, bool trained, bool decay, InitKind init,
          float init_value);

  ModelConfig config_;
  std::vector<TensorSpec> tensors_;
  size_t total_size_ = 0;
  size_t trained_begin_ = 0;
  size_t trained_count_ = 0;
};

// Fills the flat buffer deterministically from `seed` (MODEL.md §4); padding is zeroed.
void InitializeParameters(const ParamLayout& layout, uint64_t seed, std::span<float> params);

// Deterministic uniform doubles in [0, 1), the same on every platform (std distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t NextU64();
  double Uniform() { return static_cast<double>(NextU64() >> 11) * 0x1.0p-53; }
  double Uniform(double lo, double hi) { return lo + (hi - lo) * Uniform(); }
  uint64_t Below(uint64_t n) { return NextU64() % n; }
  // Where `draws` calls of NextU64 would leave it, in O(1): splitmix64's state moves by one constant a draw.
  void Skip(uint64_t draws) { state_ += draws * kIncrement; }

 private:
  static constexpr uint64_t kIncrement = 0x9E3779B97F4A7C15ull;
  uint64_t state_;
};

}  // namespace perception
