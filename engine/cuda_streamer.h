// The streaming half of the CUDA backend: per-slot states, probabilities and conviction logs in device memory, the
// published weights, and forward_step_into as one graph per tick on a high-priority stream (one kernel for small
// ticks, a few grid-wide ones for large ticks), or, for lone events where the model has one, the resident step.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <map>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cuda_memory.h"
#include "engine/param_layout.h"
#include "kernels/stream_step.h"

namespace perception {

// How one tick is laid out over the GPU: events per cluster group and blocks per cluster (see kernels/stream_step.h),
// or the wide path (grid-wide kernels over tiles of 8 events).
struct StreamLaunchShape {
  int events_per_group = 1;
  int cluster_size = 8;
  bool wide = false;
  bool operator==(const StreamLaunchShape&) const = default;
};
constexpr std::array<int, 4> kStreamGroupSizes = {1, 2, 4, 8};
constexpr std::array<int, 5> kStreamClusterSizes = {1, 2, 4, 8, 16};
constexpr StreamLaunchShape kStreamWideShape{8, 1, true};
// A value per cluster shape, indexed like kStreamGroupSizes × kStreamClusterSizes.
template <typename T>
using PerClusterShape = std::array<std::array<T, kStreamClusterSizes.size()>, kStreamGroupSizes.size()>;
// The cluster shapes that can run a tick of n events, fastest first by the estimate that a cluster runs its groups
// one after another (each a chain of dependent stages): one group's time (`group_us`) for every wave of clusters its
// groups need (`fits`' max_clusters at once); shapes with no clusters are out.
std::vector<StreamLaunchShape> ClusterShapesByEstimate(int n, const PerClusterShape<kernels::StreamShapeFit>& fits,
                                                       const PerClusterShape<float>& group_us);
// The events [from, end) of a resident run's events [first, end) (numbered modulo 2³²; a stopped run's, or a running
// one's answered) whose stamps a ring of `slots` (a power of two) still holds, and that no event posted so far
// (`posted`, stops included, every event of [first, end) among them) can be rewriting: those at most `slots` back from
// `posted`. Empty (from == end) where none is.
std::pair<uint32_t, uint32_t> ResidentStampsToRead(uint32_t first, uint32_t end, uint32_t posted, uint32_t slots);

// How many of the estimate's fastest cluster shapes CudaStreamer times on a whole tick of each bucket below
// kStreamWideFrom, beside the wide path.
constexpr int kStreamTimedClusterShapes = 3;
// Ticks of at least this many events take the wide path (where it fits), unless a single-block cluster shape runs
// them in one wave with all its weights in shared memory: then, as below it, the shape measured fastest at start
// (ShapeFor). Eager sweeps of every shape on the H200 (b4abbf7): `small`, whose weights no block holds, ran wide from
// 256 events (76.8 against 89.5 µs for the best cluster shape; at 128 the cluster shape won, 55.8 against 70.5);
// `tiny`'s cluster kernel, which holds all its weights, won at 512 (32.8 against 46.7) and tied at 1,024 (53.5
// against 54.0) while its groups of 8 fit one wave (132 single-block clusters), and the wide path won from 2,048.
constexpr int kStreamWideFrom = 256;

class CudaStreamer {
 public:
  // Allocates everything once: published weights, `slots` zeroed states, their probabilities and logs, and
  // double-buffered staging (pinned, and its device copy) for ticks of up to `slots` events.
  static absl::StatusOr<std::unique_ptr<CudaStreamer>> Create(const ParamLayout& layout, int slots,
                                                              int64_t log_entries_per_slot);
  ~CudaStreamer();
  CudaStreamer(const CudaStreamer&) = delete;
  CudaStreamer& operator=(const CudaStreamer&) = delete;

  // Where every tick, copy and the resident step run, in the order they were asked for. (Work queued here from outside
  // waits behind a running resident step until it is stopped: see YieldTo.)
  cudaStream_t stream() const { return stream_; }
  int slots() const { return slots_; }
  // Whether ticks can launch with this shape on this device (clusters of 16 need a device that co-schedules them).
  bool Supports(StreamLaunchShape shape) const { return shape.wide ? wide_fits_ : Fit(shape).max_clusters > 0; }

  // Copies a whole parameter set (device memory) into the published weights once `source`'s queued work is done and
  // rebuilds the stream pack from it; ticks queued afterwards read it, ticks queued before read the previous set.
  // Work queued on `source` afterwards waits until the copy has read the parameters. Ticks read only the pack, which
  // is rebuilt last: a publish that fails before leaves them on the previous set, whole.
  absl::Status Publish(const float* device_params, cudaStream_t source);
  // Uploads a host parameter set into the published weights (synchronous; for tests and the CPU-built models).
  absl::Status PublishFromHost(std::span<const float> params);
  // Tests only: the next publish fails where it would rebuild the pack.
  void FailNextPackForTest() { fail_next_pack_ = true; }

  // forward_step_into: replays the CUDA graph captured for the tick's bucket (ticks are padded to the next power of
  // two of events, up to the slot count; a bucket is captured on first use). A tick of up to 8 events travels in the
  // launch's parameters (the graph's kernel node is updated); a larger one is staged in pinned memory, which its
  // kernels read in place, or, while ticks queue up, from a device copy made on a stream of its own beside the tick
  // ahead (StagedRead). Nothing waits for the device, except, rarely, for the staged tick two before this one,
  // whose pinned buffer is about to be reused. With graphs off, the same work is enqueued eagerly. An event recorded
  // behind the tick (or, for a lone event, the resident step's answer) tells CheckTicks when it has finished; with
  // set_time_ticks, one recorded just before its launch times one tick in so many.
  absl::Status Step(const StreamTick& tick);
  // An eager tick with an explicit launch shape (benchmarks and tests).
  absl::Status Step(const StreamTick& tick, StreamLaunchShape shape);
  void set_use_graphs(bool use_graphs) { use_graphs_ = use_graphs; }
  // How Step(tick) times its ticks on the device: one launched tick in `every` (0 or less: none) between timing CUDA
  // events on stream(), the first recorded just before its launch (on an idle stream, the launch's latency is in the
  // time), which CheckTicks reports as TicksChecked::device_seconds; and, where `every` > 0, each lone event the
  // resident step takes by the stamps of its stamped kernel (kernels::StreamResidentStamp: the global timer from the
  // event's ring entry found to its answer), which CheckTicks reports as TicksChecked::resident_seconds while the run
  // goes on (each answered event but the latest, whose done stamp may still be on its way) and once it has stopped and
  // left (those of its events the stamp ring still holds: of the last kResidentStamps posted, by default). A timing
  // event costs the stream 1.2–1.5 µs more than the plain one behind an untimed tick (H200, bench/RESULTS.md, the
  // fifty-first session), hence one tick in kTimedTickEvery by default; the stamps cost the resident step 0.01–0.02 µs
  // an event. A running resident step keeps its kernel until it is stopped. The next launched tick is a timed one.
  void set_time_ticks(int every) {
    time_ticks_every_ = std::max(every, 0);
    launched_since_set_ = 0;
  }
  static constexpr int kTimedTickEvery = kStreamTickTimingEvery;
  // Device times kept for CheckTicks at most (a caller that never asks, a benchmark, keeps the first ones only).
  static constexpr size_t kTickTimesKept = 4096;
  // The resident step's stamp ring by default (40 KB): the most events CheckTicks reports of those posted since it last
  // read a run's stamps.
  static constexpr uint32_t kResidentStamps = 1024;
  // Where a staged tick's kernels read it: in place in pinned memory (a bus round trip in their first stage), or from
  // its copy in device memory, made on a copy stream beside the ticks queued ahead, so that the tick starts without
  // the bus. The copy pays only where a whole tick runs while it is made (bench/RESULTS.md, the twentieth session):
  // with ticks queued back to back (small, H200) 1,024 events took 117.6 -> 109.1 µs and 16 events 29.0 -> 22.3,
  // but a lone tick of 1,024 that waited for its copy 132 -> 142 µs end to end, and copying whenever the stream was
  // busy slowed the daemon's gRPC streams. By default a tick is copied while the staged tick two before it is still
  // queued or running (StagedReadFor); tests may force either read.
  enum class StagedRead { kPinned, kDevice };
  void force_staged_read(std::optional<StagedRead> read) { forced_read_ = read; }

  // The resident step (kernels/stream_step.h): with graphs on, where the model has one (small's lone-event plan) and
  // unless switched off, a tick of one event is posted into a ring in pinned memory that one cluster, launched on
  // stream() by the first such tick, reads (no launch per tick; the same bits as the launched tick). Anything else
  // this streamer is asked to do (a larger tick, a seed, a reset, a publish, a read) first posts a stop behind the
  // events already posted, and is queued on stream() behind the cluster's exit, so every request keeps its order.
  // Meanwhile the cluster holds its multiprocessors (8 of the H200's 132) and polls the ring.
  bool resident_available() const { return resident_fits_; }
  void set_use_resident(bool use_resident) { use_resident_ = use_resident; }
  bool resident_running() const { return resident_.running; }
  // Before other heavy work on the device (a training step, an evaluation): stops a running resident step and makes
  // `other` wait until it has left, so that work gets every multiprocessor (and a cooperative launch its co-residency).
  absl::Status YieldTo(cudaStream_t other);
  // Stops a running resident step and waits until it has left: before anything that may wait for the whole device
  // (creating another model: allocations, the legacy stream), which a cluster that never ends would hold forever.
  absl::Status Quiesce();
  // Stops a running resident step without waiting: it answers the events posted before the stop, then leaves and
  // frees its multiprocessors and its polling of host memory; the next lone event launches another. For a feed that
  // has gone quiet (the daemon's --stream_resident_idle_ms).
  absl::Status StopResident();
  // Tests only: makes the running resident step execute `trap` behind the events posted before (a fault inside the
  // running kernel) and returns the error its stream reports, which loses the device.
  absl::Status FaultResident();
  // One launch of the resident step carries at most kResidentLaunchEvents events: its kernel counts a launch's events
  // in an int, so the host stops it at the bound and the next lone event launches another (one relaunch in 2³⁰
  // events: ~3 hours of back-to-back lone events on the H200). Tests lower the bound, and move the events' numbering
  // (modulo 2³² over the streamer's life: half a day of a busy feed) to just before its wrap; the numbering moves
  // once the resident step has left and every queued tick has finished, as if `first` events had been posted.
  static constexpr uint32_t kResidentLaunchEvents = uint32_t{1} << 30;
  void set_resident_launch_events(uint32_t events) {
    resident_launch_events_ = std::clamp(events, 1u, kResidentLaunchEvents);
  }
  absl::Status NumberResidentEventsFromForTest(uint32_t first);
  // The resident step's launches since the streamer was made.
  uint64_t resident_launches() const { return resident_.launches; }
  // Benchmarks: the resident step's stamp ring (set_time_ticks) holds `slots` events (a power of two, allocated here;
  // a running resident step is stopped first), instead of kResidentStamps. TakeResidentStamps stops the resident step,
  // waits until it has left and returns the events it stamped since the last take (the last `slots` events posted at
  // most, stops included), oldest first, clearing the ring.
  absl::Status SizeResidentStamps(uint32_t slots);
  absl::StatusOr<std::vector<kernels::StreamResidentStamp>> TakeResidentStamps();
  // The launch shape Step chooses for a tick of n events.
  StreamLaunchShape ShapeFor(int n) const;
  // What the streamer timed when it started, to choose the shapes of ticks that do not take the wide path by rule
  // (TimeBuckets): a bucket's whole graph-launched tick with each candidate shape (median µs).
  struct ShapeTiming {
    int bucket;
    StreamLaunchShape shape;
    float us;
  };
  const std::vector<ShapeTiming>& start_timings() const { return start_timings_; }

  absl::Status ResetSlot(int slot);
  // Steps the slot through x [n,F], dt [n] from its state without logging: the state equals stepping the same
  // events one by one, because it is exactly that (MODEL.md §3 makes it the sequence path's final state too). Then
  // waits for the device, to check that state (SeedNotFiniteError where it is not finite).
  absl::Status AdvanceSlot(int slot, std::span<const float> x, std::span<const float> dt);

  // Off the hot path: wait for the queued ticks, then one device-to-host copy of the range.
  absl::Status ReadLog(int slot, int64_t begin, int64_t count, std::span<float> convictions, std::span<float> probs);
  absl::Status ReadSlotProbabilities(int slot, std::span<float> probs);
  // Backend::CheckTicks over the Step(tick) calls: which have finished (by the resident step's answer count, or an
  // event recorded behind the tick; `wait_for_ticks` first waits for all) and the device times of the timed ones, then
  // the word the ticks set in mapped memory; only where it is set, it stops a running resident step, waits for every
  // tick and copies the slots' first non-finite entries.
  absl::StatusOr<TicksChecked> CheckTicks(bool wait_for_ticks);

  // Waits for everything asked so far: a running resident step's answers (it keeps running), or stream().
  absl::Status Synchronize();

  // What the step kernels read (the published weights' dimensions and pack, the slots' states and logs) and the shared
  // memory a block may use: for the resident step launched on a stream of its own (kernels/stream_step.h), benchmarks
  // and tests only. The pack is rebuilt on stream() at each publish.
  const kernels::StreamWeights& weights() const { return weights_; }
  const float* pack() const { return pack_; }
  const kernels::StreamSlots& slot_states() const { return state_; }
  size_t max_shared_bytes() const { return max_shared_bytes_; }

 private:
  CudaStreamer(const ParamLayout& layout, int slots, int64_t log_entries_per_slot);
  absl::Status Initialize();
  // One staged tick: its inputs written by the host into pinned memory, which the kernels read there or from a copy
  // in device memory (StagedRead). Laid out by StagedLayout (one copy a tick).
  struct Staging {
    std::byte* host = nullptr;  // pinned
    std::byte* device = nullptr;
    cudaEvent_t copied = nullptr;    // `host` has been read (by the copy, or by the tick that read it in place)
    cudaEvent_t consumed = nullptr;  // on stream_: the last tick staged here has finished
  };
  // The forced read, else kDevice while the tick last staged in `s` (two staged ticks back) has not finished, so that
  // a whole tick runs while the copy is made, else kPinned.
  absl::StatusOr<StagedRead> StagedReadFor(const Staging& s) const;
  // Where a staged tick of `padded` events keeps its parts within a staging buffer (bytes from its start): the log
  // positions, Δt, slots, then the features, whose `n` real events end the bytes a copy moves.
  struct StagedAt {
    size_t log, dt, slots, x, bytes;
  };
  StagedAt StagedLayout(int padded, int n) const;
  // A tick graph, its kernel node (whose tick an inline replay replaces) and the buffers it was captured over.
  struct TickGraph {
    cudaGraph_t graph = nullptr;
    cudaGraphNode_t node = nullptr;
    cudaGraphExec_t exec = nullptr;
    const float *staging_x = nullptr, *pack = nullptr, *conv_state = nullptr;
  };

  absl::Status CheckSlot(int slot) const;
  // The floats of one slot's conv and SSM states (all layers; its CfC state is cfc_units).
  size_t ConvFloatsPerSlot() const;
  size_t SsmFloatsPerSlot() const;
  // How a shape fits this device (no clusters: unsupported).
  kernels::StreamShapeFit Fit(StreamLaunchShape shape) const;
  // Whether a single-block cluster shape runs a tick of n events in one wave with all its weights in shared memory.
  bool OneWaveHoldsWeights(int n) const;
  // Times one group's eager tick of every cluster shape this device supports (group_us_), on zeroed slots that it
  // zeroes again afterwards.
  absl::Status TimeGroups();
  // For every bucket below kStreamWideFrom, and above it while a single-block cluster shape runs it in one wave with
  // all its weights in shared memory (OneWaveHoldsWeights, where the wide path fits): times a whole tick of the
  // bucket, graph-launched as Step launches it, with each of the estimate's kStreamTimedClusterShapes fastest cluster
  // shapes and (for staged ticks) the wide path, and keeps the fastest in bucket_shapes_ (a bucket with one candidate
  // keeps it untimed); on zeroed slots that it zeroes again afterwards.
  absl::Status TimeBuckets();
  // The median device µs of each of `runs` (each enqueues its work on stream()) after two warmups: queued back to back
  // in rounds that take every run in turn, so that a clock that changes over the rounds (the device warming up as the
  // streamer starts) weighs on all of them alike.
  absl::StatusOr<std::vector<float>> MedianDeviceUs(std::span<const std::function<absl::Status()>> runs);
  absl::Status Pack();
  absl::Status CheckTick(const StreamTick& tick);
  kernels::StreamWeights WeightsAt(const float* params) const;
  int BucketFor(int n) const;
  // Whether a tick of `n` (padded) events travels in the launch's parameters.
  bool Inline(int n) const;
  // A tick's events, padded to `padded`, as launch parameters.
  kernels::StreamTickInput InlineInput(const StreamTick& tick, int padded, bool log) const;
  Staging& NextStaging(int* index);
  // Waits until `s`'s pinned buffer is free, writes the tick into it padded to `padded` events and, to be read on the
  // device, queues its copy on copy_stream_ behind the end of the tick last staged in `s`; stream_ waits for it.
  absl::Status StageTick(Staging& s, const StreamTick& tick, int padded, StagedRead read);
  // After the tick that reads `s` is queued on stream_: marks the buffer it reads free once that tick is done.
  absl::Status ReleaseStaging(Staging& s, StagedRead read);
  // A staged tick of `padded` events as the kernels read it.
  kernels::StreamTickInput StagedInput(const Staging& s, int padded, bool log, StagedRead read) const;
  // The device work of one tick: the step kernel. (For a staged tick the caller releases the staging buffer
  // afterwards, outside any graph capture.)
  absl::Status EnqueueTick(const kernels::StreamTickInput& input, StreamLaunchShape shape);
  absl::Status StepEagerly(const StreamTick& tick, StreamLaunchShape shape);
  // A staged tick of its own size, its step kernel enqueued eagerly with `shape` (StepEagerly, AdvanceSlot).
  absl::Status EnqueueStagedTick(const StreamTick& tick, bool log, StreamLaunchShape shape);
  // Step's work, before NoteTickQueued.
  absl::Status StepQueued(const StreamTick& tick);
  // Where the tick Step is about to launch is one to time (tick_timing_due_), records the event that times it on
  // stream_: kept in tick_started_ until NoteTickQueued, or returned to the pool where the tick fails.
  absl::Status RecordTickStartIfDue();
  // Remembers how to tell when the tick Step just queued has finished.
  absl::Status NoteTickQueued();
  // The tick events' pool of timing events, or of events without timing (lighter on the stream), to take from or give
  // back to; SpareTickEvent takes one, or makes a new one.
  std::vector<cudaEvent_t>& TickEventPool(bool timing) { return timing ? spare_timing_events_ : spare_tick_events_; }
  absl::StatusOr<cudaEvent_t> SpareTickEvent(bool timing);
  // Forgets the queued ticks known finished, oldest first (all of them when `all_finished`), keeping the device time
  // of the timed ones in tick_seconds_.
  absl::Status ForgetFinishedTicks(bool all_finished);
  // Where the stopped runs of the resident step not read yet have left (asked without waiting), keeps the device times
  // of their stamped events that the ring still holds (ResidentStampsToRead) in resident_seconds_.
  absl::Status ReadStoppedRuns();
  // Keeps the device times of the running stamped run's events answered since the last read, but its latest, where no
  // stopped run waits to be read.
  void ReadRunningStamps();
  // Keeps the device times of the stamped events [first, end) that the ring still holds in resident_seconds_, up to
  // kTickTimesKept; returns the first event not taken: `end`, the one where that bound was reached, or (`running`, a
  // run still going) the first whose stamp is not whole yet. A stopped run's stamps are whole: one that is not is no
  // event's of the run (a stop's slot, one rewritten) and is skipped.
  uint32_t KeepResidentTimes(uint32_t first, uint32_t end, bool running);
  // The resident step's side of the host: a lone event posted (launching the cluster first if none runs), the stop
  // posted (a no-op if none runs), and the waits on the ring's answers.
  absl::Status PostResident(const StreamTick& tick);
  absl::Status WaitResidentAnswered(uint32_t count);
  absl::Status WaitForRingEntry();
  // Captures and instantiates `input`'s tick into `graph`, which is left empty where that fails.
  absl::Status Capture(const kernels::StreamTickInput& input, StreamLaunchShape shape, TickGraph& graph);
  absl::Status CaptureInto(const kernels::StreamTickInput& input, StreamLaunchShape shape, TickGraph& graph);
  static void Destroy(TickGraph& graph);

  const ParamLayout& layout_;
  const int slots_;
  const int64_t log_entries_;
  size_t max_shared_bytes_ = 0;
  int sm_count_ = 0;
  size_t l2_bytes_ = 0;
  // Per cluster shape: how it fits the device, and the device time of a tick of one group (TimeGroups; 0 where
  // unsupported).
  PerClusterShape<kernels::StreamShapeFit> fits_{};
  PerClusterShape<float> group_us_{};
  // The shape TimeBuckets chose for each bucket it covers (below kStreamWideFrom, and above it while
  // OneWaveHoldsWeights): the fastest measured, or the only candidate.
  std::map<int, StreamLaunchShape> bucket_shapes_;
  std::vector<ShapeTiming> start_timings_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;  // staged ticks' copies to the device, at stream_'s priority
  cudaEvent_t published_ready_ = nullptr;   // the source's parameters are final
  cudaEvent_t published_copied_ = nullptr;  // the copy has read them: the source may overwrite them
  CudaArena device_{MemoryKind::kDevice}, pinned_{MemoryKind::kPinnedHost};
  float* published_ = nullptr;  // the parameter set as published, which the pack is built from
  float* pack_ = nullptr;
  bool fail_next_pack_ = false;
  kernels::StreamSlots state_{};
  kernels::StreamWideScratch wide_{};
  bool wide_fits_ = false;
  kernels::StreamWeights weights_{};
  std::array<Staging, 2> staging_{};
  int next_staging_ = 0;
  bool use_graphs_ = true;
  std::optional<StagedRead> forced_read_;
  // Staged ticks: per StagedRead, per staging buffer, by bucket.
  std::array<std::array<std::map<int, TickGraph>, 2>, 2> graphs_;
  std::map<int, TickGraph> inline_graphs_;          // inline ticks, by bucket
  std::unique_ptr<bool[]> slot_seen_;
  std::vector<int64_t> first_nonfinite_;  // CheckTicks' copy of state_.first_nonfinite
  int* seed_not_finite_ = nullptr;        // mapped: the seeded state's check (kernels::CheckStreamSlotFinite)
  // The Step(tick) calls not yet known finished, oldest first: a lone event posted to the resident step finishes with
  // the answer count `answered`, any other tick with its event `finished`, and a timed tick started with `started`
  // (reused from spare_tick_events_, or spare_timing_events_ for both events of a timed tick).
  struct QueuedTick {
    std::optional<uint32_t> answered;
    cudaEvent_t finished = nullptr;
    cudaEvent_t started = nullptr;
  };
  std::deque<QueuedTick> unfinished_ticks_;
  static constexpr size_t kTicksRemembered = 64;  // past this many, Step forgets the finished ones itself
  std::vector<cudaEvent_t> spare_tick_events_, spare_timing_events_;
  int time_ticks_every_ = kTimedTickEvery;
  uint64_t launched_since_set_ = 0;     // Step's ticks past the resident step since set_time_ticks
  bool tick_timing_due_ = false;        // the tick Step is launching is one to time
  cudaEvent_t tick_started_ = nullptr;  // RecordTickStartIfDue's, until NoteTickQueued
  // The device times of the timed ticks found finished, and of the resident step's stamped lone events read, since
  // CheckTicks last took them, up to kTickTimesKept each.
  std::vector<double> tick_seconds_, resident_seconds_;
  // The resident step's ring (pinned, read by the device over the bus) and answer counter; events are numbered over
  // the ring across launches (StreamResidentQueue), `posted` counting the stops too.
  struct Resident {
    kernels::StreamResidentEntry* ring = nullptr;
    uint32_t* done = nullptr;
    uint32_t posted = 0;
    bool running = false;         // launched, and no stop posted since
    uint32_t launch_first = 0;    // the first event of the latest launch
    uint64_t launches = 0;
    bool since_yield = false;     // launched since the last YieldTo
    cudaEvent_t left = nullptr;   // recorded on stream_ behind a stopped cluster, for YieldTo
    CudaAllocation stamp_memory;  // the stamps' ring (pinned, written by the device), `stamp_slots` stamps
    uint32_t stamp_slots = 0;
    uint32_t run_first = 0;     // the first event of the latest launch that ReadRunningStamps has not read
    bool run_stamped = false;   // whose kernel is the stamped one
    // The events [first, end) of the stopped stamped runs ReadStoppedRuns has not read (the first's first unread event
    // to the last's stop): each left before the latest stop's `left`, and a stop or an unstamped run's event between
    // them is no stamp's event.
    std::optional<std::pair<uint32_t, uint32_t>> unread_runs;
  };
  // A power of two (StreamResidentQueue). 64 entries (24 KB): a lone event's round trip on the H200 took 10.9 µs
  // against 12.4 with 1,024 (the host's stores into a larger ring reach the device later); back to back the same.
  static constexpr int kResidentRing = 64;
  Resident resident_;
  uint32_t resident_launch_events_ = kResidentLaunchEvents;
  bool resident_fits_ = false;
  bool use_resident_ = true;
};

}  // namespace perception
