// Builds the flat parameter layout in MODEL.md §4 order and initializes it from a seed.
#include "engine/param_layout.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace perception {

uint64_t Rng::NextU64() {  // splitmix64
  uint64_t z = (state_ += kIncrement);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

int ParamLayout::Add(std::string name, std::vector<int64_t> shape, bool trained, bool decay,
                     InitKind init, float init_value) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.size = 1;
  for (int64_t d : shape) spec.size *= static_cast<size_t>(d);
  spec.shape = std::move(shape);
  spec.offset = (total_size_ + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
  spec.trained = trained;
  spec.weight_decay = decay;
  spec.init = init;
  spec.init_value = init_value;
  total_size_ = spec.offset + spec.size;
  if (trained) trained_count_ += spec.size;
  tensors_.push_back(std::move(spec));
  return static_cast<int>(tensors_.size()) - 1;
}

ParamLayout::ParamLayout(const ModelConfig& c) : config_(c) {
  const int F = c.n_features, D = c.d_model, E = c.d_inner(), W = c.d_conv;
  const int Hh = c.n_heads(), C = c.cfc_units, K = c.cfc_backbone, G = c.grn_hidden, H = c.n_horizons;
  const int DC = c.head_input();
  auto bound = [](int fan_in) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(fan_in))); };
  auto linear = [&](const std::string& name, int out, int in, float b) {
    LinearTensors t;
    t.weight = Add(name + ".weight", {out, in}, true, true, InitKind::kUniform, b);
    t.bias = Add(name + ".bias", {out}, true, false, InitKind::kUniform, b);
    return t;
  };

  norm_mean = Add("norm.mean", {F}, false, false, InitKind::kConstant, 0.f);
  norm_inv_std = Add("norm.inv_std", {F}, false, false, InitKind::kConstant, 1.f);
  trained_begin_ = (total_size_ + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
  embed = linear("embed", D, F, bound(F));
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    LayerTensors t;
    t.norm = Add(p + "norm.weight", {D}, true, false, InitKind::kConstant, 1.f);
    t.in_proj = Add(p + "mixer.in_proj.weight", {c.in_proj_dim(), D}, true, true, InitKind::kUniform, bound(D));
    t.conv_weight = Add(p + "mixer.conv1d.weight", {c.conv_dim(), 1, W}, true, false, InitKind::kUniform, bound(W));
    t.conv_bias = Add(p + "mixer.conv1d.bias", {c.conv_dim()}, true, false, InitKind::kUniform, bound(W));
    t.dt_bias = Add(p + "mixer.dt_bias", {Hh}, true, false, InitKind::kDtBias, 0.f);
    t.a_log = Add(p + "mixer.A_log", {Hh}, true, false, InitKind::kALog, 0.f);
    t.d = Add(p + "mixer.D", {Hh}, true, false, InitKind::kConstant, 1.f);
    t.mixer_norm = Add(p + "mixer.norm.weight", {E}, true, false, InitKind::kConstant, 1.f);
    t.out_proj = Add(p + "mixer.out_proj.weight", {D, E}, true, true, InitKind::kUniform,
                     bound(E) / static_cast<float>(std::sqrt(static_cast<double>(c.n_layers))));
    layers.push_back(t);
  }
  norm_f = Add("norm_f.weight", {D}, true, false, InitKind::kConstant, 1.f);
  cfc_backbone = linear("cfc.backbone", K, DC, bound(DC));
  cfc_ff1 = linear("cfc.ff1", C, K, bound(K));
  cfc_ff2 = linear("cfc.ff2", C, K, bound(K));
  cfc_time_a = linear("cfc.time_a", C, K, bound(K));
  cfc_time_b = linear("cfc.time_b", C, K, bound(K));
  grn_fc2 = linear("head.grn.fc2", G, DC, bound(DC));
  grn_fc1 = linear("head.grn.fc1", G, G, bound(G));
  grn_gate = linear("head.grn.gate", G, G, bound(G));
  grn_value = linear("head.grn.value", G, G, bound(G));
  grn_skip = Add("head.grn.skip.weight", {G, DC}, true, true, InitKind::kUniform, bound(DC));
  grn_norm.weight = Add("head.grn.norm.weight", {G}, true, false, InitKind::kConstant, 1.f);
  grn_norm.bias = Add("head.grn.norm.bias", {G}, true, false, InitKind::kConstant, 0.f);
  head_out = linear("head.out", H, G, bound(G));
  total_size_ = (total_size_ + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
}

absl::StatusOr<int> ParamLayout::Find(const std::string& name) const {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].name == name) return static_cast<int>(i);
  }
  return absl::NotFoundError(absl::StrCat("no parameter named '", name, "'"));
}

void InitializeParameters(const ParamLayout& layout, uint64_t seed, std::span<float> params) {
  std::fill(params.begin(), params.end(), 0.f);
  Rng rng(seed);
  for (const TensorSpec& t : layout.tensors()) {
    float* out = params.data() + t.offset;
    for (size_t i = 0; i < t.size; ++i) {
      switch (t.init) {
        case InitKind::kUniform:
          out[i] = static_cast<float>(rng.Uniform(-t.init_value, t.init_value));
          break;
        case InitKind::kConstant:
          out[i] = t.init_value;
          break;
        case InitKind::kDtBias: {
          const double dt = std::exp(rng.Uniform(std::log(1e-3), std::log(1e-1)));
          out[i] = static_cast<float>(dt + std::log(-std::expm1(-dt)));  // softplus^-1(dt)
          break;
        }
        case InitKind::kALog:
          out[i] = static_cast<float>(std::log(rng.Uniform(1.0, 16.0)));
          break;
      }
    }
  }
}

}  // namespace perception
