// reference_dump: writes what our engine computes for one config, seeds and batch, so that the PyTorch
// reference (tests/reference/compare.py) can check it number by number against autograd (MODEL.md §8).
//
//   reference_dump --config tiny --out DIR [--param-seed 1] [--batch-seed 2] [--state-seed 3]
//                  [--batch B] [--window T] [--steps 10] [--lr 1e-2] [--max-norm 1.0]
//                  [--threads 0] [--state-streams 8] [--device cpu|cuda] [--float32 on|off]
//
// DIR/init.safetensors   the random parameters (tests/test_util.h RandomParams: every tensor perturbed, a
//                        random normalizer) as a checkpoint at step 0 (SaveCheckpoint), loaded by Python
//                        with its checkpoint loader exactly as users load ours.
// DIR/step5.safetensors  the float64 run's parameters, AdamW moments and step after 5 of the steps, as a
//                        checkpoint (float32, as every checkpoint): Python resumes from it.
// DIR/dump.safetensors   batch.{x,dt,labels,mask}; state.init.{conv,ssm,cfc} (random initial states of the
//                        first min(B, --state-streams) streams); and, per run, under a prefix (`cpu64` from CpuReference<double>, `cpu32`
//                        from CpuReference<float>):
//                          <p>.logits [B,T,H], <p>.loss [1], <p>.grad.<name>, <p>.dx [B,T,F],
//                          <p>.train.loss [S], <p>.train.grad_norm [S] (pre-clip, per step),
//                          <p>.step<S>.<name> (parameters after S steps of clip + AdamW on the batch),
//                          <p>.state.logits, <p>.state.final.{conv,ssm,cfc} (sequence path from the random
//                          initial states), <p>.stream.logits [T,H] (the step path over stream 0's events from
//                          its random initial state).
//                        A float64 value v is stored as two F32 tensors, `<key>` = float(v) and
//                        `<key>@lo` = float(v − float(v)), so Python recovers it to ~1e-14 relative.
//                        Metadata: format, config (JSON), seeds, steps, lr, max_norm, weight_decay, device,
//                        runs (the prefixes present).
//
// --device cuda adds the CUDA backend's float32 run (CudaModel, graphs on, as the daemon trains) under the prefix
// `dev32`: logits, loss, every gradient, the S training losses and pre-clip gradient norms, and the parameters
// after the S steps (the CUDA model computes no dx and has no per-stream state API here, so those keys are absent).
// --float32 off skips the `cpu32` run (the float64 one is the reference every other run is compared with).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "engine/cpu_reference.h"
#include "engine/optimizer.h"
#include "engine/param_layout.h"
#include "engine/precision.h"
#include "engine/safetensors.h"
#include "tests/test_util.h"

#if PERCEPTION_HAVE_CUDA
#include "engine/cuda_backend.h"
#include "engine/cuda_model.h"
#endif

namespace perception {
namespace {

// The exit code of a run that cannot happen here (ctest's SKIP_RETURN_CODE, as compare.py's).
constexpr int kSkipExitCode = 77;

struct Options {
  std::string config = "tiny";
  std::string out;
  std::string device = "cpu";
  uint64_t param_seed = 1, batch_seed = 2, state_seed = 3;
  int batch = 0, window = 0;  // 0: the config's
  int steps = 10;
  int save_step = 5;
  double lr = 1e-2, max_norm = 1.0;
  int threads = 0;
  int state_streams = 8;
  bool float32 = true;
  Precision precision = Precision::kFloat32;  // the CUDA backend's products (--device cuda)
};

[[noreturn]] void Usage(const std::string& error) {
  std::fprintf(stderr,
               "reference_dump: %s\n"
               "usage: reference_dump --config tiny|small|large --out DIR [--param-seed N] [--batch-seed N]\n"
               "         [--state-seed N] [--batch B] [--window T] [--steps S] [--lr X] [--max-norm X]\n"
               "         [--threads N] [--state-streams N] [--device cpu|cuda] [--float32 on|off]\n"
               "         [--precision fp32|3xtf32|tf32]\n",
               error.c_str());
  std::exit(2);
}

Options ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Usage(absl::StrCat(flag, " needs a value"));
    const std::string value = argv[++i];
    auto as_int = [&](int& out) {
      if (!absl::SimpleAtoi(value, &out)) Usage(absl::StrCat(flag, ": not an integer: ", value));
    };
    auto as_u64 = [&](uint64_t& out) {
      if (!absl::SimpleAtoi(value, &out)) Usage(absl::StrCat(flag, ": not an integer: ", value));
    };
    auto as_double = [&](double& out) {
      if (!absl::SimpleAtod(value, &out)) Usage(absl::StrCat(flag, ": not a number: ", value));
    };
    if (flag == "--config") o.config = value;
    else if (flag == "--out") o.out = value;
    else if (flag == "--device") o.device = value;
    else if (flag == "--param-seed") as_u64(o.param_seed);
    else if (flag == "--batch-seed") as_u64(o.batch_seed);
    else if (flag == "--state-seed") as_u64(o.state_seed);
    else if (flag == "--batch") as_int(o.batch);
    else if (flag == "--window") as_int(o.window);
    else if (flag == "--steps") as_int(o.steps);
    else if (flag == "--lr") as_double(o.lr);
    else if (flag == "--max-norm") as_double(o.max_norm);
    else if (flag == "--threads") as_int(o.threads);
    else if (flag == "--state-streams") as_int(o.state_streams);
    else if (flag == "--float32" && (value == "on" || value == "off")) o.float32 = value == "on";
    else if (flag == "--precision") {
      absl::StatusOr<Precision> precision = ParsePrecision(value);
      if (!precision.ok()) Usage(std::string(precision.status().message()));
      o.precision = *precision;
    }
    else Usage(absl::StrCat("unknown flag ", flag));
  }
  if (o.out.empty()) Usage("--out is required");
  if (o.steps < 1) Usage("--steps must be at least 1");
  if (o.state_streams < 1) Usage("--state-streams must be at least 1");
  o.save_step = std::max(1, o.steps / 2);
  return o;
}

// Collects the tensors of the dump; owns their storage until written.
class Dump {
 public:
  void Add(const std::string& name, std::vector<int64_t> shape, std::vector<float> data) {
    storage_.push_back(std::move(data));
    refs_.push_back({name, std::move(shape), storage_.back()});
  }
  template <typename T>
  void Add(const std::string& name, std::vector<int64_t> shape, std::span<const T> data) {
    std::vector<float> hi(data.size());
    for (size_t i = 0; i < data.size(); ++i) hi[i] = static_cast<float>(data[i]);
    if constexpr (std::is_same_v<T, double>) {
      std::vector<float> lo(data.size());
      for (size_t i = 0; i < data.size(); ++i) lo[i] = static_cast<float>(data[i] - static_cast<double>(hi[i]));
      Add(name + "@lo", shape, std::move(lo));
    }
    Add(name, std::move(shape), std::move(hi));
  }
  template <typename T>
  void Add(const std::string& name, std::vector<int64_t> shape, const std::vector<T>& data) {
    Add<T>(name, std::move(shape), std::span<const T>(data));
  }
  // Every tensor of the flat buffer `flat` under `prefix` + its name (trained tensors only, or all).
  template <typename T>
  void AddTensors(const std::string& prefix, const ParamLayout& layout, const std::vector<T>& flat, bool trained_only) {
    for (const TensorSpec& t : layout.tensors()) {
      if (trained_only && !t.trained) continue;
      Add<T>(prefix + t.name, t.shape, std::span<const T>(flat).subspan(t.offset, t.size));
    }
  }
  absl::Status Write(const std::string& path, const SafetensorsMetadata& metadata) const {
    return WriteSafetensors(path, refs_, metadata);
  }

 private:
  std::deque<std::vector<float>> storage_;
  std::vector<SafetensorsTensorRef> refs_;
};

template <typename T>
std::vector<T> Cast(const std::vector<float>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// A double as the shortest decimal text that reads back exactly.
std::string Exact(double v) {
  char buf[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "reference_dump: %s\n", std::string(status.message()).c_str());
    std::exit(1);
  }
}

// Everything one run computes, in its own precision.
template <typename T>
struct RunResult {
  std::vector<T> logits, grads, dx, params_after, state_logits, stream_logits;
  T loss = 0;
  std::vector<T> train_loss, train_grad_norm;
  std::vector<StreamState<T>> final_states;
  std::vector<float> params_saved, exp_avg_saved, exp_avg_sq_saved;  // at save_step, as a checkpoint holds them
};

// The CPU reference in precision T over the float inputs (exact in either precision).
template <typename T>
RunResult<T> RunCpu(const Options& o, const ParamLayout& layout, const std::vector<float>& params_f,
                    const testing::RandomBatch& batch_f, const std::vector<StreamState<float>>& init_states_f) {
  const ModelConfig& c = layout.config();
  const int B = batch_f.batch, Tn = batch_f.window, H = c.n_horizons, F = c.n_features;
  CpuReference<T> ref(layout, o.threads);
  const std::vector<T> params = Cast<T>(params_f);
  const auto typed = batch_f.As<T>();
  const BatchView<T> view = typed.view(B, Tn);
  RunResult<T> r;

  r.logits.resize(static_cast<size_t>(B) * Tn * H);
  ref.Forward(params, view, r.logits);
  r.grads.resize(layout.total_size());
  r.dx.resize(static_cast<size_t>(B) * Tn * F);
  r.loss = ref.LossAndGradients(params, view, r.grads, r.dx);

  // S steps of clip + AdamW on the same batch, as the trainer takes them.
  OptimizerConfig opt;
  opt.lr = o.lr;
  opt.max_grad_norm = o.max_norm;
  std::vector<T> p = params, g(layout.total_size()), m(layout.total_size(), T(0)), v(layout.total_size(), T(0));
  for (int step = 1; step <= o.steps; ++step) {
    r.train_loss.push_back(ref.LossAndGradients(p, view, g));
    r.train_grad_norm.push_back(static_cast<T>(ClipAndAdamW<T>(layout, opt, step, p, g, m, v)));
    if (step == o.save_step) {
      r.params_saved.assign(p.begin(), p.end());
      r.exp_avg_saved.assign(m.begin(), m.end());
      r.exp_avg_sq_saved.assign(v.begin(), v.end());
    }
  }
  r.params_after = std::move(p);

  // Carried state: the sequence path over the first Bs streams from random initial states, and the step path
  // over stream 0.
  std::vector<StreamState<T>> states;
  for (const auto& s : init_states_f) {
    states.push_back({Cast<T>(s.conv), Cast<T>(s.ssm), Cast<T>(s.cfc)});
  }
  const int Bs = static_cast<int>(states.size());
  StreamState<T> stream = states[0];
  BatchView<T> sub = view;
  sub.batch = Bs;
  sub.x = view.x.first(static_cast<size_t>(Bs) * Tn * F);
  sub.dt = view.dt.first(static_cast<size_t>(Bs) * Tn);
  sub.labels = view.labels.first(static_cast<size_t>(Bs) * Tn * H);
  sub.mask = view.mask.first(static_cast<size_t>(Bs) * Tn * H);
  r.state_logits.resize(static_cast<size_t>(Bs) * Tn * H);
  ref.Forward(params, sub, r.state_logits, states);
  r.final_states = std::move(states);
  r.stream_logits.resize(static_cast<size_t>(Tn) * H);
  for (int t = 0; t < Tn; ++t) {
    ref.Step(params, std::span<const T>(typed.x).subspan(static_cast<size_t>(t) * F, F), typed.dt[t], stream,
             std::span<T>(r.stream_logits).subspan(static_cast<size_t>(t) * H, H));
  }
  return r;
}

#if PERCEPTION_HAVE_CUDA
// The CUDA backend's float32 run over the same parameters and batch: what RunCpu computes, less dx and the
// carried-state and step-path outputs.
RunResult<float> RunCuda(const Options& o, const ParamLayout& layout, const std::vector<float>& params,
                         const testing::RandomBatch& batch) {
  const ModelConfig& c = layout.config();
  OptimizerConfig opt;
  opt.lr = o.lr;
  opt.max_grad_norm = o.max_norm;
  CudaModelOptions options;
  options.precision = o.precision;
  auto model = CudaModel::Create(c, opt, params, options);
  Check(model.status());
  CudaModel& m = **model;
  const BatchView<float> view = batch.view();
  RunResult<float> r;
  Check(m.StageBatch(view));
  Check(m.EnqueueEvaluate(/*carry_state=*/false));
  auto report = m.Wait();
  Check(report.status());
  r.logits.assign(m.StagedLogits().begin(), m.StagedLogits().end());
  Check(m.EnqueueGradients());
  report = m.Wait();
  Check(report.status());
  r.loss = static_cast<float>(report->loss);
  auto grads = m.DownloadGrads();
  Check(grads.status());
  r.grads = std::move(*grads);
  for (int step = 1; step <= o.steps; ++step) {
    Check(m.StageBatch(view));
    Check(m.EnqueueTrainStep());
    report = m.Wait();
    Check(report.status());
    r.train_loss.push_back(static_cast<float>(report->loss));
    r.train_grad_norm.push_back(static_cast<float>(report->grad_norm));
  }
  auto after = m.DownloadParams();
  Check(after.status());
  r.params_after = std::move(*after);
  return r;
}
#endif

template <typename T>
void AddStates(Dump& dump, const std::string& prefix, const ModelConfig& c, const std::vector<StreamState<T>>& states) {
  const int64_t B = static_cast<int64_t>(states.size()), L = c.n_layers;
  std::vector<T> conv, ssm, cfc;
  for (const auto& s : states) {
    conv.insert(conv.end(), s.conv.begin(), s.conv.end());
    ssm.insert(ssm.end(), s.ssm.begin(), s.ssm.end());
    cfc.insert(cfc.end(), s.cfc.begin(), s.cfc.end());
  }
  // Per stream, layer-major: conv [B, L, W-1, E+2N], ssm [B, L, Hh, P, N], cfc [B, C].
  dump.Add<T>(prefix + "conv", {B, L, c.d_conv - 1, c.conv_dim()}, conv);
  dump.Add<T>(prefix + "ssm", {B, L, c.n_heads(), c.headdim, c.d_state}, ssm);
  dump.Add<T>(prefix + "cfc", {B, c.cfc_units}, cfc);
}

template <typename T>
void AddRun(Dump& dump, const std::string& prefix, const Options& o, const ParamLayout& layout, int B, int Tn,
            const RunResult<T>& r) {
  const ModelConfig& c = layout.config();
  const int64_t H = c.n_horizons, F = c.n_features;
  dump.Add<T>(prefix + ".logits", {B, Tn, H}, r.logits);
  dump.Add<T>(prefix + ".loss", {1}, std::vector<T>{r.loss});
  dump.AddTensors<T>(prefix + ".grad.", layout, r.grads, /*trained_only=*/true);
  dump.Add<T>(prefix + ".train.loss", {o.steps}, r.train_loss);
  dump.Add<T>(prefix + ".train.grad_norm", {o.steps}, r.train_grad_norm);
  dump.AddTensors<T>(absl::StrCat(prefix, ".step", o.steps, "."), layout, r.params_after, /*trained_only=*/true);
  // A device run (RunCuda) computes no dx, carried state or step path: those keys are absent from its prefix.
  if (r.dx.empty()) return;
  dump.Add<T>(prefix + ".dx", {B, Tn, F}, r.dx);
  dump.Add<T>(prefix + ".state.logits", {static_cast<int64_t>(r.final_states.size()), Tn, H}, r.state_logits);
  AddStates<T>(dump, prefix + ".state.final.", c, r.final_states);
  dump.Add<T>(prefix + ".stream.logits", {Tn, H}, r.stream_logits);
}

int Main(int argc, char** argv) {
  const Options o = ParseOptions(argc, argv);
  if (o.device != "cpu" && o.device != "cuda") Usage(absl::StrCat("--device ", o.device, ": cpu or cuda"));
#if PERCEPTION_HAVE_CUDA
  if (o.device == "cuda") {
    if (const absl::Status available = CudaDeviceAvailable(); !available.ok()) {
      std::fprintf(stderr, "SKIP: --device cuda needs a CUDA device: %s\n", std::string(available.message()).c_str());
      return kSkipExitCode;
    }
  }
#else
  if (o.device == "cuda") Usage("--device cuda: this build has no CUDA backend (PERCEPTION_CUDA=OFF)");
#endif
  absl::StatusOr<ModelConfig> named = NamedConfig(o.config);
  Check(named.status());
  ModelConfig config = *named;
  if (o.batch > 0) config.batch = o.batch;
  if (o.window > 0) config.window = o.window;
  config.warmup = std::min(config.warmup, config.window - 1);
  Check(ValidateConfig(config));
  const ParamLayout layout(config);
  const int B = config.batch, Tn = config.window;

  const std::vector<float> params = testing::RandomParams(layout, o.param_seed);
  const testing::RandomBatch batch = testing::MakeRandomBatch(config, B, Tn, o.batch_seed);
  std::vector<StreamState<float>> init_states;
  // The carried-state check runs over the first few streams only (the states of `small` are 128 KiB a stream).
  for (int b = 0; b < std::min(B, o.state_streams); ++b) {
    init_states.push_back(testing::RandomState<float>(config, o.state_seed * 1000003 + b));
  }

  std::filesystem::create_directories(o.out);
  const std::string dir = o.out + "/";
  Checkpoint init{config,
                  params,
                  std::vector<float>(params.size(), 0.f),
                  std::vector<float>(params.size(), 0.f),
                  0,
                  std::nullopt};
  Check(SaveCheckpoint(dir + "init.safetensors", init));

  std::fprintf(stderr, "reference_dump: %s B=%d T=%d, %zu trained parameters; float64 run...\n", o.config.c_str(),
               B, Tn, layout.trained_count());
  const RunResult<double> r64 = RunCpu<double>(o, layout, params, batch, init_states);
  std::vector<std::string> runs = {"cpu64"};
  RunResult<float> r32, dev32;
  if (o.float32) {
    std::fprintf(stderr, "reference_dump: float32 run...\n");
    r32 = RunCpu<float>(o, layout, params, batch, init_states);
    runs.push_back("cpu32");
  }
#if PERCEPTION_HAVE_CUDA
  if (o.device == "cuda") {
    std::fprintf(stderr, "reference_dump: CUDA float32 run...\n");
    dev32 = RunCuda(o, layout, params, batch);
    runs.push_back("dev32");
  }
#endif

  Checkpoint saved{config, r64.params_saved, r64.exp_avg_saved, r64.exp_avg_sq_saved, o.save_step, std::nullopt};
  Check(SaveCheckpoint(dir + "step" + std::to_string(o.save_step) + ".safetensors", saved));

  Dump dump;
  dump.Add("batch.x", {B, Tn, config.n_features}, std::vector<float>(batch.x));
  dump.Add("batch.dt", {B, Tn}, std::vector<float>(batch.dt));
  dump.Add("batch.labels", {B, Tn, config.n_horizons}, std::vector<float>(batch.labels));
  dump.Add("batch.mask", {B, Tn, config.n_horizons}, std::vector<float>(batch.mask));
  AddStates<float>(dump, "state.init.", config, init_states);
  AddRun<double>(dump, "cpu64", o, layout, B, Tn, r64);
  if (o.float32) AddRun<float>(dump, "cpu32", o, layout, B, Tn, r32);
  if (o.device == "cuda") AddRun<float>(dump, "dev32", o, layout, B, Tn, dev32);
  const SafetensorsMetadata metadata = {
      {"format", "perception-reference-dump-v1"},
      {"config", ConfigToJson(config)},
      {"config_name", o.config},
      {"param_seed", absl::StrCat(o.param_seed)},
      {"batch_seed", absl::StrCat(o.batch_seed)},
      {"state_seed", absl::StrCat(o.state_seed)},
      {"steps", absl::StrCat(o.steps)},
      {"save_step", absl::StrCat(o.save_step)},
      {"lr", Exact(o.lr)},
      {"max_norm", Exact(o.max_norm)},
      {"weight_decay", Exact(OptimizerConfig{}.weight_decay)},
      {"device", o.device},
      {"runs", absl::StrJoin(runs, ",")},
  };
  Check(dump.Write(dir + "dump.safetensors", metadata));
  std::fprintf(stderr, "reference_dump: wrote %sdump.safetensors, init.safetensors, step%d.safetensors "
               "(loss %.9g, float64)\n", dir.c_str(), o.save_step, r64.loss);
  return 0;
}

}  // namespace
}  // namespace perception

int main(int argc, char** argv) { return perception::Main(argc, argv); }
