// ModelConfig presets, JSON round trip, validation messages and the parameter layout of MODEL.md §4.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/config.h"
#include "engine/param_layout.h"

namespace perception {
namespace {

using ::testing::HasSubstr;

TEST(ConfigTest, PresetsMatchModelTable) {
  ModelConfig small = *NamedConfig("small");
  EXPECT_EQ(small, *NamedConfig("default"));
  EXPECT_EQ(small.n_features, 40);
  EXPECT_EQ(small.d_inner(), 256);
  EXPECT_EQ(small.n_heads(), 4);
  EXPECT_EQ(small.in_proj_dim(), 2 * 256 + 2 * 32 + 4);
  ModelConfig large = *NamedConfig("large");
  EXPECT_EQ(large.d_model, 512);
  EXPECT_EQ(large.n_layers, 4);
  EXPECT_EQ(large.window, 256);
  ModelConfig tiny = *NamedConfig("tiny");
  EXPECT_EQ(tiny.d_state, 3);
  EXPECT_EQ(tiny.window, 9);
  for (const std::string& name : NamedConfigNames()) EXPECT_TRUE(ValidateConfig(*NamedConfig(name)).ok()) << name;
  EXPECT_THAT(NamedConfig("huge").status().message(), HasSubstr("unknown config 'huge'"));
}

TEST(ConfigTest, SmallHasTheSpecifiedParameterCount) {
  ParamLayout layout(*NamedConfig("small"));
  EXPECT_EQ(layout.trained_count(), 318685u);
}

// The count ValidateConfig bounds before any int holds a product is the layout's own.
TEST(ConfigTest, TheBoundedParameterCountIsTheLayouts) {
  std::vector<ModelConfig> configs;
  for (const std::string& name : NamedConfigNames()) configs.push_back(*NamedConfig(name));
  ModelConfig odd = *NamedConfig("tiny");
  odd.n_features = 11, odd.d_model = 10, odd.n_layers = 3, odd.expand = 3, odd.headdim = 5, odd.d_state = 7;
  odd.d_conv = 2, odd.cfc_units = 9, odd.cfc_backbone = 13, odd.grn_hidden = 4;
  configs.push_back(odd);
  for (const ModelConfig& c : configs) {
    ASSERT_TRUE(ValidateConfig(c).ok());
    EXPECT_EQ(TrainedParameterCount(c), static_cast<int64_t>(ParamLayout(c).trained_count())) << ConfigToJson(c);
  }
}

// Each dimension within its bound can still multiply past an int or past memory: refused before anything is sized.
TEST(ConfigTest, SizesTheDimensionsMultiplyToAreBounded) {
  ModelConfig c = *NamedConfig("small");
  c.expand = 32768, c.d_model = 65536, c.headdim = 65536;  // expand·d_model = 2^31 overflowed int
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("d_inner = expand*d_model = 2147483648 must be at most 65536"));
  c = *NamedConfig("small");
  c.d_model = 65536, c.expand = 1, c.headdim = 65536, c.n_layers = 65536;  // ~5.6e14 weights
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("parameters, more than the 268435456 the daemon holds"));
  c = *NamedConfig("small");
  c.d_model = 1, c.expand = 65536, c.headdim = 64, c.d_state = 2048;  // 2^27 floats of state a layer
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("an SSM state of d_inner*d_state = 134217728 floats"));
  c = *NamedConfig("small");
  c.batch = 65536, c.window = 65536;  // 2^32 rows: batch·window overflowed int
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("batch*window = 4294967296 rows of up to 580 floats"));
  c.batch = 4096, c.window = 4096;  // 2^24 rows of 580 floats
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("is more than 1073741824 floats of activations"));
  c.window = 256;
  EXPECT_TRUE(ValidateConfig(c).ok());
  // Rows narrow in in_proj but wide in the head: 2^21 rows of the head's 2G = 2,048 floats wrapped an int.
  c = *NamedConfig("small");
  c.d_model = 32, c.d_state = 16, c.grn_hidden = 1024, c.batch = 512, c.window = 4096;
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("batch*window = 2097152 rows of up to 2048 floats"));
  c.grn_hidden = 64, c.cfc_units = 1024;  // the CfC's 4C
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("rows of up to 4096 floats"));
}

TEST(ConfigTest, JsonRoundTrip) {
  for (const std::string& name : NamedConfigNames()) {
    ModelConfig config = *NamedConfig(name);
    config.horizons.back() += 7;  // not a preset value, so the list really travels
    absl::StatusOr<ModelConfig> back = ConfigFromJson(ConfigToJson(config));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, config);
  }
  EXPECT_THAT(ConfigToJson(*NamedConfig("small")), HasSubstr("\"horizons\":[10,20,50,100,200]"));
}

TEST(ConfigTest, ValidationNamesTheProblem) {
  ModelConfig c = *NamedConfig("small");
  c.headdim = 48;
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("not divisible by headdim 48"));
  c = *NamedConfig("small");
  c.horizons = {10, 20};
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("horizons has 2 entries but n_horizons is 5"));
  c = *NamedConfig("small");
  c.d_state = 0;
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("d_state must be in [1, 65536], got 0"));
  c = *NamedConfig("small");
  c.d_model = 100000000;  // would overflow expand·d_model in int
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("d_model must be in [1, 65536]"));
  c = *NamedConfig("small");
  c.warmup = 64;
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("warmup 64"));
  EXPECT_THAT(ConfigFromJson("{\"d_model\": 8}").status().message(), HasSubstr("missing key 'n_features'"));
  EXPECT_THAT(ConfigFromJson("[1,2]").status().message(), HasSubstr("not a JSON object"));
  EXPECT_THAT(ConfigFromJson("{oops").status().message(), HasSubstr("not a JSON object"));
}

// Integers past int's range once wrapped into valid-looking values (4294967298 layers loaded as 2).
TEST(ConfigTest, IntegersOutsideIntRangeAreRejected) {
  const std::string small = ConfigToJson(*NamedConfig("small"));
  const struct {
    std::string from, to, message;
  } cases[] = {
      {"\"n_layers\":2", "\"n_layers\":4294967298", "config: 'n_layers' is out of range"},
      {"\"n_layers\":2", "\"n_layers\":18446744073709551615", "config: 'n_layers' is out of range"},
      {"\"window\":64", "\"window\":-4294967232", "config: 'window' is out of range"},
      {"[10,20,50,100,200]", "[10,20,4294967346,100,200]", "config: 'horizons' is out of range"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.to);
    std::string text = small;
    const size_t at = text.find(c.from);
    ASSERT_NE(at, std::string::npos) << text;
    text.replace(at, c.from.size(), c.to);
    EXPECT_THAT(ConfigFromJson(text).status().message(), HasSubstr(c.message));
  }
}

TEST(ConfigTest, JsonWithANulByteIsRejected) {
  // The parser would stop at the NUL and take the valid config before it.
  const std::string text = ConfigToJson(*NamedConfig("small")) + std::string("\0{garbage", 9);
  EXPECT_THAT(ConfigFromJson(text).status().message(), HasSubstr("config: holds a NUL byte"));
}

TEST(ParamLayoutTest, FollowsModelOrderWithAlignedViews) {
  ParamLayout layout(*NamedConfig("small"));
  const std::vector<std::string> first = {"norm.mean", "norm.inv_std", "embed.weight", "embed.bias",
                                          "layers.0.norm.weight", "layers.0.mixer.in_proj.weight",
                                          "layers.0.mixer.conv1d.weight", "layers.0.mixer.conv1d.bias",
                                          "layers.0.mixer.dt_bias", "layers.0.mixer.A_log", "layers.0.mixer.D",
                                          "layers.0.mixer.norm.weight", "layers.0.mixer.out_proj.weight"};
  for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(layout.tensor(i).name, first[i]);
  EXPECT_EQ(layout.tensors().back().name, "head.out.bias");
  EXPECT_EQ(layout.tensor(*layout.Find("layers.1.mixer.conv1d.weight")).shape, (std::vector<int64_t>{320, 1, 4}));
  EXPECT_EQ(layout.tensor(*layout.Find("head.grn.skip.weight")).shape, (std::vector<int64_t>{64, 192}));
  size_t end = 0;
  for (const TensorSpec& t : layout.tensors()) {
    EXPECT_EQ(t.offset % ParamLayout::kTensorAlignment, 0u) << t.name;
    EXPECT_GE(t.offset, end) << t.name;
    end = t.offset + t.size;
    EXPECT_EQ(t.trained, t.name.rfind("norm.", 0) != 0) << t.name;
  }
  EXPECT_LE(end, layout.total_size());
  EXPECT_GE(layout.tensor(layout.embed.weight).offset, layout.trained_begin());
  EXPECT_FALSE(layout.Find("nope").ok());
  // Decay exactly on the projection weights (MODEL.md §4).
  EXPECT_TRUE(layout.tensor(layout.layers[0].in_proj).weight_decay);
  EXPECT_TRUE(layout.tensor(layout.grn_skip).weight_decay);
  EXPECT_FALSE(layout.tensor(layout.layers[0].conv_weight).weight_decay);
  EXPECT_FALSE(layout.tensor(layout.embed.bias).weight_decay);
  EXPECT_FALSE(layout.tensor(layout.grn_norm.weight).weight_decay);
}

TEST(ParamLayoutTest, InitializationIsDeterministicAndInRange) {
  const ModelConfig config = *NamedConfig("small");
  ParamLayout layout(config);
  std::vector<float> a(layout.total_size()), b(layout.total_size()), c(layout.total_size());
  InitializeParameters(layout, 7, a);
  InitializeParameters(layout, 7, b);
  InitializeParameters(layout, 8, c);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  auto view = [&](int index) {
    const TensorSpec& t = layout.tensor(index);
    return std::span<const float>(a.data() + t.offset, t.size);
  };
  for (float v : view(layout.embed.weight)) EXPECT_LE(std::abs(v), 1.0 / std::sqrt(40.0));
  const float out_bound = 1.0 / std::sqrt(256.0) / std::sqrt(2.0);
  float max_out = 0;
  for (float v : view(layout.layers[0].out_proj)) max_out = std::max(max_out, std::abs(v));
  EXPECT_LE(max_out, out_bound);
  EXPECT_GT(max_out, 0.9f * out_bound);
  for (float v : view(layout.layers[1].a_log)) {
    EXPECT_GE(v, 0.f);
    EXPECT_LE(v, std::log(16.f) + 1e-6f);
  }
  for (float v : view(layout.layers[1].dt_bias)) {
    const double dt = std::log1p(std::exp(static_cast<double>(v)));
    EXPECT_GE(dt, 1e-3 * (1 - 1e-5));
    EXPECT_LE(dt, 1e-1 * (1 + 1e-5));
  }
  for (float v : view(layout.layers[0].d)) EXPECT_EQ(v, 1.f);
  for (float v : view(layout.grn_norm.bias)) EXPECT_EQ(v, 0.f);
  for (float v : view(layout.norm_inv_std)) EXPECT_EQ(v, 1.f);
}

}  // namespace
}  // namespace perception
