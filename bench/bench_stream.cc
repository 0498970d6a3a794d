// bench_stream: device time per streaming tick (forward_step_into) for 1 .. 10,000 instruments, graph-replayed and
// eager, with CUDA events around every tick; prints one table and optionally writes JSON.
#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/percentile.h"
#include "bench/resident_stamps.h"
#include "engine/config.h"
#include "engine/cuda_backend.h"
#include "engine/cuda_check.h"
#include "engine/cuda_memory.h"
#include "engine/cuda_streamer.h"
#include "engine/param_layout.h"
#include "engine/status_macros.h"

ABSL_FLAG(std::vector<std::string>, configs, std::vector<std::string>({"tiny", "small", "large"}), "model configs");
ABSL_FLAG(std::vector<std::string>, instruments, std::vector<std::string>({"1", "64", "1024", "10000"}),
          "instruments per tick");
ABSL_FLAG(int, levels, 0,
          "LOBSTER book levels of every config's events: n_features = 4*levels + 8 (0: each preset's own; small's "
          "one-event plan is compiled in for every level count from 1 to 10)");
ABSL_FLAG(int, iterations, 200, "timed ticks per measurement (after 20 warmup ticks)");
ABSL_FLAG(std::string, json, "", "write the results here as JSON");
ABSL_FLAG(bool, sweep, true, "time every launch shape eagerly, to check the default choice");
ABSL_FLAG(bool, print_shapes, false, "print the median of every launch shape of the sweep");
ABSL_FLAG(bool, resident, false,
          "also time the streamer's resident step (lone events, kernels/stream_step.h) of each config that has one: "
          "one instrument's events posted into mapped pinned memory, host-timed round trips and back-to-back events");
ABSL_FLAG(int, time_ticks, perception::CudaStreamer::kTimedTickEvery,
          "the streamer times its ticks on the device as the daemon's does (CudaStreamer::set_time_ticks): one "
          "launched tick in this many between CUDA events (whose median the graph row also prints as its own events'), "
          "and, with --resident, each lone event by the resident kernel's stamps on the device's clocks "
          "(StreamResidentStamp), for its device time an event; 0 times nothing");
ABSL_FLAG(int, queue_us, 3000,
          "hold the stream this long (a sleeping host function) before the timed ticks, so that the host queues them "
          "ahead and the events time the device alone; 0: ticks are timed as the host submits them");

namespace perception {
namespace {

struct Row {
  std::string config;
  int instruments = 0;
  double graph_median_us = 0, graph_p99_us = 0, eager_median_us = 0, best_shape_us = 0, host_step_us = 0;
  double graph_own_median_us = 0;  // the streamer's own events around the graphed ticks it timed (0: none)
  StreamLaunchShape best_shape, default_shape;
  int64_t allocations = 0;
  int graph_queued_ahead = 0;  // graphed ticks queued when the stream's hold ended (TimeTicks)
};

std::string ShapeName(StreamLaunchShape shape) {
  return shape.wide ? "wide" : absl::StrCat("group ", shape.events_per_group, ", cluster ", shape.cluster_size);
}

struct StreamHold {
  int microseconds = 0;
  std::atomic<bool> released{false};
};

void CUDART_CB HoldStream(void* hold) {
  auto& stream_hold = *static_cast<StreamHold*>(hold);
  std::this_thread::sleep_for(std::chrono::microseconds(stream_hold.microseconds));
  stream_hold.released = true;
}

// Device time of each tick between events recorded on the streamer's stream; `run` enqueues one tick. A tick that
// the device finishes faster than the host submits the next would otherwise be timed with the host's submission in
// it, so the stream is held while the host queues the ticks (as far as the staging buffers let it). `queued_ahead`,
// where given, gets how many ticks the host had queued when the hold ended: past them, a tick the device finishes
// before the host queues the next is timed with the host's time in it.
template <typename Run>
absl::StatusOr<std::vector<double>> TimeTicks(CudaStreamer& streamer, int iterations, Run run,
                                              int* queued_ahead = nullptr) {
  for (int i = 0; i < 20; ++i) RETURN_IF_ERROR(run());
  RETURN_IF_ERROR(streamer.Synchronize());
  std::vector<cudaEvent_t> events(2 * iterations);
  for (cudaEvent_t& e : events) CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  StreamHold hold{absl::GetFlag(FLAGS_queue_us)};
  if (hold.microseconds > 0) CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(streamer.stream(), HoldStream, &hold));
  int queued = iterations;
  for (int i = 0; i < iterations; ++i) {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events[2 * i], streamer.stream()));
    RETURN_IF_ERROR(run());
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events[2 * i + 1], streamer.stream()));
    if (queued == iterations && (hold.microseconds == 0 || hold.released)) queued = i + 1;
  }
  RETURN_IF_ERROR(streamer.Synchronize());  // (the hold has ended: it runs on the stream)
  if (queued_ahead != nullptr) *queued_ahead = queued;
  std::vector<double> us;
  for (int i = 0; i < iterations; ++i) {
    float ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]));
    us.push_back(ms * 1e3);
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  return us;
}

// The named preset, with --levels' features where given.
absl::StatusOr<ModelConfig> BenchModelConfig(const std::string& name) {
  ASSIGN_OR_RETURN(ModelConfig config, NamedConfig(name));
  if (const int levels = absl::GetFlag(FLAGS_levels); levels > 0) config.n_features = LobsterFeatureCount(levels);
  return config;
}

absl::StatusOr<std::vector<Row>> BenchConfig(const std::string& name, const std::vector<int>& sizes, int iterations) {
  ASSIGN_OR_RETURN(const ModelConfig config, BenchModelConfig(name));
  const ParamLayout layout(config);
  std::vector<float> params(layout.total_size());
  InitializeParameters(layout, 1, params);
  const int capacity = *std::max_element(sizes.begin(), sizes.end());
  ASSIGN_OR_RETURN(std::unique_ptr<CudaStreamer> streamer, CudaStreamer::Create(layout, capacity, std::max<int64_t>(64, (int64_t{1} << 20) / capacity)));
  RETURN_IF_ERROR(streamer->PublishFromHost(params));
  // The shapes the streamer chose at start for ticks below the wide path, and what it measured to choose them.
  for (const CudaStreamer::ShapeTiming& t : streamer->start_timings()) {
    std::printf("  start %-6s bucket %5d  %-22s %9.2f us%s\n", name.c_str(), t.bucket, ShapeName(t.shape).c_str(), t.us,
                streamer->ShapeFor(t.bucket) == t.shape ? "  (chosen)" : "");
  }
  // Launched ticks alone, timed between events on the stream: a resident step has no launch per tick to time that
  // way (BenchResident times it).
  streamer->set_use_resident(false);
  streamer->set_time_ticks(absl::GetFlag(FLAGS_time_ticks));
  std::vector<Row> rows;
  Rng rng(7);
  for (int n : sizes) {
    std::vector<float> x(static_cast<size_t>(n) * config.n_features), dt(n);
    for (float& v : x) v = static_cast<float>(rng.Uniform(-2, 2));
    for (float& v : dt) v = static_cast<float>(rng.Uniform(0, 0.5));
    std::vector<int32_t> slots(n);
    for (int i = 0; i < n; ++i) slots[i] = i;
    std::vector<int64_t> log(n, 0);
    const StreamTick tick{x, dt, slots, log};
    Row row;
    row.config = name;
    row.instruments = n;
    row.default_shape = streamer->ShapeFor(n);
    // Every tick of the row counts (graphed, eager, lone and swept); Main fails the run on any.
    const int64_t allocations_before = CudaAllocationCount();
    streamer->set_use_graphs(true);
    RETURN_IF_ERROR(streamer->CheckTicks(/*wait_for_ticks=*/true).status());  // (the times of earlier ticks dropped)
    ASSIGN_OR_RETURN(std::vector<double> graphed,
                     TimeTicks(*streamer, iterations, [&] { return streamer->Step(tick); }, &row.graph_queued_ahead));
    row.graph_median_us = Percentile(graphed, 0.5);
    row.graph_p99_us = Percentile(graphed, 0.99);
    ASSIGN_OR_RETURN(const TicksChecked own, streamer->CheckTicks(/*wait_for_ticks=*/true));
    if (!own.device_seconds.empty()) {  // (the warmup's ticks among them: the same tick)
      std::vector<double> own_us = own.device_seconds;
      for (double& t : own_us) t *= 1e6;
      row.graph_own_median_us = Percentile(own_us, 0.5);
    }
    streamer->set_use_graphs(false);
    ASSIGN_OR_RETURN(std::vector<double> eager, TimeTicks(*streamer, iterations, [&] { return streamer->Step(tick); }));
    row.eager_median_us = Percentile(eager, 0.5);
    // Host cost of one graphed Step call plus the wait for it: the end-to-end latency of a lone tick.
    streamer->set_use_graphs(true);
    std::vector<double> host;
    for (int i = 0; i < std::min(iterations, 100); ++i) {
      const auto start = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(streamer->Step(tick));
      RETURN_IF_ERROR(streamer->Synchronize());
      host.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    }
    row.host_step_us = Percentile(host, 0.5);
    // Sweep the launch shapes eagerly, to check the default choice (0: not swept).
    row.best_shape_us = absl::GetFlag(FLAGS_sweep) ? 1e30 : 0;
    std::vector<StreamLaunchShape> shapes;
    for (int group : kStreamGroupSizes) {
      for (int cluster : kStreamClusterSizes) shapes.push_back({group, cluster});
    }
    shapes.push_back(kStreamWideShape);
    for (const StreamLaunchShape shape : shapes) {
      if (!absl::GetFlag(FLAGS_sweep) || !streamer->Supports(shape)) continue;
      ASSIGN_OR_RETURN(std::vector<double> t,
                       TimeTicks(*streamer, std::max(20, iterations / 4), [&] { return streamer->Step(tick, shape); }));
      if (absl::GetFlag(FLAGS_print_shapes)) {
        std::printf("  %-6s %6d  %s  eager %9.2f us\n", name.c_str(), n, ShapeName(shape).c_str(), Percentile(t, 0.5));
      }
      if (Percentile(t, 0.5) < row.best_shape_us) {
        row.best_shape_us = Percentile(t, 0.5);
        row.best_shape = shape;
      }
    }
    row.allocations = CudaAllocationCount() - allocations_before;
    rows.push_back(row);
    std::printf("%-6s %6d  graph %9.2f us (p99 %9.2f; own events %9.2f)  eager %9.2f us  lone tick wall %9.2f us  "
                "best eager %9.2f us (%s; default %s)  allocations %lld  queued ahead %d of %d\n",
                name.c_str(), n, row.graph_median_us, row.graph_p99_us, row.graph_own_median_us, row.eager_median_us,
                row.host_step_us,
                row.best_shape_us, ShapeName(row.best_shape).c_str(), ShapeName(row.default_shape).c_str(),
                static_cast<long long>(row.allocations), row.graph_queued_ahead, iterations);
    std::fflush(stdout);
  }
  return rows;
}

// The streamer's resident path for one instrument of `name` (CudaStreamer: lone events posted to the resident step)
// against its launched ticks (the same calls with the resident step off): a lone event's round trip (Step, then
// Synchronize, which waits for its answer; median and percentiles of `iterations`·10), `iterations`·50 events back
// to back (Step after Step, then one Synchronize; µs per event), and the round trip of the first lone event after a
// stop (what the daemon's idle release costs the next event: a launch and the weights' load; `iterations` of them).
// With --time_ticks, also the device's own time an event (the kernel's stamps, ResidentDeviceTimes) of the lone and
// the back-to-back events, or why a phase has none (too few events past the warmup for a clock rate).
struct ResidentResult {
  std::string config;
  double round_trip_us = 0, back_to_back_us = 0;  // host clock
  absl::StatusOr<ResidentDeviceTimes> lone_device, back_to_back_device;
  int64_t allocations = 0;  // made meanwhile
};
// One phase's device-clock line: an event from its ring entry found whole to just before its answer's store (and,
// back to back, from one answer to the next), or why there is none.
void PrintDeviceTimes(const std::string& name, const char* phase, const absl::StatusOr<ResidentDeviceTimes>& t,
                      bool back_to_back) {
  if (!t.ok()) {
    std::printf("%-6s resident, device clock, %s: none (%s)\n", name.c_str(), phase,
                std::string(t.status().message()).c_str());
    return;
  }
  std::printf("%-6s resident, device clock, %s: an event %8.2f us (p99 %8.2f; by the global timer %8.2f) over %d "
              "events",
              name.c_str(), phase, t->busy_median_us, t->busy_p99_us, t->busy_timer_median_us, t->events);
  if (back_to_back) std::printf("; answer to answer %8.2f us", t->period_median_us);
  std::printf("; clock %.3f GHz\n", t->cycles_per_ns);
}

absl::StatusOr<std::optional<ResidentResult>> BenchResident(const std::string& name, int iterations) {
  ASSIGN_OR_RETURN(const ModelConfig config, BenchModelConfig(name));
  const ParamLayout layout(config);
  std::vector<float> params(layout.total_size());
  InitializeParameters(layout, 1, params);
  constexpr int64_t kLogEntries = 1 << 16;
  ASSIGN_OR_RETURN(std::unique_ptr<CudaStreamer> streamer, CudaStreamer::Create(layout, 1, kLogEntries));
  RETURN_IF_ERROR(streamer->PublishFromHost(params));
  if (!streamer->resident_available()) {
    std::printf("%-6s resident: no resident step on this device\n", name.c_str());
    return std::nullopt;
  }
  Rng rng(7);
  std::vector<float> x(config.n_features), dt = {0.25f};
  for (float& v : x) v = static_cast<float>(rng.Uniform(-2, 2));
  std::vector<int32_t> slots = {0};
  std::vector<int64_t> log = {0};
  int64_t logged = 0;
  auto step = [&] {
    log[0] = logged++ % kLogEntries;
    return streamer->Step(StreamTick{x, dt, slots, log});
  };
  using Clock = std::chrono::steady_clock;
  auto us_since = [](Clock::time_point start) {
    return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  };
  auto round_trips = [&](bool resident) -> absl::StatusOr<std::vector<double>> {
    streamer->set_use_resident(resident);
    std::vector<double> us;
    for (int i = 0; i < 10 * iterations + 20; ++i) {
      const auto start = Clock::now();
      RETURN_IF_ERROR(step());
      RETURN_IF_ERROR(streamer->Synchronize());
      if (i >= 20) us.push_back(us_since(start));
    }
    return us;
  };
  auto back_to_back = [&](bool resident) -> absl::StatusOr<double> {
    streamer->set_use_resident(resident);
    const int count = 50 * iterations;
    for (int i = 0; i < 20; ++i) RETURN_IF_ERROR(step());
    RETURN_IF_ERROR(streamer->Synchronize());
    const auto start = Clock::now();
    for (int i = 0; i < count; ++i) RETURN_IF_ERROR(step());
    RETURN_IF_ERROR(streamer->Synchronize());
    return us_since(start) / count;
  };
  // The device's own time for the resident events (stamped by the kernel): a ring that holds a whole phase.
  constexpr size_t kWarmupEvents = 20;
  const bool record_stamps = absl::GetFlag(FLAGS_time_ticks) > 0;
  streamer->set_time_ticks(absl::GetFlag(FLAGS_time_ticks));
  if (record_stamps) {
    RETURN_IF_ERROR(
        streamer->SizeResidentStamps(std::bit_ceil(static_cast<uint32_t>(50 * iterations + kWarmupEvents))));
  }
  // A phase's summary, or why it has none; only a failure to take the stamps fails the bench.
  auto device_times = [&]() -> absl::StatusOr<absl::StatusOr<ResidentDeviceTimes>> {
    if (!record_stamps) return absl::StatusOr<ResidentDeviceTimes>(absl::UnavailableError("--time_ticks=0"));
    ASSIGN_OR_RETURN(const std::vector<kernels::StreamResidentStamp> taken, streamer->TakeResidentStamps());
    return SummarizeResidentStamps(taken, kWarmupEvents);
  };
  const int64_t allocations_before = CudaAllocationCount();
  ASSIGN_OR_RETURN(const std::vector<double> launched, round_trips(false));
  ASSIGN_OR_RETURN(const std::vector<double> resident, round_trips(true));
  ASSIGN_OR_RETURN(const absl::StatusOr<ResidentDeviceTimes> lone_device, device_times());
  ASSIGN_OR_RETURN(const double launched_per_event, back_to_back(false));
  ASSIGN_OR_RETURN(const double resident_per_event, back_to_back(true));
  ASSIGN_OR_RETURN(const absl::StatusOr<ResidentDeviceTimes> back_to_back_device, device_times());
  std::vector<double> restarts;
  for (int i = 0; i < iterations + 5; ++i) {
    RETURN_IF_ERROR(streamer->StopResident());
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(streamer->stream()));  // (the stopped cluster has left)
    const auto start = Clock::now();
    RETURN_IF_ERROR(step());
    RETURN_IF_ERROR(streamer->Synchronize());
    if (i >= 5) restarts.push_back(us_since(start));
  }
  std::vector<float> probs(config.n_horizons);
  RETURN_IF_ERROR(streamer->ReadSlotProbabilities(0, probs));  // (which stops the resident step)
  const int64_t allocations = CudaAllocationCount() - allocations_before;
  std::printf("%-6s resident: round trip %8.2f us (p10 %8.2f, p99 %8.2f; launched tick's Step + Synchronize %8.2f, "
              "p10 %8.2f, p99 %8.2f), back to back %8.2f us/event (launched %8.2f) over %d events; the first event "
              "after a stop %8.2f us (p99 %8.2f); allocations %lld\n",
              name.c_str(), Percentile(resident, 0.5), Percentile(resident, 0.1), Percentile(resident, 0.99),
              Percentile(launched, 0.5), Percentile(launched, 0.1), Percentile(launched, 0.99), resident_per_event,
              launched_per_event, 50 * iterations, Percentile(restarts, 0.5), Percentile(restarts, 0.99),
              static_cast<long long>(allocations));
  if (record_stamps) {
    PrintDeviceTimes(name, "lone events", lone_device, /*back_to_back=*/false);
    PrintDeviceTimes(name, "back to back", back_to_back_device, /*back_to_back=*/true);
  }
  std::fflush(stdout);
  return ResidentResult{name, Percentile(resident, 0.5), resident_per_event, lone_device, back_to_back_device,
                        allocations};
}

// Only back to back is one answer to the next a device time (between lone events it is the host's round trip).
std::string DeviceTimesJson(const absl::StatusOr<ResidentDeviceTimes>& t, bool back_to_back) {
  if (!t.ok()) return "null";
  return absl::StrCat("{\"events\":", t->events, ",\"median_us\":", t->busy_median_us, ",\"p99_us\":", t->busy_p99_us,
                      ",\"timer_median_us\":", t->busy_timer_median_us,
                      back_to_back ? absl::StrCat(",\"answer_to_answer_median_us\":", t->period_median_us) : "",
                      ",\"cycles_per_ns\":", t->cycles_per_ns, "}");
}

std::string ToJson(const std::vector<Row>& rows, const std::vector<ResidentResult>& resident,
                   const std::string& device) {
  std::vector<std::string> items;
  for (const Row& r : rows) {
    items.push_back(absl::StrCat(
        "{\"config\":\"", r.config, "\",\"instruments\":", r.instruments, ",\"graph_median_us\":", r.graph_median_us,
        ",\"graph_p99_us\":", r.graph_p99_us, ",\"graph_own_median_us\":", r.graph_own_median_us,
        ",\"eager_median_us\":", r.eager_median_us,
        ",\"lone_tick_wall_us\":", r.host_step_us, ",\"best_eager_us\":", r.best_shape_us,
        ",\"best_group\":", r.best_shape.events_per_group, ",\"best_cluster\":", r.best_shape.cluster_size,
        ",\"best_wide\":", r.best_shape.wide ? "true" : "false", ",\"default_group\":", r.default_shape.events_per_group,
        ",\"default_cluster\":", r.default_shape.cluster_size, ",\"default_wide\":", r.default_shape.wide ? "true" : "false",
        ",\"allocations\":", r.allocations, ",\"graph_queued_ahead\":", r.graph_queued_ahead, "}"));
  }
  std::vector<std::string> resident_items;
  for (const ResidentResult& r : resident) {
    resident_items.push_back(absl::StrCat("{\"config\":\"", r.config, "\",\"round_trip_median_us\":", r.round_trip_us,
                                          ",\"back_to_back_host_mean_us\":", r.back_to_back_us,
                                          ",\"lone_device\":", DeviceTimesJson(r.lone_device, false),
                                          ",\"back_to_back_device\":", DeviceTimesJson(r.back_to_back_device, true),
                                          ",\"allocations\":", r.allocations, "}"));
  }
  return absl::StrCat("{\"device\":\"", device, "\",\"rows\":[", absl::StrJoin(items, ","), "],\"resident\":[",
                      absl::StrJoin(resident_items, ","), "]}\n");
}

absl::Status Main() {
  RETURN_IF_ERROR(CudaDeviceAvailable());
  std::vector<int> sizes;
  for (const std::string& s : absl::GetFlag(FLAGS_instruments)) sizes.push_back(std::stoi(s));
  cudaDeviceProp properties{};
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, 0));
  std::printf("bench_stream on %s: device time per tick (median of %d, CUDA events; stream held %d us while the host "
              "queues ticks), ticks of up to 8 events in the launch's parameters, larger ones staged in pinned memory\n",
              properties.name, absl::GetFlag(FLAGS_iterations), absl::GetFlag(FLAGS_queue_us));
  if (const int levels = absl::GetFlag(FLAGS_levels); levels > 0) {
    std::printf("every config with %d LOBSTER book level(s): %d features\n", levels, LobsterFeatureCount(levels));
  }
  std::vector<Row> all;
  std::vector<ResidentResult> resident;
  int64_t allocations = 0;
  for (const std::string& name : absl::GetFlag(FLAGS_configs)) {
    ASSIGN_OR_RETURN(std::vector<Row> rows, BenchConfig(name, sizes, absl::GetFlag(FLAGS_iterations)));
    for (const Row& row : rows) allocations += row.allocations;
    all.insert(all.end(), rows.begin(), rows.end());
    if (absl::GetFlag(FLAGS_resident)) {
      ASSIGN_OR_RETURN(std::optional<ResidentResult> result, BenchResident(name, absl::GetFlag(FLAGS_iterations)));
      if (result.has_value()) {
        allocations += result->allocations;
        resident.push_back(*std::move(result));
      }
    }
  }
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << ToJson(all, resident, properties.name);
  }
  if (allocations != 0) {
    return absl::InternalError(absl::StrCat(allocations, " allocations (device or pinned) during timed ticks (listed "
                                            "above): a tick must allocate none"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace perception

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = perception::Main();
  if (!status.ok()) {
    std::fprintf(stderr, "bench_stream: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
