// The daemon's Prometheus metrics (training, RPCs, checkpoints, process) and their text exposition.
#pragma once

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

// Thread-safe: every method may be called from any thread.
class ServerMetrics {
 public:
  ServerMetrics();

  // One training step that ran on the device.
  void ObserveTrainStep(double device_seconds, double loss);
  // One checkpoint operation, "save" or "load", that succeeded.
  void ObserveCheckpoint(std::string_view operation, double seconds);
  // One answered RPC; a refusal (see IsRefusal) also counts in perception_requests_rejected_total.
  void ObserveRpc(std::string_view method, absl::StatusCode code, double seconds);

  // Gauges of the daemon's state, set just before each scrape.
  void SetModelParameters(int64_t trained_parameters);
  void SetQueuedJobs(int jobs);

  // Every metric, process metrics included, in the Prometheus text exposition format (version 0.0.4).
  std::string Render() const;

 private:
  const prometheus::Histogram::BucketBoundaries rpc_buckets_, checkpoint_buckets_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Histogram& train_step_seconds_;
  prometheus::Counter& train_steps_;
  prometheus::Gauge& train_loss_;
  prometheus::Family<prometheus::Histogram>& rpc_duration_;
  prometheus::Family<prometheus::Counter>& rejected_;
  prometheus::Family<prometheus::Histogram>& checkpoint_duration_;
  prometheus::Gauge& model_parameters_;
  prometheus::Gauge& queued_jobs_;
};

// A status that refuses the request (bad input, no model, a limit, draining, a missing or corrupt checkpoint),
// as opposed to OK, a client that gave up (CANCELLED, DEADLINE_EXCEEDED) or a failure of the daemon itself.
bool IsRefusal(absl::StatusCode code);

}  // namespace perception::server
