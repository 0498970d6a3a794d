// `perception`: offline training, evaluation and checkpoint inspection on the engine (no daemon).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/atomic_file.h"
#include "engine/checkpoint.h"
#include "engine/cli/arguments.h"
#include "engine/cli/interruption.h"
#include "engine/config.h"
#include "engine/backend.h"
#include "engine/dataset.h"
#include "engine/host_allocation.h"
#include "engine/lobster.h"
#include "engine/npy.h"
#include "engine/precision.h"
#include "engine/status_macros.h"
#include "spdlog/spdlog.h"

PERCEPTION_FLAG(std::string, device, "cpu", "compute device: cpu, cuda, or auto (cuda when a device is present)");
PERCEPTION_FLAG(std::string, graphs, "on",
    "CUDA graphs for the training step: on, or off to run it eagerly (debugging)");
PERCEPTION_FLAG(std::string, precision, "auto",
    "the CUDA backend's linear-layer products: auto (3xtf32 on CUDA, fp32 on the CPU), fp32 (cuBLAS float32), "
    "3xtf32 (float32 accuracy on the TF32 tensor cores, held to fp32's bars) or tf32 (inputs rounded to TF32)");
PERCEPTION_FLAG(std::string, config, "small", "model config: tiny, small or large");
PERCEPTION_FLAG(std::vector<std::string>, lobster, {}, "ORDERBOOK,MESSAGES: a LOBSTER file pair");
PERCEPTION_FLAG(int, levels, 0,
    "book levels to read: the orderbook file's first (best) levels (0: all, inferred from its column count)");
PERCEPTION_FLAG(int, steps, 200,
    "optimizer steps (>= 1); train --checkpoint: the rest of the checkpoint's schedule unless given");
PERCEPTION_FLAG(int, batch, 0, "windows per batch (0: the config's; below 0 is refused)");
PERCEPTION_FLAG(int, window, 0, "events per window (0: the config's; below 0 is refused)");
PERCEPTION_FLAG(int, warmup, -1,
    "leading window positions masked out of the loss (-1: the config's; below -1 is refused)");
PERCEPTION_FLAG(double, lr, 1e-3, "peak learning rate");
PERCEPTION_FLAG(std::string, lr_schedule, "cosine",
    "constant, or cosine (linear warmup to --lr, then cosine decay to --lr/10 at --steps)");
PERCEPTION_FLAG(int, lr_warmup_steps, 20,
    "warmup steps of the cosine schedule, >= 0 and < --steps (left unset: 20, or --steps - 1 if that is less)");
PERCEPTION_FLAG(double, weight_decay, 0.01, "AdamW decoupled weight decay");
PERCEPTION_FLAG(double, max_grad_norm, 1.0, "global gradient-norm clip (<= 0: off)");
PERCEPTION_FLAG(uint64_t, seed, 1, "seed for initialization and window sampling");
PERCEPTION_FLAG(double, train_fraction, 0.7,
    "leading fraction of the events used for training; the rest validates (eval, where given: its loss over the "
    "rest too, the part train held out)");
PERCEPTION_FLAG(int, log_every, 25, "steps between progress lines");
PERCEPTION_FLAG(int, val_every, 100, "steps between validation passes (0: only at the end; below 0 is refused)");
PERCEPTION_FLAG(std::string, save, "", "train: checkpoint path to write after training (required)");
PERCEPTION_FLAG(std::string, save_best, "",
    "train: checkpoint path that holds the model of the run's lowest validation loss, written at each validation "
    "that beats the run's best (optional)");
PERCEPTION_FLAG(std::string, checkpoint, "",
    "eval: checkpoint to evaluate; train: checkpoint to train on from (its config, model, optimizer state and "
    "settings, step and normalizer; without it, train starts from a fresh initialization of --config)");
PERCEPTION_FLAG(std::string, out, "", "eval: logits [events, H] float32 .npy");
PERCEPTION_FLAG(std::string, features_out, "",
    "eval: features [events, F+1] float32 .npy (F raw features, then dt)");

namespace perception {
namespace {

constexpr char kUsage[] = R"(train, evaluate and inspect PerceptionNet v1 offline.

  perception train [--config NAME] --lobster ORDERBOOK,MESSAGES [--levels N] [--steps N] [--batch B] [--window T]
                   [--lr X] [--seed S] [--device cpu|cuda|auto] [--precision P] [--graphs on|off]
                   [--val_every N] [--save_best CKPT] --save CKPT
  (--config defaults to small, --steps to 200)
  perception train --checkpoint CKPT --lobster ORDERBOOK,MESSAGES [--steps N] [--seed S] ... --save CKPT
  (trains on from CKPT with its config, optimizer and normalizer, for the rest of its schedule unless --steps is
   given; with the --lobster, --seed and --train_fraction of the run that saved it, on the batches that run would
   have trained next: an interrupted run resumed ends where the whole run would have, bit for bit)
  perception eval --checkpoint CKPT --lobster ORDERBOOK,MESSAGES [--levels N] --out LOGITS.npy
                  [--features_out FEATURES.npy] [--train_fraction F] [--device cpu|cuda|auto] [--precision P]
  (--device defaults to cpu)
  perception inspect CKPT
  (a subcommand refuses the flags it does not read, such as eval --config))";

absl::StatusOr<LobsterData> ReadLobsterFlag() {
  const std::vector<std::string> files = absl::GetFlag(FLAGS_lobster);
  if (files.size() != 2) {
    return absl::InvalidArgumentError("--lobster takes two files: ORDERBOOK,MESSAGES");
  }
  if (const int levels = absl::GetFlag(FLAGS_levels); levels < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--levels must be >= 0 (0: all of the files' levels), got ", levels));
  }
  return ReadLobster(files[0], files[1], absl::GetFlag(FLAGS_levels));
}

BatchView<float> View(const Batch& b) { return {b.batch, b.window, b.x, b.dt, b.labels, b.mask}; }

// The flags and the subcommands that read them (CheckFlagsTakenBy refuses the rest).
const std::vector<FlagUse>& FlagUses() {
  static const auto* const uses = new std::vector<FlagUse>{
      {FLAGS_device, {"train", "eval"}},
      {FLAGS_precision, {"train", "eval"}},
      {FLAGS_lobster, {"train", "eval"}},
      {FLAGS_levels, {"train", "eval"}},
      {FLAGS_graphs, {"train"}},
      {FLAGS_config, {"train"}},
      {FLAGS_steps, {"train"}},
      {FLAGS_batch, {"train"}},
      {FLAGS_window, {"train"}},
      {FLAGS_warmup, {"train"}},
      {FLAGS_lr, {"train"}},
      {FLAGS_lr_schedule, {"train"}},
      {FLAGS_lr_warmup_steps, {"train"}},
      {FLAGS_weight_decay, {"train"}},
      {FLAGS_max_grad_norm, {"train"}},
      {FLAGS_seed, {"train"}},
      {FLAGS_train_fraction, {"train", "eval"}},
      {FLAGS_log_every, {"train"}},
      {FLAGS_val_every, {"train"}},
      {FLAGS_save, {"train"}},
      {FLAGS_save_best, {"train"}},
      {FLAGS_checkpoint, {"train", "eval"}},
      {FLAGS_out, {"eval"}},
      {FLAGS_features_out, {"eval"}},
  };
  return *uses;
}

// Whether `a` and `b` name one file: one inode where both exist, else one absolute path once symlinks and dots
// resolve (weakly_canonical leaves a relative path to a file not there yet relative: x.npy against ./x.npy).
bool SameFile(const std::string& a, const std::string& b) {
  std::error_code error;
  if (std::filesystem::equivalent(a, b, error)) return true;
  const auto resolved = [&error](const std::string& path) {
    return std::filesystem::weakly_canonical(std::filesystem::absolute(path, error), error);
  };
  const std::filesystem::path resolved_a = resolved(a);
  if (error) return a == b;
  const std::filesystem::path resolved_b = resolved(b);
  return error ? a == b : resolved_a == resolved_b;
}

// A path a subcommand writes or reads, by the flag that names it.
struct NamedPath {
  std::string flag, path;
};
// Refuses an output that names an input or another output: `eval --out X --features_out X` kept only the features,
// and `eval --out CKPT --checkpoint CKPT` replaced the checkpoint with logits, each with exit code 0.
absl::Status CheckOutputsDistinct(std::span<const NamedPath> outputs, std::span<const NamedPath> inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (const NamedPath& other : outputs.subspan(i + 1)) {
      if (SameFile(outputs[i].path, other.path)) {
        return absl::InvalidArgumentError(absl::StrCat(outputs[i].flag, " and ", other.flag, " name one file ('",
                                                       other.path, "'): the second would overwrite the first"));
      }
    }
    for (const NamedPath& input : inputs) {
      if (SameFile(outputs[i].path, input.path)) {
        return absl::InvalidArgumentError(absl::StrCat(outputs[i].flag, " names the file ", input.flag,
                                                       " reads ('", input.path, "'): writing it would destroy it"));
      }
    }
  }
  return absl::OkStatus();
}

// The outputs a subcommand writes only after its work: distinct from each other and from its inputs, and each a
// destination that takes a new file, so that a run fails before the work and before any of them is written.
absl::Status CheckOutputsBeforeTheWork(std::span<const NamedPath> outputs, std::span<const NamedPath> inputs) {
  RETURN_IF_ERROR(CheckOutputsDistinct(outputs, inputs));
  for (const NamedPath& output : outputs) RETURN_IF_ERROR(CheckWritableDestination(output.path));
  return absl::OkStatus();
}

// --lobster's two files, as inputs CheckOutputsDistinct compares outputs with.
std::vector<NamedPath> LobsterInputs() {
  std::vector<NamedPath> inputs;
  for (const std::string& file : absl::GetFlag(FLAGS_lobster)) inputs.push_back({"--lobster", file});
  return inputs;
}

// --lr, --weight_decay and --max_grad_norm, at a constant rate (not yet validated as a whole).
absl::StatusOr<OptimizerConfig> RateFromFlags() {
  OptimizerConfig o;
  o.lr = absl::GetFlag(FLAGS_lr);
  RETURN_IF_ERROR(CheckFinitePositive("lr", o.lr));
  o.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  o.max_grad_norm = absl::GetFlag(FLAGS_max_grad_norm);
  return o;
}

absl::StatusOr<OptimizerConfig> OptimizerFromFlags() {
  ASSIGN_OR_RETURN(OptimizerConfig o, RateFromFlags());
  ASSIGN_OR_RETURN(o.schedule, ParseLrSchedule(absl::GetFlag(FLAGS_lr_schedule)));
  o.total_steps = absl::GetFlag(FLAGS_steps);
  const int warmup_steps = absl::GetFlag(FLAGS_lr_warmup_steps);
  if (warmup_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--lr_warmup_steps must be >= 0, got ", warmup_steps));
  }
  if (o.schedule == LrSchedule::kConstant && FlagGiven(FLAGS_lr_warmup_steps)) {
    return absl::InvalidArgumentError(
        "--lr_warmup_steps sets the cosine schedule: with --lr_schedule constant it would be ignored");
  }
  // The cosine schedule needs warmup_steps < total_steps (ValidateOptimizerConfig). A warmup asked for that does not
  // fit is refused rather than shortened behind the user's back; only the default (20) is cut to fit a short run.
  if (o.schedule == LrSchedule::kWarmupCosine && FlagGiven(FLAGS_lr_warmup_steps) &&
      warmup_steps >= o.total_steps) {
    return absl::InvalidArgumentError(absl::StrCat("--lr_warmup_steps (", warmup_steps, ") must be < --steps (",
                                                   o.total_steps, ") for the cosine schedule"));
  }
  o.warmup_steps = std::min<int64_t>(warmup_steps, o.total_steps - 1);
  o.min_lr = o.lr * 0.1;
  RETURN_IF_ERROR(ValidateOptimizerConfig(o));
  return o;
}

// The backend of --device with the products of --precision.
absl::StatusOr<std::unique_ptr<Backend>> BackendFromFlags(const ModelConfig& config, const OptimizerConfig& optimizer,
                                                          std::vector<float> params) {
  ASSIGN_OR_RETURN(const std::optional<Precision> precision, ParsePrecisionChoice(absl::GetFlag(FLAGS_precision)));
  return MakeBackend(absl::GetFlag(FLAGS_device), config, optimizer, std::move(params), nullptr, precision);
}

absl::StatusOr<ModelConfig> TrainingConfig(int levels) {
  ASSIGN_OR_RETURN(ModelConfig config, NamedConfig(absl::GetFlag(FLAGS_config)));
  config.n_features = LobsterFeatureCount(levels);
  if (absl::GetFlag(FLAGS_batch) > 0) config.batch = absl::GetFlag(FLAGS_batch);
  if (absl::GetFlag(FLAGS_window) > 0) config.window = absl::GetFlag(FLAGS_window);
  if (absl::GetFlag(FLAGS_warmup) >= 0) config.warmup = absl::GetFlag(FLAGS_warmup);
  RETURN_IF_ERROR(ValidateConfig(config));
  return config;
}

// Only 0 (--batch, --window) and -1 (--warmup) stand for the config's value: any other value out of range is refused
// here, before any data is read, instead of being quietly replaced by the config's.
absl::Status CheckShapeFlags() {
  if (const int batch = absl::GetFlag(FLAGS_batch); batch < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--batch must be >= 0 (0: the config's), got ", batch));
  }
  if (const int window = absl::GetFlag(FLAGS_window); window < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--window must be >= 0 (0: the config's), got ", window));
  }
  if (const int warmup = absl::GetFlag(FLAGS_warmup); warmup < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--warmup must be >= 0, or -1 for the config's, got ", warmup));
  }
  return absl::OkStatus();
}

// The backend's model and optimizer state with the run's optimizer settings, written to `path`; its step.
absl::StatusOr<int64_t> SaveModel(Backend& backend, const OptimizerConfig& optimizer, const std::string& path) {
  ASSIGN_OR_RETURN(Checkpoint checkpoint, backend.ExportState());
  checkpoint.optimizer = optimizer;
  RETURN_IF_ERROR(SaveCheckpoint(path, checkpoint));
  return checkpoint.step;
}

// --save_best: the model of the run's lowest validation loss so far, written to `path` whenever a validation beats
// it (nothing where `path` is empty). A run on one day overfits it (the shipped AMZN day's validation is lowest
// near step 50 of the default 200 steps), and --save keeps the last model.
class BestModel {
 public:
  BestModel(std::string path, const OptimizerConfig& optimizer) : path_(std::move(path)), optimizer_(optimizer) {}

  // A failed write is kept for Report and ends the offers, not the run: the steps and --save's model are not lost
  // to a full disk.
  void Offer(Backend& backend, double val_loss) {
    if (path_.empty() || !failure_.ok() || !(val_loss < loss_)) return;
    absl::StatusOr<int64_t> step = SaveModel(backend, optimizer_, path_);
    if (step.ok()) {
      loss_ = val_loss;
      step_ = *step;
    } else {
      failure_ = step.status();
      spdlog::error("--save_best {} not written: {}; the run goes on", path_, failure_.ToString());
    }
  }
  // The best's line; an error where a write failed or no validation loss was finite (a file already at the path
  // is not this run's best).
  absl::Status Report() const {
    if (path_.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(failure_);
    if (!std::isfinite(loss_)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--save_best ", path_, " not written: no validation loss was finite"));
    }
    std::printf("best validation loss %.5f at step %lld: saved %s\n", loss_, static_cast<long long>(step_),
                path_.c_str());
    return absl::OkStatus();
  }

 private:
  std::string path_;
  OptimizerConfig optimizer_;
  absl::Status failure_;
  double loss_ = INFINITY;
  int64_t step_ = 0;
};

// What train starts from: a fresh initialization of --config with the optimizer of the flags, or --checkpoint's model
// (its step, moments and normalizer in `resumed`) with the checkpoint's optimizer settings.
struct StartingPoint {
  OptimizerConfig optimizer;
  std::optional<Checkpoint> resumed;
  int64_t step() const { return resumed.has_value() ? resumed->step : 0; }
};

// Flags that set what a checkpoint holds: train --checkpoint refuses them rather than train on with a model or a
// schedule other than the one asked for. A checkpoint without optimizer settings (another program wrote it) takes
// --lr, --weight_decay and --max_grad_norm, at a constant rate: a schedule's steps would need a start it does not hold.
absl::Status CheckNoSettingOfTheCheckpoint(bool holds_optimizer) {
  const std::pair<const char*, bool> shape[] = {{"config", FlagGiven(FLAGS_config)},
                                                {"batch", FlagGiven(FLAGS_batch)},
                                                {"window", FlagGiven(FLAGS_window)},
                                                {"warmup", FlagGiven(FLAGS_warmup)}};
  const std::pair<const char*, bool> rate[] = {{"lr", FlagGiven(FLAGS_lr)},
                                               {"weight_decay", FlagGiven(FLAGS_weight_decay)},
                                               {"max_grad_norm", FlagGiven(FLAGS_max_grad_norm)}};
  const std::pair<const char*, bool> schedule[] = {{"lr_schedule", FlagGiven(FLAGS_lr_schedule)},
                                                   {"lr_warmup_steps", FlagGiven(FLAGS_lr_warmup_steps)}};
  const auto refuse_given = [](std::span<const std::pair<const char*, bool>> flags, std::string_view why) {
    for (const auto& [name, given] : flags) {
      if (given) return absl::InvalidArgumentError(absl::StrCat("--", name, std::string(why)));
    }
    return absl::OkStatus();
  };
  constexpr std::string_view kTheCheckpoints =
      " is the checkpoint's where train goes on from --checkpoint (its model, optimizer and schedule)";
  RETURN_IF_ERROR(refuse_given(shape, kTheCheckpoints));
  if (holds_optimizer) RETURN_IF_ERROR(refuse_given(rate, kTheCheckpoints));
  return refuse_given(schedule, holds_optimizer ? kTheCheckpoints
                                                : " sets a schedule, which a run from a checkpoint without optimizer "
                                                  "settings does not take: it trains at the constant --lr");
}

// --checkpoint's model and settings; --steps, where not given, set to the rest of its schedule.
absl::StatusOr<StartingPoint> ResumedFrom(const std::string& path, int& steps) {
  ASSIGN_OR_RETURN(Checkpoint checkpoint, LoadCheckpoint(path));
  RETURN_IF_ERROR(CheckNoSettingOfTheCheckpoint(checkpoint.optimizer.has_value()));
  StartingPoint start;
  if (checkpoint.optimizer.has_value()) {
    start.optimizer = *checkpoint.optimizer;
  } else {
    ASSIGN_OR_RETURN(start.optimizer, RateFromFlags());
    RETURN_IF_ERROR(ValidateOptimizerConfig(start.optimizer));
    spdlog::warn("{} holds no optimizer settings: it trains on at a constant rate, --lr {} (weight decay {}, "
                 "gradient-norm clip {})", path, start.optimizer.lr, start.optimizer.weight_decay,
                 start.optimizer.max_grad_norm);
  }
  if (!FlagGiven(FLAGS_steps)) {
    const int64_t total = start.optimizer.total_steps, rest = total - checkpoint.step;
    if (total == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, checkpoint.optimizer.has_value() ? " sets no number of steps (a constant rate, as a daemon's model "
                                                   "has where no --total_steps was given)"
                                                 : " holds no optimizer settings",
          ": give --steps N"));
    }
    if (rest <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " is at step ", checkpoint.step, ", where its schedule of ", total,
          " steps ends: give --steps N to train on past it (at the schedule's last rate)"));
    }
    if (rest > std::numeric_limits<int>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("the rest of ", path, "'s schedule (", rest, " steps) is more "
                                                     "than one run takes: give --steps N"));
    }
    steps = static_cast<int>(rest);
  }
  start.resumed = std::move(checkpoint);
  return start;
}

// How an interrupted run that saved the model of `step` to `save` goes on: resumed from it, the rest of `steps`, on
// the batches it would have trained.
std::string HowToTrainTheRest(const StartingPoint& start, int steps, int64_t step, const std::string& save) {
  const int64_t rest = start.step() + steps - step, rest_of_schedule = start.optimizer.total_steps - step;
  return absl::StrCat("; to train the remaining ", rest, " steps on the batches this run would have, run perception "
                      "train --checkpoint ", save, rest == rest_of_schedule ? "" : absl::StrCat(" --steps ", rest),
                      " with this run's --lobster, --levels, --seed, --train_fraction, --device and --precision");
}

absl::Status Train() {
  RETURN_IF_ERROR(CheckAtLeastOne({{"steps", absl::GetFlag(FLAGS_steps)}}));
  RETURN_IF_ERROR(CheckShapeFlags());
  if (const int val_every = absl::GetFlag(FLAGS_val_every); val_every < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--val_every must be >= 0 (0: only at the end), got ", val_every));
  }
  const std::string resume = absl::GetFlag(FLAGS_checkpoint);
  if (resume.empty() && FlagGiven(FLAGS_checkpoint)) return absl::InvalidArgumentError("--checkpoint needs a path");
  // Before the files are read (SplitByTime's refusal came after, and said the split "leaves an empty part").
  RETURN_IF_ERROR(CheckOpenFraction("train_fraction", absl::GetFlag(FLAGS_train_fraction)));
  if (absl::GetFlag(FLAGS_save).empty()) return absl::InvalidArgumentError("train needs --save CKPT");
  std::vector<NamedPath> outputs = {{"--save", absl::GetFlag(FLAGS_save)}};
  if (const std::string save_best = absl::GetFlag(FLAGS_save_best); !save_best.empty()) {
    outputs.push_back({"--save_best", save_best});
  } else if (FlagGiven(FLAGS_save_best)) {
    return absl::InvalidArgumentError("--save_best needs a checkpoint path");
  }
  // A resumed run may save over its --checkpoint: that is read whole first, and written once the run is done.
  RETURN_IF_ERROR(CheckOutputsBeforeTheWork(outputs, LobsterInputs()));
  int steps = absl::GetFlag(FLAGS_steps);
  // The schedule does not depend on the data: a bad one fails before the data is read.
  StartingPoint start;
  if (resume.empty()) {
    ASSIGN_OR_RETURN(start.optimizer, OptimizerFromFlags());
  } else {
    ASSIGN_OR_RETURN(start, ResumedFrom(resume, steps));
  }
  ASSIGN_OR_RETURN(LobsterData data, ReadLobsterFlag());
  ModelConfig config;
  if (start.resumed.has_value()) {
    config = start.resumed->config;
    RETURN_IF_ERROR(CheckLobsterFeatureCount(data.levels, config.n_features, "the checkpoint"));
  } else {
    ASSIGN_OR_RETURN(config, TrainingConfig(data.levels));
  }
  ASSIGN_OR_RETURN(EventSeries series, BuildSeries(data, config.horizons));
  ASSIGN_OR_RETURN(SplitSeries split, SplitByTime(series, absl::GetFlag(FLAGS_train_fraction)));
  spdlog::info("{} events at {} levels: {} train, {} validation; config {} (F={}, T={}, B={}){}", series.size(),
               data.levels, split.train.size(), split.validation.size(),
               start.resumed.has_value() ? "of the checkpoint" : absl::GetFlag(FLAGS_config), config.n_features,
               config.window, config.batch,
               start.resumed.has_value() ? absl::StrCat("; from step ", start.step(), " of ", resume) : "");

  ParamLayout layout(config);
  std::vector<float> params;
  Normalizer normalizer;
  if (start.resumed.has_value()) {
    params = start.resumed->params;
    normalizer = ReadNormalizer(layout, params);
    if (const std::string warning = FlooredFeaturesVaryWarning(normalizer, series); !warning.empty()) {
      spdlog::warn("{}", warning);
    }
  } else {
    params.resize(layout.total_size());
    InitializeParameters(layout, absl::GetFlag(FLAGS_seed), params);
    normalizer = FitNormalizer(split.train);
    if (const std::string warning = UnvaryingFeaturesWarning(normalizer, split.train.size()); !warning.empty()) {
      spdlog::warn("{}", warning);
    }
    WriteNormalizer(layout, normalizer, params);
  }
  // A validation event can lie far out under a std fitted on the training part (floored where a feature did not
  // vary there): as eval, the run refuses it rather than train and validate on outputs that are not MODEL.md's.
  RETURN_IF_ERROR(CheckSeriesStandardizedRange(normalizer, series));
  const std::string graphs = absl::GetFlag(FLAGS_graphs);
  if (graphs != "on" && graphs != "off") {
    return absl::InvalidArgumentError(absl::StrCat("--graphs takes on or off, not '", graphs, "'"));
  }
  RETURN_IF_ERROR(CheckAtLeastOne({{"log_every", absl::GetFlag(FLAGS_log_every)}}));
  const OptimizerConfig& optimizer = start.optimizer;
  // Made before the backend starts any thread (CUDA's, the CPU backend's), which must inherit its blocked signals.
  Interruption interruption("no further step is taken; the model is validated and saved to --save (again: end at "
                            "once, nothing saved)",
                            "the run ends without saving");
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, BackendFromFlags(config, optimizer, std::move(params)));
  if (start.resumed.has_value()) RETURN_IF_ERROR(backend->ImportState(*start.resumed));
  backend->set_use_graphs(graphs == "on");
  spdlog::info("device {} ({} products)", backend->device_name(), PrecisionName(backend->precision()));

  RETURN_IF_ERROR(CheckTrainingPart(split.train));
  ASSIGN_OR_RETURN(WindowSampler sampler,
                   WindowSampler::Create(split.train, config.window, config.warmup, absl::GetFlag(FLAGS_seed)));
  // The batches of the steps the checkpoint holds, had it come from a run with this run's data and seed.
  sampler.Skip(config.batch, start.step());
  const Batch validation = SequentialWindows(split.validation, config.window, config.warmup);
  RETURN_IF_ERROR(CheckValidationWindows(validation));
  const double prior_loss = PriorBaselineLoss(ClassPrior(split.train), validation.labels, validation.mask);
  std::printf("class-prior baseline on validation (%d windows): %.5f\n", validation.batch, prior_loss);

  // Each step's batch sampled before the step ahead of it, which the backend may copy it in beside
  // (Backend::TrainStepWithNext); the same batches in the same order as sampling each just before its step.
  Batch batches[2];
  const int log_every = absl::GetFlag(FLAGS_log_every);
  const int val_every = absl::GetFlag(FLAGS_val_every);
  const auto started = std::chrono::steady_clock::now();
  double val_loss = NAN;
  BestModel best(absl::GetFlag(FLAGS_save_best), optimizer);
  // A step whose gradient norm is not finite ends the run on the model before it, which is still saved.
  absl::Status stopped;
  int64_t last_validated = -1;
  // The two batches' buffers come with the first sample: a shape the host cannot hold is refused, where std::bad_alloc
  // aborted the program.
  RETURN_IF_ERROR(AllocateOrExhausted(
      absl::StrCat("two training batches of ", config.batch, " windows x ", config.window, " events"), [&] {
        sampler.Sample(config.batch, batches[0]);
        batches[1] = batches[0];
      }));
  // Ctrl-C ended an hours-long run with nothing saved but --save_best's model: from here it stops between steps and
  // saves the model it reached.
  const Interruption::Armed armed = interruption.Arm();
  // Steps are numbered as the model's (the checkpoint's step + 1 on): the schedule, the validations and the lines.
  for (int s = 1; s <= steps; ++s) {
    const int64_t step_number = start.step() + s;
    if (interruption.Requested()) {
      interruption.Stopped();
      // An untrained model is no result: an earlier run's --save stays.
      if (s == 1) return absl::CancelledError("interrupted before the first step: --save not written");
      stopped = absl::CancelledError(absl::StrCat("interrupted after ", s - 1, " of ", steps, " steps"));
      break;
    }
    const Batch& batch = batches[(s - 1) % 2];
    Batch& next = batches[s % 2];
    if (s < steps) sampler.Sample(config.batch, next);
    absl::StatusOr<TrainStepResult> step = s < steps ? backend->TrainStepWithNext(View(batch), View(next))
                                                     : backend->TrainStep(View(batch));
    if (IsStepNotTaken(step.status())) {
      stopped = absl::FailedPreconditionError(absl::StrCat(
          "step ", step_number,
          start.resumed.has_value() ? absl::StrCat(" (", s, " of this run's ", steps, ")") : absl::StrCat(" of ", steps),
          " was not taken (", step.status().message(),
          "). perception train stops at a step not taken and saves the model before it to --save; to go on, train ",
          "again with a lower --lr"));
      break;
    }
    RETURN_IF_ERROR(step.status());
    const TrainStepResult& r = *step;
    if (!std::isfinite(r.loss)) return absl::InternalError(absl::StrCat("loss is not finite at step ", step_number));
    const bool validate = s == steps || (val_every > 0 && step_number % val_every == 0);
    if (validate) {
      ASSIGN_OR_RETURN(val_loss, backend->Evaluate(View(validation), {}));
      best.Offer(*backend, val_loss);
      last_validated = step_number;
    }
    if (validate || step_number % log_every == 0 || s == 1) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      std::printf("step %5lld  loss %.5f  grad_norm %.4f  lr %.2e  val_loss %s  %.2f steps/s\n",
                  static_cast<long long>(step_number), r.loss, r.grad_norm, LearningRate(optimizer, step_number),
                  validate ? absl::StrFormat("%.5f", std::isnan(val_loss) ? NAN : val_loss).c_str() : "   -   ",
                  s / seconds);  // (NaN's sign bit printed "-nan")
      std::fflush(stdout);
    }
  }
  // A stopped run's failure to validate or save the model it reached says where it had stopped.
  const auto after_the_stop = [&stopped](const absl::Status& failed) {
    if (stopped.ok()) return failed;
    return absl::Status(failed.code(), absl::StrCat(stopped.message(), "; then ", failed.message()));
  };
  if (!stopped.ok() && last_validated != backend->step()) {  // the model saved below, validated
    const absl::StatusOr<double> validated = backend->Evaluate(View(validation), {});
    if (!validated.ok()) return after_the_stop(validated.status());
    val_loss = *validated;
    best.Offer(*backend, val_loss);
  }
  std::printf("%s\n", CompareWithPrior("validation loss", val_loss, prior_loss).c_str());
  const std::string save = absl::GetFlag(FLAGS_save);
  const absl::StatusOr<int64_t> saved = SaveModel(*backend, optimizer, save);
  if (!saved.ok()) return after_the_stop(saved.status());
  const int64_t step = *saved;
  std::printf("saved %s (step %lld)\n", save.c_str(), static_cast<long long>(step));
  const absl::Status best_saved = best.Report();
  // A model whose validation outputs overflow is no result to exit 0 on (`train && deploy` shipped it).
  if (stopped.ok() && !std::isfinite(val_loss)) {
    if (!best_saved.ok()) spdlog::error("{}", std::string(best_saved.message()));
    return absl::FailedPreconditionError(absl::StrCat(
        "the model has diverged at step ", step, ": its validation loss is not finite (saved to --save all the "
        "same); train again with a lower --lr"));
  }
  if (stopped.ok()) return best_saved;
  if (!best_saved.ok()) spdlog::error("{}", std::string(best_saved.message()));
  if (absl::IsCancelled(stopped)) {
    return absl::CancelledError(absl::StrCat(stopped.message(), ": the model of step ", step,
                                             " is validated and saved to --save",
                                             HowToTrainTheRest(start, steps, step, save)));
  }
  return stopped;
}

// "`what` L vs class-prior baseline P (better by D)" for `logits` of `scored`'s events, the baseline predicting
// `prior`; where `scored` (the `part`) scores no label, says so.
std::string LossAgainstPrior(std::string_view what, std::span<const float> logits, const EventSeries& scored,
                             std::span<const double> prior, std::string_view part) {
  if (!ScoresALabel(scored.mask)) {
    return absl::StrCat(std::string(what), " none (no label is scored: each event is within a horizon of the ",
                        std::string(part), "'s end or a tie)");
  }
  return CompareWithPrior(what, CpuReference<float>::MaskedBce(logits, scored.labels, scored.mask),
                          PriorBaselineLoss(prior, scored.labels, scored.mask));
}

absl::Status Eval() {
  const std::string path = absl::GetFlag(FLAGS_checkpoint);
  if (path.empty()) return absl::InvalidArgumentError("eval needs --checkpoint");
  if (absl::GetFlag(FLAGS_out).empty()) return absl::InvalidArgumentError("eval needs --out LOGITS.npy");
  if (FlagGiven(FLAGS_train_fraction)) {
    RETURN_IF_ERROR(CheckOpenFraction("train_fraction", absl::GetFlag(FLAGS_train_fraction)));
  }
  std::vector<NamedPath> outputs = {{"--out", absl::GetFlag(FLAGS_out)}};
  if (const std::string features_out = absl::GetFlag(FLAGS_features_out); !features_out.empty()) {
    outputs.push_back({"--features_out", features_out});
  }
  std::vector<NamedPath> inputs = LobsterInputs();
  inputs.push_back({"--checkpoint", path});
  RETURN_IF_ERROR(CheckOutputsBeforeTheWork(outputs, inputs));
  ASSIGN_OR_RETURN(Checkpoint checkpoint, LoadCheckpoint(path));
  ASSIGN_OR_RETURN(LobsterData data, ReadLobsterFlag());
  const ModelConfig& config = checkpoint.config;
  RETURN_IF_ERROR(CheckLobsterFeatureCount(data.levels, config.n_features, "the checkpoint"));
  ASSIGN_OR_RETURN(EventSeries series, BuildSeries(data, config.horizons));
  std::optional<SplitSeries> held_out;
  if (FlagGiven(FLAGS_train_fraction)) {
    ASSIGN_OR_RETURN(held_out, SplitByTime(series, absl::GetFlag(FLAGS_train_fraction)));
  }
  const Normalizer normalizer = ReadNormalizer(ParamLayout(config), checkpoint.params);
  if (const std::string warning = FlooredFeaturesVaryWarning(normalizer, series); !warning.empty()) {
    spdlog::warn("{}", warning);
  }
  // As the daemon refuses such an event streamed: the logits from it on would not be MODEL.md's.
  RETURN_IF_ERROR(CheckSeriesStandardizedRange(normalizer, series));
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, BackendFromFlags(config, OptimizerConfig{}, checkpoint.params));
  const size_t n = series.size();
  const int F = config.n_features, H = config.n_horizons;
  std::vector<float> logits(n * H);
  RETURN_IF_ERROR(backend->ForwardStream(series.features, series.dt, logits));
  // A file of NaNs with exit 0 went on to whatever read it next.
  if (const auto not_finite = std::ranges::count_if(logits, [](float v) { return !std::isfinite(v); });
      not_finite > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        not_finite, " of ", logits.size(), " logits are not finite: the checkpoint's model has diverged (",
        absl::GetFlag(FLAGS_out), " not written)"));
  }
  RETURN_IF_ERROR(WriteNpy(absl::GetFlag(FLAGS_out), logits, {static_cast<int64_t>(n), H}));
  std::printf("%zu events, %s; logits [%zu, %d] -> %s\n", n,
              LossAgainstPrior("masked BCE over the whole stream", logits, series, ClassPrior(series), "file").c_str(),
              n, H,
              absl::GetFlag(FLAGS_out).c_str());
  // The whole stream holds the events the checkpoint trained on where it was trained on this file: the part train
  // held out is scored alone, its labels as train's validation part has them, each event from the state the whole
  // stream reached (train's validation scores windows from zero states, their warmup masked: another number).
  if (held_out.has_value()) {
    const size_t first = held_out->train.size();
    std::printf("%s\n", LossAgainstPrior(absl::StrCat("the held-out part's (events ", first + 1, " to ", n,
                                                      ", after --train_fraction ", absl::GetFlag(FLAGS_train_fraction),
                                                      ", in the whole stream, not train's windows) masked BCE"),
                                         std::span<const float>(logits).subspan(first * H), held_out->validation,
                                         ClassPrior(held_out->train), "part").c_str());
  }
  const std::string features_out = absl::GetFlag(FLAGS_features_out);
  if (!features_out.empty()) {
    std::vector<float> features(n * (F + 1));
    for (size_t i = 0; i < n; ++i) {
      std::copy_n(&series.features[i * F], F, &features[i * (F + 1)]);
      features[i * (F + 1) + F] = series.dt[i];
    }
    RETURN_IF_ERROR(WriteNpy(features_out, features, {static_cast<int64_t>(n), F + 1}));
    std::printf("features [%zu, %d] -> %s\n", n, F + 1, features_out.c_str());
  }
  return absl::OkStatus();
}

absl::Status Inspect(const std::string& path) {
  ASSIGN_OR_RETURN(Checkpoint checkpoint, LoadCheckpoint(path));
  const ParamLayout layout(checkpoint.config);
  std::printf("%s\nformat perception-v1, step %lld, %zu trained parameters\nconfig %s\n\n", path.c_str(),
              static_cast<long long>(checkpoint.step), layout.trained_count(),
              ConfigToJson(checkpoint.config).c_str());
  std::printf("%-34s %-14s %9s %12s %12s\n", "tensor", "shape", "elements", "rms", "adam_v_rms");
  for (const TensorSpec& t : layout.tensors()) {
    double ss = 0, vv = 0;
    for (size_t i = t.offset; i < t.offset + t.size; ++i) {
      ss += static_cast<double>(checkpoint.params[i]) * checkpoint.params[i];
      vv += static_cast<double>(checkpoint.exp_avg_sq[i]) * checkpoint.exp_avg_sq[i];
    }
    std::printf("%-34s %-14s %9zu %12.5g %12s\n", t.name.c_str(), absl::StrJoin(t.shape, "x").c_str(), t.size,
                std::sqrt(ss / t.size), t.trained ? absl::StrFormat("%.5g", std::sqrt(vv / t.size)).c_str() : "buffer");
  }
  return absl::OkStatus();
}

absl::Status Run(const std::vector<std::string>& args) {
  if (args.size() < 2) return absl::InvalidArgumentError(absl::StrCat("no command given\n\n", kUsage));
  const std::string command = args[1];
  if ((command == "train" || command == "eval") && args.size() == 2) {
    RETURN_IF_ERROR(CheckFlagsTakenBy(command, FlagUses()));
    RETURN_IF_ERROR(CheckGivenOnce(FLAGS_lobster, "a command reads one LOBSTER file pair"));
    return command == "train" ? Train() : Eval();
  }
  if (command == "inspect" && args.size() == 3) {
    RETURN_IF_ERROR(CheckFlagsTakenBy(command, FlagUses()));
    return Inspect(args[2]);
  }
  if (command == "inspect" && args.size() == 2) {
    return absl::InvalidArgumentError("inspect needs a checkpoint: inspect CKPT");
  }
  constexpr std::array<std::string_view, 3> kCommands = {"train", "eval", "inspect"};
  return UnexpectedArguments(args, kCommands, kUsage);
}

}  // namespace
}  // namespace perception

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(perception::kUsage);
  const absl::Status status = perception::Run(perception::ParseArguments(argc, argv));
  if (!status.ok()) {
    std::fflush(stdout);  // what the run printed before its error, in that order where both go to one pipe
    std::fprintf(stderr, "perception: %s\n", std::string(status.message()).c_str());
    perception::Interruption::EndByTheSignalReceived();
    return 1;
  }
  return 0;
}
