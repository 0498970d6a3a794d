// The model host: every operation on the resident model, run on the device worker's thread.
#include "server/model_host.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/checkpoint.h"
#include "engine/device_loss.h"
#include "engine/param_layout.h"
#include "engine/status_macros.h"
#include "server/stopwatch.h"
#include "spdlog/spdlog.h"

namespace perception::server {
namespace {

bool IsIdentityNormalizer(const Normalizer& normalizer) {
  return std::ranges::all_of(normalizer.mean, [](float v) { return v == 0.f; }) &&
         std::ranges::all_of(normalizer.inv_std, [](float v) { return v == 1.f; });
}

absl::Status CheckNormalizerSize(const Normalizer& normalizer, const ModelConfig& config) {
  if (normalizer.mean.size() == static_cast<size_t>(config.n_features)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("normalizer has ", normalizer.mean.size(), " features but the model takes ", config.n_features));
}

// A name through a file (ENOTDIR) is the caller's mistake, as LoadCheckpoint's NOT_FOUND for it says; other causes
// keep errno's code (a refused permission, a full disk). abseil's code for ENOTDIR, FAILED_PRECONDITION, reads as
// "the model's state; retry later" in this API.
absl::Status FolderNotCreated(const std::string& path, const std::error_code& error) {
  const std::string message = absl::StrCat("cannot create the folder for checkpoint '", path, "': ", error.message());
  if (error.value() == ENOTDIR) return absl::InvalidArgumentError(message);
  return absl::ErrnoToStatus(error.value(), message);
}

}  // namespace

ModelHost::ModelHost(std::string device, ServerMetrics& metrics, StreamingConfig streaming, bool use_graphs,
                     std::optional<Precision> precision, BackendDecorator decorate)
    : device_(std::move(device)), use_graphs_(use_graphs), precision_(precision), decorate_(std::move(decorate)),
      metrics_(metrics), streaming_(streaming) {}

absl::StatusOr<std::unique_ptr<Backend>> ModelHost::NewBackend(const ModelConfig& config,
                                                               const OptimizerConfig& optimizer,
                                                               std::vector<float> params) {
  RETURN_IF_ERROR(DeviceLostStatus());
  // The current model's resident streaming step would hold the device through the new one's allocations.
  if (backend_ != nullptr) RETURN_IF_ERROR(backend_->QuiesceDevice());
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                   MakeBackend(device_, config, optimizer, std::move(params), communicator_, precision_));
  if (decorate_ != nullptr) backend = decorate_(std::move(backend));
  backend->set_use_graphs(use_graphs_);
  backend->set_stream_resident(streaming_.resident);
  backend->set_stream_tick_timing(streaming_.tick_timing_every);
  return backend;
}

absl::StatusOr<std::unique_ptr<Backend>> ModelHost::NewBackendFrom(const Checkpoint& state,
                                                                   const OptimizerConfig& optimizer) {
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, NewBackend(state.config, optimizer, state.params));
  RETURN_IF_ERROR(backend->ImportState(state));
  return backend;
}

absl::Status ModelHost::JoinDataParallel(const std::string& unique_id, const DataParallelOptions& options) {
  if (backend_ != nullptr || communicator_ != nullptr) {
    return absl::FailedPreconditionError("a daemon joins a data-parallel job once, before any model exists");
  }
  if (device_ == "cpu") {
    return absl::FailedPreconditionError("data-parallel training runs on NCCL, which the CPU backend cannot join");
  }
  ASSIGN_OR_RETURN(communicator_, perception::JoinDataParallel(unique_id, options));
  data_parallel_ = options;
  spdlog::info("joined the data-parallel job as rank {} of {}", options.rank, options.world_size);
  return absl::OkStatus();
}

absl::Status ModelHost::Init(const ModelConfig& config, const OptimizerConfig& optimizer, uint64_t seed,
                             const std::optional<Normalizer>& normalizer, bool replace) {
  RETURN_IF_ERROR(CheckInitMayReplace(replace));
  const ParamLayout layout(config);
  std::vector<float> params(layout.total_size());
  InitializeParameters(layout, seed, params);
  if (normalizer.has_value()) {
    RETURN_IF_ERROR(CheckNormalizerSize(*normalizer, config));
    WriteNormalizer(layout, *normalizer, params);
  }
  Normalizer installed = ReadNormalizer(layout, params);
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, NewBackend(config, optimizer, std::move(params)));
  const std::string replaced = WhatInstallReplaces();
  Install(std::move(backend), optimizer, 0, std::move(installed));
  spdlog::info("model initialized on {} ({} products): {} trained parameters, seed {}{}", backend_->device_name(),
               PrecisionName(backend_->precision()), backend_->layout().trained_count(), seed, replaced);
  return absl::OkStatus();
}

absl::Status ModelHost::SetNormalizer(const Normalizer& normalizer) {
  RETURN_IF_ERROR(RequireModel());
  RETURN_IF_ERROR(CheckNormalizerSize(normalizer, backend_->config()));
  ASSIGN_OR_RETURN(const Checkpoint previous, backend_->ExportState());
  Checkpoint changed = previous;
  WriteNormalizer(backend_->layout(), normalizer, changed.params);
  RETURN_IF_ERROR(backend_->ImportState(changed));
  ++weights_version_;
  const absl::Status published = MaybePublish(/*due=*/true);
  if (published.ok()) {
    normalizer_ = normalizer;
    return absl::OkStatus();
  }
  // The previous model stays in place, as after any failure here: the change is taken back, since the weights
  // streaming reads (and its standardization with them) could not follow it. A publication that failed part way may
  // have copied some of it: the previous weights are published again.
  if (const absl::Status restored = backend_->ImportState(previous); !restored.ok()) {
    normalizer_ = normalizer;  // (the backend holds the change)
    return absl::Status(published.code(), absl::StrCat(published.message(), "; restoring the previous normalizer "
                                                       "failed too, so the model has the new one: ",
                                                       restored.message()));
  }
  --weights_version_;
  if (const absl::Status republished = MaybePublish(/*due=*/true); !republished.ok()) {
    return absl::Status(published.code(), absl::StrCat(published.message(), "; publishing the previous weights again "
                                                       "failed too: ", republished.message()));
  }
  return published;
}

absl::Status ModelHost::SetOptimizer(const OptimizerConfig& optimizer) {
  RETURN_IF_ERROR(RequireModel());
  ASSIGN_OR_RETURN(const Checkpoint state, backend_->ExportState());
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, NewBackendFrom(state, optimizer));
  Adopt(std::move(backend), optimizer);
  return absl::OkStatus();
}

absl::StatusOr<double> ModelHost::Load(const std::string& path, const std::optional<OptimizerConfig>& requested,
                                       const Limits& limits) {
  const Stopwatch stopwatch;
  ASSIGN_OR_RETURN(Checkpoint checkpoint, LoadCheckpoint(path));
  RETURN_IF_ERROR(CheckTrainingShapeWithinLimits(checkpoint.config, limits));
  const OptimizerConfig optimizer = requested.value_or(checkpoint.optimizer.value_or(OptimizerConfig{}));
  Normalizer installed = ReadNormalizer(ParamLayout(checkpoint.config), checkpoint.params);
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, NewBackendFrom(checkpoint, optimizer));
  const std::string replaced = WhatInstallReplaces();
  Install(std::move(backend), optimizer, checkpoint.step, std::move(installed));
  const double seconds = stopwatch.Seconds();
  metrics_.ObserveCheckpoint("load", seconds);
  spdlog::info("loaded checkpoint {} (step {}) in {:.3f} s{}", path, checkpoint.step, seconds, replaced);
  return seconds;
}

absl::StatusOr<SaveOutcome> ModelHost::Save(const std::string& path) {
  RETURN_IF_ERROR(RequireModel());
  if (data_parallel_.has_value() && data_parallel_->rank != 0) {
    return absl::FailedPreconditionError(absl::StrCat("this daemon is rank ", data_parallel_->rank, " of ",
                                                      data_parallel_->world_size,
                                                      " of a data-parallel job: checkpoints are saved by rank 0"));
  }
  // An aborted step may have applied a partial sum of the ranks' gradients: saving that (--checkpoint_on_exit included)
  // would overwrite the last good checkpoint with weights no rank agrees on.
  if (communicator_ != nullptr) {
    if (const absl::Status usable = DataParallelUsable(*communicator_); !usable.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "not saved, so that the last checkpoint is kept: a step of the aborted job may have left the weights half "
          "updated (", usable.message(), ")"));
    }
  }
  const Stopwatch stopwatch;
  ASSIGN_OR_RETURN(Checkpoint state, backend_->ExportState());
  state.optimizer = optimizer_;
  // Only now, with a model to write: a refused save leaves no folders behind. SaveCheckpoint may still refuse it (a
  // value no checkpoint may hold, a failed write), so the folders this save creates are removed again then.
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::vector<std::filesystem::path> created;  // innermost first
  std::error_code error;
  for (std::filesystem::path folder = parent; !folder.empty() && !std::filesystem::exists(folder, error);
       folder = folder.parent_path()) {
    created.push_back(folder);
  }
  std::filesystem::create_directories(parent, error);
  const absl::Status saved = error ? FolderNotCreated(path, error) : SaveCheckpoint(path, state);
  if (!saved.ok()) {
    // remove, not remove_all: a folder that something else has filled meanwhile stays.
    for (const std::filesystem::path& folder : created) std::filesystem::remove(folder, error);
    return saved;
  }
  const auto bytes = static_cast<int64_t>(std::filesystem::file_size(path, error));
  const SaveOutcome outcome{state.step, error ? 0 : bytes, stopwatch.Seconds()};
  metrics_.ObserveCheckpoint("save", outcome.seconds);
  spdlog::info("saved checkpoint {} (step {}, {} bytes) in {:.3f} s", path, outcome.step, outcome.bytes,
               outcome.seconds);
  return outcome;
}

absl::Status ModelHost::CheckTrainingBatch(const BatchView<float>& batch) const {
  RETURN_IF_ERROR(CheckFeaturesAndHorizons(batch));
  const ModelConfig& config = backend_->config();
  if (batch.batch != config.batch || batch.window != config.window) {
    return absl::InvalidArgumentError(absl::StrCat("batch shape ", batch.batch, " windows x ", batch.window,
                                                   " events differs from the model's training shape ", config.batch,
                                                   " x ", config.window, " (fixed when the model was created)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainOutcome> ModelHost::TrainStep(const BatchView<float>& batch, const BatchView<float>* next,
                                                  const Normalizer* batch_checked_under,
                                                  const Normalizer* next_checked_under) {
  RETURN_IF_ERROR(RequireModel());
  RETURN_IF_ERROR(CheckTrainingBatch(batch));
  if (absl::Status in_range = CheckBatchRange(batch, batch_checked_under); !in_range.ok()) {
    // The step before may have staged it as its `next`, under a normalizer a SetNormalizer has replaced since: the
    // backend must not train that copy for a later batch at the same address.
    ForgetStagedNext();
    return in_range;
  }
  const Stopwatch stopwatch;
  const bool stage_next = next != nullptr && CheckTrainingBatch(*next).ok() &&
                          CheckBatchRange(*next, next_checked_under).ok();
  absl::StatusOr<TrainStepResult> stepped =
      stage_next ? backend_->TrainStepStagingNext(batch, *next) : backend_->TrainStep(batch);
  if (stepped.status().code() == absl::StatusCode::kDataLoss) metrics_.ObserveReplicaDivergence();
  if (IsStepNotTaken(stepped.status())) {
    // A refusal by its code, but a diverging job is the operator's concern too.
    if (int64_t dropped = 0; steps_not_taken_log_.Admit("step not taken", dropped)) {
      spdlog::warn("a training step was not taken: {}{}", std::string(stepped.status().message()),
                   steps_not_taken_log_.DroppedNote(dropped));
    }
    metrics_.ObserveStepNotTaken();
    // What a client of the daemon can do (the engine's message leaves it to each program).
    stepped = absl::Status(stepped.status().code(),
                           absl::StrCat(stepped.status().message(), "; train on without the batch, or, if the weights "
                                        "have diverged, load a checkpoint and lower the learning rate"));
  }
  // Counted for every step run, a failed or refused one too (its graph replayed all the same), so that they do not
  // land on the next step that succeeds.
  const TrainingCounters counters = backend_->training_counters();
  const bool device_timed = counters.timed_steps > training_counters_.timed_steps;
  metrics_.ObserveTrainGraphs(counters.graph_captures - training_counters_.graph_captures,
                              counters.graph_replays - training_counters_.graph_replays);
  metrics_.ObserveReplicaChecks(counters.replica_checks - training_counters_.replica_checks);
  training_counters_ = counters;
  if (!stepped.ok()) return AfterFailedStep(stepped.status());
  const TrainStepResult result = *std::move(stepped);
  // On CUDA the step's device time comes from events recorded around its launch; on the CPU the step's wall time
  // is its device time.
  const TrainOutcome outcome{result, device_timed ? counters.last_step_seconds : stopwatch.Seconds()};
  metrics_.ObserveTrainStep(outcome.device_seconds, result.loss);
  RecordAppliedStep(result.step);
  return outcome;
}

void ModelHost::RecordAppliedStep(int64_t step) {
  step_ = step;
  ++weights_version_;
  const bool due = ++steps_since_publish_ >= streaming_.publish_every_steps && publication_holds_ == 0;
  if (const absl::Status published = MaybePublish(due); !published.ok()) {
    // The step is applied whatever becomes of its publication: an error here would have the client train it again.
    // Streaming keeps the weights it reads; the next step publishes again.
    spdlog::error("step {}: refreshing the weights streaming reads failed: {}", step, published.ToString());
  }
}

absl::Status ModelHost::AfterFailedStep(const absl::Status& failed) {
  const int64_t applied = backend_->step();
  if (applied == step_) return failed;
  // The update was applied before the step failed (the data-parallel replica check comes after it): the step and
  // the weights version follow the weights, streaming reads them, and the client learns not to train the batch again.
  RecordAppliedStep(applied);
  return absl::Status(failed.code(), absl::StrCat(failed.message(), " (the step was applied: the model is at step ",
                                                  applied, ")"));
}

absl::StatusOr<Evaluation> ModelHost::Evaluate(const BatchView<float>& batch, bool with_probabilities,
                                               const Normalizer* checked_under) {
  RETURN_IF_ERROR(RequireModel());
  RETURN_IF_ERROR(CheckFeaturesAndHorizons(batch));
  RETURN_IF_ERROR(CheckBatchRange(batch, checked_under));
  const Stopwatch stopwatch;
  logits_.resize(batch.labels.size());
  Evaluation evaluation;
  ASSIGN_OR_RETURN(evaluation.loss, backend_->Evaluate(batch, logits_));
  evaluation.device_seconds = stopwatch.Seconds();
  evaluation.step = step_;

  const std::vector<int>& horizons = backend_->config().horizons;
  const size_t H = horizons.size();
  for (const int horizon : horizons) evaluation.horizons.push_back({.horizon_events = horizon});
  for (size_t i = 0; i < logits_.size(); ++i) {
    if (batch.mask[i] == 0.f) continue;
    HorizonScore& score = evaluation.horizons[i % H];
    ++score.masked_labels;
    // A logit that is not a number predicts neither way: never correct (NaN > 0 is false, which read as "down").
    score.correct += !std::isnan(logits_[i]) && (logits_[i] > 0.f) == (batch.labels[i] == 1.f);
  }
  for (const HorizonScore& score : evaluation.horizons) evaluation.masked_labels += score.masked_labels;
  if (with_probabilities) {
    evaluation.probabilities.resize(logits_.size());
    std::ranges::transform(logits_, evaluation.probabilities.begin(),
                           [](float logit) { return 1.f / (1.f + std::exp(-logit)); });
  }
  return evaluation;
}

HostStatus ModelHost::Status() const {
  if (backend_ == nullptr) {
    return {device_, std::string(PrecisionChoiceName(precision_)), 0, std::nullopt, data_parallel_, 0};
  }
  return {backend_->device_name(), PrecisionName(backend_->precision()), backend_->memory_bytes(),
          ModelInfo{backend_->config(), optimizer_, step_, weights_version_,
                    static_cast<int64_t>(backend_->layout().trained_count()), !IsIdentityNormalizer(normalizer_),
                    published_weights_version_, normalizer_},
          data_parallel_, training_counters_.replica_checks};
}

absl::Status ModelHost::CheckInitMayReplace(bool replace) const {
  if (backend_ == nullptr || replace) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "a model already exists; set replace to discard it (perceptionctl init --replace)");
}

absl::Status ModelHost::RequireModel() const {
  RETURN_IF_ERROR(DeviceLostStatus());
  if (backend_ != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError("no model: call InitModel or LoadCheckpoint first");
}

absl::Status ModelHost::CheckFeaturesAndHorizons(const BatchView<float>& batch) const {
  const ModelConfig& config = backend_->config();
  // The batch passed ValidateBatch, so its sizes are exact multiples of its B·T events.
  const size_t events = static_cast<size_t>(batch.batch) * batch.window;
  const size_t features = batch.x.size() / events, horizons = batch.labels.size() / events;
  if (features != static_cast<size_t>(config.n_features) || horizons != static_cast<size_t>(config.n_horizons)) {
    return absl::InvalidArgumentError(absl::StrCat("batch has ", features, " features and ", horizons,
                                                   " horizons but the model takes ", config.n_features, " and ",
                                                   config.n_horizons));
  }
  return absl::OkStatus();
}

absl::Status ModelHost::CheckBatchRange(const BatchView<float>& batch, const Normalizer* checked_under) const {
  if (checked_under != nullptr && *checked_under == normalizer_) return absl::OkStatus();
  return CheckBatchStandardizedRange(normalizer_, batch.window, batch.x);
}

std::string ModelHost::WhatInstallReplaces() const {
  if (backend_ == nullptr) return "";
  return absl::StrCat("; the model it replaces, at step ", step_, ", is discarded");
}

void ModelHost::Install(std::unique_ptr<Backend> backend, const OptimizerConfig& optimizer, int64_t step,
                        Normalizer normalizer) {
  Adopt(std::move(backend), optimizer);
  ++model_generation_;
  step_ = step;
  normalizer_ = std::move(normalizer);
  ++weights_version_;
  metrics_.ForgetTrainLoss();
}

void ModelHost::Adopt(std::unique_ptr<Backend> backend, const OptimizerConfig& optimizer) {
  backend_ = std::move(backend);
  training_counters_ = {};
  optimizer_ = optimizer;
  streaming_configured_ = false;  // a new backend: its streaming slots are allocated on first use
  published_weights_version_ = 0;
  metrics_.SetStreamWeightsVersion(0);
}

absl::Status ModelHost::ReleaseIdleDevice() {
  if (backend_ == nullptr || !DeviceLostStatus().ok()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const bool released, backend_->ReleaseIdleDevice());
  if (released) metrics_.ObserveResidentIdleStop();
  return absl::OkStatus();
}

absl::StatusOr<Backend*> ModelHost::StreamingBackend() {
  RETURN_IF_ERROR(RequireModel());
  if (!streaming_configured_) {
    RETURN_IF_ERROR(backend_->ConfigureStreaming(streaming_.slots, log_entries_per_slot()));
    streaming_configured_ = true;
    published_weights_version_ = weights_version_;
    steps_since_publish_ = 0;
    metrics_.SetStreamWeightsVersion(published_weights_version_);
    spdlog::info("streaming on {}: {} slots, {} conviction-log entries each, weights version {}",
                 backend_->device_name(), streaming_.slots, log_entries_per_slot(), weights_version_);
  }
  return backend_.get();
}

void ModelHost::ReleasePublication() {
  if (--publication_holds_ > 0 || steps_since_publish_ < streaming_.publish_every_steps) return;
  if (const absl::Status published = MaybePublish(/*due=*/true); !published.ok()) {
    spdlog::error("step {}: refreshing the weights streaming reads, held during a seed, failed: {}", step_,
                  published.ToString());
  }
}

absl::Status ModelHost::MaybePublish(bool due) {
  if (!streaming_configured_ || !due) return absl::OkStatus();
  RETURN_IF_ERROR(backend_->PublishWeights());
  published_weights_version_ = weights_version_;
  steps_since_publish_ = 0;
  metrics_.SetStreamWeightsVersion(published_weights_version_);
  return absl::OkStatus();
}

}  // namespace perception::server
