// The resident model: the one engine Backend and what the daemon knows about it (optimizer, step, versions).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "engine/dataset.h"
#include "engine/optimizer.h"
#include "engine/precision.h"
#include "server/log_throttle.h"
#include "server/metrics.h"
#include "server/request_validation.h"

namespace perception::server {

struct ModelInfo {
  ModelConfig config;
  OptimizerConfig optimizer;
  int64_t step = 0;             // optimizer steps taken
  int64_t weights_version = 0;  // increases with every change of the weights
  int64_t trained_parameters = 0;
  bool normalizer_fitted = false;  // false while the normalizer is the identity
  int64_t published_weights_version = 0;  // the weights version streaming reads; 0 until streaming first runs
  Normalizer normalizer;                  // the buffers the model standardizes its inputs with
};

// Live streaming's device side: the backend's state slots and conviction logs, sized once per model.
struct StreamingConfig {
  int slots = 256;                        // state slots (live streams at once)
  int64_t log_entries_total = 5'000'000;  // conviction-log entries over all slots (each slot gets total / slots)
  int publish_every_steps = 1;            // training steps between refreshes of the weights streaming reads
  bool resident = true;                   // lone events through a resident step where the backend has one
  int tick_timing_every = kStreamTickTimingEvery;  // Backend::set_stream_tick_timing
};

struct HostStatus {
  std::string device_name;   // the backend's; the requested device ("auto", ...) before any model
  std::string precision;     // the backend's product arithmetic ("fp32", ...); the requested one ("auto", ...) before
  int64_t memory_bytes = 0;  // of that device; 0 before any model or when unknown
  std::optional<ModelInfo> model;
  std::optional<DataParallelOptions> data_parallel;  // when this daemon is one rank of a data-parallel job
  int64_t replica_checks = 0;                        // the current backend's (TrainingCounters::replica_checks)
};

struct TrainOutcome {
  TrainStepResult result;
  double device_seconds = 0;
};

struct HorizonScore {
  int horizon_events = 0;
  int64_t masked_labels = 0;  // labels with mask 1
  int64_t correct = 0;        // of those, predicted correctly (up when the logit is positive)
};

struct Evaluation {
  double loss = 0;  // masked BCE
  int64_t masked_labels = 0;
  std::vector<HorizonScore> horizons;  // [H]
  std::vector<float> probabilities;    // [B, T, H] when requested, else empty
  int64_t step = 0;
  double device_seconds = 0;
};

struct SaveOutcome {
  int64_t step = 0;
  int64_t bytes = 0;
  double seconds = 0;
};

// Not thread-safe: only the device worker's thread calls it, because the Backend it owns is not thread-safe
// and, on CUDA, holds the device context. Every method leaves the previous model in place when it fails.
class ModelHost {
 public:
  // Takes each backend this host makes and returns the one to use in its place: tests wrap it in a decorator that
  // records the calls the host makes, which no other way shows (the CPU backend ignores the Train stream's `next`).
  using BackendDecorator = absl::AnyInvocable<std::unique_ptr<Backend>(std::unique_ptr<Backend>)>;

  // `device` and `precision` as MakeBackend takes them: "auto", "cpu" or "cuda", and the CUDA products' arithmetic
  // (nullopt: the device's default).
  // `use_graphs` off runs the CUDA training step and streaming ticks kernel by kernel instead of as captured graphs
  // (debugging). `decorate`, where given, wraps every backend made (tests only).
  ModelHost(std::string device, ServerMetrics& metrics, StreamingConfig streaming = {}, bool use_graphs = true,
            std::optional<Precision> precision = Precision::kFloat32, BackendDecorator decorate = nullptr);

  // Makes this daemon one rank of a data-parallel job: joins the NCCL communicator on the calling (device worker's)
  // thread; every model installed afterwards trains through it. Once, before any model exists; CUDA only.
  absl::Status JoinDataParallel(const std::string& unique_id, const DataParallelOptions& options);

  // A new model with weights initialized from `seed` and the given normalizer (the identity when absent).
  // FAILED_PRECONDITION when a model exists and `replace` is false.
  absl::Status Init(const ModelConfig& config, const OptimizerConfig& optimizer, uint64_t seed,
                    const std::optional<Normalizer>& normalizer, bool replace);
  // Init's refusal of a model that exists without `replace` (FAILED_PRECONDITION), for a caller to put before its own.
  absl::Status CheckInitMayReplace(bool replace) const;
  // Replaces the normalizer buffers; INVALID_ARGUMENT unless it has the model's feature count.
  absl::Status SetNormalizer(const Normalizer& normalizer);
  // Replaces the optimizer settings, keeping weights, moments and step.
  absl::Status SetOptimizer(const OptimizerConfig& optimizer);

  // Replaces the model with the checkpoint at `path`, whatever its config, if its training shape fits `limits` (as
  // InitModel's must: RESOURCE_EXHAUSTED otherwise, the model left as it was); returns the seconds it took. The
  // optimizer is `requested`, else the checkpoint's, else the defaults (a checkpoint saved without one).
  absl::StatusOr<double> Load(const std::string& path, const std::optional<OptimizerConfig>& requested,
                              const Limits& limits);
  // Writes the model to `path`, creating the missing folders on the way to it. FAILED_PRECONDITION without a model
  // and on a data-parallel rank other than 0 (the ranks hold the same state, rank 0 saves it): nothing created then.
  // A save SaveCheckpoint refuses removes the folders it created.
  absl::StatusOr<SaveOutcome> Save(const std::string& path);

  // `batch` must have the model's features and horizons and, for training, its (batch, window), and every feature
  // within kMaxStandardizedFeature of the normalizer's mean, which is checked here unless the batch was checked under
  // the normalizer the host has (`batch_checked_under`, `next_checked_under`: the daemon checks a batch off the
  // worker under the one it last published). `next`, where given, is the batch of the training step that will come
  // next (the Train stream's): staged while this step runs (Backend::TrainStepStagingNext) where it passes the same
  // checks. Its step may still be refused (a SetNormalizer in between puts it beyond the bound): then what was staged
  // is dropped, so that the backend, which knows it by address only, never trains it for another batch.
  absl::StatusOr<TrainOutcome> TrainStep(const BatchView<float>& batch, const BatchView<float>* next = nullptr,
                                         const Normalizer* batch_checked_under = nullptr,
                                         const Normalizer* next_checked_under = nullptr);
  // The step whose batch was given as `next` will not run (Backend::ForgetStagedNext).
  void ForgetStagedNext() {
    if (backend_ != nullptr) backend_->ForgetStagedNext();
  }
  // `batch` as TrainStep's, in any (batch, window); `checked_under` as TrainStep's `batch_checked_under`.
  absl::StatusOr<Evaluation> Evaluate(const BatchView<float>& batch, bool with_probabilities,
                                      const Normalizer* checked_under = nullptr);

  HostStatus Status() const;
  // OK with a model on a device that is not lost; FAILED_PRECONDITION without one (UNAVAILABLE once it is lost).
  absl::Status RequireModel() const;
  // Which model is installed: changes with every InitModel and LoadCheckpoint (Install), not with a change of the
  // weights or of the optimizer, so that a Train stream can tell its model was replaced under it.
  int64_t model_generation() const { return model_generation_; }
  // When the device has had no work for a while: frees what the backend holds there only to answer sooner (a running
  // resident streaming step: Backend::ReleaseIdleDevice). Nothing to do without a model.
  absl::Status ReleaseIdleDevice();

  // ---- Streaming (the stream batcher calls these on the worker thread) ----
  // The backend with streaming configured: slots and logs are allocated, and the current weights published, on
  // the first call after a model is installed. FAILED_PRECONDITION without a model.
  absl::StatusOr<Backend*> StreamingBackend();
  // Whether StreamingBackend has configured the current model (slots and logs exist on its device).
  bool streaming_configured() const { return streaming_configured_; }
  // The weights version the published copy holds (0 before StreamingBackend configured the model).
  int64_t published_weights_version() const { return published_weights_version_; }
  int64_t log_entries_per_slot() const { return streaming_.log_entries_total / streaming_.slots; }
  // While held (a SeedStream stepping its window in several jobs), training's publications wait, so that the window
  // runs under one weights version; the last release publishes what waited. SetNormalizer still publishes at once.
  void HoldPublication() { ++publication_holds_; }
  void ReleasePublication();
  // Whether a training publication is due and waits for a hold's release: a new seed then waits too, so that seeds
  // that overlap one another cannot hold it back for good.
  bool PublicationWaits() const {
    return publication_holds_ > 0 && streaming_configured_ && steps_since_publish_ >= streaming_.publish_every_steps;
  }

 private:
  absl::Status CheckFeaturesAndHorizons(const BatchView<float>& batch) const;
  // Every feature within kMaxStandardizedFeature of the normalizer's mean (beyond, the step or evaluation would not be
  // MODEL.md's, as for such an event streamed), unless the batch was checked before its job under the normalizer the
  // host has now: `checked_under` (the pass over a training batch would leave the device idle for a few hundred µs).
  absl::Status CheckBatchRange(const BatchView<float>& batch, const Normalizer* checked_under) const;
  // ... and the model's training (batch, window).
  absl::Status CheckTrainingBatch(const BatchView<float>& batch) const;
  // For the log of an Init or Load: the model it replaces and its step, discarded ("" without one).
  std::string WhatInstallReplaces() const;
  // Makes `backend` the model; weights changed.
  void Install(std::unique_ptr<Backend> backend, const OptimizerConfig& optimizer, int64_t step,
               Normalizer normalizer);
  // Makes `backend` (training `optimizer`) the current one: fresh training counters, streaming not yet configured
  // on it. Step and weights are the caller's to set.
  void Adopt(std::unique_ptr<Backend> backend, const OptimizerConfig& optimizer);
  // After a change of the weights: refreshes the published copy when streaming runs and `due`.
  absl::Status MaybePublish(bool due);

  // After a training step's update was applied: the step and weights version advance and the weights are published
  // when due (a failed publication is logged; the step stays applied).
  void RecordAppliedStep(int64_t step);
  // A training step failed with `failed`: where the backend applied it all the same, records the step
  // (RecordAppliedStep) and says so in the returned error.
  absl::Status AfterFailedStep(const absl::Status& failed);
  // MakeBackend for this host's device, with its precision and graph setting, through `decorate_` where given; the
  // current backend quiesced first.
  absl::StatusOr<std::unique_ptr<Backend>> NewBackend(const ModelConfig& config, const OptimizerConfig& optimizer,
                                                      std::vector<float> params);
  // NewBackend holding the whole of `state` (weights, moments, step): a backend takes its optimizer at construction.
  absl::StatusOr<std::unique_ptr<Backend>> NewBackendFrom(const Checkpoint& state, const OptimizerConfig& optimizer);

  const std::string device_;
  const bool use_graphs_;
  const std::optional<Precision> precision_;
  BackendDecorator decorate_;  // null: backends are used as MakeBackend makes them
  ServerMetrics& metrics_;
  // A client that loops TrainStep on diverged weights logged a warning a step; bounded as refused calls are.
  LogThrottle steps_not_taken_log_;
  std::optional<DataParallelOptions> data_parallel_;
  std::shared_ptr<NcclCommunicator> communicator_;  // outlives every backend that trains through it
  std::unique_ptr<Backend> backend_;
  TrainingCounters training_counters_;  // the backend's, as of its last training step
  OptimizerConfig optimizer_;
  int64_t step_ = 0;
  int64_t weights_version_ = 0;
  int64_t model_generation_ = 0;
  Normalizer normalizer_;  // the model's (its norm.mean and norm.inv_std buffers)
  const StreamingConfig streaming_;
  bool streaming_configured_ = false;  // on the current backend
  int64_t published_weights_version_ = 0;
  int64_t steps_since_publish_ = 0;  // (a daemon that never streams counts every step it applies)
  int publication_holds_ = 0;
  std::vector<float> logits_;  // Evaluate's output buffer, reused
};

}  // namespace perception::server
