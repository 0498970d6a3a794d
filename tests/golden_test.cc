// The engine's CPU reference against the independent PyTorch reference in CI, where torch is absent: goldens of
// tests/reference/perception_ref.py's float64 run on `tiny` (B=3), written by tests/reference/make_golden.py into
// tests/data/golden/<name> (init.safetensors, the parameters; golden.safetensors, the batch and torch's logits, loss,
// dx, every gradient, the per-step losses and pre-clip norms and the parameters after S clip+AdamW steps).
// `tiny` steps at max_norm 1, which its norms (0.21-0.39) never reach; `tiny_clipped` at 0.25, where all steps but
// one clip, so the clip's scale and its branch are held to torch's clip_grad_norm_ too.
// CpuReference<double> and <float> run the same forward, backward and steps (the golden's steps, lr, max_norm,
// weight_decay, betas, eps) and are held per tensor, by ‖a−b‖/‖b‖, to MODEL.md §8's bars: double against torch's
// float64 1e-9; float logits, loss and per-step losses 1e-5, gradients, dx, norms and parameters after the steps
// 1e-4. A NaN or Inf never passes. A missing golden fails the test, saying how to generate it.
// PERCEPTION_GOLDEN_ROOT in the environment replaces the goldens' folder (tests/CMakeLists.txt compiles in the
// committed one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "engine/cpu_reference.h"
#include "engine/optimizer.h"
#include "engine/param_layout.h"
#include "engine/safetensors.h"

namespace perception {
namespace {

// A golden of the committed set: its folder under the goldens' root and make_golden.py's flags beyond the defaults.
struct GoldenCase {
  const char* name;
  const char* make_golden_flags;
  bool clips;  // whether some steps' norms exceed max_norm (and others not), or none does
};

// gtest names a failed case by this, not by the struct's bytes.
void PrintTo(const GoldenCase& golden, std::ostream* os) { *os << golden.name; }

constexpr GoldenCase kGoldens[] = {{"tiny", "", false}, {"tiny_clipped", "--max-norm 0.25 ", true}};

std::string HowToGenerate(const GoldenCase& golden) {
  return absl::StrCat("generate it on a host with torch (pip install torch safetensors numpy):\n",
                      "  cmake --build build --target reference_dump\n",
                      "  python3 tests/reference/make_golden.py --dump-bin build/bin/reference_dump ",
                      golden.make_golden_flags, "--out tests/data/golden/", golden.name, "\nand commit the folder");
}

constexpr double kBarF64 = 1e-9;          // float64 against float64
constexpr double kBarF32Values = 1e-5;    // logits, loss (MODEL.md §8)
constexpr double kBarF32Gradients = 1e-4;  // gradients, dx, parameters after the steps (MODEL.md §8)

std::string GoldenDir(const GoldenCase& golden) {
  const char* root = std::getenv("PERCEPTION_GOLDEN_ROOT");
  return absl::StrCat(root != nullptr && *root != '\0' ? root : PERCEPTION_GOLDEN_ROOT, "/", golden.name);
}

// ‖a−b‖/‖b‖ in double; infinite where either holds a NaN or Inf, or the shapes differ, or b is zero and a not.
template <typename T>
double RelErr(std::span<const T> a, std::span<const double> b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a[i]), y = b[i];
    if (!std::isfinite(x) || !std::isfinite(y)) return std::numeric_limits<double>::infinity();
    num += (x - y) * (x - y);
    den += y * y;
  }
  if (den == 0) return num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  const double err = std::sqrt(num) / std::sqrt(den);
  return std::isfinite(err) ? err : std::numeric_limits<double>::infinity();
}

struct Golden {
  ModelConfig config;
  std::vector<float> params;  // the checkpoint's, layout order
  std::optional<SafetensorsFile> file;
  int batch = 0, steps = 0;
  OptimizerConfig optimizer;

  // A float32 tensor of the golden (the batch), its shape checked.
  std::vector<float> Floats(const std::string& key, const std::vector<int64_t>& shape) const {
    const auto it = file->tensors().find(key);
    if (it == file->tensors().end()) {
      ADD_FAILURE() << "golden.safetensors has no tensor " << key;
      return {};
    }
    EXPECT_EQ(FormatShape(it->second.shape), FormatShape(shape)) << key;
    return it->second.ToFloats();
  }
  // A float64 value of torch's: `<key>` + `<key>@lo` (make_golden.py's encoding), its shape checked.
  std::vector<double> Doubles(const std::string& key, const std::vector<int64_t>& shape) const {
    const std::vector<float> hi = Floats(key, shape), lo = Floats(key + "@lo", shape);
    if (hi.size() != lo.size()) return {};
    std::vector<double> v(hi.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(hi[i]) + static_cast<double>(lo[i]);
    return v;
  }
};

std::string Meta(const SafetensorsMetadata& m, const std::string& key) {
  const auto it = m.find(key);
  return it == m.end() ? "" : it->second;
}

class GoldenTest : public ::testing::TestWithParam<GoldenCase> {
 protected:
  void SetUp() override {
    const std::string dir = GoldenDir(GetParam());
    for (const char* name : {"init.safetensors", "golden.safetensors"}) {
      ASSERT_TRUE(std::filesystem::exists(dir + "/" + name))
          << "no golden: " << dir << "/" << name << " is missing; " << HowToGenerate(GetParam());
    }
    absl::StatusOr<Checkpoint> checkpoint = LoadCheckpoint(dir + "/init.safetensors");
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    absl::StatusOr<SafetensorsFile> file = ReadSafetensors(dir + "/golden.safetensors");
    ASSERT_TRUE(file.ok()) << file.status();
    const SafetensorsMetadata& meta = file->metadata();
    ASSERT_EQ(Meta(meta, "format"), "perception-golden-v1");
    absl::StatusOr<ModelConfig> config = ConfigFromJson(Meta(meta, "config"));
    ASSERT_TRUE(config.ok()) << config.status();
    ASSERT_TRUE(*config == checkpoint->config) << "golden.safetensors' config is not init.safetensors' config";
    ASSERT_EQ(checkpoint->step, 0);
    g_.config = *config;
    g_.params = std::move(checkpoint->params);
    OptimizerConfig& opt = g_.optimizer;
    ASSERT_TRUE(absl::SimpleAtoi(Meta(meta, "steps"), &g_.steps) && g_.steps >= 1) << Meta(meta, "steps");
    const std::pair<const char*, double*> fields[] = {{"lr", &opt.lr},         {"max_norm", &opt.max_grad_norm},
                                                      {"weight_decay", &opt.weight_decay},
                                                      {"beta1", &opt.beta1},   {"beta2", &opt.beta2},
                                                      {"eps", &opt.eps}};
    for (const auto& [key, field] : fields) {
      ASSERT_TRUE(absl::SimpleAtod(Meta(meta, key), field)) << "metadata " << key << ": '" << Meta(meta, key) << "'";
    }
    ASSERT_TRUE(ValidateOptimizerConfig(opt).ok());
    const auto x = file->tensors().find("batch.x");
    ASSERT_NE(x, file->tensors().end()) << "golden.safetensors has no batch.x";
    ASSERT_EQ(x->second.shape.size(), 3u);
    g_.batch = static_cast<int>(x->second.shape[0]);
    g_.file = std::move(*file);
    std::printf("golden %s: %s, torch %s, B=%d T=%d, %d steps lr %s max_norm %s weight_decay %s\n", dir.c_str(),
                Meta(g_.file->metadata(), "config_name").c_str(), Meta(g_.file->metadata(), "torch_version").c_str(),
                g_.batch, g_.config.window, g_.steps, Meta(g_.file->metadata(), "lr").c_str(),
                Meta(g_.file->metadata(), "max_norm").c_str(), Meta(g_.file->metadata(), "weight_decay").c_str());
  }

  // CpuReference<T>'s run against torch's float64 one, every tensor, with the worst error per group printed.
  template <typename T>
  void Check(const char* label, double bar_values, double bar_gradients) {
    const ParamLayout layout(g_.config);
    const ModelConfig& c = g_.config;
    const int B = g_.batch, Tn = c.window, H = c.n_horizons, F = c.n_features;
    const std::vector<float> xf = g_.Floats("batch.x", {B, Tn, F}), dtf = g_.Floats("batch.dt", {B, Tn}),
                             yf = g_.Floats("batch.labels", {B, Tn, H}), mf = g_.Floats("batch.mask", {B, Tn, H});
    ASSERT_FALSE(::testing::Test::HasFailure());
    const std::vector<T> x(xf.begin(), xf.end()), dt(dtf.begin(), dtf.end()), y(yf.begin(), yf.end()),
        m(mf.begin(), mf.end());
    const BatchView<T> batch{B, Tn, x, dt, y, m};
    const std::vector<T> params(g_.params.begin(), g_.params.end());
    ASSERT_EQ(params.size(), layout.total_size());

    CpuReference<T> model(layout);
    std::vector<T> logits(static_cast<size_t>(B) * Tn * H), grads(layout.total_size()),
        dx(static_cast<size_t>(B) * Tn * F);
    model.Forward(params, batch, logits);
    const T loss = model.LossAndGradients(params, batch, grads, dx);

    // S steps of clip + AdamW on the batch, as reference_dump and compare.py take them.
    std::vector<T> p = params, g(layout.total_size()), m1(layout.total_size(), T(0)), m2(layout.total_size(), T(0));
    std::vector<T> train_loss, train_norm;
    for (int step = 1; step <= g_.steps; ++step) {
      train_loss.push_back(model.LossAndGradients(p, batch, g));
      train_norm.push_back(static_cast<T>(ClipAndAdamW<T>(layout, g_.optimizer, step, p, g, m1, m2)));
    }

    std::map<std::string, std::pair<double, std::string>> worst;  // group: (err/bar, "name err (bar)")
    auto add = [&](const std::string& group, const std::string& key, std::span<const T> ours,
                   const std::vector<int64_t>& shape, double bar) {
      const std::vector<double> theirs = g_.Doubles("torch64." + key, shape);
      const double err = RelErr<T>(ours, theirs);
      EXPECT_LE(err, bar) << label << " vs torch64: " << key << " relative error " << err << " above " << bar;
      auto& w = worst[group];
      if (w.second.empty() || !(err / bar <= w.first)) {
        char text[160];
        std::snprintf(text, sizeof text, "%.3e (bar %.0e), worst: %s", err, bar, key.c_str());
        w = {err / bar, text};
      }
    };
    add("logits", "logits", logits, {B, Tn, H}, bar_values);
    add("loss", "loss", std::span<const T>(&loss, 1), {1}, bar_values);
    add("dx", "dx", dx, {B, Tn, F}, bar_gradients);
    add("train losses", "train.loss", train_loss, {g_.steps}, bar_values);
    add("train grad norms", "train.grad_norm", train_norm, {g_.steps}, bar_gradients);
    size_t trained = 0;
    for (const TensorSpec& t : layout.tensors()) {
      if (!t.trained) continue;
      ++trained;
      add("grads", "grad." + t.name, std::span<const T>(grads).subspan(t.offset, t.size), t.shape, bar_gradients);
      add(absl::StrCat("params after ", g_.steps, " steps"), absl::StrCat("step", g_.steps, ".", t.name),
          std::span<const T>(p).subspan(t.offset, t.size), t.shape, bar_gradients);
    }
    // Every gradient of the golden belongs to a tensor of ours (a renamed tensor is not silently unchecked).
    size_t golden_grads = 0;
    for (const auto& [key, tensor] : g_.file->tensors()) {
      if (key.starts_with("torch64.grad.") && !key.ends_with("@lo")) ++golden_grads;
    }
    EXPECT_EQ(golden_grads, trained) << "the golden's gradients are not the layout's trained tensors";
    for (const auto& [group, w] : worst) {
      std::printf("  %s vs torch64  %-24s %s\n", label, group.c_str(), w.second.c_str());
    }
  }

  Golden g_;
};

TEST_P(GoldenTest, CpuReferenceDoubleMatchesTorchFloat64) { Check<double>("cpu64", kBarF64, kBarF64); }

TEST_P(GoldenTest, CpuReferenceFloatMatchesTorchFloat64) {
  Check<float>("cpu32", kBarF32Values, kBarF32Gradients);
}

// What a golden's steps hold the clip to: torch's pre-clip norms against its max_norm. A regenerated golden whose
// steps no longer clip (or all clip) would leave a branch of the clip unchecked without this.
TEST_P(GoldenTest, ItsStepsClipAsItsCaseSays) {
  const std::vector<double> norms = g_.Doubles("torch64.train.grad_norm", {g_.steps});
  ASSERT_EQ(norms.size(), static_cast<size_t>(g_.steps));
  const auto clipped = std::count_if(norms.begin(), norms.end(),
                                     [&](double norm) { return norm > g_.optimizer.max_grad_norm; });
  std::printf("%ld of %d steps clipped at max_norm %g\n", static_cast<long>(clipped), g_.steps,
              g_.optimizer.max_grad_norm);
  if (GetParam().clips) {
    EXPECT_GT(clipped, 0);
    EXPECT_LT(clipped, g_.steps);
  } else {
    EXPECT_EQ(clipped, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Goldens, GoldenTest, ::testing::ValuesIn(kGoldens),
                         [](const ::testing::TestParamInfo<GoldenCase>& info) { return info.param.name; });

}  // namespace
}  // namespace perception
