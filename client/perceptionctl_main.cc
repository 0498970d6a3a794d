// perceptionctl: the command line of perceptiond (status, init, train, eval, checkpoints, live streaming).
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "absl/strings/numbers.h"
#include "client/data_parallel.h"
#include "client/lobster_commands.h"
#include "client/stream_commands.h"
#include "client/perception_client.h"
#include "engine/cli/arguments.h"
#include "engine/cli/interruption.h"
#include "engine/host_allocation.h"
#include "engine/optimizer.h"
#include "engine/status_macros.h"
#include "perception/v1/default_address.h"

PERCEPTION_FLAG(std::string, target, perception::v1::kDefaultAddress, "perceptiond address, host:port");
PERCEPTION_FLAG(std::vector<std::string>, targets, {},
    "the daemons of one data-parallel job (perceptiond --world_size), in rank order, instead of --target: "
    "init and checkpoint load go to every rank, train shards each global batch across them, checkpoint save "
    "goes to rank 0");
PERCEPTION_FLAG(absl::Duration, timeout, absl::Seconds(60),
    "deadline of each call; train: the longest wait for a step's response, stream and bench: for an "
    "acknowledgement, while steps or events are outstanding");
PERCEPTION_FLAG(absl::Duration, wait, absl::ZeroDuration(), "first wait up to this long for the daemon to serve");
PERCEPTION_FLAG(std::string, config, "small", "init: model preset (tiny, small, large)");
PERCEPTION_FLAG(int, levels, 0,
    "book levels: init sets n_features = 4*levels + 8 (0: the preset's); train, eval and stream read the "
    "orderbook file's first (best) levels (0: all, inferred from its column count)");
PERCEPTION_FLAG(uint64_t, seed, 1,
    "init: weight initialization seed; train: window sampling seed (mixed with the model's step, so that "
    "each run of train continues with fresh windows)");
PERCEPTION_FLAG(int, batch, 0, "windows per training batch: init sets it (0: the preset's); train checks it (0: any)");
PERCEPTION_FLAG(int, eval_every, 0,
    "train: steps between validation passes, each printed (0: only the one at the end of the run)");
PERCEPTION_FLAG(std::string, save_best, "",
    "train: checkpoint name (on the daemon, rank 0) that each validation beating the run's best so far saves "
    "the model to; the starting model is validated and saved first, so a bad name fails before any step");
PERCEPTION_FLAG(bool, fit_normalizer, false,
    "train: fit the normalizer on the files even where the model trained past step 0 without one (refused "
    "otherwise: it changes the inputs the model's weights were trained on)");
PERCEPTION_FLAG(int, window, 0, "events per window: init sets it (0: the preset's); train checks it; eval uses it");
PERCEPTION_FLAG(int, warmup, -1,
    "init: leading window positions that train and eval mask out of the loss when they build batches (kept in "
    "the model's config; -1: the preset's)");
PERCEPTION_FLAG(std::optional<double>, lr, std::nullopt,
    "peak learning rate, > 0; init: without it 1e-3; train: without it the model's is kept");
PERCEPTION_FLAG(std::string, lr_schedule, "constant", "init: constant, or cosine (linear warmup then cosine decay)");
PERCEPTION_FLAG(int64_t, lr_warmup_steps, 0, "init, cosine schedule: steps of the linear warmup");
PERCEPTION_FLAG(int64_t, total_steps, 0,
                "init, cosine schedule: the step at which the learning rate reaches --min_lr; train: moves the model's "
                "(0: keeps it), to extend its schedule");
PERCEPTION_FLAG(double, min_lr, 0,
                "init, cosine schedule: the final learning rate; train: changes the model's (without it: kept)");
PERCEPTION_FLAG(bool, replace, false, "init: replace the daemon's existing model");
PERCEPTION_FLAG(std::vector<std::string>, lobster, {},
    "ORDERBOOK MESSAGES (or ORDERBOOK,MESSAGES): a LOBSTER file pair");
PERCEPTION_FLAG(int, steps, 100, "train: optimizer steps (>= 1)");
PERCEPTION_FLAG(double, train_fraction, 0.7, "train: leading fraction of the events to train on; the rest validates");
PERCEPTION_FLAG(int, log_every, 10, "train: steps between progress lines when the output is not a terminal");
PERCEPTION_FLAG(std::string, instrument, "", "stream, convictions: the instrument id");
PERCEPTION_FLAG(std::string, rate, "max", "stream, bench: events per second (in all), or max");
PERCEPTION_FLAG(int, seed_window, 0,
    "stream: seed the state with the first N events (SeedStream), then stream the rest; refused on an "
    "instrument that already has events unless --reseed");
PERCEPTION_FLAG(bool, reseed, false,
    "stream, with --seed-window: let the seed replace the live state of an instrument that has events");
PERCEPTION_FLAG(bool, while_fed, false,
    "streams reset: even while an open Stream call feeds the instrument (its next events follow the zeroed state)");
PERCEPTION_FLAG(int64_t, first, 0, "stream: start at this event of the files (0-based)");
PERCEPTION_FLAG(int64_t, count, 0, "stream: use this many events from --first on (0: all the rest)");
PERCEPTION_FLAG(uint64_t, start_seq, 1,
    "stream: the sequence number of event --first (seed window included), >= 1; a failed stream names the "
    "--first and --start_seq that resume it");
PERCEPTION_FLAG(uint64_t, from, 0,
    "convictions: the first sequence number to write (0: the log's oldest; one already overwritten is "
    "OUT_OF_RANGE; one past the log's end writes only the header)");
PERCEPTION_FLAG(std::string, out, "", "convictions: the CSV file to write");
PERCEPTION_FLAG(int, instruments, 1, "bench: instruments (bench-0, bench-1, ...)");
PERCEPTION_FLAG(int64_t, events, 10000, "bench: events in all, spread round-robin over the instruments");
PERCEPTION_FLAG(int, connections, 1, "bench: Stream calls, each with its share of the instruments");
PERCEPTION_FLAG(int, in_flight, 8, "bench: unacknowledged requests per connection (one event per instrument each)");

namespace perception::client {
namespace {

constexpr char kUsage[] = R"(drive perceptiond over gRPC.

  perceptionctl [--target HOST:PORT] [--timeout D] [--wait D] COMMAND ...   (flags may also follow COMMAND)
  perceptionctl --targets H:P,H:P,... status | init ... | train ... | checkpoint save|load NAME
                                      (one data-parallel job, ranks in order; train's batch is N x the model's)
    status
    init [--config NAME (small)] [--levels N] [--seed S] [--batch B] [--window T] [--lr X]
         [--lr_schedule cosine --total_steps N [--lr_warmup_steps W] [--min_lr Y]] [--replace]
    train --lobster ORDERBOOK MESSAGES [--levels N] [--steps N (100)] [--batch B] [--window T] [--lr X]
          [--total_steps N] [--min_lr Y] [--eval-every N] [--save-best NAME] [--fit-normalizer]
    eval --lobster ORDERBOOK MESSAGES [--levels N] [--window T]
    checkpoint save NAME
    checkpoint load NAME
    stream --lobster ORDERBOOK MESSAGES [--levels N] --instrument ID [--rate EVENTS_PER_S|max]
           [--seed-window N [--reseed]] [--first I] [--count N] [--start_seq S]
    convictions --instrument ID [--from SEQ] --out FILE.csv
    streams                                  (list the live streams)
    streams reset ID [--while_fed] | streams close ID
    bench --instruments N --events M [--rate R|max] [--connections C] [--in-flight K])";

constexpr std::array<std::string_view, 9> kCommands = {"status", "init",        "train",   "eval", "checkpoint",
                                                      "stream", "convictions", "streams", "bench"};

// The flags and the commands that read them (CheckFlagsTakenBy refuses the rest); --target, --targets, --timeout
// and --wait are every command's.
const std::vector<FlagUse>& FlagUses() {
  static const auto* const uses = new std::vector<FlagUse>{
      {FLAGS_config, {"init"}},
      {FLAGS_levels, {"init", "train", "eval", "stream"}},
      {FLAGS_seed, {"init", "train"}},
      {FLAGS_batch, {"init", "train"}},
      {FLAGS_eval_every, {"train"}},
      {FLAGS_save_best, {"train"}},
      {FLAGS_fit_normalizer, {"train"}},
      {FLAGS_window, {"init", "train", "eval"}},
      {FLAGS_warmup, {"init"}},
      {FLAGS_lr, {"init", "train"}},
      {FLAGS_lr_schedule, {"init"}},
      {FLAGS_lr_warmup_steps, {"init"}},
      {FLAGS_total_steps, {"init", "train"}},
      {FLAGS_min_lr, {"init", "train"}},
      {FLAGS_replace, {"init"}},
      {FLAGS_lobster, {"train", "eval", "stream"}},
      {FLAGS_steps, {"train"}},
      {FLAGS_train_fraction, {"train"}},
      {FLAGS_log_every, {"train"}},
      {FLAGS_instrument, {"stream", "convictions"}},
      {FLAGS_rate, {"stream", "bench"}},
      {FLAGS_seed_window, {"stream"}},
      {FLAGS_reseed, {"stream"}},
      {FLAGS_while_fed, {"streams"}},
      {FLAGS_first, {"stream"}},
      {FLAGS_count, {"stream"}},
      {FLAGS_start_seq, {"stream"}},
      {FLAGS_from, {"convictions"}},
      {FLAGS_out, {"convictions"}},
      {FLAGS_instruments, {"bench"}},
      {FLAGS_events, {"bench"}},
      {FLAGS_connections, {"bench"}},
      {FLAGS_in_flight, {"bench"}},
  };
  return *uses;
}

std::string Describe(const v1::Model& model) {
  const v1::ModelConfig& c = model.config();
  const v1::OptimizerSettings& o = model.optimizer();
  std::string schedule = "constant";
  if (o.schedule() == v1::LR_SCHEDULE_WARMUP_COSINE) {
    schedule = absl::StrCat("warmup ", o.warmup_steps(), " then cosine to ", o.min_lr(), " at step ", o.total_steps());
  }
  return absl::StrFormat(
      "model: F=%d D=%d L=%d expand=%d P=%d N=%d W=%d C=%d K=%d G=%d horizons [%s]; trains on %d x %d events "
      "(warmup %d)\n  step %d, weights version %d, %d trained parameters, normalizer %s\n"
      "  optimizer: AdamW lr %g (%s), weight decay %g, clip %g",
      c.n_features(), c.d_model(), c.n_layers(), c.expand(), c.headdim(), c.d_state(), c.d_conv(), c.cfc_units(),
      c.cfc_backbone(), c.grn_hidden(), absl::StrJoin(c.horizons(), ", "), c.batch(), c.window(), c.warmup(),
      model.step(), model.weights_version(), model.trained_parameters(),
      model.normalizer_fitted() ? "fitted" : "not fitted (identity)", o.lr(), schedule, o.weight_decay(),
      o.max_grad_norm());
}

absl::Status Status(PerceptionClient& client) {
  ASSIGN_OR_RETURN(const v1::GetStatusResponse status, client.GetStatus());
  const v1::Device& device = status.device();
  const v1::Limits& limits = status.limits();
  const std::string memory =
      device.memory_bytes() > 0 ? absl::StrFormat(", %.1f GiB", device.memory_bytes() / double(1 << 30)) : "";
  std::printf(
      "perceptiond %s at %s\ndevice: %s%s, precision %s\n%s\nlimits: batch <= %d, window <= %d, messages <= %lld "
      "bytes, queue depth %d (%d jobs waiting)\n",
      status.version().c_str(), client.target().c_str(), device.name().c_str(), memory.c_str(),
      device.precision().c_str(),
      status.has_model() ? Describe(status.model()).c_str() : "model: none (perceptionctl init)", limits.max_batch(),
      limits.max_window(), static_cast<long long>(limits.max_message_bytes()), limits.queue_depth(),
      status.queued_jobs());
  const v1::StreamingStatus& s = status.streaming();
  std::printf(
      "streaming: %d of %d slots live, %lld log entries per slot, weights version %lld, %lld events pending (calls "
      "held at %lld)\n",
      s.active_streams(), s.slots(), static_cast<long long>(s.log_entries_per_slot()),
      static_cast<long long>(s.weights_version()), static_cast<long long>(s.pending_events()),
      static_cast<long long>(s.max_pending_events()));
  if (status.draining()) {
    std::printf("draining: the daemon is exiting; it refuses new work and answers reads of the convictions until "
                "they are read back or its --drain_for_reads ends\n");
  }
  if (status.has_data_parallel()) {
    const v1::DataParallelStatus& p = status.data_parallel();
    std::printf("data parallel: rank %d of %d, parameter checksum every %lld steps (%lld compared equal)\n", p.rank(),
                p.world_size(), static_cast<long long>(p.replica_check_every()),
                static_cast<long long>(p.replica_checks()));
  }
  return absl::OkStatus();
}

// --lr, or 0 when it is not given (init: the default, train: the model's). A value <= 0 was taken for "not given"
// and silently dropped, so `init --lr 0` or `--lr -1e-3` ran at another learning rate than asked: refused.
absl::StatusOr<double> LrFromFlag() {
  const std::optional<double> lr = absl::GetFlag(FLAGS_lr);
  if (!lr.has_value()) return 0.0;
  RETURN_IF_ERROR(CheckFinitePositive("lr", *lr, "leave it out for init's default or to keep the model's"));
  return *lr;
}

// --window, >= 0 (0: the preset's or the model's); a negative one was replaced by that default.
absl::StatusOr<int> WindowFromFlag() {
  const int window = absl::GetFlag(FLAGS_window);
  if (window < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--window must be >= 0 (0: the model's), got ", window));
  }
  return window;
}

absl::StatusOr<v1::OptimizerSettings> OptimizerFromFlags() {
  v1::OptimizerSettings settings;
  ASSIGN_OR_RETURN(const double lr, LrFromFlag());
  if (lr > 0) settings.set_lr(lr);
  ASSIGN_OR_RETURN(const LrSchedule schedule, ParseLrSchedule(absl::GetFlag(FLAGS_lr_schedule)));
  // The cosine schedule's settings: a constant learning rate would ignore them in silence.
  const std::pair<bool, const char*> cosine_flags[] = {{FlagGiven(FLAGS_lr_warmup_steps), "--lr_warmup_steps"},
                                                       {FlagGiven(FLAGS_total_steps), "--total_steps"},
                                                       {FlagGiven(FLAGS_min_lr), "--min_lr"}};
  for (const auto& [given, flag] : cosine_flags) {
    if (given && schedule == LrSchedule::kConstant) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " sets the cosine schedule: without --lr_schedule cosine it would be ignored"));
    }
  }
  // The daemon's own checks of these name the request's fields; the flags are named here, before --wait waits.
  const int64_t warmup_steps = absl::GetFlag(FLAGS_lr_warmup_steps), total_steps = absl::GetFlag(FLAGS_total_steps);
  const double min_lr = absl::GetFlag(FLAGS_min_lr);
  if (schedule == LrSchedule::kWarmupCosine && (warmup_steps < 0 || total_steps <= warmup_steps)) {
    return absl::InvalidArgumentError(absl::StrCat("--lr_schedule cosine needs 0 <= --lr_warmup_steps (", warmup_steps,
                                                   ") < --total_steps (", total_steps, ")"));
  }
  // Without --lr, init's learning rate is the optimizer's default (the daemon's OptimizerFromProto).
  if (const double bound = lr > 0 ? lr : OptimizerConfig{}.lr;
      schedule == LrSchedule::kWarmupCosine && !(min_lr >= 0 && min_lr <= bound)) {
    return absl::InvalidArgumentError(absl::StrCat("--min_lr (", min_lr, ") must be in [0, --lr] (--lr ", bound,
                                                   lr > 0 ? ")" : ", init's default)"));
  }
  settings.set_schedule(schedule == LrSchedule::kWarmupCosine ? v1::LR_SCHEDULE_WARMUP_COSINE
                                                              : v1::LR_SCHEDULE_CONSTANT);
  settings.set_warmup_steps(warmup_steps);
  settings.set_total_steps(total_steps);
  settings.set_min_lr(min_lr);
  return settings;
}

// init's request, from the flags (before anything is sent).
absl::StatusOr<v1::InitModelRequest> InitRequestFromFlags() {
  v1::InitModelRequest request;
  request.set_config_name(absl::GetFlag(FLAGS_config));
  // 0 (the default) keeps the preset's feature count; below it the preset's was used in silence.
  if (const int levels = absl::GetFlag(FLAGS_levels); levels < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--levels must be >= 0 (0: the preset's), got ", levels));
  } else if (levels > 0) {
    request.set_levels(levels);
  }
  request.set_batch(absl::GetFlag(FLAGS_batch));
  ASSIGN_OR_RETURN(const int window, WindowFromFlag());
  request.set_window(window);
  // -1 (the default) keeps the preset's warmup; below it the preset's was used in silence.
  if (const int warmup = absl::GetFlag(FLAGS_warmup); warmup < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--warmup must be >= 0, or -1 for the preset's, got ", warmup));
  } else if (warmup >= 0) {
    request.set_warmup(warmup);
  }
  request.set_seed(absl::GetFlag(FLAGS_seed));
  ASSIGN_OR_RETURN(*request.mutable_optimizer(), OptimizerFromFlags());
  request.set_replace(absl::GetFlag(FLAGS_replace));
  return request;
}

absl::Status Init(PerceptionClient& client, const v1::InitModelRequest& request) {
  ASSIGN_OR_RETURN(const v1::InitModelResponse response, client.InitModel(request));
  std::printf("initialized %s\n%s\n", request.config_name().c_str(), Describe(response.model()).c_str());
  return absl::OkStatus();
}

absl::StatusOr<LobsterFiles> LobsterFromFlags() {
  const std::vector<std::string> files = absl::GetFlag(FLAGS_lobster);
  if (files.size() != 2) return absl::InvalidArgumentError("--lobster takes two files: ORDERBOOK MESSAGES");
  if (const int levels = absl::GetFlag(FLAGS_levels); levels < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--levels must be >= 0 (0: all of the orderbook file's levels), got ", levels));
  }
  return LobsterFiles{files[0], files[1], absl::GetFlag(FLAGS_levels)};
}

absl::StatusOr<TrainOptions> TrainOptionsFromFlags() {
  ASSIGN_OR_RETURN(const LobsterFiles files, LobsterFromFlags());
  RETURN_IF_ERROR(
      CheckAtLeastOne({{"steps", absl::GetFlag(FLAGS_steps)}, {"log_every", absl::GetFlag(FLAGS_log_every)}}));
  if (const int every = absl::GetFlag(FLAGS_eval_every); every < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--eval_every must be >= 0 (0: only at the end), got ", every));
  }
  // Checked here, before --wait waits and the files are read; NaN fails both comparisons.
  RETURN_IF_ERROR(CheckOpenFraction("train_fraction", absl::GetFlag(FLAGS_train_fraction)));
  ASSIGN_OR_RETURN(const int window, WindowFromFlag());
  ASSIGN_OR_RETURN(const double lr, LrFromFlag());
  if (const int64_t total_steps = absl::GetFlag(FLAGS_total_steps); total_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--total_steps must be >= 1 (0: the model's), got ", total_steps));
  }
  // (Checked against the learning rate once the model's settings are known: TrainOnLobster.)
  const std::optional<double> min_lr =
      FlagGiven(FLAGS_min_lr) ? std::optional(absl::GetFlag(FLAGS_min_lr)) : std::nullopt;
  return TrainOptions{files,
                      absl::GetFlag(FLAGS_steps),
                      absl::GetFlag(FLAGS_batch),
                      window,
                      lr,
                      absl::GetFlag(FLAGS_total_steps),
                      min_lr,
                      absl::GetFlag(FLAGS_train_fraction),
                      absl::GetFlag(FLAGS_seed),
                      absl::GetFlag(FLAGS_log_every),
                      absl::GetFlag(FLAGS_eval_every),
                      absl::GetFlag(FLAGS_save_best),
                      absl::GetFlag(FLAGS_fit_normalizer)};
}

absl::Status SaveCheckpoint(PerceptionClient& client, const std::string& name) {
  v1::SaveCheckpointRequest request;
  request.set_name(name);
  ASSIGN_OR_RETURN(const v1::SaveCheckpointResponse response, client.SaveCheckpoint(request));
  std::printf("saved %s: step %lld, %lld bytes in %.3f s\n", response.name().c_str(),
              static_cast<long long>(response.step()), static_cast<long long>(response.bytes()), response.seconds());
  return absl::OkStatus();
}

absl::Status LoadCheckpoint(PerceptionClient& client, const std::string& name) {
  v1::LoadCheckpointRequest request;
  request.set_name(name);
  ASSIGN_OR_RETURN(const v1::LoadCheckpointResponse response, client.LoadCheckpoint(request));
  std::printf("loaded %s in %.3f s\n%s\n", name.c_str(), response.seconds(), Describe(response.model()).c_str());
  return absl::OkStatus();
}

absl::StatusOr<double> RateFromFlag() {
  const std::string rate = absl::GetFlag(FLAGS_rate);
  double value = 0;
  if (rate == "max") return 0.0;
  // (An infinite rate paced every send at the run's start: bench then timed latencies from there.)
  if (!absl::SimpleAtod(rate, &value) || !(value > 0) || std::isinf(value)) {
    return absl::InvalidArgumentError(absl::StrCat("--rate must be a finite positive number of events per second, "
                                                   "or max, not '", rate, "'"));
  }
  return value;
}

absl::StatusOr<StreamOptions> StreamOptionsFromFlags() {
  ASSIGN_OR_RETURN(const LobsterFiles files, LobsterFromFlags());
  ASSIGN_OR_RETURN(const double rate, RateFromFlag());
  return StreamOptions{files, absl::GetFlag(FLAGS_instrument), rate, absl::GetFlag(FLAGS_seed_window),
                       absl::GetFlag(FLAGS_reseed), absl::GetFlag(FLAGS_first), absl::GetFlag(FLAGS_count),
                       absl::GetFlag(FLAGS_start_seq)};
}

absl::StatusOr<BenchOptions> BenchOptionsFromFlags() {
  ASSIGN_OR_RETURN(const double rate, RateFromFlag());
  return BenchOptions{absl::GetFlag(FLAGS_instruments), absl::GetFlag(FLAGS_events), rate,
                      absl::GetFlag(FLAGS_connections), absl::GetFlag(FLAGS_in_flight)};
}

absl::Status ListStreams(PerceptionClient& client) {
  ASSIGN_OR_RETURN(const v1::ListStreamsResponse response, client.ListStreams());
  std::fputs(StreamsTable(response).c_str(), stdout);
  return absl::OkStatus();
}

// CheckRanks over `daemons` (--targets), for `command`, which acts for the whole job through rank 0.
absl::Status CheckOneJob(std::span<PerceptionClient* const> daemons, const std::string& command) {
  std::vector<v1::GetStatusResponse> statuses;
  std::vector<std::string> targets;
  for (PerceptionClient* daemon : daemons) {
    ASSIGN_OR_RETURN(statuses.emplace_back(), daemon->GetStatus());
    targets.push_back(daemon->target());
  }
  if (const absl::Status ranks = CheckRanks(statuses, targets); !ranks.ok()) {
    return absl::Status(ranks.code(), absl::StrCat(ranks.message(), " (", command, " acts for the job through rank 0; "
                                                   "give each daemon of its own a --target)"));
  }
  return absl::OkStatus();
}

// A command resolved from the arguments and flags before anything is sent or waited for (--wait), so that a
// mistyped one fails at once. It addresses the daemons of --targets (the ranks of a data-parallel job) or the one of
// --target.
using Command = std::function<absl::Status(std::span<PerceptionClient* const>)>;
using DaemonCommand = std::function<absl::Status(PerceptionClient&)>;

Command OnEveryDaemon(DaemonCommand command) {
  return [command = std::move(command)](std::span<PerceptionClient* const> daemons) -> absl::Status {
    for (PerceptionClient* daemon : daemons) RETURN_IF_ERROR(command(*daemon));
    return absl::OkStatus();
  };
}

// A command for the first daemon only: the one of --target, or rank 0 of --targets.
Command OnFirstDaemon(DaemonCommand command) {
  return [command = std::move(command)](std::span<PerceptionClient* const> daemons) { return command(*daemons[0]); };
}

// The commands of one daemon only.
absl::StatusOr<DaemonCommand> ParseDaemonCommand(const std::vector<std::string>& args) {
  const std::string command = args.size() > 1 ? args[1] : "";
  if (command == "eval" && args.size() == 2) {
    ASSIGN_OR_RETURN(const LobsterFiles files, LobsterFromFlags());
    ASSIGN_OR_RETURN(const int window, WindowFromFlag());
    return DaemonCommand([files, window](PerceptionClient& client) {
      return EvaluateLobster(client, files, window);
    });
  }
  // The commands' own checks run here too, before --wait waits for the daemon.
  if (command == "stream" && args.size() == 2) {
    ASSIGN_OR_RETURN(const StreamOptions options, StreamOptionsFromFlags());
    RETURN_IF_ERROR(CheckStreamOptions(options));
    // Made here, before the clients' channels start their threads, which must inherit its blocked signals.
    auto interruption = std::make_shared<Interruption>(
        "no further events are sent; waiting for those sent to be acknowledged (again: stop waiting)",
        "the call is cancelled");
    return DaemonCommand([options, interruption](PerceptionClient& client) {
      return StreamLobster(client, options, interruption.get());
    });
  }
  if (command == "convictions" && args.size() == 2) {
    RETURN_IF_ERROR(CheckConvictionsOptions(absl::GetFlag(FLAGS_instrument), absl::GetFlag(FLAGS_out)));
    return DaemonCommand([instrument = absl::GetFlag(FLAGS_instrument), from = absl::GetFlag(FLAGS_from),
                          out = absl::GetFlag(FLAGS_out)](PerceptionClient& client) {
      return WriteConvictions(client, instrument, from, out);
    });
  }
  if (command == "bench" && args.size() == 2) {
    ASSIGN_OR_RETURN(const BenchOptions options, BenchOptionsFromFlags());
    RETURN_IF_ERROR(CheckBenchOptions(options));
    // (Made before the channels' threads, as stream's.)
    auto interruption = std::make_shared<Interruption>(
        "no further events are sent; waiting for those sent to be acknowledged, then the report (again: stop "
        "waiting)",
        "the calls are cancelled");
    return DaemonCommand([options, interruption](PerceptionClient& client) {
      return Bench(client, options, interruption.get());
    });
  }
  // (The one flag of streams' that only its reset reads.)
  if (command == "streams" && FlagGiven(FLAGS_while_fed) && !(args.size() == 4 && args[2] == "reset")) {
    return absl::InvalidArgumentError("--while_fed applies to streams reset ID only");
  }
  if (command == "streams" && args.size() == 2) return DaemonCommand(ListStreams);
  if (command == "streams" && args.size() == 4 && args[2] == "reset") {
    return DaemonCommand([instrument = args[3]](PerceptionClient& client) -> absl::Status {
      v1::ResetStreamRequest request;
      request.set_instrument(instrument);
      request.set_while_fed(absl::GetFlag(FLAGS_while_fed));
      RETURN_IF_ERROR(client.ResetStream(request).status());
      std::printf("reset %s: its state is zeroed; its sequence numbers and log continue\n", instrument.c_str());
      return absl::OkStatus();
    });
  }
  if (command == "streams" && args.size() == 4 && args[2] == "close") {
    return DaemonCommand([instrument = args[3]](PerceptionClient& client) -> absl::Status {
      v1::CloseStreamRequest request;
      request.set_instrument(instrument);
      ASSIGN_OR_RETURN(const v1::CloseStreamResponse closed, client.CloseStream(request));
      std::printf("closed %s after %llu events\n", instrument.c_str(),
                  static_cast<unsigned long long>(closed.processed_events()));
      return absl::OkStatus();
    });
  }
  return UnexpectedArguments(args, kCommands, kUsage);
}

// `several`: --targets named the daemons, so only the commands that address every rank are taken.
absl::StatusOr<Command> ParseCommand(const std::vector<std::string>& args, bool several) {
  const std::string command = args.size() > 1 ? args[1] : "";
  // Only a command there is: a mistyped one is named as unexpected, with the usage, rather than its flags refused.
  if (std::ranges::find(kCommands, command) != kCommands.end()) {
    RETURN_IF_ERROR(CheckFlagsTakenBy(command, FlagUses()));
    RETURN_IF_ERROR(CheckGivenOnce(FLAGS_lobster, "a command reads one LOBSTER file pair"));
  }
  if (command == "status" && args.size() == 2) return OnEveryDaemon(Status);
  if (command == "init" && args.size() == 2) {
    ASSIGN_OR_RETURN(const v1::InitModelRequest request, InitRequestFromFlags());
    return OnEveryDaemon([request](PerceptionClient& daemon) { return Init(daemon, request); });
  }
  if (command == "train" && args.size() == 2) {
    ASSIGN_OR_RETURN(const TrainOptions options, TrainOptionsFromFlags());
    // Made here, before the clients' channels start their threads, which must inherit its blocked signals.
    auto interruption = std::make_shared<Interruption>(
        "no further batches are sent; waiting for the steps sent to be answered (again: stop waiting)",
        absl::StrCat("the wait for the steps sent is cancelled",
                     several ? " on every rank (ranks it leaves at different steps fail their next collective: the "
                               "job then aborts at its collective timeout)"
                             : "",
                     "; a validation request or a save under way still completes"));
    return Command([options, interruption](std::span<PerceptionClient* const> ranks) {
      TrainOptions run = options;
      run.interruption = interruption.get();
      return TrainOnLobster(ranks, run);
    });
  }
  if (command == "checkpoint" && args.size() == 4 && args[2] == "load") {
    return OnEveryDaemon([name = args[3]](PerceptionClient& rank) { return LoadCheckpoint(rank, name); });
  }
  // Every rank holds the same parameters (checked by checksum); rank 0 saves them. Targets that are not one job's
  // ranks hold models of their own, and saving the first alone left the others unsaved without a word.
  if (command == "checkpoint" && args.size() == 4 && args[2] == "save") {
    return Command([name = args[3]](std::span<PerceptionClient* const> daemons) -> absl::Status {
      if (daemons.size() > 1) RETURN_IF_ERROR(CheckOneJob(daemons, "checkpoint save"));
      return SaveCheckpoint(*daemons[0], name);
    });
  }
  if (several) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--targets applies to status, init, train and checkpoint save|load; give one --target for the rest (got: ",
        absl::StrJoin(args.begin() + 1, args.end(), " "), ")"));
  }
  ASSIGN_OR_RETURN(DaemonCommand one, ParseDaemonCommand(args));
  return OnFirstDaemon(std::move(one));
}

absl::Status Run(const std::vector<std::string>& args) {
  // A deadline of zero or less fails every call at once (DEADLINE_EXCEEDED), far from the flag that caused it.
  if (const absl::Duration timeout = absl::GetFlag(FLAGS_timeout); timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--timeout must be > 0, got ", absl::FormatDuration(timeout)));
  }
  const ClientOptions options{.timeout = absl::GetFlag(FLAGS_timeout)};
  const absl::Duration wait = absl::GetFlag(FLAGS_wait);
  if (wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--wait must be >= 0 (0: no wait), got ", absl::FormatDuration(wait)));
  }
  std::vector<std::string> targets = absl::GetFlag(FLAGS_targets);
  ASSIGN_OR_RETURN(const Command command, ParseCommand(args, /*several=*/!targets.empty()));
  // --target beside --targets was ignored without a word.
  if (!targets.empty() && FlagGiven(FLAGS_target)) {
    return absl::InvalidArgumentError("give --target (one daemon) or --targets (the ranks of a job), not both");
  }
  if (targets.empty()) targets.push_back(absl::GetFlag(FLAGS_target));
  std::vector<std::unique_ptr<PerceptionClient>> clients;
  std::vector<PerceptionClient*> daemons;
  for (const std::string& target : targets) {
    daemons.push_back(clients.emplace_back(std::make_unique<PerceptionClient>(target, options)).get());
    if (wait > absl::ZeroDuration()) RETURN_IF_ERROR(daemons.back()->WaitUntilServing(wait));
  }
  return command(daemons);
}

}  // namespace
}  // namespace perception::client

int main(int argc, char** argv) {
  perception::KeepFreedHostMemoryForReuse();  // train and eval serialize megabytes a request
  absl::SetProgramUsageMessage(perception::client::kUsage);
  const absl::Status status = perception::client::Run(perception::ParseArguments(argc, argv));
  std::fflush(stdout);  // what was printed before the failure comes first even when both go to one pipe
  if (status.ok()) return 0;
  std::fprintf(stderr, "perceptionctl: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  perception::Interruption::EndByTheSignalReceived();
  return 1;
}
