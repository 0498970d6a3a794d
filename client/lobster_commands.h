// perceptionctl's train and eval: LOBSTER files turned into windows by the engine's code, run on the daemon.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "client/perception_client.h"
#include "engine/cli/interruption.h"
#include "engine/dataset.h"

namespace perception::client {

struct LobsterFiles {
  std::string orderbook, messages;
  int levels = 0;  // 0: inferred from the orderbook's columns
};

// Whether the first signal asked a command with `interruption` (may be null) to stop.
inline bool StopRequested(const Interruption* interruption) {
  return interruption != nullptr && interruption->Requested();
}

// `interruption` (may be null) armed for a command whose second signal cancels `calls`; nullopt without one.
std::optional<Interruption::Armed> ArmToCancel(Interruption* interruption, CallCancellation& calls);

struct TrainOptions {
  LobsterFiles files;
  int steps = 0;
  int batch = 0, window = 0;  // 0: the model's; anything else must equal it
  double lr = 0;              // 0: keep the model's
  // The model's cosine schedule, changed for this run and on: its last step (0: keep the model's) and its final rate.
  int64_t total_steps = 0;
  std::optional<double> min_lr;
  double train_fraction = 0.7;
  uint64_t seed = 1;  // window sampling, mixed with the model's step (each run continues with fresh windows)
  int log_every = 10;
  int eval_every = 0;     // steps between validation passes during the run (0: only at its end)
  std::string save_best;  // a checkpoint name, saved on the daemon (rank 0) at each validation beating the run's best
  bool fit_normalizer = false;  // fit one on a model trained past step 0 without one (refused otherwise)
  // Ctrl-C (may be null): once the steps start, its first signal stops the run at a step every rank reaches, the
  // steps sent answered and no validation run; its second cancels the calls.
  Interruption* interruption = nullptr;
};

// Splits the events by time, fits and sends the normalizer if the model has none, streams `steps` random training
// windows through Train with a progress display, then prints the validation loss beside the class-prior baseline.
// With `eval_every`, the validation loss is also printed every that many steps (the steps in between run as one
// Train stream each, on the same batches as one stream would), and `save_best` keeps the best model of the run.
// Several `ranks` are the daemons of one data-parallel job in rank order: each global batch of N·B windows is
// sampled once and rank r trains on its windows [r·B, (r+1)·B) (client/data_parallel.h); rank 0 validates.
// Interrupted (options.interruption), it returns CANCELLED saying where the model stands and how to go on.
absl::Status TrainOnLobster(std::span<PerceptionClient* const> ranks, const TrainOptions& options);

// The normalizer the daemon's model standardizes its inputs with (v1::Model.normalizer); nullopt where the daemon
// sent none of the model's size.
std::optional<Normalizer> NormalizerOf(const v1::Model& model);

// Evaluates every whole window of the files (the model's window unless `window` > 0) and prints the masked loss,
// the per-horizon accuracy and the baseline of predicting the files' own class prior.
absl::Status EvaluateLobster(PerceptionClient& client, const LobsterFiles& files, int window);

}  // namespace perception::client
