// Shared test fixtures: initial or perturbed parameters, seeded random batches and states, error norms, bit equality.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "engine/config.h"
#include "engine/cpu_reference.h"
#include "engine/param_layout.h"

namespace perception::testing {

// ‖a − b‖ / ‖b‖ in double; infinite if either holds a NaN or their sizes differ.
template <typename A, typename B>
double RelativeError(std::span<const A> a, std::span<const B> b) {
  if (a.size() != b.size()) return INFINITY;  // (a result cut short, or none, is no match)
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (std::isnan(x) || std::isnan(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}
template <typename A, typename B>
double RelativeError(const std::vector<A>& a, const std::vector<B>& b) {
  return RelativeError(std::span<const A>(a), std::span<const B>(b));
}

inline std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Compares bytes, so NaN payloads and signed zeros count, and empty spans need no pointer.
inline bool BitIdentical(std::span<const float> a, std::span<const float> b) {
  return std::ranges::equal(std::as_bytes(a), std::as_bytes(b));
}

// Parameters initialized from `seed` (MODEL.md §4), unperturbed.
inline std::vector<float> InitialParams(const ModelConfig& config, uint64_t seed) {
  const ParamLayout layout(config);
  std::vector<float> params(layout.total_size());
  InitializeParameters(layout, seed, params);
  return params;
}

// Initialized parameters with every tensor perturbed by up to ±`perturbation` (constants like norm weights 1 and D 1
// become random), and a random normalizer, so that no gradient path is hidden by a special value.
inline std::vector<float> RandomParams(const ParamLayout& layout, uint64_t seed, double perturbation = 0.2) {
  std::vector<float> params(layout.total_size());
  InitializeParameters(layout, seed, params);
  Rng rng(seed ^ 0x5eed);
  for (const TensorSpec& t : layout.tensors()) {
    for (size_t i = t.offset; i < t.offset + t.size; ++i) {
      if (t.name == "norm.inv_std") {
        params[i] = static_cast<float>(rng.Uniform(0.5, 2.0));
      } else {
        params[i] += static_cast<float>(rng.Uniform(-perturbation, perturbation));
      }
    }
  }
  return params;
}

// RandomParams with layer 0's first heads' dt_bias at 30 and 100: softplus(Δt's argument) past 20, where MODEL.md's
// softplus is the argument itself (log1p(exp(100)) overflows float32), is reached.
inline std::vector<float> RandomParamsWithLargeDtBias(const ParamLayout& layout, uint64_t seed) {
  std::vector<float> params = RandomParams(layout, seed);
  const TensorSpec& dt_bias = layout.tensor(layout.layers[0].dt_bias);
  params[dt_bias.offset] = 30.f;
  params[dt_bias.offset + 1] = 100.f;
  return params;
}

struct RandomBatch {
  int batch, window;
  std::vector<float> x, dt, labels, mask;
  template <typename T>
  struct Typed {
    std::vector<T> x, dt, labels, mask;
    BatchView<T> view(int batch, int window) const { return {batch, window, x, dt, labels, mask}; }
  };
  template <typename T>
  Typed<T> As() const {
    return {{x.begin(), x.end()}, {dt.begin(), dt.end()}, {labels.begin(), labels.end()}, {mask.begin(), mask.end()}};
  }
  BatchView<float> view() const { return {batch, window, x, dt, labels, mask}; }
};

// x ~ U(-2, 2), Δt exponential-like in [0, 3) with some exact zeros, labels and mask random (mask mostly 1).
inline RandomBatch MakeRandomBatch(const ModelConfig& c, int batch, int window, uint64_t seed) {
  Rng rng(seed);
  RandomBatch b{batch, window, {}, {}, {}, {}};
  const size_t events = static_cast<size_t>(batch) * window;
  for (size_t i = 0; i < events * c.n_features; ++i) b.x.push_back(static_cast<float>(rng.Uniform(-2, 2)));
  for (size_t i = 0; i < events; ++i) {
    const double u = rng.Uniform();
    b.dt.push_back(u < 0.1 ? 0.f : static_cast<float>(-0.5 * std::log(1 - u)));
  }
  for (size_t i = 0; i < events * c.n_horizons; ++i) {
    b.labels.push_back(rng.Uniform() < 0.5 ? 1.f : 0.f);
    b.mask.push_back(rng.Uniform() < 0.8 ? 1.f : 0.f);
  }
  return b;
}

template <typename T>
StreamState<T> RandomState(const ModelConfig& c, uint64_t seed) {
  Rng rng(seed);
  StreamState<T> s = StreamState<T>::Zero(c);
  for (T& v : s.conv) v = static_cast<T>(rng.Uniform(-1, 1));
  for (T& v : s.ssm) v = static_cast<T>(rng.Uniform(-0.5, 0.5));
  for (T& v : s.cfc) v = static_cast<T>(rng.Uniform(-0.9, 0.9));
  return s;
}

}  // namespace perception::testing
