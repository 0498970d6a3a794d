// Prometheus metrics of the daemon: a prometheus-cpp registry plus process metrics read from /proc at each scrape.
#include "server/metrics.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "engine/device_loss.h"
#include "prometheus/text_serializer.h"

namespace perception::server {
namespace {

// 1, 2.5 and 5 times each power of ten from 10^first to 10^last: buckets that span several decades. Parsed from
// decimal text so that each boundary prints as written (2.5e-06, not 2.5000000000000002e-06).
prometheus::Histogram::BucketBoundaries DecadeBuckets(int first, int last) {
  prometheus::Histogram::BucketBoundaries bounds;
  for (int exponent = first; exponent <= last; ++exponent) {
    for (const char* mantissa : {"1", "2.5", "5"}) bounds.push_back(std::stod(absl::StrCat(mantissa, "e", exponent)));
  }
  return bounds;
}

// A bidirectional call lasts from well under a second (refused at once) to a trading day or more.
prometheus::Histogram::BucketBoundaries SessionBuckets() {
  return {0.01, 0.1, 1, 10, 60, 300, 900, 1800, 3600, 7200, 14400, 28800, 43200, 86400};
}

// 1, 2, 4, ... up to `last`: instruments per tick.
prometheus::Histogram::BucketBoundaries PowerOfTwoBuckets(double last) {
  prometheus::Histogram::BucketBoundaries bounds;
  for (double b = 1; b <= last; b *= 2) bounds.push_back(b);
  return bounds;
}

prometheus::MetricFamily ProcessFamily(std::string name, std::string help, prometheus::MetricType type, double value) {
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return {std::move(name), std::move(help), type, {metric}};
}

double BootTimeSeconds() {
  std::ifstream file("/proc/stat");
  std::string key;
  double value = 0;
  while (file >> key) {
    if (key == "btime" && file >> value) return value;
    file.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

// /proc/self/stat and /proc/self/fd, opened once for the process's life: a process out of descriptors could not open
// them at the scrape, and its process metrics vanished just when process_open_fds should show the limit reached. The
// boot time too is read once.
class ProcSelf {
 public:
  static ProcSelf& Get() {
    static ProcSelf* const proc = new ProcSelf();
    return *proc;
  }

  // Fields of /proc/self/stat after the command name (which may hold spaces): [0] is field 3, `state`.
  std::vector<std::string> StatFields() const {
    char buffer[4096];
    const ssize_t n = stat_ < 0 ? -1 : ::pread(stat_, buffer, sizeof(buffer) - 1, 0);
    if (n <= 0) return {};
    const absl::string_view stat(buffer, static_cast<size_t>(n));
    const size_t name_end = stat.rfind(')');
    if (name_end == absl::string_view::npos || name_end + 2 > stat.size()) return {};
    return absl::StrSplit(stat.substr(name_end + 2), absl::ByAnyChar(" \n"), absl::SkipEmpty());
  }

  double boot_time_seconds() const { return boot_time_seconds_; }

  // Open descriptors, this one's included; nullopt where /proc/self/fd could not be read.
  std::optional<double> OpenFds() {
    absl::MutexLock lock(&mu_);
    if (fd_dir_ < 0 || ::lseek(fd_dir_, 0, SEEK_SET) != 0) return std::nullopt;
    alignas(dirent64) char buffer[8192];
    double fds = 0;
    for (ssize_t n; (n = ::getdents64(fd_dir_, buffer, sizeof(buffer))) != 0;) {
      if (n < 0) return std::nullopt;
      for (ssize_t at = 0; at < n;) {
        const auto* entry = reinterpret_cast<const dirent64*>(buffer + at);
        if (entry->d_name[0] != '.') ++fds;  // not "." or ".."
        at += entry->d_reclen;
      }
    }
    return fds;
  }

 private:
  ProcSelf()
      : stat_(::open("/proc/self/stat", O_RDONLY | O_CLOEXEC)),
        fd_dir_(::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC)),
        boot_time_seconds_(BootTimeSeconds()) {}

  const int stat_;
  absl::Mutex mu_;  // the directory's read offset
  const int fd_dir_;
  const double boot_time_seconds_;
};


// The process metrics every Prometheus client library exports, read from /proc; empty where /proc is missing.
std::vector<prometheus::MetricFamily> ProcessMetrics() {
  const std::vector<std::string> fields = ProcSelf::Get().StatFields();
  constexpr size_t kUtime = 14 - 3, kStime = 15 - 3, kStartTime = 22 - 3, kVsize = 23 - 3, kRss = 24 - 3;
  if (fields.size() <= kRss) return {};
  const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  auto field = [&](size_t i) { return std::stod(fields[i]); };
  const std::optional<double> open_fds = ProcSelf::Get().OpenFds();
  rlimit fd_limit{};
  ::getrlimit(RLIMIT_NOFILE, &fd_limit);
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> families = {
      ProcessFamily("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                    MetricType::Counter, (field(kUtime) + field(kStime)) / ticks),
      ProcessFamily("process_resident_memory_bytes", "Resident memory size in bytes.", MetricType::Gauge,
                    field(kRss) * page),
      ProcessFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", MetricType::Gauge, field(kVsize)),
      ProcessFamily("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                    MetricType::Gauge, ProcSelf::Get().boot_time_seconds() + field(kStartTime) / ticks),
  };
  if (open_fds.has_value()) {
    families.push_back(
        ProcessFamily("process_open_fds", "Number of open file descriptors.", MetricType::Gauge, *open_fds));
  }
  families.push_back(ProcessFamily("process_max_fds", "Maximum number of open file descriptors.", MetricType::Gauge,
                                   static_cast<double>(fd_limit.rlim_cur)));
  return families;
}

}  // namespace

ServerMetrics::ServerMetrics()
    : rpc_buckets_(DecadeBuckets(-5, 2)),
      session_buckets_(SessionBuckets()),
      checkpoint_buckets_(DecadeBuckets(-4, 2)),
      registry_(std::make_shared<prometheus::Registry>()),
      train_step_seconds_(prometheus::BuildHistogram()
                              .Name("perception_train_step_seconds")
                              .Help("Device time of one training step (forward, backward, optimizer) in seconds.")
                              .Register(*registry_)
                              .Add({}, DecadeBuckets(-6, 1))),
      train_steps_(prometheus::BuildCounter()
                       .Name("perception_train_steps_total")
                       .Help("Training steps that succeeded on the device (refused ones: "
                             "perception_train_steps_not_taken_total; failed ones: the RPC metrics' code label).")
                       .Register(*registry_)
                       .Add({})),
      train_loss_(prometheus::BuildGauge()
                      .Name("perception_train_loss")
                      .Help("Masked BCE of the latest training batch, before its update; NaN until the resident "
                            "model (the last InitModel or LoadCheckpoint) trains.")
                      .Register(*registry_)
                      .Add({})),
      train_graph_captures_(prometheus::BuildCounter()
                                .Name("perception_train_graph_captures_total")
                                .Help("Training-step CUDA graphs captured: one per training shape and input "
                                      "plan (a Train stream that stages its next batch beside the step uses two "
                                      "or three plans a shape), again after the model is rebuilt (InitModel, "
                                      "LoadCheckpoint, SetOptimizer). A count that keeps rising at one shape is a "
                                      "recapture.")
                                .Register(*registry_)
                                .Add({})),
      train_graph_replays_(prometheus::BuildCounter()
                               .Name("perception_train_graph_replays_total")
                               .Help("Training steps run as one replay of a captured CUDA graph, applied or not.")
                               .Register(*registry_)
                               .Add({})),
      replica_checks_(prometheus::BuildCounter()
                          .Name("perception_replica_checks_total")
                          .Help("Data-parallel parameter checksums compared across the ranks and found equal.")
                          .Register(*registry_)
                          .Add({})),
      replica_divergences_(prometheus::BuildCounter()
                               .Name("perception_replica_divergences_total")
                               .Help("Data-parallel checks that found the ranks' parameters differing (the step "
                                     "answered DATA_LOSS).")
                               .Register(*registry_)
                               .Add({})),
      train_steps_not_taken_(prometheus::BuildCounter()
                                 .Name("perception_train_steps_not_taken_total")
                                 .Help("Training steps refused because their gradient norm was not finite (the "
                                       "update not applied; FAILED_PRECONDITION): a job whose weights diverge, or a "
                                       "batch that overflowed them.")
                                 .Register(*registry_)
                                 .Add({})),
      resident_idle_stops_(prometheus::BuildCounter()
                               .Name("perception_stream_resident_idle_stops_total")
                               .Help("Resident streaming steps stopped after the device had no work for "
                                     "--stream_resident_idle_ms (the next lone event starts another).")
                               .Register(*registry_)
                               .Add({})),
      rpc_duration_(prometheus::BuildHistogram()
                        .Name("perception_rpc_duration_seconds")
                        .Help("Time from receiving a unary RPC to answering it in seconds, by method and status "
                              "code (Train and Stream: perception_rpc_session_seconds).")
                        .Register(*registry_)),
      rpc_session_(prometheus::BuildHistogram()
                       .Name("perception_rpc_session_seconds")
                       .Help("Length of a bidirectional call (Train, Stream), from its start to its end, in seconds, "
                             "by method and status code: as long as the client keeps it open.")
                       .Register(*registry_)),
      rejected_(prometheus::BuildCounter()
                    .Name("perception_requests_rejected_total")
                    .Help("Requests refused, by reason: the status code they were refused with, in lower case "
                          "(invalid_argument, failed_precondition, not_found, unavailable while draining or while the "
                          "model is replaced (a Stream's new instrument), "
                          "resource_exhausted: a full queue, a limit, or the device's memory). Failures such as "
                          "data_loss, internal, or unavailable once the device is lost, are not refusals: see the "
                          "RPC histograms' code label.")
                    .Register(*registry_)),
      checkpoint_duration_(prometheus::BuildHistogram()
                               .Name("perception_checkpoint_duration_seconds")
                               .Help("Time to save or load a checkpoint in seconds, by operation.")
                               .Register(*registry_)),
      model_parameters_(prometheus::BuildGauge()
                            .Name("perception_model_parameters")
                            .Help("Trained parameters of the resident model; 0 when there is none.")
                            .Register(*registry_)
                            .Add({})),
      queued_jobs_(prometheus::BuildGauge()
                       .Name("perception_queued_jobs")
                       .Help("Jobs waiting for the device, the running one not included.")
                       .Register(*registry_)
                       .Add({})),
      device_job_seconds_(prometheus::BuildGauge()
                              .Name("perception_device_job_seconds")
                              .Help("How long the device's running job (a training step, a tick, a checkpoint "
                                    "load) has run so far in seconds; 0 when the device is idle or the job waits for "
                                    "its data-parallel peers (the join). A hung kernel "
                                    "shows as a value that keeps climbing (health turns NOT_SERVING past "
                                    "--device_stall_timeout).")
                              .Register(*registry_)
                              .Add({})),
      draining_(prometheus::BuildGauge()
                    .Name("perception_draining")
                    .Help("1 once the daemon drains before it exits (a signal, a lost device): it accepts no new "
                          "work, answers reads until --drain_grace ends, then saves --checkpoint_on_exit; 0 while it "
                          "serves. Health turns NOT_SERVING and GetStatus.draining true with it.")
                    .Register(*registry_)
                    .Add({})),
      stream_events_(prometheus::BuildCounter()
                         .Name("perception_stream_events_total")
                         .Help("Streamed events processed (one conviction each).")
                         .Register(*registry_)
                         .Add({})),
      stream_step_seconds_(prometheus::BuildHistogram()
                               .Name("perception_stream_step_seconds")
                               .Help("Host time of one streaming tick (one batched step over its instruments) in "
                                     "seconds: running it on the CPU backend, queueing it on CUDA, whose device "
                                     "runs it after (perception_stream_event_latency_seconds includes that).")
                               .Register(*registry_)
                               .Add({}, DecadeBuckets(-6, 1))),
      stream_tick_instruments_(prometheus::BuildHistogram()
                                   .Name("perception_stream_tick_instruments")
                                   .Help("Instruments (events) in one streaming tick.")
                                   .Register(*registry_)
                                   // (to 65,536: ticks of 10,000 instruments are measured, and slots unbounded)
                                   .Add({}, PowerOfTwoBuckets(65536))),
      stream_event_latency_(prometheus::BuildHistogram()
                                .Name("perception_stream_event_latency_seconds")
                                .Help("Time from receiving a streamed event to the device finishing its tick (its "
                                      "conviction logged), in seconds.")
                                .Register(*registry_)
                                .Add({}, DecadeBuckets(-6, 1))),
      stream_tick_device_seconds_(prometheus::BuildHistogram()
                                      .Name("perception_stream_tick_device_seconds")
                                      .Help("Device time of one streaming tick in seconds (CUDA only). "
                                            "path=\"launched\": a launched tick, between CUDA events recorded on the "
                                            "device's stream before and after it; path=\"resident\": a lone event "
                                            "through the resident step, on the device's global timer from its arrival "
                                            "to its answer, observed while that run of the resident step goes on "
                                            "(but its latest event) and once it has stopped.")
                                      .Register(*registry_)),
      launched_tick_device_seconds_(stream_tick_device_seconds_.Add({{"path", "launched"}}, DecadeBuckets(-6, 0))),
      resident_event_device_seconds_(stream_tick_device_seconds_.Add({{"path", "resident"}}, DecadeBuckets(-6, 0))),
      active_streams_(prometheus::BuildGauge()
                          .Name("perception_active_streams")
                          .Help("Live streams (instruments holding a state slot).")
                          .Register(*registry_)
                          .Add({})),
      stream_pending_events_(prometheus::BuildGauge()
                                 .Name("perception_stream_pending_events")
                                 .Help("Streamed events accepted and not yet processed, over all streams. At "
                                       "--stream_max_pending_events the Stream calls stop reading requests until "
                                       "the device catches up.")
                                 .Register(*registry_)
                                 .Add({})),
      stream_reads_held_(prometheus::BuildCounter()
                             .Name("perception_stream_reads_held_total")
                             .Help("Times a Stream call held back its next read because --stream_max_pending_events "
                                   "events were waiting for the device: the feeds outrun the device.")
                             .Register(*registry_)
                             .Add({})),
      convictions_overwritten_(prometheus::BuildCounter()
                                   .Name("perception_convictions_overwritten_total")
                                   .Help("Conviction-log entries overwritten as instruments' log rings wrapped, "
                                         "read or not (each ring keeps --stream_log_entries / --stream_slots), all "
                                         "instruments.")
                                   .Register(*registry_)
                                   .Add({})),
      overwritten_reads_(prometheus::BuildCounter()
                             .Name("perception_convictions_lost_reads_total")
                             .Help("ReadConvictions calls refused (OUT_OF_RANGE) because the entries they asked "
                                   "for had been overwritten: convictions a client lost before reading them.")
                             .Register(*registry_)
                             .Add({})),
      nonfinite_streams_(prometheus::BuildCounter()
                             .Name("perception_stream_nonfinite_outputs_total")
                             .Help("Instruments stopped because the model's output for one of their events was not "
                                   "finite (float32 overflowed inside the model): the event and the stream's later "
                                   "ones left its log, and it takes no events until reset, seeded or closed.")
                             .Register(*registry_)
                             .Add({})),
      stream_rejected_(prometheus::BuildCounter()
                           .Name("perception_stream_events_rejected_total")
                           .Help("Streamed events refused, by reason: instrument (an empty or too long id, or one "
                                 "with a control character), sequence, features, book, exchange_time (earlier than "
                                 "the stream's last event, beyond the bound, or too far from the stream's first "
                                 "event's), capacity, model_change, stopped (by a failed tick, until reset), "
                                 "no_model, empty (a request without events), seeding (a SeedStream runs on the "
                                 "instrument), payload (LOBSTER rows and feature vectors mixed on one instrument), "
                                 "call_ended (read after the call's failure, a refused event or the drain).")
                           .Register(*registry_)),
      stream_dropped_(prometheus::BuildCounter()
                          .Name("perception_stream_events_dropped_total")
                          .Help("Streamed events accepted and then dropped unprocessed, no conviction logged, by "
                                "reason: failed_tick (a tick the device failed, or streaming that could not start: "
                                "the events of its instruments in it and queued behind it), nonfinite_output (an "
                                "output that was not finite: the event and its instrument's later ones), "
                                "standardized_bound (an instrument's queued events, one of which a SetNormalizer "
                                "put beyond the bound on standardized features). Each call "
                                "that sent them was told where its instruments resume; events a drain drops at the "
                                "exit are in the log alone.")
                          .Register(*registry_)),
      stream_weights_version_(prometheus::BuildGauge()
                                  .Name("perception_stream_weights_version")
                                  .Help("Weights version of the published copy streaming reads; 0 before streaming.")
                                  .Register(*registry_)
                                  .Add({})) {
  ForgetTrainLoss();
  ProcSelf::Get();  // opens its files now, while descriptors are free
  for (const absl::StatusCode code : kRefusalCodes) {
    rejected_.Add({{"reason", absl::AsciiStrToLower(absl::StatusCodeToString(code))}});
  }
  for (const std::string_view reason : kStreamRejectReasons) stream_rejected_.Add({{"reason", std::string(reason)}});
  for (const std::string_view reason : kStreamDropReasons) stream_dropped_.Add({{"reason", std::string(reason)}});
}

void ServerMetrics::ObserveStreamTick(int instruments, double seconds) {
  stream_step_seconds_.Observe(seconds);
  stream_tick_instruments_.Observe(instruments);
}

void ServerMetrics::ObserveStreamEventLatency(double seconds) {
  // Counted here, once the event's tick finished, not at its launch: an event a later check drops (an output not
  // finite, a failed tick) has no conviction.
  stream_events_.Increment();
  stream_event_latency_.Observe(seconds);
}

void ServerMetrics::ObserveStreamTickDeviceTime(double seconds, bool resident) {
  (resident ? resident_event_device_seconds_ : launched_tick_device_seconds_).Observe(seconds);
}

void ServerMetrics::RejectStreamEvent(std::string_view reason) {
  stream_rejected_.Add({{"reason", std::string(reason)}}).Increment();
}

void ServerMetrics::ObserveNonFiniteStream() { nonfinite_streams_.Increment(); }

void ServerMetrics::DropStreamEvents(std::string_view reason, int64_t events) {
  stream_dropped_.Add({{"reason", std::string(reason)}}).Increment(static_cast<double>(events));
}

void ServerMetrics::AddConvictionsOverwritten(uint64_t entries) {
  if (entries > 0) convictions_overwritten_.Increment(static_cast<double>(entries));
}

void ServerMetrics::ObserveOverwrittenRead() { overwritten_reads_.Increment(); }

void ServerMetrics::SetActiveStreams(int streams) { active_streams_.Set(streams); }

void ServerMetrics::SetStreamPendingEvents(int64_t events) { stream_pending_events_.Set(static_cast<double>(events)); }

void ServerMetrics::ObserveStreamReadHeld() { stream_reads_held_.Increment(); }

void ServerMetrics::SetStreamWeightsVersion(int64_t version) {
  stream_weights_version_.Set(static_cast<double>(version));
}

void ServerMetrics::ObserveTrainStep(double device_seconds, double loss) {
  train_step_seconds_.Observe(device_seconds);
  train_steps_.Increment();
  train_loss_.Set(loss);
}

void ServerMetrics::ObserveTrainGraphs(int64_t captures, int64_t replays) {
  train_graph_captures_.Increment(static_cast<double>(captures));
  train_graph_replays_.Increment(static_cast<double>(replays));
}

void ServerMetrics::ForgetTrainLoss() { train_loss_.Set(std::numeric_limits<double>::quiet_NaN()); }

void ServerMetrics::ObserveReplicaChecks(int64_t equal) { replica_checks_.Increment(static_cast<double>(equal)); }

void ServerMetrics::ObserveReplicaDivergence() { replica_divergences_.Increment(); }
void ServerMetrics::ObserveStepNotTaken() { train_steps_not_taken_.Increment(); }

void ServerMetrics::ObserveResidentIdleStop() { resident_idle_stops_.Increment(); }

void ServerMetrics::ObserveCheckpoint(std::string_view operation, double seconds) {
  checkpoint_duration_.Add({{"operation", std::string(operation)}}, checkpoint_buckets_).Observe(seconds);
}

void ServerMetrics::ObserveRpc(std::string_view method, RpcKind kind, absl::StatusCode code, double seconds) {
  const std::string code_name = absl::StatusCodeToString(code);
  const prometheus::Labels labels{{"method", std::string(method)}, {"code", code_name}};
  if (kind == RpcKind::kUnary) {
    rpc_duration_.Add(labels, rpc_buckets_).Observe(seconds);
  } else {
    rpc_session_.Add(labels, session_buckets_).Observe(seconds);
  }
  if (IsRefusal(code)) rejected_.Add({{"reason", absl::AsciiStrToLower(code_name)}}).Increment();
}

void ServerMetrics::SetModelParameters(int64_t trained_parameters) {
  model_parameters_.Set(static_cast<double>(trained_parameters));
}

void ServerMetrics::SetQueuedJobs(int jobs) { queued_jobs_.Set(jobs); }

void ServerMetrics::SetDeviceJobSeconds(double seconds) { device_job_seconds_.Set(seconds); }

void ServerMetrics::SetDraining() { draining_.Set(1); }

std::string ServerMetrics::Render() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (prometheus::MetricFamily& family : ProcessMetrics()) families.push_back(std::move(family));
  return prometheus::TextSerializer().Serialize(families);
}

bool IsRefusal(absl::StatusCode code) {
  if (code == absl::StatusCode::kUnavailable && !DeviceLostStatus().ok()) return false;
  return std::ranges::find(kRefusalCodes, code) != kRefusalCodes.end();
}

}  // namespace perception::server
