// The daemon's Prometheus metrics (training, streaming, RPCs, checkpoints, process) and their text exposition.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace perception::server {

// What perception_stream_events_rejected_total counts by: every series exists from the start at 0, so that a
// first refusal shows in rate() and increase() (a series born at 1 would be its own baseline).
inline constexpr std::array<std::string_view, 13> kStreamRejectReasons = {
    "instrument", "sequence", "features", "book",    "exchange_time", "capacity",  "model_change",
    "stopped",    "no_model", "empty",    "seeding", "payload",       "call_ended"};

// What perception_stream_events_dropped_total counts by, each series from 0: a tick the device failed (or streaming
// that could not start), and an output that was not finite (the event and its instrument's later ones).
inline constexpr std::array<std::string_view, 3> kStreamDropReasons = {"failed_tick", "nonfinite_output",
                                                                         "standardized_bound"};

// Thread-safe: every method may be called from any thread.
class ServerMetrics {
 public:
  ServerMetrics();

  // One training step applied: its device time and loss.
  void ObserveTrainStep(double device_seconds, double loss);
  // The CUDA graphs a step run on the device captured (0 or 1) and replayed (0 or 1), whether it was applied or not.
  void ObserveTrainGraphs(int64_t captures, int64_t replays);
  // A new model is resident (InitModel, LoadCheckpoint): the last loss was another model's, so the loss reads NaN
  // (no sample, a gap on a dashboard, where 0 would read as a perfect fit) until the new model trains.
  void ForgetTrainLoss();
  // Data parallel: parameter checksums compared across the ranks and found equal, and a check that found them
  // differing.
  void ObserveReplicaChecks(int64_t equal);
  void ObserveReplicaDivergence();
  // A training step refused because its gradient norm was not finite (the update not applied).
  void ObserveStepNotTaken();
  // One checkpoint operation, "save" or "load", that succeeded.
  void ObserveCheckpoint(std::string_view operation, double seconds);
  // One answered RPC; a refusal (see IsRefusal) also counts in perception_requests_rejected_total. A unary call's
  // time is the daemon's latency (perception_rpc_duration_seconds); a bidirectional call (Train, Stream) lasts as
  // long as its client keeps it open (perception_rpc_session_seconds).
  enum class RpcKind { kUnary, kBidirectional };
  void ObserveRpc(std::string_view method, RpcKind kind, absl::StatusCode code, double seconds);

  // One streaming tick: `instruments` events (one per instrument) in one batched step of `seconds`.
  void ObserveStreamTick(int instruments, double seconds);
  // One streamed event processed (perception_stream_events_total), from its receipt to its conviction being in the
  // log.
  void ObserveStreamEventLatency(double seconds);
  // The device time of one launched streaming tick (TicksChecked::device_seconds) or of one lone event through the
  // resident step (TicksChecked::resident_seconds).
  void ObserveStreamTickDeviceTime(double seconds, bool resident);
  // A streamed event refused, by reason: one of kStreamRejectReasons.
  void RejectStreamEvent(std::string_view reason);
  void AddConvictionsOverwritten(uint64_t entries);
  // An instrument stopped because the model's output for one of its events was not finite.
  void ObserveNonFiniteStream();
  // Accepted events dropped unprocessed, by reason: one of kStreamDropReasons.
  void DropStreamEvents(std::string_view reason, int64_t events);
  // A ReadConvictions refused (OUT_OF_RANGE) because the entries it asked for had been overwritten: a client lost
  // convictions it had not read.
  void ObserveOverwrittenRead();
  void SetActiveStreams(int streams);
  // Streamed events accepted and not yet processed, over all streams.
  void SetStreamPendingEvents(int64_t events);
  // A Stream call stopped reading because the daemon held its most pending events (StreamOptions::max_pending_events).
  void ObserveStreamReadHeld();
  // The weights version streaming reads (the published copy).
  void SetStreamWeightsVersion(int64_t version);
  // A resident streaming step stopped because the device had no work for a while (ModelHost::ReleaseIdleDevice).
  void ObserveResidentIdleStop();

  // Gauges of the daemon's state, set just before each scrape.
  void SetModelParameters(int64_t trained_parameters);
  void SetQueuedJobs(int jobs);
  // How long the device's running job has run so far (0 when it is idle): a hung kernel shows as a climbing value.
  void SetDeviceJobSeconds(double seconds);
  // The daemon has begun to drain before it exits (a signal, a lost device).
  void SetDraining();

  // Every metric, process metrics included, in the Prometheus text exposition format (version 0.0.4).
  std::string Render() const;

 private:
  const prometheus::Histogram::BucketBoundaries rpc_buckets_, session_buckets_, checkpoint_buckets_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Histogram& train_step_seconds_;
  prometheus::Counter& train_steps_;
  prometheus::Gauge& train_loss_;
  prometheus::Counter& train_graph_captures_;
  prometheus::Counter& train_graph_replays_;
  prometheus::Counter& replica_checks_;
  prometheus::Counter& replica_divergences_;
  prometheus::Counter& train_steps_not_taken_;
  prometheus::Counter& resident_idle_stops_;
  prometheus::Family<prometheus::Histogram>& rpc_duration_;
  prometheus::Family<prometheus::Histogram>& rpc_session_;
  prometheus::Family<prometheus::Counter>& rejected_;
  prometheus::Family<prometheus::Histogram>& checkpoint_duration_;
  prometheus::Gauge& model_parameters_;
  prometheus::Gauge& queued_jobs_;
  prometheus::Gauge& device_job_seconds_;
  prometheus::Gauge& draining_;
  prometheus::Counter& stream_events_;
  prometheus::Histogram& stream_step_seconds_;
  prometheus::Histogram& stream_tick_instruments_;
  prometheus::Histogram& stream_event_latency_;
  prometheus::Family<prometheus::Histogram>& stream_tick_device_seconds_;
  prometheus::Histogram& launched_tick_device_seconds_;
  prometheus::Histogram& resident_event_device_seconds_;
  prometheus::Gauge& active_streams_;
  prometheus::Gauge& stream_pending_events_;
  prometheus::Counter& stream_reads_held_;
  prometheus::Counter& convictions_overwritten_;
  prometheus::Counter& overwritten_reads_;
  prometheus::Counter& nonfinite_streams_;
  prometheus::Family<prometheus::Counter>& stream_rejected_;
  prometheus::Family<prometheus::Counter>& stream_dropped_;
  prometheus::Gauge& stream_weights_version_;
};

// A status that refuses the request (bad input, no model, a limit or a full queue, draining, a missing checkpoint),
// as opposed to OK, a client that gave up (CANCELLED, DEADLINE_EXCEEDED) or a failure: DATA_LOSS (a corrupt
// checkpoint, data-parallel replicas that diverged), INTERNAL and the like, and UNAVAILABLE once the device is lost
// (DeviceLostStatus: the daemon failed the call, and drains to exit). RESOURCE_EXHAUSTED counts as a refusal
// although a device out of memory answers it too.
bool IsRefusal(absl::StatusCode code);
// The codes IsRefusal takes for refusals: perception_requests_rejected_total's reasons, in lower case.
inline constexpr std::array<absl::StatusCode, 5> kRefusalCodes = {
    absl::StatusCode::kInvalidArgument, absl::StatusCode::kFailedPrecondition, absl::StatusCode::kNotFound,
    absl::StatusCode::kResourceExhausted, absl::StatusCode::kUnavailable};

}  // namespace perception::server
