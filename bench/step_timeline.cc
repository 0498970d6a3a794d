// step_timeline: where the wall time of one replayed training step goes — every kernel and copy of the captured step
// on the device's clock (CUPTI activity records), the idle gaps between them, their overlap and the critical chain
// through the graph's dependency edges. Prints a table and a summary; --json writes both.
#include <cxxabi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <cuda.h>
#include <cuda_runtime.h>
#include <cupti.h>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_model.h"
#include "bench/percentile.h"
#include "engine/cuda_backend.h"
#include "engine/cuda_check.h"

ABSL_FLAG(std::string, config, "small", "model config");
ABSL_FLAG(std::string, precision, "3xtf32", "the products: fp32, 3xtf32 or tf32 (as bench_train)");
ABSL_FLAG(int, warmup, 10, "untimed steps and replays before anything is recorded");
ABSL_FLAG(int, replays, 20, "replays recorded; the one of median wall time is listed");
ABSL_FLAG(int, gaps, 12, "the largest idle gaps listed");
ABSL_FLAG(bool, list, true, "list every kernel and copy of the listed replay");
ABSL_FLAG(bool, prefetch, false,
          "time and record the loader's steady state: each step's batch copied in beside the step before, the next "
          "one copied in beside its compute (bench_train's prefetch column); false: each step copies its own batch in "
          "first");
ABSL_FLAG(std::string, json, "", "also write the listed replay and the summary here as JSON");
ABSL_FLAG(int, hold_us, 3000,
          "recorded replays start this long after their launch (a host function holds the stream meanwhile), so the "
          "timeline shows the device's work, not the host still submitting the graph; 0: launched on an idle stream");

#define CUPTI_RETURN_IF_ERROR(call)                                                               \
  do {                                                                                            \
    if (const CUptiResult result_ = (call); result_ != CUPTI_SUCCESS) {                           \
      const char* message_ = nullptr;                                                             \
      cuptiGetResultString(result_, &message_);                                                   \
      return absl::InternalError(absl::StrCat(#call, ": ", message_ ? message_ : "CUPTI error")); \
    }                                                                                             \
  } while (0)

namespace perception {
namespace {

// One kernel, copy or memset as the device ran it.
struct Activity {
  uint64_t start = 0, end = 0;  // ns on CUPTI's clock
  uint32_t stream = 0, correlation = 0;  // the correlation id is the cudaGraphLaunch's: one per replay
  uint64_t node = 0;                     // CUPTI's id of the executed graph node
  int grid[3] = {0, 0, 0}, block[3] = {0, 0, 0};
  std::string name;
};

// CUPTI hands records and node clones over on its own threads.
std::mutex g_mutex;
std::vector<Activity> g_activities;
std::unordered_map<uint64_t, uint64_t> g_cloned_from;  // node id → the id of the node it was cloned from
size_t g_dropped = 0;

std::string Demangled(const char* name) {
  int status = 0;
  char* plain = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && plain ? plain : name;
  std::free(plain);
  for (const std::string noise : {"(anonymous namespace)::", "perception::kernels::", "perception::"}) {
    for (size_t at; (at = s.find(noise)) != std::string::npos;) s.erase(at, noise.size());
  }
  if (s.starts_with("void ")) s.erase(0, 5);
  // The parameter list repeats what the kernel's name already says: cut at the first '(' outside template brackets.
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    depth += s[i] == '<' ? 1 : s[i] == '>' ? -1 : 0;
    if (s[i] == '(' && depth == 0) return s.substr(0, i);
  }
  return s;
}

const char* CopyKind(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    default: return "other";
  }
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{8} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext context, uint32_t stream, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Activity> got;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    Activity a;
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      a = {k->start, k->end, k->streamId, k->correlationId, k->graphNodeId,
           {k->gridX, k->gridY, k->gridZ}, {k->blockX, k->blockY, k->blockZ}, Demangled(k->name)};
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      a = {m->start, m->end, m->streamId, m->correlationId, m->graphNodeId, {}, {},
           absl::StrCat("[memcpy ", CopyKind(m->copyKind), " ", m->bytes, " B]")};
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      a = {m->start, m->end, m->streamId, m->correlationId, m->graphNodeId, {}, {},
           absl::StrCat("[memset ", m->bytes, " B]")};
    } else {
      continue;
    }
    got.push_back(std::move(a));
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(context, stream, &dropped);
  std::free(buffer);
  const std::lock_guard lock(g_mutex);
  g_dropped += dropped;
  g_activities.insert(g_activities.end(), got.begin(), got.end());
}

// Instantiation clones the captured graph's nodes; the records name the clones.
void CUPTIAPI OnResource(void*, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_RESOURCE || id != CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED) return;
  const auto* graph = static_cast<const CUpti_GraphData*>(static_cast<const CUpti_ResourceData*>(data)->resourceDescriptor);
  uint64_t clone = 0, original = 0;
  if (cuptiGetGraphNodeId(graph->node, &clone) != CUPTI_SUCCESS) return;
  if (cuptiGetGraphNodeId(graph->originalNode, &original) != CUPTI_SUCCESS) return;
  const std::lock_guard lock(g_mutex);
  g_cloned_from[clone] = original;
}

// The captured step's dependency edges by CUPTI node id: for each node, the nodes it waits for.
struct Dependencies {
  std::unordered_set<uint64_t> nodes;
  std::unordered_map<uint64_t, std::vector<uint64_t>> preds;
  uint64_t Original(uint64_t id) const {
    for (auto it = g_cloned_from.find(id); it != g_cloned_from.end(); it = g_cloned_from.find(id)) id = it->second;
    return id;
  }
};

absl::StatusOr<Dependencies> EdgesOf(cudaGraph_t graph) {
  Dependencies deps;
  size_t count = 0;
  CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nodes.data(), &count));
  for (cudaGraphNode_t node : nodes) {
    uint64_t id = 0;
    CUPTI_RETURN_IF_ERROR(cuptiGetGraphNodeId(node, &id));
    deps.nodes.insert(id);
  }
  CUDA_RETURN_IF_ERROR(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &count));
  std::vector<cudaGraphNode_t> from(count), to(count);
  std::vector<cudaGraphEdgeData> data(count);
  CUDA_RETURN_IF_ERROR(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &count));
  for (size_t i = 0; i < count; ++i) {
    uint64_t f = 0, t = 0;
    CUPTI_RETURN_IF_ERROR(cuptiGetGraphNodeId(from[i], &f));
    CUPTI_RETURN_IF_ERROR(cuptiGetGraphNodeId(to[i], &t));
    deps.preds[t].push_back(f);
  }
  return deps;
}

struct Gap {
  uint64_t begin, end;
  int before, after;  // the activity that ended at begin, the one that started at end
};

struct ChainLink {
  int activity;
  // Its start minus the end of the activity it waited for: negative where a programmatic launch let it start before
  // that one ended.
  int64_t wait_ns;
};

// One replay's activities (sorted by start, times relative to the first start) and what the summary says of them.
struct Replay {
  std::vector<Activity> activities;
  uint64_t wall = 0, busy = 0, overlap = 0, serialized = 0;
  std::vector<Gap> gaps;  // largest first
  std::vector<ChainLink> chain;  // first to last
  bool chain_from_edges = false;
};

// The activities that `i` waited for: its graph predecessors that ran (through nodes without records: event and
// empty nodes), or, without edges, every activity that ended before it started.
std::vector<int> Predecessors(const Replay& r, int i, const Dependencies* deps,
                              const std::unordered_map<uint64_t, int>& by_node) {
  std::vector<int> out;
  if (deps) {
    std::vector<uint64_t> todo = {deps->Original(r.activities[i].node)};
    std::unordered_map<uint64_t, bool> seen;
    while (!todo.empty()) {
      const uint64_t node = todo.back();
      todo.pop_back();
      const auto preds = deps->preds.find(node);
      if (preds == deps->preds.end()) continue;
      for (const uint64_t p : preds->second) {
        if (seen[p]) continue;
        seen[p] = true;
        if (const auto ran = by_node.find(p); ran != by_node.end()) {
          out.push_back(ran->second);
        } else {
          todo.push_back(p);
        }
      }
    }
    return out;
  }
  for (int j = 0; j < i; ++j) {  // sorted by start: j < i keeps the walk from cycling through zero-length ones
    if (r.activities[j].end <= r.activities[i].start) out.push_back(j);
  }
  return out;
}

void Analyze(Replay& r, const Dependencies* deps) {
  auto& a = r.activities;
  std::sort(a.begin(), a.end(), [](const Activity& x, const Activity& y) { return x.start < y.start; });
  const uint64_t t0 = a.front().start;
  for (Activity& x : a) {
    x.start -= t0;
    x.end -= t0;
  }
  // Sweep the starts and ends: time with ≥ 1 activity running (busy), ≥ 2 (overlap), and the holes between.
  std::vector<std::pair<uint64_t, int>> events;
  for (const Activity& x : a) {
    events.push_back({x.start, +1});
    events.push_back({x.end, -1});
    r.serialized += x.end - x.start;
    r.wall = std::max(r.wall, x.end);
  }
  std::sort(events.begin(), events.end());  // an end before a start at the same instant: no zero-length gap counted
  int running = 0;
  uint64_t last = 0;
  for (const auto& [t, step] : events) {
    if (running >= 1) r.busy += t - last;
    if (running >= 2) r.overlap += t - last;
    if (running == 0 && t > last && step > 0) {
      Gap g{last, t, -1, -1};
      for (int i = 0; i < static_cast<int>(a.size()); ++i) {
        if (a[i].end == last) g.before = i;
        if (a[i].start == t && g.after < 0) g.after = i;
      }
      r.gaps.push_back(g);
    }
    running += step;
    last = t;
  }
  std::sort(r.gaps.begin(), r.gaps.end(),
            [](const Gap& x, const Gap& y) { return x.end - x.begin > y.end - y.begin; });

  // The critical chain: from the activity that ends last, back through the predecessor that ended last each time.
  // Edges only when every activity maps to its own node of the captured graph.
  std::unordered_map<uint64_t, int> by_node;
  for (int i = 0; deps && i < static_cast<int>(a.size()); ++i) {
    if (const uint64_t node = deps->Original(a[i].node); deps->nodes.contains(node)) by_node[node] = i;
  }
  r.chain_from_edges = deps != nullptr && by_node.size() == a.size();
  const Dependencies* used = r.chain_from_edges ? deps : nullptr;
  int at = static_cast<int>(std::max_element(a.begin(), a.end(), [](const Activity& x, const Activity& y) {
                              return x.end < y.end;
                            }) - a.begin());
  std::vector<ChainLink> chain;
  while (at >= 0) {
    int next = -1;
    for (const int p : Predecessors(r, at, used, by_node)) {
      if (next < 0 || a[p].end > a[next].end) next = p;
    }
    chain.push_back({at, next < 0 ? static_cast<int64_t>(a[at].start)
                                  : static_cast<int64_t>(a[at].start) - static_cast<int64_t>(a[next].end)});
    at = next;
  }
  r.chain.assign(chain.rbegin(), chain.rend());
}

// Holds the stream for *(int*)us µs: a graph launched behind it is wholly submitted before the device reaches it.
void CUDART_CB Hold(void* us) { std::this_thread::sleep_for(std::chrono::microseconds(*static_cast<const int*>(us))); }

double HostUsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
}

std::string Dim3(const int d[3]) { return absl::StrCat(d[0], ",", d[1], ",", d[2]); }

double Us(uint64_t ns) { return ns * 1e-3; }

absl::StatusOr<double> MedianUs(std::vector<double> us) {
  if (us.empty()) return absl::InternalError("nothing timed");
  return Median(std::move(us));
}

absl::Status Run() {
  ASSIGN_OR_RETURN(const Precision precision, ParsePrecision(absl::GetFlag(FLAGS_precision)));
  ASSIGN_OR_RETURN(const ModelConfig config, NamedConfig(absl::GetFlag(FLAGS_config)));
  const int warmup = std::max(absl::GetFlag(FLAGS_warmup), 2), replays = std::max(absl::GetFlag(FLAGS_replays), 1);
  ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model, MakeBenchModel(config, precision, /*graphs=*/true));
  // Between steps the model holds the next of the two batches staged; prefetching, the one after it is staged before
  // each step too.
  const bool prefetch = absl::GetFlag(FLAGS_prefetch);
  const testing::RandomBatch batches[2] = {BenchBatch(config, 0), BenchBatch(config, 1)};
  int staged = 0;
  auto stage_following = [&] {
    staged ^= 1;
    return model->StageBatch(batches[staged].view());
  };

  // The model's own replays first, before CUPTI is attached, timed as bench_train times them: launched on an idle
  // stream (as bench_train and the trainer do) and held (the graph wholly submitted before the device starts it).
  // Their difference is the part of a step spent waiting for the host's submission; what recording costs shows
  // against the event-timed replays below.
  const int hold_us = absl::GetFlag(FLAGS_hold_us);
  const int held_for = std::max(hold_us, 3000);
  std::vector<double> plain_us, held_us, launch_host_us;
  for (int i = 0; i < warmup + 2 * replays; ++i) {
    const bool held = i >= warmup + replays;
    if (prefetch) RETURN_IF_ERROR(stage_following());
    if (held) CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(model->stream(), Hold, const_cast<int*>(&held_for)));
    const auto enqueue = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(model->EnqueueTrainStep());
    if (!held && i >= warmup) launch_host_us.push_back(HostUsSince(enqueue));
    RETURN_IF_ERROR(model->Wait().status());
    if (!prefetch) RETURN_IF_ERROR(stage_following());
    if (i >= warmup) (held ? held_us : plain_us).push_back(model->training_counters().last_step_seconds * 1e6);
  }
  ASSIGN_OR_RETURN(const double plain_median, MedianUs(plain_us));
  ASSIGN_OR_RETURN(const double held_median, MedianUs(held_us));
  ASSIGN_OR_RETURN(const double launch_host_median, MedianUs(launch_host_us));

  CUPTI_RETURN_IF_ERROR(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted));
  CUpti_SubscriberHandle subscriber;
  CUPTI_RETURN_IF_ERROR(cuptiSubscribe(&subscriber, OnResource, nullptr));
  CUPTI_RETURN_IF_ERROR(
      cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED));
  for (const CUpti_ActivityKind kind :
       {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET}) {
    CUPTI_RETURN_IF_ERROR(cuptiActivityEnable(kind));
  }

  // The step captured here as the model captures it (same calls, same streams), so its graph's edges are at hand:
  // prefetching, on the batch the last step copied in, with the next one staged to copy in beside it.
  if (prefetch) RETURN_IF_ERROR(stage_following());
  const cudaStream_t stream = model->stream();
  cudaGraph_t graph = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status enqueued = model->EnqueueTrainStepEagerly();
  CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  RETURN_IF_ERROR(enqueued);
  const absl::StatusOr<Dependencies> deps = EdgesOf(graph);
  cudaGraphExec_t exec = nullptr;
  CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  std::vector<double> traced_us, traced_launch_host_us;
  for (int i = 0; i < warmup + replays; ++i) {
    if (i == warmup) {  // the warmup's records out of the way
      CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
      CUPTI_RETURN_IF_ERROR(cuptiActivityFlushAll(1));
      const std::lock_guard lock(g_mutex);
      g_activities.clear();
    }
    if (hold_us > 0) CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(stream, Hold, const_cast<int*>(&hold_us)));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
    const auto launch = std::chrono::steady_clock::now();
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream));
    if (i >= warmup) traced_launch_host_us.push_back(HostUsSince(launch));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    if (i >= warmup) traced_us.push_back(ms * 1e3);
  }
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  CUPTI_RETURN_IF_ERROR(cuptiActivityFlushAll(1));
  for (const CUpti_ActivityKind kind :
       {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET}) {
    CUPTI_RETURN_IF_ERROR(cuptiActivityDisable(kind));
  }
  ASSIGN_OR_RETURN(const double traced_median, MedianUs(traced_us));
  ASSIGN_OR_RETURN(const double traced_launch_host_median, MedianUs(traced_launch_host_us));

  std::map<uint32_t, Replay> by_launch;
  {
    const std::lock_guard lock(g_mutex);
    for (const Activity& a : g_activities) by_launch[a.correlation].activities.push_back(a);
  }
  std::vector<Replay> runs;
  for (auto& [correlation, r] : by_launch) {
    Analyze(r, deps.ok() ? &*deps : nullptr);
    runs.push_back(std::move(r));
  }
  if (runs.empty()) return absl::InternalError("CUPTI recorded no activity");
  std::sort(runs.begin(), runs.end(), [](const Replay& x, const Replay& y) { return x.wall < y.wall; });
  const Replay& r = runs[runs.size() / 2];
  const auto& a = r.activities;

  std::vector<bool> on_chain(a.size(), false);
  uint64_t chain_busy = 0;
  int64_t chain_wait = 0, chain_overlap = 0;  // (overlap: of each link with the one before it)
  for (const ChainLink& link : r.chain) {
    on_chain[link.activity] = true;
    chain_busy += a[link.activity].end - a[link.activity].start;
    (link.wait_ns >= 0 ? chain_wait : chain_overlap) += std::abs(link.wait_ns);
  }
  int kernels = 0;
  for (const Activity& x : a) kernels += x.grid[0] > 0;

  std::printf("step_timeline: %s %s, %zu activities a replay (%d kernels), %zu replays recorded, %zu records dropped\n",
              absl::GetFlag(FLAGS_config).c_str(), PrecisionName(precision), a.size(), kernels, runs.size(), g_dropped);
  std::printf("edges: %s\n", r.chain_from_edges ? "the captured graph's (every activity mapped to its node)"
                                                : deps.ok() ? "unmapped node ids: chain approximated (latest end before each start)"
                                                            : std::string(deps.status().message()).c_str());
  if (absl::GetFlag(FLAGS_list)) {
    std::printf("%4s %9s %9s %8s %7s %6s %14s %10s %1s %s\n", "#", "start_ns", "end_ns", "dur_ns", "wait_ns", "stream",
                "grid", "block", "C", "name");
    std::vector<int64_t> wait(a.size(), 0);
    for (const ChainLink& link : r.chain) wait[link.activity] = link.wait_ns;
    for (size_t i = 0; i < a.size(); ++i) {
      std::printf("%4zu %9lu %9lu %8lu %7s %6u %14s %10s %1s %s\n", i, a[i].start, a[i].end, a[i].end - a[i].start,
                  on_chain[i] ? std::to_string(wait[i]).c_str() : "", a[i].stream, Dim3(a[i].grid).c_str(),
                  Dim3(a[i].block).c_str(), on_chain[i] ? "*" : "", a[i].name.c_str());
    }
  }
  std::vector<double> walls;
  for (const Replay& x : runs) walls.push_back(Us(x.wall));
  std::printf("replay walls (first start -> last end) us: min %.1f median %.1f max %.1f\n", walls.front(),
              walls[walls.size() / 2], walls.back());
  std::printf("event-timed replay median us, without CUPTI (the model's graph): %.1f launched on an idle stream, %.1f "
              "held %d us (host: %.1f us in EnqueueTrainStep)\n",
              plain_median, held_median, held_for, launch_host_median);
  std::printf("event-timed replay median us, with CUPTI (this graph, the recorded replays): %.1f %s (host: %.1f us in "
              "cudaGraphLaunch)\n",
              traced_median, hold_us > 0 ? absl::StrCat("held ", hold_us, " us").c_str() : "launched on an idle stream",
              traced_launch_host_median);
  std::printf("listed replay: wall %.1f us; busy (>= 1 running) %.1f; idle %.1f in %zu gaps; overlap (>= 2 running) "
              "%.1f; serialized sum %.1f\n",
              Us(r.wall), Us(r.busy), Us(r.wall - r.busy), r.gaps.size(), Us(r.overlap), Us(r.serialized));
  std::printf("critical chain: %zu activities, %.1f us running (%.1f of it beside the link before: programmatic "
              "launches) + %.1f us waiting = %.1f us; off the chain %.1f us running\n",
              r.chain.size(), Us(chain_busy), chain_overlap * 1e-3, chain_wait * 1e-3,
              (static_cast<int64_t>(chain_busy) - chain_overlap + chain_wait) * 1e-3, Us(r.serialized - chain_busy));
  std::printf("largest idle gaps:\n");
  const int shown = std::min<int>(absl::GetFlag(FLAGS_gaps), r.gaps.size());
  for (int i = 0; i < shown; ++i) {
    const Gap& g = r.gaps[i];
    std::printf("  %7.2f us at %8.1f: after #%d %s | before #%d %s\n", Us(g.end - g.begin), Us(g.begin), g.before,
                g.before >= 0 ? a[g.before].name.c_str() : "?", g.after, g.after >= 0 ? a[g.after].name.c_str() : "?");
  }

  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    nlohmann::ordered_json json;
    json["config"] = absl::GetFlag(FLAGS_config);
    json["precision"] = PrecisionName(precision);
    json["chain_from_edges"] = r.chain_from_edges;
    json["summary"] = {{"wall_us", Us(r.wall)},
                       {"busy_us", Us(r.busy)},
                       {"idle_us", Us(r.wall - r.busy)},
                       {"gaps", r.gaps.size()},
                       {"overlap_us", Us(r.overlap)},
                       {"serialized_us", Us(r.serialized)},
                       {"chain_running_us", Us(chain_busy)},
                       {"chain_waiting_us", chain_wait * 1e-3},
                       {"chain_overlap_us", chain_overlap * 1e-3},
                       {"replay_walls_us", walls},
                       {"hold_us", hold_us},
                       {"event_replay_median_us_without_cupti", plain_median},
                       {"event_replay_median_us_without_cupti_held", held_median},
                       {"host_us_enqueue_without_cupti", launch_host_median},
                       {"event_replay_median_us_with_cupti", traced_median},
                       {"host_us_graph_launch_with_cupti", traced_launch_host_median}};
    for (size_t i = 0; i < a.size(); ++i) {
      json["activities"].push_back({{"start_ns", a[i].start},
                                    {"end_ns", a[i].end},
                                    {"stream", a[i].stream},
                                    {"grid", {a[i].grid[0], a[i].grid[1], a[i].grid[2]}},
                                    {"block", {a[i].block[0], a[i].block[1], a[i].block[2]}},
                                    {"on_chain", static_cast<bool>(on_chain[i])},
                                    {"name", a[i].name}});
    }
    for (const ChainLink& link : r.chain) json["chain"].push_back({{"activity", link.activity}, {"wait_ns", link.wait_ns}});
    for (int i = 0; i < shown; ++i) {
      json["largest_gaps"].push_back({{"begin_ns", r.gaps[i].begin},
                                      {"ns", r.gaps[i].end - r.gaps[i].begin},
                                      {"before", r.gaps[i].before},
                                      {"after", r.gaps[i].after}});
    }
    std::ofstream(path) << json.dump(1) << "\n";
  }
  CUPTI_RETURN_IF_ERROR(cuptiUnsubscribe(subscriber));
  CUDA_RETURN_IF_ERROR(cudaEventDestroy(start));
  CUDA_RETURN_IF_ERROR(cudaEventDestroy(stop));
  CUDA_RETURN_IF_ERROR(cudaGraphExecDestroy(exec));
  CUDA_RETURN_IF_ERROR(cudaGraphDestroy(graph));
  return absl::OkStatus();
}

}  // namespace
}  // namespace perception

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // A diagnostic, not a test: without a device (CI) there is nothing to trace, which is not a failure.
  if (const absl::Status available = perception::CudaDeviceAvailable(); !available.ok()) {
    std::printf("step_timeline: skipped: %s\n", std::string(available.message()).c_str());
    return 0;
  }
  if (const absl::Status status = perception::Run(); !status.ok()) {
    std::fprintf(stderr, "step_timeline: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
