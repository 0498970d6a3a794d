// Training and evaluation on LOBSTER data through the daemon.
#include "client/lobster_commands.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/data_parallel.h"
#include "client/training_progress.h"
#include "engine/dataset.h"
#include "engine/lobster.h"
#include "engine/status_macros.h"

namespace perception::client {

std::optional<Normalizer> NormalizerOf(const v1::Model& model) {
  const v1::Normalizer& normalizer = model.normalizer();
  if (normalizer.mean_size() != model.config().n_features() || normalizer.inv_std_size() != normalizer.mean_size()) {
    return std::nullopt;
  }
  return Normalizer{{normalizer.mean().begin(), normalizer.mean().end()},
                    {normalizer.inv_std().begin(), normalizer.inv_std().end()}};
}

namespace {

// The Evaluate answers over many requests, combined exactly.
struct EvaluationTotals {
  double loss_sum = 0;  // Σ m·bce
  int64_t masked_labels = 0;
  std::vector<v1::HorizonAccuracy> horizons;  // counts summed; accuracy filled at the end

  double loss() const { return loss_sum / std::max<int64_t>(masked_labels, 1); }
};

absl::StatusOr<v1::GetStatusResponse> StatusWithModel(PerceptionClient& client) {
  ASSIGN_OR_RETURN(v1::GetStatusResponse status, client.GetStatus());
  if (!status.has_model()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the daemon at ", client.target(), " has no model; run `perceptionctl init` first"));
  }
  return status;
}

// The files as one event series with the model's horizons; their feature count must be the model's.
absl::StatusOr<EventSeries> ReadSeries(const LobsterFiles& files, const v1::ModelConfig& config) {
  ASSIGN_OR_RETURN(const LobsterData data, ReadLobster(files.orderbook, files.messages, files.levels));
  RETURN_IF_ERROR(CheckLobsterFeatureCount(data.levels, config.n_features(), "the model"));
  const std::vector<int> horizons(config.horizons().begin(), config.horizons().end());
  return BuildSeries(data, horizons);
}

// Evaluates all of `windows` in requests within the daemon's batch and message limits; CANCELLED where `interruption`
// asked to stop before one of them (the pass is dropped rather than waited for).
absl::StatusOr<EvaluationTotals> EvaluateWindows(PerceptionClient& client, const Batch& windows,
                                                 const v1::Limits& limits, const Interruption* interruption = nullptr) {
  const int64_t bytes_per_window =
      int64_t{windows.window} * (windows.n_features + 1 + 2 * windows.n_horizons) * sizeof(float);
  const int per_request =
      static_cast<int>(std::clamp<int64_t>(limits.max_message_bytes() / 2 / bytes_per_window, 1, limits.max_batch()));
  EvaluationTotals totals;
  v1::EvaluateRequest request;
  for (int first = 0; first < windows.batch; first += per_request) {
    if (StopRequested(interruption)) return absl::CancelledError("validation interrupted");
    CopyWindows(windows, first, std::min(per_request, windows.batch - first), *request.mutable_batch());
    ASSIGN_OR_RETURN(const v1::EvaluateResponse response, client.Evaluate(request));
    totals.loss_sum += response.loss() * response.masked_labels();
    totals.masked_labels += response.masked_labels();
    totals.horizons.resize(response.horizons_size());
    for (int h = 0; h < response.horizons_size(); ++h) {
      v1::HorizonAccuracy& total = totals.horizons[h];
      total.set_horizon_events(response.horizons(h).horizon_events());
      total.set_masked_labels(total.masked_labels() + response.horizons(h).masked_labels());
      total.set_correct(total.correct() + response.horizons(h).correct());
    }
  }
  return totals;
}

std::string AccuracyByHorizon(const EvaluationTotals& totals) {
  std::string text = "accuracy by horizon (events):";
  for (const v1::HorizonAccuracy& h : totals.horizons) {
    // A horizon that scored no label has no accuracy (0.000 read as always wrong).
    const std::string accuracy = h.masked_labels() > 0
                                     ? absl::StrFormat("%.3f", static_cast<double>(h.correct()) / h.masked_labels())
                                     : std::string("n/a (no label scored)");
    absl::StrAppend(&text, " ", h.horizon_events(), ": ", accuracy);
  }
  return text;
}

absl::Status CheckTrainingShape(const TrainOptions& options, const v1::ModelConfig& config) {
  // Only the flags given (0: the model's) and differing: "--batch 4 --window 0 differ" named a window not asked for.
  std::vector<std::string> differing;
  if (options.batch != 0 && options.batch != config.batch()) differing.push_back(absl::StrCat("--batch ", options.batch));
  if (options.window != 0 && options.window != config.window()) {
    differing.push_back(absl::StrCat("--window ", options.window));
  }
  if (differing.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("the model trains on batches of ", config.batch(), " windows x ",
                                                 config.window(), " events, fixed at init; ",
                                                 absl::StrJoin(differing, " and "), differing.size() > 1 ? " differ"
                                                                                                   : " differs",
                                                 " (re-init to change them)"));
}

// The files' events against the normalizer they will be standardized with, as perception eval checks them: refused,
// naming the line, where one lies beyond kMaxStandardizedFeature (the daemon would refuse its batch, naming only a
// window); with `warn_floored`, a warning where features the normalizer floored vary in them.
absl::Status CheckFilesAgainst(const Normalizer& normalizer, const EventSeries& series, bool warn_floored) {
  if (const std::string warning = warn_floored ? FlooredFeaturesVaryWarning(normalizer, series) : "";
      !warning.empty()) {
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
  }
  return CheckSeriesStandardizedRange(normalizer, series);
}

// Before the first step, on every rank: the run's optimizer settings where it changes them (--lr, --total_steps,
// --min_lr), then the normalizer if the model has none (fitted on `training`, the files' training part). Every rank's
// settings first: a daemon refuses them while live streams hold state (it rebuilds the model), and a refusal then
// leaves every model as it was, where a normalizer sent before it would have changed what those streams read. Before
// either, the files (`series`) are checked against the normalizer the run will train under, and `training` for a
// scored label, so that a refusal there too leaves every model as it was.
absl::Status PrepareModels(std::span<PerceptionClient* const> ranks, const v1::Model& model,
                           const EventSeries& training, const EventSeries& series,
                           const v1::OptimizerSettings* changed_optimizer) {
  const std::optional<Normalizer> fitted =
      model.normalizer_fitted() ? std::nullopt : std::optional<Normalizer>(FitNormalizer(training));
  // (First: a std floored on the training part is the likely cause of a refusal below.)
  if (const std::string warning = fitted.has_value() ? UnvaryingFeaturesWarning(*fitted, training.size()) : "";
      !warning.empty()) {
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
  }
  if (const std::optional<Normalizer> normalizer = fitted.has_value() ? fitted : NormalizerOf(model)) {
    RETURN_IF_ERROR(CheckFilesAgainst(*normalizer, series, /*warn_floored=*/!fitted.has_value()));
  }
  RETURN_IF_ERROR(CheckTrainingPart(training));
  if (changed_optimizer != nullptr) {
    v1::SetOptimizerRequest request;
    *request.mutable_optimizer() = *changed_optimizer;
    for (PerceptionClient* rank : ranks) RETURN_IF_ERROR(rank->SetOptimizer(request).status());
  }
  if (!fitted.has_value()) return absl::OkStatus();
  const Normalizer& normalizer = *fitted;
  v1::SetNormalizerRequest request;
  request.mutable_normalizer()->mutable_mean()->Assign(normalizer.mean.begin(), normalizer.mean.end());
  request.mutable_normalizer()->mutable_inv_std()->Assign(normalizer.inv_std.begin(), normalizer.inv_std.end());
  for (PerceptionClient* rank : ranks) RETURN_IF_ERROR(rank->SetNormalizer(request).status());
  std::printf("fitted the normalizer on %zu training events and sent it\n", training.size());
  return absl::OkStatus();
}

// The best validation loss of a run; each new best is saved to `checkpoint` (rank 0's daemon) when it names one.
class BestValidation {
 public:
  BestValidation(PerceptionClient& client, std::string checkpoint)
      : client_(client), checkpoint_(std::move(checkpoint)) {}

  // The first save's failure is returned: it checks the name before any step is spent. A later one (a full disk, a
  // file put at the name) is kept for Report and ends the saves, not the run, as perception train's --save_best: the
  // steps go on, and the checkpoint keeps the best saved before.
  absl::Status Offer(double loss, int64_t step) {
    if (!(loss < loss_)) return absl::OkStatus();
    loss_ = loss;
    step_ = step;
    if (checkpoint_.empty() || !failure_.ok()) return absl::OkStatus();
    v1::SaveCheckpointRequest request;
    request.set_name(checkpoint_);
    absl::StatusOr<v1::SaveCheckpointResponse> saved = client_.SaveCheckpoint(request);
    if (!saved.ok() && !saved_step_.has_value()) return saved.status();
    if (!saved.ok()) {
      failure_ = absl::Status(saved.status().code(),
                              absl::StrCat("--save-best ", checkpoint_, " not written at model step ", step, " (",
                                           saved.status().message(), "); the last best it saved was model step ",
                                           *saved_step_, " (validation loss ", absl::StrFormat("%.5f", saved_loss_),
                                           ")"));
      std::fprintf(stderr, "warning: %s; the run goes on without saving its bests\n",
                   std::string(failure_.message()).c_str());
      return absl::OkStatus();
    }
    saved_step_ = saved->step();
    saved_loss_ = loss;
    std::printf("saved the best model so far (validation loss %.5f, model step %lld) to %s\n", loss,
                static_cast<long long>(saved->step()), saved->name().c_str());
    return absl::OkStatus();
  }
  // The run's end, at the daemon's model step `step`: the failed save, if one failed.
  absl::Status Report(int64_t step) const {
    if (failure_.ok()) return failure_;
    return absl::Status(failure_.code(), absl::StrCat(failure_.message(), ". The run went on to model step ", step,
                                                      " (perceptionctl checkpoint save NAME keeps it)"));
  }
  double loss() const { return loss_; }
  int64_t step() const { return step_; }
  // What the checkpoint holds, "" where this run saved none.
  std::string Saved() const {
    if (!failure_.ok()) return std::string(failure_.message());
    if (!saved_step_.has_value()) return "";
    return absl::StrFormat("--save-best %s holds the run's best validated model (step %d, validation loss %.5f)",
                           checkpoint_, *saved_step_, saved_loss_);
  }

 private:
  PerceptionClient& client_;
  const std::string checkpoint_;
  double loss_ = std::numeric_limits<double>::infinity();
  int64_t step_ = 0;
  std::optional<int64_t> saved_step_;
  double saved_loss_ = 0;
  absl::Status failure_;
};

// The model's optimizer settings with the run's --lr, --total_steps and --min_lr, checked before the files are read:
// the daemon takes settings under which the run would not train as asked. Past a cosine schedule's end every step
// trains at min_lr, so a new --lr there changed nothing, and with min_lr 0 the run left the weights as they were
// while its progress and the status read as training.
absl::StatusOr<v1::OptimizerSettings> RunOptimizer(const v1::Model& model, const TrainOptions& options) {
  v1::OptimizerSettings run = model.optimizer();
  const bool cosine = run.schedule() == v1::LR_SCHEDULE_WARMUP_COSINE;
  if (!cosine && (options.total_steps > 0 || options.min_lr.has_value())) {
    return absl::InvalidArgumentError(
        "--total_steps and --min_lr change the model's cosine schedule, and its learning rate is constant");
  }
  if (options.lr > 0) run.set_lr(options.lr);
  if (!cosine) return run;
  if (options.total_steps > 0) run.set_total_steps(options.total_steps);
  if (options.min_lr.has_value()) run.set_min_lr(*options.min_lr);
  if (run.total_steps() <= run.warmup_steps()) {
    return absl::InvalidArgumentError(absl::StrCat("--total_steps (", run.total_steps(),
                                                   ") must be past the model's warmup (", run.warmup_steps(),
                                                   " steps)"));
  }
  if (!(run.min_lr() >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--min_lr (", run.min_lr(), ") must be at least 0"));
  }
  // The daemon's refusal named neither flag (its optimizer's "min_lr must be in [0, lr]"), after the files were read.
  if (!(run.min_lr() <= run.lr())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the learning rate ", run.lr(), options.lr > 0 ? " (--lr)" : " (the model's)", " is below min_lr ",
        run.min_lr(), options.min_lr.has_value() ? " (--min_lr)" : " (the model's)",
        ", where the cosine schedule ends: give --lr >= ", run.min_lr(), ", or --min_lr in [0, ", run.lr(), "]"));
  }
  // The run's first step is the model's next, and the schedule's last step already trains at min_lr (progress 1).
  const int64_t step = model.step();
  const int64_t first = step + 1;
  if (first < run.total_steps()) return run;
  const std::string past_end = absl::StrCat("the model is at step ", step, " and its cosine schedule ends at step ",
                                            run.total_steps(), ": every step from ", first, " on trains at min_lr ",
                                            run.min_lr());
  if (run.min_lr() == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this run would not change the model: ", past_end, ". Give --total_steps beyond ", first,
        " to extend the schedule (it goes on from where step ", first, " falls on it), or --min_lr > 0"));
  }
  if (options.lr > 0) {  // (with a --total_steps that does not reach past the run's first step too)
    return absl::InvalidArgumentError(absl::StrCat(
        "--lr ", options.lr, " would not apply: ", past_end, ". Give --total_steps beyond ", first,
        " as well to extend the schedule, or --min_lr instead to change the rate past its end"));
  }
  std::printf("%s\n", past_end.c_str());
  return run;
}

// A model trained without a normalizer learned its weights, and Adam's moments, on the features as its batches came:
// one fitted now would move every input under them, and the model would mean another function from this run on
// (the run once did so with one line of output). Checked before the files are read.
absl::Status CheckNormalizerToFit(const v1::Model& model, const TrainOptions& options) {
  if (model.normalizer_fitted() && options.fit_normalizer) {  // (it would be ignored)
    return absl::InvalidArgumentError("--fit-normalizer fits a normalizer onto a model without one, and this model "
                                      "has one");
  }
  if (model.normalizer_fitted() || model.step() == 0 || options.fit_normalizer) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the model is at step ", model.step(), " and has no normalizer (it trained on its features as they came): "
      "fitting one now would change the inputs its weights were trained on. Give --fit-normalizer to fit one "
      "anyway, or start a new model (init --replace)"));
}

// The same command's flags, changed to train the `rest` of an interrupted run's steps. Another --save-best name: a
// run saves its starting model there first, over the better one this run may have saved.
std::string RestOfTheRun(const TrainOptions& options, int rest) {
  return absl::StrCat("the same command with --steps ", rest,
                      options.fit_normalizer ? ", without --fit-normalizer" : "",
                      options.save_best.empty() ? "" : " and another --save-best name",
                      " trains the rest, on the batches this run would have");
}

// Where a run the first signal stopped stands: `done` of its steps trained, each answered, the model at `step`.
absl::Status InterruptedRun(const TrainOptions& options, int done, int64_t step, size_t ranks,
                            const BestValidation& best) {
  options.interruption->Stopped();
  const std::string saved = best.Saved();
  return absl::CancelledError(absl::StrCat(
      done < options.steps ? absl::StrCat("interrupted after ", done, " of ", options.steps, " steps, each answered")
                           : absl::StrCat("interrupted after the run's ", done, " steps, its validation dropped"),
      ": the model is at step ", step, ranks > 1 ? " on every rank" : " on the daemon",
      saved.empty() ? "" : absl::StrCat("; ", saved),
      "; `perceptionctl eval` scores it, `perceptionctl checkpoint save NAME` keeps it",
      done < options.steps ? absl::StrCat("; ", RestOfTheRun(options, options.steps - done)) : ""));
}

// A run the first signal stopped that then failed (`failed`; CANCELLED where the second signal cut the wait for the
// steps sent).
absl::Status InterruptedThenFailed(const TrainOptions& options, int done, const BestValidation& best,
                                   const absl::Status& failed) {
  options.interruption->Stopped();
  const std::string saved = best.Saved();
  return absl::Status(failed.code(), absl::StrCat("interrupted after ", done, " of ", options.steps,
                                                  " steps answered, then ", failed.message(),
                                                  saved.empty() ? "" : absl::StrCat("; ", saved)));
}

}  // namespace

std::optional<Interruption::Armed> ArmToCancel(Interruption* interruption, CallCancellation& calls) {
  if (interruption == nullptr) return std::nullopt;
  return interruption->Arm([&calls] { calls.Cancel(); });
}

absl::Status TrainOnLobster(std::span<PerceptionClient* const> ranks, const TrainOptions& options) {
  // 0 keeps the model's learning rate; a negative one (or NaN) was dropped as if it were 0.
  if (!(options.lr >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--lr must be > 0 (0: keep the model's), got ", options.lr));
  }
  PerceptionClient& client = *ranks[0];
  std::vector<v1::GetStatusResponse> statuses;
  std::vector<std::string> targets;
  for (PerceptionClient* rank : ranks) {
    ASSIGN_OR_RETURN(statuses.emplace_back(), StatusWithModel(*rank));
    targets.push_back(rank->target());
  }
  RETURN_IF_ERROR(CheckTargets(statuses, targets));
  const v1::GetStatusResponse& status = statuses[0];
  const v1::ModelConfig& config = status.model().config();
  RETURN_IF_ERROR(CheckTrainingShape(options, config));
  RETURN_IF_ERROR(CheckNormalizerToFit(status.model(), options));
  ASSIGN_OR_RETURN(const v1::OptimizerSettings optimizer, RunOptimizer(status.model(), options));
  ASSIGN_OR_RETURN(const EventSeries series, ReadSeries(options.files, config));
  ASSIGN_OR_RETURN(const SplitSeries split, SplitByTime(series, options.train_fraction));
  ASSIGN_OR_RETURN(WindowSampler sampler,
                   WindowSampler::Create(split.train, config.window(), config.warmup(), options.seed));
  const Batch validation = SequentialWindows(split.validation, config.window(), config.warmup());
  RETURN_IF_ERROR(CheckValidationWindows(validation));
  const int world_size = static_cast<int>(ranks.size());
  // Past the global batches of the model's steps: training in chunks (train --steps N, again and again) goes on with
  // fresh batches, and a run interrupted and then resumed for the rest trains the batches the whole run would have
  // (the seed mixed with the starting step gave each run other windows than the one before it would have trained).
  sampler.Skip(world_size * config.batch(), status.model().step());
  std::printf("%zu events: %zu train, %zu validation (%d windows); batches of %d x %d events on %s%s\n",
              series.size(), split.train.size(), split.validation.size(), validation.batch,
              world_size * config.batch(), config.window(), status.device().name().c_str(),
              world_size > 1 ? absl::StrCat(", split over ", world_size, " ranks").c_str() : "");
  const bool optimizer_changes = options.lr > 0 || options.total_steps > 0 || options.min_lr.has_value();
  RETURN_IF_ERROR(
      PrepareModels(ranks, status.model(), split.train, series, optimizer_changes ? &optimizer : nullptr));

  TrainingProgress progress(options.steps, options.log_every, ::isatty(STDOUT_FILENO) == 1);
  BestValidation best(client, options.save_best);
  int64_t step = status.model().step();
  if (!options.save_best.empty()) {
    // The starting model is the run's first candidate: saving it checks the name before any step is spent, and a
    // run that only made the model worse keeps the model it started from.
    ASSIGN_OR_RETURN(const EvaluationTotals start, EvaluateWindows(client, validation, status.limits()));
    progress.Note(absl::StrFormat("model step %d: validation loss %.5f", step, start.loss()));
    RETURN_IF_ERROR(best.Offer(start.loss(), step));
  }
  Interruption* const interruption = options.interruption;
  const auto interrupted = [interruption] { return StopRequested(interruption); };
  CallCancellation calls;  // the ranks' Train calls, which a second signal cancels
  const std::optional<Interruption::Armed> armed = ArmToCancel(interruption, calls);
  int done = 0;
  while (done < options.steps && !interrupted()) {
    const int chunk = options.eval_every > 0 ? std::min(options.eval_every, options.steps - done) : options.steps;
    ShardedBatches batches([&](Batch& global) { sampler.Sample(world_size * config.batch(), global); }, world_size,
                           config.batch(), interrupted);
    const absl::Status trained = TrainRanks(
        ranks, chunk, batches,
        [&](const v1::TrainStepResponse& response) {
          progress.Update(response.loss(), response.grad_norm());
          step = response.step();
          ++done;
        },
        &calls);
    if (!trained.ok() && !interrupted()) return trained;
    if (!trained.ok()) {
      progress.Finish();
      return InterruptedThenFailed(options, done, best, trained);
    }
    if (interrupted() || done == options.steps) break;
    absl::StatusOr<EvaluationTotals> totals = EvaluateWindows(client, validation, status.limits(), interruption);
    if (!totals.ok() && interrupted()) {
      // EvaluateWindows' own CANCELLED is the interruption's: the pass is dropped; any other failure is the run's.
      if (absl::IsCancelled(totals.status())) break;
      progress.Finish();
      return InterruptedThenFailed(options, done, best, totals.status());
    }
    RETURN_IF_ERROR(totals.status());
    progress.Note(absl::StrFormat("model step %d: validation loss %.5f", step, totals->loss()));
    RETURN_IF_ERROR(best.Offer(totals->loss(), step));
  }
  progress.Finish();
  if (interrupted()) return InterruptedRun(options, done, step, ranks.size(), best);

  const absl::StatusOr<EvaluationTotals> validated =
      EvaluateWindows(client, validation, status.limits(), interruption);
  if (!validated.ok() && interrupted()) {
    return absl::IsCancelled(validated.status()) ? InterruptedRun(options, done, step, ranks.size(), best)
                                                 : InterruptedThenFailed(options, done, best, validated.status());
  }
  ASSIGN_OR_RETURN(const EvaluationTotals totals, validated);
  const double prior_loss = PriorBaselineLoss(ClassPrior(split.train), validation.labels, validation.mask);
  std::printf("%s\n", CompareWithPrior("validation loss", totals.loss(), prior_loss).c_str());
  // (NaN outputs score as "down": the accuracies would be the share of down labels, a model that seemed to work.)
  if (!std::isfinite(totals.loss())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the model at step ", step, " has diverged: its validation loss is not finite. It stays on the daemon as it "
        "is; load a checkpoint saved before", options.save_best.empty() ? "" : " (--save-best kept the best one)",
        " (perceptionctl checkpoint load) and train it with a lower --lr, or init a new model"));
  }
  std::printf("%s\n", AccuracyByHorizon(totals).c_str());
  RETURN_IF_ERROR(best.Offer(totals.loss(), step));
  if (options.eval_every > 0) {
    std::printf("best validation loss %.5f at model step %lld\n", best.loss(), static_cast<long long>(best.step()));
  }
  return best.Report(step);
}

absl::Status EvaluateLobster(PerceptionClient& client, const LobsterFiles& files, int window) {
  // 0 is the model's window; a negative one was replaced by it.
  if (window < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--window must be >= 0 (0: the model's), got ", window));
  }
  ASSIGN_OR_RETURN(const v1::GetStatusResponse status, StatusWithModel(client));
  const v1::ModelConfig& config = status.model().config();
  ASSIGN_OR_RETURN(const EventSeries series, ReadSeries(files, config));
  const int T = window > 0 ? window : config.window();
  if (T <= config.warmup()) {
    return absl::InvalidArgumentError(absl::StrCat("--window ", T, " would mask every position: the model's first ",
                                                   config.warmup(), " (its warmup) are not scored"));
  }
  if (const std::optional<Normalizer> normalizer = NormalizerOf(status.model())) {
    RETURN_IF_ERROR(CheckFilesAgainst(*normalizer, series, /*warn_floored=*/true));
  }
  const Batch windows = SequentialWindows(series, T, config.warmup());
  if (windows.batch == 0)
    return absl::InvalidArgumentError(absl::StrCat("the files hold less than one window of ", T, " events"));
  if (!ScoresALabel(windows.mask)) {
    return absl::InvalidArgumentError(
        "the files' windows score no label (each event is within a horizon of the files' end, in a window's warmup, "
        "or a tie: its mid's mean over the horizon equals its mid): nothing to evaluate");
  }
  ASSIGN_OR_RETURN(const EvaluationTotals totals, EvaluateWindows(client, windows, status.limits()));
  // Not a result: NaN outputs score as "down", so the accuracies came out as the share of down labels, a model that
  // seemed to beat a coin on every horizon.
  if (!std::isfinite(totals.loss())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the model at step ", status.model().step(), " gives outputs that are not finite on these windows (loss ",
        totals.loss(), "): it has diverged; load a checkpoint saved before it did (perceptionctl checkpoint load) "
        "or init a new model"));
  }
  const double prior_loss = PriorBaselineLoss(ClassPrior(series), windows.labels, windows.mask);
  std::printf(
      "%d windows of %d events at step %lld: loss %.5f vs class-prior baseline %.5f (prior of these files)\n%s\n",
      windows.batch, T, static_cast<long long>(status.model().step()), totals.loss(), prior_loss,
      AccuracyByHorizon(totals).c_str());
  return absl::OkStatus();
}

}  // namespace perception::client
