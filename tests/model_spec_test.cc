// The presets, parameter layout and initialization against MODEL.md §4 and §7 as transcribed by hand in
// tests/model_spec_table.h (not derived from ParamLayout).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/param_layout.h"
#include "tests/model_spec_table.h"

namespace perception {
namespace {

using testing::SpecInit;
using testing::SpecPreset;
using testing::SpecPresets;
using testing::SpecTensor;
using testing::SpecTensors;

class ModelSpecTest : public ::testing::TestWithParam<SpecPreset> {};

std::string PresetName(const ::testing::TestParamInfo<SpecPreset>& info) { return info.param.name; }

// MODEL.md §7: all 13 columns, the horizons and (§1.2) the warmup.
TEST_P(ModelSpecTest, PresetHasEveryFieldOfTheTable) {
  const SpecPreset& p = GetParam();
  const absl::StatusOr<ModelConfig> config = NamedConfig(p.name);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->n_features, p.F);
  EXPECT_EQ(config->d_model, p.D);
  EXPECT_EQ(config->n_layers, p.L);
  EXPECT_EQ(config->expand, p.expand);
  EXPECT_EQ(config->headdim, p.P);
  EXPECT_EQ(config->d_state, p.N);
  EXPECT_EQ(config->d_conv, p.W);
  EXPECT_EQ(config->cfc_units, p.C);
  EXPECT_EQ(config->cfc_backbone, p.K);
  EXPECT_EQ(config->grn_hidden, p.G);
  EXPECT_EQ(config->n_horizons, p.H);
  EXPECT_EQ(config->window, p.T);
  EXPECT_EQ(config->batch, p.B);
  // §1.2: default horizons 10, 20, 50, 100, 200; tiny's H = 3 takes the first three (the project's choice).
  const std::vector<int> defaults = {10, 20, 50, 100, 200};
  EXPECT_EQ(config->horizons, std::vector<int>(defaults.begin(), defaults.begin() + p.H));
  if (p.name != "tiny") {
    EXPECT_EQ(config->warmup, 16);  // §1.2's default; tiny's T = 9 cannot hold it
  }
  EXPECT_TRUE(ValidateConfig(*config).ok());
  if (p.name == "small") {
    EXPECT_EQ(*config, *NamedConfig("default"));
  }
}

// MODEL.md §4 row by row: names (with every layer's), shapes, trained or buffer, weight decay, init kind and bound.
TEST_P(ModelSpecTest, LayoutIsTheParameterTable) {
  const SpecPreset& p = GetParam();
  const ParamLayout layout(*NamedConfig(p.name));
  const std::vector<SpecTensor> spec = SpecTensors(p);
  ASSERT_EQ(layout.tensors().size(), spec.size());
  size_t trained = 0;
  for (size_t i = 0; i < spec.size(); ++i) {
    const SpecTensor& want = spec[i];
    const TensorSpec& got = layout.tensor(static_cast<int>(i));
    SCOPED_TRACE(want.name);
    EXPECT_EQ(got.name, want.name);  // in the table's order
    EXPECT_EQ(got.shape, want.shape);
    int64_t size = 1;
    for (int64_t d : want.shape) size *= d;
    EXPECT_EQ(got.size, static_cast<size_t>(size));
    EXPECT_EQ(got.trained, want.trained);
    EXPECT_EQ(got.weight_decay, want.weight_decay);
    if (want.trained) trained += size;
    switch (want.init) {
      case SpecInit::kConstant:
        EXPECT_EQ(got.init, InitKind::kConstant);
        EXPECT_EQ(got.init_value, want.value);
        break;
      case SpecInit::kUniform:
        EXPECT_EQ(got.init, InitKind::kUniform);
        EXPECT_NEAR(got.init_value, want.value, 1e-6 * want.value);
        break;
      case SpecInit::kDtBias:
        EXPECT_EQ(got.init, InitKind::kDtBias);
        break;
      case SpecInit::kALog:
        EXPECT_EQ(got.init, InitKind::kALog);
        break;
    }
  }
  EXPECT_EQ(layout.trained_count(), trained);
  EXPECT_EQ(TrainedParameterCount(*NamedConfig(p.name)), static_cast<int64_t>(trained));
  if (p.name == "small") {
    EXPECT_EQ(trained, 318685u);  // §7
  }
}

// The values InitializeParameters writes for a seed: constants exactly, random tensors inside their range and spread.
TEST_P(ModelSpecTest, InitializedValuesFollowTheTable) {
  const SpecPreset& p = GetParam();
  const ParamLayout layout(*NamedConfig(p.name));
  std::vector<float> params(layout.total_size());
  InitializeParameters(layout, 20240611, params);
  for (const SpecTensor& want : SpecTensors(p)) {
    SCOPED_TRACE(want.name);
    const absl::StatusOr<int> index = layout.Find(want.name);
    ASSERT_TRUE(index.ok()) << index.status();
    const TensorSpec& t = layout.tensor(*index);
    const std::span<const float> v(params.data() + t.offset, t.size);
    const auto [lo, hi] = std::ranges::minmax(v);
    switch (want.init) {
      case SpecInit::kConstant:
        EXPECT_EQ(lo, want.value);
        EXPECT_EQ(hi, want.value);
        break;
      case SpecInit::kUniform: {
        const double bound = want.value * (1 + 1e-6);  // the bound rounded to float
        EXPECT_GE(lo, -bound);
        EXPECT_LE(hi, bound);
        EXPECT_LT(lo, hi);  // not all equal (nor all zero)
        if (v.size() >= 64) {  // spread over the range, both signs
          EXPECT_LT(lo, -0.8 * want.value);
          EXPECT_GT(hi, 0.8 * want.value);
        }
        break;
      }
      case SpecInit::kDtBias:
        for (float x : v) {
          const double dt = std::log1p(std::exp(static_cast<double>(x)));  // softplus
          EXPECT_GE(dt, 1e-3 * (1 - 1e-5));
          EXPECT_LE(dt, 1e-1 * (1 + 1e-5));
        }
        EXPECT_LT(lo, hi);
        break;
      case SpecInit::kALog:
        for (float x : v) {
          const double a = std::exp(static_cast<double>(x));
          EXPECT_GE(a, 1 - 1e-6);
          EXPECT_LE(a, 16 * (1 + 1e-6));
        }
        EXPECT_LT(lo, hi);
        break;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, ModelSpecTest, ::testing::ValuesIn(SpecPresets()), PresetName);

// The median of `values` (a copy is sorted).
double Median(std::vector<double> values) {
  std::ranges::sort(values);
  return values[values.size() / 2];
}

// The draws of dt_bias and A_log, not only their ranges: over 1,024 heads (headdim 1), softplus(dt_bias) is
// log-uniform on [1e-3, 1e-1] (median 1e-2; a dt drawn uniformly has median 0.05, and dt_bias = ln dt without the
// softplus inverse never passes softplus(ln 0.1) = 0.0953), and exp(A_log) uniform on [1, 16] (median 8.5, where
// A_log drawn uniformly on [0, ln 16] has median 4).
TEST(ModelSpecInit, DtBiasAndALogFollowTheirDistributions) {
  ModelConfig config = *NamedConfig("tiny");
  config.d_model = 512;
  config.headdim = 1;
  config.n_layers = 1;
  ASSERT_TRUE(ValidateConfig(config).ok()) << ValidateConfig(config);
  const ParamLayout layout(config);
  ASSERT_EQ(config.n_heads(), 1024);
  std::vector<float> params(layout.total_size());
  InitializeParameters(layout, 12, params);
  const TensorSpec& dt_bias = layout.tensor(layout.layers[0].dt_bias);
  const TensorSpec& a_log = layout.tensor(layout.layers[0].a_log);
  std::vector<double> log_dt, a;
  for (size_t i = 0; i < dt_bias.size; ++i) {
    log_dt.push_back(std::log(std::log1p(std::exp(params[dt_bias.offset + i]))));  // ln softplus(dt_bias)
  }
  for (size_t i = 0; i < a_log.size; ++i) a.push_back(std::exp(params[a_log.offset + i]));
  EXPECT_NEAR(Median(log_dt), std::log(1e-2), 0.3);
  EXPECT_GT(std::ranges::max(log_dt), std::log(0.097));
  EXPECT_LT(std::ranges::min(log_dt), std::log(1.1e-3));
  EXPECT_NEAR(Median(a), 8.5, 1.0);
  EXPECT_GT(std::ranges::max(a), 15.5);
  EXPECT_LT(std::ranges::min(a), 1.5);
}

}  // namespace
}  // namespace perception
