// MODEL.md §4's parameter table and §7's presets, transcribed by hand, so that tests compare the engine's
// ParamLayout, initialization and checkpoints against the page rather than against the layout itself.
#pragma once

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace perception::testing {

// One row of MODEL.md §7: every dimension of a preset (expand·D = E, E / P = Hh derived here, not by ModelConfig).
struct SpecPreset {
  std::string name;
  int F, D, L, expand, P, N, W, C, K, G, H, T, B;
};

// Names a parameterized test's preset in its name and messages (gtest would print its bytes).
inline void PrintTo(const SpecPreset& p, std::ostream* os) { *os << p.name; }

// MODEL.md §7, row by row.
inline const std::vector<SpecPreset>& SpecPresets() {
  static const std::vector<SpecPreset> presets = {
      //       F    D  L  e   P   N  W    C    K    G  H    T    B
      {"small", 40, 128, 2, 2, 64, 32, 4, 64, 128, 64, 5, 64, 256},
      {"tiny", 6, 8, 2, 2, 4, 3, 4, 5, 7, 6, 3, 9, 2},
      {"large", 48, 512, 4, 2, 64, 64, 4, 128, 256, 128, 5, 256, 64},
  };
  return presets;
}

// MODEL.md §4's init column.
enum class SpecInit {
  kConstant,  // every element equals `value`
  kUniform,   // U(-value, +value)
  kDtBias,    // softplus^-1(dt), dt = exp(U(ln 1e-3, ln 1e-1)): softplus(v) in [1e-3, 1e-1]
  kALog,      // ln U(1, 16): v in [0, ln 16]
};

// One tensor of MODEL.md §4, with `{l}` expanded.
struct SpecTensor {
  std::string name;
  std::vector<int64_t> shape;
  bool trained;       // false for the buffers (norm.mean, norm.inv_std)
  bool weight_decay;  // the table's "weight decay" column; a buffer has none
  SpecInit init;
  double value;  // the constant, or the uniform bound
};

// MODEL.md §4 for the dimensions of `p`, in the table's order (each layer's rows together, l = 0..L-1).
inline std::vector<SpecTensor> SpecTensors(const SpecPreset& p) {
  const int64_t F = p.F, D = p.D, L = p.L, N = p.N, W = p.W, C = p.C, K = p.K, G = p.G, H = p.H;
  const int64_t E = p.expand * D, Hh = E / p.P;
  auto inv_sqrt = [](int64_t fan) { return 1.0 / std::sqrt(static_cast<double>(fan)); };
  std::vector<SpecTensor> t;
  auto buffer = [&](const std::string& name, std::vector<int64_t> shape, double value) {
    t.push_back({name, std::move(shape), false, false, SpecInit::kConstant, value});
  };
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool decay, SpecInit init, double value) {
    t.push_back({name, std::move(shape), true, decay, init, value});
  };
  // | `norm.mean`, `norm.inv_std` | [F] | 0, 1 (then fitted) | buffer |
  buffer("norm.mean", {F}, 0.0);
  buffer("norm.inv_std", {F}, 1.0);
  // | `embed.weight`, `embed.bias` | [D,F], [D] | U(±1/√F) | yes, no |
  add("embed.weight", {D, F}, true, SpecInit::kUniform, inv_sqrt(F));
  add("embed.bias", {D}, false, SpecInit::kUniform, inv_sqrt(F));
  for (int64_t l = 0; l < L; ++l) {
    const std::string q = "layers." + std::to_string(l) + ".";
    // | `layers.{l}.norm.weight` | [D] | 1 | no |
    add(q + "norm.weight", {D}, false, SpecInit::kConstant, 1.0);
    // | `layers.{l}.mixer.in_proj.weight` | [2E+2N+Hh, D] | U(±1/√D) | yes |
    add(q + "mixer.in_proj.weight", {2 * E + 2 * N + Hh, D}, true, SpecInit::kUniform, inv_sqrt(D));
    // | `layers.{l}.mixer.conv1d.weight`, `.conv1d.bias` | [E+2N,1,W], [E+2N] | U(±1/√W) | no |
    add(q + "mixer.conv1d.weight", {E + 2 * N, 1, W}, false, SpecInit::kUniform, inv_sqrt(W));
    add(q + "mixer.conv1d.bias", {E + 2 * N}, false, SpecInit::kUniform, inv_sqrt(W));
    // | `layers.{l}.mixer.dt_bias` | [Hh] | softplus⁻¹(dt), dt = exp(U(ln 1e-3, ln 1e-1)) | no |
    add(q + "mixer.dt_bias", {Hh}, false, SpecInit::kDtBias, 0.0);
    // | `layers.{l}.mixer.A_log` | [Hh] | ln U(1, 16) | no |
    add(q + "mixer.A_log", {Hh}, false, SpecInit::kALog, 0.0);
    // | `layers.{l}.mixer.D` | [Hh] | 1 | no |
    add(q + "mixer.D", {Hh}, false, SpecInit::kConstant, 1.0);
    // | `layers.{l}.mixer.norm.weight` | [E] | 1 | no |
    add(q + "mixer.norm.weight", {E}, false, SpecInit::kConstant, 1.0);
    // | `layers.{l}.mixer.out_proj.weight` | [D, E] | U(±1/√E)/√L | yes |
    add(q + "mixer.out_proj.weight", {D, E}, true, SpecInit::kUniform, inv_sqrt(E) / std::sqrt(static_cast<double>(L)));
  }
  // | `norm_f.weight` | [D] | 1 | no |
  add("norm_f.weight", {D}, false, SpecInit::kConstant, 1.0);
  // | `cfc.backbone.weight`, `.bias` | [K, D+C], [K] | U(±1/√(D+C)) | yes, no |
  add("cfc.backbone.weight", {K, D + C}, true, SpecInit::kUniform, inv_sqrt(D + C));
  add("cfc.backbone.bias", {K}, false, SpecInit::kUniform, inv_sqrt(D + C));
  // | `cfc.{ff1,ff2,time_a,time_b}.weight`, `.bias` | [C,K], [C] | U(±1/√K) | yes, no |
  for (const char* x : {"ff1", "ff2", "time_a", "time_b"}) {
    add(std::string("cfc.") + x + ".weight", {C, K}, true, SpecInit::kUniform, inv_sqrt(K));
    add(std::string("cfc.") + x + ".bias", {C}, false, SpecInit::kUniform, inv_sqrt(K));
  }
  // | `head.grn.fc2.weight`, `.bias` | [G, D+C], [G] | U(±1/√(D+C)) | yes, no |
  add("head.grn.fc2.weight", {G, D + C}, true, SpecInit::kUniform, inv_sqrt(D + C));
  add("head.grn.fc2.bias", {G}, false, SpecInit::kUniform, inv_sqrt(D + C));
  // | `head.grn.{fc1,gate,value}.weight`, `.bias` | [G,G], [G] | U(±1/√G) | yes, no |
  for (const char* x : {"fc1", "gate", "value"}) {
    add(std::string("head.grn.") + x + ".weight", {G, G}, true, SpecInit::kUniform, inv_sqrt(G));
    add(std::string("head.grn.") + x + ".bias", {G}, false, SpecInit::kUniform, inv_sqrt(G));
  }
  // | `head.grn.skip.weight` | [G, D+C] | U(±1/√(D+C)) | yes |
  add("head.grn.skip.weight", {G, D + C}, true, SpecInit::kUniform, inv_sqrt(D + C));
  // | `head.grn.norm.weight`, `.bias` | [G], [G] | 1, 0 | no |
  add("head.grn.norm.weight", {G}, false, SpecInit::kConstant, 1.0);
  add("head.grn.norm.bias", {G}, false, SpecInit::kConstant, 0.0);
  // | `head.out.weight`, `.bias` | [H,G], [H] | U(±1/√G) | yes, no |
  add("head.out.weight", {H, G}, true, SpecInit::kUniform, inv_sqrt(G));
  add("head.out.bias", {H}, false, SpecInit::kUniform, inv_sqrt(G));
  return t;
}

}  // namespace perception::testing
