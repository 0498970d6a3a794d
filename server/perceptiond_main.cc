// perceptiond: the daemon that owns one compute device and trains and serves PerceptionNet v1 over gRPC.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/atomic_file.h"
#include "engine/backend.h"
#include "engine/cli/arguments.h"
#include "engine/config.h"
#include "engine/device_loss.h"
#include "engine/host_allocation.h"
#include "engine/precision.h"
#include "engine/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "perception/v1/default_address.h"
#include "server/calls_in_flight.h"
#include "server/checkpoint_directory.h"
#include "server/device_worker.h"
#include "server/listen_address.h"
#include "server/metrics.h"
#include "server/metrics_http_server.h"
#include "server/perception_service.h"
#include "server/rendezvous.h"
#include "server/stall_watch.h"
#include "server/stream_batcher.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, perception::v1::kDefaultAddress, "gRPC listen address, host:port (port 0: any)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics listen address, host:port (port 0: any; empty: no metrics endpoint)");
ABSL_FLAG(std::string, device, "auto", "compute device: auto (CUDA when a device is present), cpu or cuda");
ABSL_FLAG(std::string, precision, "auto",
          "the CUDA backend's linear-layer products: auto (3xtf32 on CUDA, fp32 on the CPU), fp32 (cuBLAS float32), "
          "3xtf32 (float32 accuracy on the TF32 tensor cores, held to fp32's bars) or tf32 (inputs rounded to TF32)");
ABSL_FLAG(bool, graphs, true, "CUDA graphs for the training step and streaming ticks (--nographs: kernel by kernel)");
ABSL_FLAG(std::string, checkpoint_dir, "checkpoints",
          "folder that checkpoint names are relative to; created when missing");
ABSL_FLAG(std::string, load, "", "checkpoint name to load at startup");
ABSL_FLAG(std::string, load_if_present, "",
          "checkpoint name to load at startup when the file exists (as --load: one that cannot be loaded fails the "
          "start); when it does not, the daemon starts from --init_config if given, else with no model. With "
          "--checkpoint_on_exit of the same name, a restarted daemon resumes the model it saved");
ABSL_FLAG(std::string, init_config, "", "preset to create a model from at startup (tiny, small, large; seed 1)");
ABSL_FLAG(int, init_levels, 0, "with --init_config: LOBSTER book levels, n_features = 4*levels + 8 (0: the preset's)");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20, "largest request message in bytes");
ABSL_FLAG(int, max_batch, 1024, "most windows in one batch");
ABSL_FLAG(int, max_window, 4096, "most events in one window");
ABSL_FLAG(int, queue_depth, 64,
          "most calls' jobs waiting for the device at each priority (streaming, training); beyond it, calls answer "
          "RESOURCE_EXHAUSTED (the streaming ticks and seed parts the daemon queues itself are not counted)");
ABSL_FLAG(std::string, checkpoint_on_exit, "", "checkpoint name to save the model to after draining (empty: none)");
ABSL_FLAG(absl::Duration, device_stall_timeout, absl::Seconds(60),
          "health reports NOT_SERVING while one device job (a training step, a tick, a checkpoint load) has run "
          "longer than this, as a hung kernel would, so that a supervisor's liveness probe restarts the daemon; "
          "SERVING again once it ends (a CPU daemon's big evaluations can take longer: raise it there); inf turns "
          "the watch off");
ABSL_FLAG(absl::Duration, drain_grace, absl::ZeroDuration(),
          "on SIGTERM/SIGINT/SIGHUP, how long health reports NOT_SERVING and new work is refused (UNAVAILABLE) before "
          "the listener closes, so that load balancers and clients notice; GetStatus, ListStreams and ReadConvictions "
          "still answer meanwhile, so that clients read back the convictions of the events streamed before the "
          "signal (which the device holds only until the daemon exits); a second signal or a lost device ends it");
ABSL_FLAG(absl::Duration, drain_for_reads, absl::Seconds(10),
          "on SIGTERM/SIGINT/SIGHUP, after --drain_grace: how much longer reads still answer while convictions wait to "
          "be read back (a live stream's log entries past the end of every ReadConvictions of it, or events still to "
          "process), ending as soon as none waits, the device is lost, or a second signal arrives (0: not at all); "
          "then the listener closes once the calls in flight are answered (their accepted events processed, for up "
          "to 60 s)");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(30),
          "how often the daemon pings a client connection with calls open, so that a feed whose host or network "
          "vanished without closing its connection is found: its calls are cancelled, its instruments free for "
          "ResetStream and SeedStream (inf: no pings; gRPC's own default is 2 h)");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(20),
          "how long the daemon waits for a client's answer to its ping before it closes the connection and cancels "
          "its calls (gRPC's default); the answer comes only once the client has taken what the connection still "
          "carried to it: raise it where clients read large pages over slow links");
ABSL_FLAG(int, stream_slots, 256, "live streams at once: one device state slot per instrument (at most 2^20)");
ABSL_FLAG(int64_t, stream_log_entries, 5'000'000,
          "conviction-log entries kept on the device over all slots, at most 2^30 (each slot retains total / "
          "stream_slots; older entries are overwritten and counted)");
ABSL_FLAG(bool, stream_resident, true,
          "on CUDA (small fed by any LOBSTER level count from 1 to 10: 4*levels + 8 features): lone streaming events "
          "go to a resident step that polls a ring in pinned memory, instead of a launch per tick; it holds 8 "
          "multiprocessors while streaming, and yields them to every training step (--nostream_resident: a "
          "launched tick per event)");
ABSL_FLAG(int, stream_resident_idle_ms, 1000,
          "on CUDA: once the device has had no work for this many milliseconds, a running resident streaming step is "
          "stopped, freeing its multiprocessors and its polling of host memory; the next lone event starts it again "
          "(0: it runs until other work needs the device)");
ABSL_FLAG(int, stream_tick_timing, perception::kStreamTickTimingEvery,
          "on CUDA: the device time of one launched streaming tick in this many is measured between CUDA events, "
          "which make that tick 2.5-3 us longer on the H200 (~4 us at 1,024 instruments; 1: every tick), and of every "
          "lone event through the resident step by its kernel's stamps (~0.02 us each), for "
          "perception_stream_tick_device_seconds (0: none of either)");
ABSL_FLAG(int, stream_seed_job_us, 250,
          "a SeedStream steps its window in device jobs of about this many microseconds each (the first 16 events), "
          "with other instruments' ticks between them: a long window holds each tick up by one job, not by its whole "
          "length, and takes at most job / (job + tick) of the device while events wait (each tick takes one event "
          "of each instrument, so a larger job lowers the rate an instrument can stream at during a seed)");
ABSL_FLAG(int, stream_ack_events, 1000, "a Stream acknowledges after this many processed events...");
ABSL_FLAG(int, stream_ack_ms, 50, "...or this many milliseconds after the first unacknowledged one");
ABSL_FLAG(int, publish_every_steps, 1,
          "training steps between refreshes of the published weights that streaming reads");
ABSL_FLAG(int64_t, stream_max_pending_events, 1 << 20,
          "streamed events accepted and not yet processed, over all streams, at which Stream calls stop reading "
          "requests until the device catches up (bounds the daemon's memory; each call reads at most one request "
          "past it)");
ABSL_FLAG(int64_t, stream_read_max, 65536,
          "most convictions one ReadConvictions page returns (a page also stays within 4,000,000 bytes, which gRPC's "
          "clients receive without raising their limit)");
ABSL_FLAG(int64_t, inject_device_loss_at_tick, 0,
          "for tests of a lost device: the streaming tick with this number (from 1) loses the device instead of "
          "running (on CUDA a kernel that traps, a real sticky error); 0: never");
ABSL_FLAG(int, pause_after_alarm_cancel_us, 0,
          "for tests of a Stream call's end: microseconds each call sleeps after cancelling its acknowledgement "
          "alarm, so that the alarm's callback lands inside the cancel; 0: none");
ABSL_FLAG(int, world_size, 0,
          "data-parallel training over NCCL: the number of daemons (one GPU each) in the job; 0: not data parallel. "
          "1 still trains through the NCCL path");
ABSL_FLAG(int, rank, 0, "with --world_size: this daemon's rank in [0, world_size); rank 0 creates the NCCL id");
ABSL_FLAG(std::vector<std::string>, peers, {},
          "with --world_size > 1: every rank's gRPC address (host:port), in rank order; the others fetch the NCCL id "
          "from the first");
PERCEPTION_FLAG(absl::Duration, collective_timeout, absl::Seconds(60),
          "with --world_size: how long joining the job, and a training step's collectives, may take before the step "
          "fails (a peer died or stalled) and the communicator is aborted; at most --device_stall_timeout");
PERCEPTION_FLAG(int64_t, replica_check_every, 100,
          "with --world_size: optimizer steps between checksums of the parameters compared across the ranks (0: none)");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error, critical or off");

namespace perception::server {
namespace {

// Calls still unanswered this long into the shutdown are cancelled.
constexpr absl::Duration kShutdownTimeout = absl::Seconds(60);
// How long the answers of calls whose streamed events the exit dropped are waited for.
constexpr absl::Duration kDroppedAnswersWait = absl::Seconds(2);
// Once every answer is delivered: how long a call that came just then, and each client's side of its connection's
// GOAWAY, are given before gRPC cancels and disconnects what is left.
constexpr absl::Duration kCloseGrace = absl::Milliseconds(250);
// How often the drain's grace and its wait for answers to be delivered look for a second signal.
constexpr absl::Duration kSignalPoll = absl::Milliseconds(100);
// How often a drain looks again whether the convictions have been read back.
constexpr absl::Duration kReadBackPoll = absl::Milliseconds(20);
// The most conviction-log entries --stream_log_entries may ask for: 2^30 take 24 GiB of device memory at five
// horizons.
constexpr int64_t kMaxStreamLogEntries = int64_t{1} << 30;
// The most slots --stream_slots may ask for. Each takes ~1.7 KB of host memory from the start (its queues and
// bookkeeping), used or not: 2^20 take 1.8 GB; 10^8 had taken 15 GB and were still growing before the daemon listened.
constexpr int kMaxStreamSlots = 1 << 20;

// Blocked in every thread (threads inherit the mask), so that only WaitForTerminationSignal receives them. SIGHUP
// (the terminal a daemon was started from closing) drains as the others do: by default it killed the daemon on the
// spot, its model and unread convictions with it and --checkpoint_on_exit unsaved.
sigset_t TerminationSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  return signals;
}

int WaitForTerminationSignal() {
  const sigset_t signals = TerminationSignals();
  int signal = 0;
  sigwait(&signals, &signal);
  return signal;
}

// spdlog reads a name it does not know as `off`: a misspelt level would silence the daemon.
absl::StatusOr<spdlog::level::level_enum> LogLevelFromFlags() {
  const std::string name = absl::GetFlag(FLAGS_log_level);
  const spdlog::level::level_enum level = spdlog::level::from_str(name);
  if (level == spdlog::level::off && name != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown --log_level '", name, "' (trace, debug, info, warn, error, critical or off)"));
  }
  return level;
}

// Checked before the listeners open, as every flag is: a refusal after them logged "serving ... on ..." first.
absl::Status CheckListenFlags() {
  for (const auto& [name, address] : {std::pair{"listen", absl::GetFlag(FLAGS_listen)},
                                      std::pair{"metrics_listen", absl::GetFlag(FLAGS_metrics_listen)}}) {
    if (address.empty() && std::string_view(name) == "metrics_listen") continue;  // no metrics endpoint
    if (const absl::Status checked = CheckListenPort(address); !checked.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " ", checked.message()));
    }
  }
  return absl::OkStatus();
}

// The daemon's waits. A negative drain wait was taken as none, without a word.
absl::Status CheckWaitFlags() {
  for (const auto& [name, wait] : {std::pair{"drain_grace", absl::GetFlag(FLAGS_drain_grace)},
                                   std::pair{"drain_for_reads", absl::GetFlag(FLAGS_drain_for_reads)}}) {
    if (wait < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " must be 0 (none) or positive, got ", absl::FormatDuration(wait)));
    }
  }
  if (const absl::Duration stall = absl::GetFlag(FLAGS_device_stall_timeout); stall <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--device_stall_timeout must be positive (inf: no watch), got ",
                                                   absl::FormatDuration(stall)));
  }
  // gRPC takes whole milliseconds: 500us would have been 0.
  if (const absl::Duration time = absl::GetFlag(FLAGS_keepalive_time); time < absl::Milliseconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--keepalive_time must be at least 1ms (inf: no pings), got ", absl::FormatDuration(time)));
  }
  if (const absl::Duration timeout = absl::GetFlag(FLAGS_keepalive_timeout);
      timeout < absl::Milliseconds(1) || timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--keepalive_timeout must be at least 1ms and finite, got ",
                                                   absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

absl::StatusOr<Limits> LimitsFromFlags() {
  const Limits limits{absl::GetFlag(FLAGS_max_message_bytes), absl::GetFlag(FLAGS_max_batch),
                      absl::GetFlag(FLAGS_max_window), absl::GetFlag(FLAGS_queue_depth)};
  RETURN_IF_ERROR(CheckAtLeastOne({{"max_message_bytes", limits.max_message_bytes},
                                   {"max_batch", limits.max_batch},
                                   {"max_window", limits.max_window},
                                   {"queue_depth", limits.queue_depth}}));
  if (limits.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes must be at most ", INT_MAX, ", got ", limits.max_message_bytes));
  }
  return limits;
}

absl::StatusOr<StreamOptions> StreamOptionsFromFlags() {
  StreamOptions options;
  options.device = {absl::GetFlag(FLAGS_stream_slots), absl::GetFlag(FLAGS_stream_log_entries),
                    absl::GetFlag(FLAGS_publish_every_steps), absl::GetFlag(FLAGS_stream_resident),
                    absl::GetFlag(FLAGS_stream_tick_timing)};
  options.ack_every_events = absl::GetFlag(FLAGS_stream_ack_events);
  options.ack_every_ms = absl::GetFlag(FLAGS_stream_ack_ms);
  const int seed_job_us = absl::GetFlag(FLAGS_stream_seed_job_us);
  options.seed_job_time = absl::Microseconds(seed_job_us);
  options.max_read_count = absl::GetFlag(FLAGS_stream_read_max);
  options.max_pending_events = absl::GetFlag(FLAGS_stream_max_pending_events);
  options.inject_device_loss_at_tick = absl::GetFlag(FLAGS_inject_device_loss_at_tick);
  if (options.inject_device_loss_at_tick < 0) {
    return absl::InvalidArgumentError("--inject_device_loss_at_tick must be 0 (never) or a tick's number");
  }
  const int pause_us = absl::GetFlag(FLAGS_pause_after_alarm_cancel_us);
  if (pause_us < 0) return absl::InvalidArgumentError("--pause_after_alarm_cancel_us must be 0 (none) or positive");
  options.pause_after_alarm_cancel = absl::Microseconds(pause_us);
  const int idle_ms = absl::GetFlag(FLAGS_stream_resident_idle_ms);
  if (idle_ms < 0) return absl::InvalidArgumentError("--stream_resident_idle_ms must be 0 (never) or positive");
  options.resident_idle_period = idle_ms == 0 ? absl::InfiniteDuration() : absl::Milliseconds(idle_ms);
  if (options.device.tick_timing_every < 0) {
    return absl::InvalidArgumentError("--stream_tick_timing must be 0 (none) or positive");
  }
  RETURN_IF_ERROR(CheckAtLeastOne({{"stream_slots", options.device.slots},
                                   {"publish_every_steps", options.device.publish_every_steps},
                                   {"stream_ack_events", options.ack_every_events},
                                   {"stream_ack_ms", options.ack_every_ms},
                                   {"stream_seed_job_us", seed_job_us},
                                   {"stream_read_max", options.max_read_count},
                                   {"stream_max_pending_events", options.max_pending_events}}));
  if (options.device.slots > kMaxStreamSlots) {
    return absl::InvalidArgumentError(absl::StrCat("--stream_slots must be at most ", kMaxStreamSlots, ", got ",
                                                   options.device.slots, " (each slot takes host memory from the "
                                                   "start, whether or not an instrument uses it)"));
  }
  if (options.device.log_entries_total < options.device.slots) {
    return absl::InvalidArgumentError(absl::StrCat("--stream_log_entries (", options.device.log_entries_total,
                                                   ") must be at least --stream_slots (", options.device.slots,
                                                   "): each slot keeps a log"));
  }
  // Each entry takes (horizons + 1) floats on the device and a weights version on the host: far more entries than
  // any device holds wrapped the logs' sizes to a few bytes (CudaArena now refuses that) or failed the first stream's
  // host allocation, which ended the daemon.
  if (options.device.log_entries_total > kMaxStreamLogEntries) {
    return absl::InvalidArgumentError(absl::StrCat("--stream_log_entries must be at most ", kMaxStreamLogEntries,
                                                   ", got ", options.device.log_entries_total));
  }
  return options;
}

struct DataParallelFlags {
  DataParallelOptions options;
  std::vector<std::string> peers;
};

// --world_size, --rank, --peers and the rest; nullopt without --world_size.
absl::StatusOr<std::optional<DataParallelFlags>> DataParallelFromFlags() {
  const int world_size = absl::GetFlag(FLAGS_world_size), rank = absl::GetFlag(FLAGS_rank);
  const std::vector<std::string> peers = absl::GetFlag(FLAGS_peers);
  if (world_size == 0) {
    if (rank != 0 || !peers.empty()) return absl::InvalidArgumentError("--rank and --peers need --world_size");
    // (Ignored without a job, as --rank and --peers would be.)
    if (FlagGiven(FLAGS_collective_timeout) || FlagGiven(FLAGS_replica_check_every)) {
      return absl::InvalidArgumentError(
          "--collective_timeout and --replica_check_every apply to --world_size; without it they would be ignored");
    }
    return std::nullopt;
  }
  if (world_size < 0 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank ", rank, " must be in [0, --world_size) and --world_size ", world_size, " positive"));
  }
  if (absl::GetFlag(FLAGS_device) == "cpu") {
    return absl::InvalidArgumentError(
        "--world_size needs the CUDA backend: data-parallel training runs on NCCL, which --device=cpu cannot join");
  }
  if (world_size > 1 && peers.size() != static_cast<size_t>(world_size)) {
    return absl::InvalidArgumentError(absl::StrCat("--peers must list the ", world_size,
                                                   " ranks' gRPC addresses in rank order; it lists ", peers.size()));
  }
  const DataParallelOptions options{rank, world_size, absl::GetFlag(FLAGS_collective_timeout),
                                    absl::GetFlag(FLAGS_replica_check_every)};
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--collective_timeout must be positive, got ", absl::FormatDuration(options.timeout)));
  }
  if (options.check_every < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--replica_check_every must be >= 0 (0: none), got ", options.check_every));
  }
  // A step waiting on a slow peer is a device job all the while: past the stall watch's limit health turns
  // NOT_SERVING as for a hung kernel, and a liveness probe restarts a healthy rank, which ends the whole job.
  if (const absl::Duration stall = absl::GetFlag(FLAGS_device_stall_timeout); options.timeout > stall) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--collective_timeout (", absl::FormatDuration(options.timeout), ") must not exceed --device_stall_timeout (",
        absl::FormatDuration(stall), "): a step waiting that long on a slow peer would turn health NOT_SERVING as a "
        "hung device would, and a liveness probe would restart this rank, ending the job; raise both"));
  }
  return DataParallelFlags{options, peers};
}

// Rank 0 creates the NCCL unique id and publishes it on the Rendezvous service; the others fetch it from rank 0's
// daemon; then every rank joins the communicator on the device worker's thread, within the timeout.
absl::Status JoinDataParallel(DeviceWorker& worker, RendezvousService& rendezvous, const DataParallelFlags& flags) {
  const DataParallelOptions& options = flags.options;
  std::string unique_id;
  if (options.rank == 0) {
    ASSIGN_OR_RETURN(unique_id, NewDataParallelId());
    rendezvous.Publish(unique_id);
  } else {
    ASSIGN_OR_RETURN(unique_id, FetchUniqueId(flags.peers[0], options.rank, options.world_size, options.timeout));
  }
  spdlog::info("rank {} of {}: joining the data-parallel job (timeout {})", options.rank, options.world_size,
               absl::FormatDuration(options.timeout));
  return worker.Run(JobPriority::kTraining, [&](ModelHost& host) {
    const DeviceWorker::PeerWait waiting(worker);  // the join waits for the other ranks, not for the device
    return host.JoinDataParallel(unique_id, options);
  });
}

// --device, and --precision on the backend it resolves to: the CPU computes in fp32 only, and refusing the pair here
// beats a daemon that serves and then refuses every model.
absl::Status CheckDeviceFlags(const std::optional<Precision>& precision) {
  const std::string device = absl::GetFlag(FLAGS_device);
  if (const absl::Status known = CheckDeviceName(device); !known.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--device: ", known.message()));
  }
  if (device == "cuda" || precision.value_or(DefaultPrecision(/*cuda=*/false)) == Precision::kFloat32) {
    return absl::OkStatus();
  }
  if (device == "cpu") {
    return absl::InvalidArgumentError(absl::StrCat("--precision=", PrecisionName(*precision),
                                                   " is the CUDA backend's; --device=cpu computes in fp32"));
  }
  const absl::Status cuda = CudaBackendAvailable();
  if (cuda.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--precision=", PrecisionName(*precision),
                                                 " is the CUDA backend's, but --device=auto resolves to the CPU here (",
                                                 cuda.message(), "); the CPU computes in fp32 only: pass "
                                                 "--precision=fp32 or auto"));
}

// --device=cuda where no CUDA device can be used (no driver, no GPU in the container) served, health SERVING, and
// refused every model. Checked after a data-parallel join, whose rank 1 asks rank 0 for the NCCL id before it touches
// a device.
absl::Status CheckCudaDeviceUsable() {
  if (absl::GetFlag(FLAGS_device) != "cuda") return absl::OkStatus();
  const absl::Status usable = CudaBackendAvailable();
  if (usable.ok()) return usable;
  return absl::FailedPreconditionError(absl::StrCat("--device=cuda, but no CUDA device can be used here (",
                                                    usable.message(), "): the daemon would serve no model"));
}

// LobsterFeatureCount(levels) must not overflow, and a negative count was silently the preset's.
absl::Status CheckInitLevels() {
  const int levels = absl::GetFlag(FLAGS_init_levels);
  if (levels >= 0 && levels <= kMaxLobsterLevels) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--init_levels must be in [0, ", kMaxLobsterLevels,
                                                 "] (0: the preset's feature count), got ", levels));
}

// The start-up model flags' combinations and names, checked before the listeners open, so that a refused one ends
// the daemon before a supervisor or load balancer sees it up. PrepareModel resolves the name again, as it loads.
absl::Status CheckModelFlags(const CheckpointDirectory& checkpoints) {
  const std::string load = absl::GetFlag(FLAGS_load), load_if_present = absl::GetFlag(FLAGS_load_if_present);
  if (!load.empty() && !load_if_present.empty()) {
    return absl::InvalidArgumentError(
        "--load and --load_if_present exclude each other (--load: the checkpoint must exist; --load_if_present: "
        "it may be missing)");
  }
  // --init_config is --load_if_present's fallback, but --load has none: a missing file there fails the start.
  if (!load.empty() && !absl::GetFlag(FLAGS_init_config).empty())
    return absl::InvalidArgumentError("--load and --init_config exclude each other");
  if (absl::GetFlag(FLAGS_init_levels) != 0 && absl::GetFlag(FLAGS_init_config).empty()) {
    return absl::InvalidArgumentError(
        "--init_levels applies to --init_config's preset; without one it would be ignored");
  }
  if (const std::string preset = absl::GetFlag(FLAGS_init_config); !preset.empty()) {
    if (const absl::Status known = NamedConfig(preset).status(); !known.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--init_config: ", known.message()));
    }
  }
  if (load_if_present.empty()) return absl::OkStatus();
  return checkpoints.Resolve(load_if_present, "--load_if_present").status();
}

absl::Status CreatePreset(PerceptionService& service, const std::string& preset) {
  ASSIGN_OR_RETURN(ModelConfig config, NamedConfig(preset));
  if (const int levels = absl::GetFlag(FLAGS_init_levels); levels > 0) config.n_features = LobsterFeatureCount(levels);
  RETURN_IF_ERROR(ValidateConfig(config));
  return service.CreateModel(config, OptimizerConfig{}, /*seed=*/1, std::nullopt, /*replace=*/false).status();
}

// --load_if_present: whether its file is there. Any entry with the name counts, a dangling symlink or a folder
// included, so that the load, not a silent fallback to a fresh model, reports what is wrong with it; a name that
// cannot be looked up (a folder on the way without search permission) fails too, for the same reason.
absl::StatusOr<bool> CheckpointPresent(const std::string& path) {
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::symlink_status(path, error);
  if (status.type() == std::filesystem::file_type::not_found) return false;
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("--load_if_present: cannot tell whether ", path, " exists: ", error.message()));
  }
  return true;
}

// Loads --load_if_present's checkpoint when present; otherwise false, having logged which start the daemon makes.
absl::StatusOr<bool> LoadIfPresent(PerceptionService& service, const CheckpointDirectory& checkpoints,
                                   const std::string& name, const std::string& preset) {
  ASSIGN_OR_RETURN(const std::string path, checkpoints.Resolve(name, "--load_if_present"));
  ASSIGN_OR_RETURN(const bool present, CheckpointPresent(path));
  if (!present) {
    spdlog::info("--load_if_present: no checkpoint '{}' yet; {}", name,
                 preset.empty() ? "serving with no model (InitModel or LoadCheckpoint creates one)"
                                : absl::StrCat("creating a model from --init_config=", preset));
    return false;
  }
  // A checkpoint that is there but does not load fails the start: serving a fresh model instead would lose the one
  // the file held without anyone noticing, and the next exit's save would overwrite it.
  const absl::StatusOr<PerceptionService::LoadedModel> loaded =
      service.LoadModel(name, "--load_if_present", /*optimizer=*/std::nullopt);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat("--load_if_present: checkpoint '", name, "' exists but does not load: ",
                                     loaded.status().message()));
  }
  spdlog::info("--load_if_present: loaded checkpoint '{}' at step {}", name, loaded->model.step());
  return true;
}

// --load, --load_if_present or --init_config (CheckModelFlags has refused the combinations that exclude each other).
absl::Status PrepareModel(PerceptionService& service, const CheckpointDirectory& checkpoints) {
  const std::string load = absl::GetFlag(FLAGS_load), preset = absl::GetFlag(FLAGS_init_config);
  if (!load.empty()) {
    RETURN_IF_ERROR(checkpoints.Resolve(load, "--load").status());  // (a refused name names the flag already)
    const absl::Status loaded = service.LoadModel(load, "--load", /*optimizer=*/std::nullopt).status();
    if (loaded.ok()) return loaded;
    return absl::Status(loaded.code(),
                        absl::StrCat("--load: checkpoint '", load, "' does not load: ", loaded.message()));
  }
  if (const std::string name = absl::GetFlag(FLAGS_load_if_present); !name.empty()) {
    ASSIGN_OR_RETURN(const bool loaded, LoadIfPresent(service, checkpoints, name, preset));
    if (loaded) return absl::OkStatus();
  }
  if (preset.empty()) return absl::OkStatus();
  return CreatePreset(service, preset);
}

// A name the exit's save would refuse, or a folder it cannot write in, is refused before the daemon serves, not found
// after the drain with the model lost. SaveOnExit resolves it again: a folder may have taken the name meanwhile.
absl::Status CheckCheckpointOnExit(const CheckpointDirectory& checkpoints) {
  const std::string name = absl::GetFlag(FLAGS_checkpoint_on_exit);
  if (name.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::string path, checkpoints.ResolveForWriting(name, "--checkpoint_on_exit"));
  if (absl::GetFlag(FLAGS_rank) != 0) return absl::OkStatus();  // (only rank 0 saves)
  // The save creates the folders the name adds (ModelHost::Save): the nearest one there is must take a file.
  const std::filesystem::path file(path);
  std::filesystem::path folder = file.parent_path();
  std::error_code error;
  while (!folder.empty() && !std::filesystem::exists(folder, error)) folder = folder.parent_path();
  return CheckCanCreateBeside((folder / file.filename()).string());
}

absl::Status SaveOnExit(DeviceWorker& worker, const CheckpointDirectory& checkpoints) {
  const std::string name = absl::GetFlag(FLAGS_checkpoint_on_exit);
  const HostStatus status = worker.status();
  if (name.empty()) return absl::OkStatus();
  if (!status.model.has_value()) {
    // Not an error (the daemon served what it was asked), but the operator who asked for the file must not look for it.
    spdlog::warn("--checkpoint_on_exit={}: no checkpoint saved, the daemon holds no model (none was initialized or "
                 "loaded)", name);
    return absl::OkStatus();
  }
  if (status.data_parallel.has_value() && status.data_parallel->rank != 0) return absl::OkStatus();  // rank 0 saves
  ASSIGN_OR_RETURN(const std::string path, checkpoints.ResolveForWriting(name, "--checkpoint_on_exit"));
  return worker.Run(JobPriority::kTraining, [&](ModelHost& host) { return host.Save(path).status(); });
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetrics(ServerMetrics& metrics, const DeviceWorker& worker) {
  const std::string address = absl::GetFlag(FLAGS_metrics_listen);
  if (address.empty()) return nullptr;
  ASSIGN_OR_RETURN(std::unique_ptr<MetricsHttpServer> server, MetricsHttpServer::Start(address, [&] {
                     const HostStatus status = worker.status();
                     metrics.SetModelParameters(status.model ? status.model->trained_parameters : 0);
                     metrics.SetQueuedJobs(worker.queued_jobs());
                     metrics.SetDeviceJobSeconds(absl::ToDoubleSeconds(worker.busy_for()));
                     return metrics.Render();
                   }));
  spdlog::info("metrics on http://{}/metrics (port {})", address, server->port());
  return server;
}

// gRPC's channel arguments take milliseconds as an int, INT_MAX standing for never.
int ChannelArgumentMilliseconds(absl::Duration duration) {
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(duration), INT_MAX));
}

// A feed whose host or network vanished leaves its connection half open: the daemon learned of it only when TCP gave
// up on data it sent (never, while the feed was quiet), and until then the call held its instruments, ResetStream
// and SeedStream refused, for gRPC's default of 2 h. Connections without calls are not pinged (a server's pings are
// not limited to two without data between them, as a client's are: a quiet feed is pinged all along).
void AddKeepalive(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             ChannelArgumentMilliseconds(absl::GetFlag(FLAGS_keepalive_time)));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             ChannelArgumentMilliseconds(absl::GetFlag(FLAGS_keepalive_timeout)));
}

// Health stays NOT_SERVING until Serve has the model ready.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc(PerceptionService& service, RendezvousService& rendezvous,
                                                        const Limits& limits, CallsInFlight& calls) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  const std::string address = absl::GetFlag(FLAGS_listen);
  grpc::ServerBuilder builder;
  int port = 0;
  // gRPC sets SO_REUSEPORT on Linux by default: a second daemon on a port in use started and took calls at random
  // with the first. Its start now fails as a taken --metrics_listen does.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  AddKeepalive(builder);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(limits.max_message_bytes));
  builder.RegisterService(&service);
  builder.RegisterService(&rendezvous);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(calls.Counter());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, " (in use, or not an address of this host)"));
  }
  server->GetHealthCheckService()->SetServingStatus(v1::Perception::service_full_name(), false);
  server->GetHealthCheckService()->SetServingStatus(false);  // every service, the server's own ("") included
  spdlog::info("serving {} on {} (port {})", v1::Perception::service_full_name(), address, port);
  return server;
}

// Health NOT_SERVING while a device job runs past --device_stall_timeout; none where it is infinite.
absl::StatusOr<std::unique_ptr<StallWatch>> WatchForStalls(const DeviceWorker& worker, grpc::Server& server) {
  const absl::Duration limit = absl::GetFlag(FLAGS_device_stall_timeout);  // positive (CheckWaitFlags)
  if (limit == absl::InfiniteDuration()) return nullptr;
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  return std::make_unique<StallWatch>(
      worker, limit, std::min(limit / 10, absl::Seconds(1)),
      [health](absl::Duration busy) {
        spdlog::critical("a device job has run for {} (--device_stall_timeout): health NOT_SERVING until it ends",
                         absl::FormatDuration(busy));
        health->SetServingStatus(false);
      },
      [health] {
        spdlog::warn("the stalled device job has ended: health SERVING again");
        health->SetServingStatus(true);
      });
}

// Whether a second termination signal has come during the drain (taking it, and remembering it: every wait of the
// drain after it ends at once, since its sender wants the daemon gone). Called from the main thread alone.
bool SecondSignalArrived() {
  static bool arrived = false;
  if (!arrived) {
    const sigset_t signals = TerminationSignals();
    const timespec now = {};
    if (const int signal = sigtimedwait(&signals, nullptr, &now); signal > 0) {
      spdlog::warn("{} again: the drain's waits end now", strsignal(signal));
      arrived = true;
    }
  }
  return arrived;
}

std::string DescribeUnread(const StreamBatcher::Unread& unread) {
  return absl::StrCat(unread.convictions, " conviction(s) of ", unread.streams, " stream(s) not read back and ",
                      unread.events, " event(s) still to process");
}

// The convictions live only in device memory: while some wait to be read back, reads keep answering, for up to
// --drain_for_reads.
void WaitForReadBack(const StreamBatcher& streams) {
  const absl::Duration limit = absl::GetFlag(FLAGS_drain_for_reads);
  StreamBatcher::Unread unread = streams.NotReadBack();
  if (unread.none()) return;
  const absl::Time deadline = absl::Now() + limit;
  if (limit > absl::ZeroDuration() && DeviceLostStatus().ok() && !SecondSignalArrived()) {
    spdlog::info("{}: reads answer until they are read back, for up to {} (--drain_for_reads; a second signal ends "
                 "it)", DescribeUnread(unread), absl::FormatDuration(limit));
  }
  while (!unread.none() && absl::Now() < deadline && !SecondSignalArrived() && DeviceLostStatus().ok()) {
    absl::SleepFor(kReadBackPoll);
    unread = streams.NotReadBack();
  }
  // (Read back: every stream's log read to its end; what a read started past, by --from, is not waited for.)
  if (unread.none()) {
    spdlog::info("every stream's log was read to its end");
    return;
  }
  // Events the lost device's failed tick had not yet dropped are counted here too, however the race went: none of
  // them will be processed.
  if (!DeviceLostStatus().ok()) {
    spdlog::warn("{}: the drain stops waiting for them (the device is lost, and they with it); calls in flight are "
                 "answered with where each instrument stopped", DescribeUnread(unread));
    return;
  }
  std::string why = "--drain_for_reads is 0";
  if (SecondSignalArrived()) {
    why = "a second signal ended the wait";
  } else if (limit > absl::ZeroDuration()) {
    why = absl::StrCat("--drain_for_reads (", absl::FormatDuration(limit), ") ran out");
  }
  // Not lost yet: calls in flight still have their accepted events processed and acknowledged, and reads answer,
  // until WaitForAnswersDelivered lets the listener close (LogLostWithTheExit).
  spdlog::warn("{}: the drain stops waiting for them ({}); calls in flight are still answered, their events processed, "
               "for up to {} (a second signal drops the events left)", DescribeUnread(unread), why,
               absl::FormatDuration(kShutdownTimeout));
}

// What no client read back by the time the listener closes: it goes with the exit (the device's memory).
void LogLostWithTheExit(const StreamBatcher& streams) {
  const StreamBatcher::Unread unread = streams.NotReadBack();
  if (!unread.none()) spdlog::warn("{}: they are lost with the exit", DescribeUnread(unread));
}

// Until the answers owed are delivered, for at most `limit`, or until a second signal where `signal_ends`; the log
// says what was left, and `then` what becomes of it.
void WaitForAnswersDelivered(CallsInFlight& calls, absl::Duration limit, bool signal_ends, const char* then) {
  const absl::Time start = absl::Now(), deadline = start + limit;
  CallsInFlight::Undelivered left;
  do {
    left = calls.WaitUntilDelivered(std::min(deadline, absl::Now() + kSignalPoll));
  } while ((left.calls > 0 || left.bytes > 0) && absl::Now() < deadline && !(signal_ends && SecondSignalArrived()));
  if (left.calls == 0 && left.bytes == 0) return;
  spdlog::warn("{} {}, {} call(s) still unanswered ({}) and {} byte(s) sent not yet acknowledged by the clients "
               "(their connections closed all the same)",
               signal_ends && SecondSignalArrived() ? "a second signal ended the wait for answers to be delivered: after"
                                                    : "after",
               absl::FormatDuration(absl::Now() - start), left.calls, then, left.bytes);
}

// Events still queued once the waits are over would hold the listener's close for as long as they take to process,
// a second signal notwithstanding (a cut Stream call's 16k events on `large` on the CPU held it 56 s after the second
// signal): they are dropped, and their calls told where each instrument resumes. Nobody could read their convictions
// back before the exit. Whether any were.
bool DropEventsLeft(StreamBatcher& streams) {
  const absl::StatusOr<int64_t> dropped = streams.DropQueuedAtExit();
  if (!dropped.ok()) {
    spdlog::error("the events still to process could not be dropped: {}", dropped.status().ToString());
    return false;
  }
  if (*dropped == 0) return false;
  spdlog::warn("{} event(s) still to process were dropped unprocessed; their calls were told where each instrument "
               "resumes", *dropped);
  return true;
}

// The listener closes, and with it the connections clients keep open.
void StopListening(grpc::Server& server) { server.Shutdown(absl::ToChronoTime(absl::Now() + kCloseGrace)); }

// Health NOT_SERVING and new work refused, a grace period, the wait for convictions to be read back, then the
// listener closes once calls in flight are answered, streamed events still queued then dropped (DropEventsLeft); the
// device finishes what else it had queued. A second signal ends each of the waits.
void Drain(grpc::Server& server, PerceptionService& service, StreamBatcher& streams, CallsInFlight& calls) {
  server.GetHealthCheckService()->SetServingStatus(false);
  service.BeginDrain();
  // A lost device ends the grace too: every read then fails UNAVAILABLE, and each second of it only delays the
  // restart the exit asks for (a lost device waited out the whole grace).
  const absl::Time grace_ends = absl::Now() + absl::GetFlag(FLAGS_drain_grace);
  while (absl::Now() < grace_ends && !SecondSignalArrived() && DeviceLostStatus().ok()) {
    absl::SleepFor(std::min(kSignalPoll, grace_ends - absl::Now()));
  }
  if (absl::Now() < grace_ends && !DeviceLostStatus().ok()) spdlog::warn("the device is lost: the drain's grace ends");
  WaitForReadBack(streams);
  WaitForAnswersDelivered(calls, kShutdownTimeout, /*signal_ends=*/true,
                          "their streamed events still queued are dropped next, the rest cancelled");
  // The dropped events' answers (the calls' last acknowledgements and UNAVAILABLE) are delivered before the listener
  // closes, which would reset a connection with them still unread in its kernel: a short wait, a second signal or not.
  if (DropEventsLeft(streams)) {
    WaitForAnswersDelivered(calls, kDroppedAnswersWait, /*signal_ends=*/false, "cancelled");
  }
  LogLostWithTheExit(streams);
  StopListening(server);
}

absl::Status Serve() {
  // A sticky CUDA error ends the daemon as SIGTERM does, and it then exits non-zero so that its supervisor restarts it.
  OnDeviceLost([] {
    spdlog::critical("{}; draining", std::string(DeviceLostStatus().message()));
    kill(getpid(), SIGTERM);
  });
  ASSIGN_OR_RETURN(const CheckpointDirectory checkpoints,
                   CheckpointDirectory::Open(absl::GetFlag(FLAGS_checkpoint_dir)));
  RETURN_IF_ERROR(CheckCheckpointOnExit(checkpoints));
  RETURN_IF_ERROR(CheckModelFlags(checkpoints));
  ASSIGN_OR_RETURN(const Limits limits, LimitsFromFlags());
  RETURN_IF_ERROR(CheckWaitFlags());
  RETURN_IF_ERROR(CheckListenFlags());
  ASSIGN_OR_RETURN(const StreamOptions stream_options, StreamOptionsFromFlags());
  ASSIGN_OR_RETURN(const std::optional<DataParallelFlags> data_parallel, DataParallelFromFlags());
  ASSIGN_OR_RETURN(const std::optional<Precision> precision, ParsePrecisionChoice(absl::GetFlag(FLAGS_precision)));
  RETURN_IF_ERROR(CheckDeviceFlags(precision));
  RETURN_IF_ERROR(CheckInitLevels());
  ServerMetrics metrics;
  DeviceWorker worker(std::make_unique<ModelHost>(absl::GetFlag(FLAGS_device), metrics, stream_options.device,
                                                  absl::GetFlag(FLAGS_graphs), precision),
                      limits.queue_depth, stream_options.resident_idle_period);
  StreamBatcher streams(worker, stream_options, metrics);
  // The worker runs what is left in its queue as it stops, the batcher's jobs among them: it stops while the batcher
  // lives, on every way out of here (a lost device, a failed save or start-up returns early).
  absl::Cleanup stop_worker = [&worker] { worker.Stop(); };
  PerceptionService service(worker, streams, stream_options, checkpoints, limits, metrics);
  RendezvousService rendezvous(data_parallel ? data_parallel->options.rank : 0,
                               data_parallel ? data_parallel->options.world_size : 0);
  // Both listeners open before the data-parallel join and --load, --load_if_present or --init_config: scrapes see the
  // daemon through a long join or load (nothing they render needs a model), and a data-parallel rank 0 can hand out
  // the NCCL id while it joins. Health says SERVING once the job is joined and the model is ready.
  ASSIGN_OR_RETURN(const std::unique_ptr<MetricsHttpServer> metrics_server, StartMetrics(metrics, worker));
  CallsInFlight calls;
  ASSIGN_OR_RETURN(const std::unique_ptr<grpc::Server> server, StartGrpc(service, rendezvous, limits, calls));
  // A start-up that fails from here on stops listening too (the server's own destructor would wait for its clients).
  absl::Cleanup stop_listening = [&server] { StopListening(*server); };
  if (data_parallel.has_value()) RETURN_IF_ERROR(JoinDataParallel(worker, rendezvous, *data_parallel));
  RETURN_IF_ERROR(CheckCudaDeviceUsable());
  RETURN_IF_ERROR(PrepareModel(service, checkpoints));
  ASSIGN_OR_RETURN(std::unique_ptr<StallWatch> stall_watch, WatchForStalls(worker, *server));
  server->GetHealthCheckService()->SetServingStatus(true);

  const int signal = WaitForTerminationSignal();
  // A lost device raised the signal itself, and has said so.
  if (DeviceLostStatus().ok()) spdlog::info("{}: draining", strsignal(signal));
  stall_watch.reset();  // health stays NOT_SERVING from here on
  Drain(*server, service, streams, calls);
  if (const absl::Status lost = DeviceLostStatus(); !lost.ok()) {  // exit non-zero, unsaved: the weights were there
    if (const std::string name = absl::GetFlag(FLAGS_checkpoint_on_exit); !name.empty()) {
      spdlog::error("--checkpoint_on_exit={} not saved: the model was on the lost device", name);
    }
    return lost;
  }
  RETURN_IF_ERROR(SaveOnExit(worker, checkpoints));
  std::move(stop_worker).Invoke();
  spdlog::info("drained; exiting");
  return absl::OkStatus();
}

}  // namespace
}  // namespace perception::server

int main(int argc, char** argv) {
  const bool keeps_freed_memory = perception::KeepFreedHostMemoryForReuse();
  absl::SetProgramUsageMessage("trains and serves PerceptionNet v1 on one device over gRPC");  // --help names it
  // (ParseArguments: FlagGiven answers for the flags given, and `--drain-grace` is `--drain_grace` as for the clients.)
  const std::vector<std::string> arguments = perception::ParseArguments(argc, argv);
  spdlog::set_default_logger(spdlog::stderr_color_mt("perceptiond"));
  if (arguments.size() > 1) {  // a flag without its dashes, say, was ignored without a word
    spdlog::critical("INVALID_ARGUMENT: perceptiond takes flags only, not '{}' (perceptiond --help lists them)",
                     absl::StrJoin(arguments.begin() + 1, arguments.end(), " "));
    return 1;
  }
  const absl::StatusOr<spdlog::level::level_enum> level = perception::server::LogLevelFromFlags();
  if (!level.ok()) {
    spdlog::critical("{}", level.status().ToString());
    return 1;
  }
  spdlog::set_level(*level);
  if (!keeps_freed_memory) spdlog::debug("the allocator hands freed memory back to the kernel (not glibc's)");
  const sigset_t signals = perception::server::TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // before any thread starts
  const absl::Status status = perception::server::Serve();
  if (!status.ok()) {
    spdlog::critical("{}", status.ToString());
    return 1;
  }
  return 0;
}
