// The stream batcher: live events of many instruments coalesced into one batched device step per tick.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/stream_table.h"
#include "perception/v1/instrument_id.h"
#include "perception/v1/perception.pb.h"
#include "server/device_worker.h"
#include "server/metrics.h"
#include "server/model_host.h"

namespace perception::server {

using v1::CheckInstrumentId;
using v1::kMaxInstrumentIdBytes;
// How many instruments a failure's message names; the others are counted.
inline constexpr size_t kInstrumentsNamed = 4;
// How many streams ListStreams lists under one hold of the batcher's lock: events that come meanwhile wait for that
// many, not for the whole list (sorting 200,000 streams under it, as the whole list was, took 77 ms on its own).
inline constexpr size_t kListChunk = 256;
// An instrument id as a message names it: ids too long to be accepted are cut, so that the message stays short.
std::string ShownInstrumentId(absl::string_view instrument);

// Streaming's flags.
struct StreamOptions {
  StreamingConfig device;        // slots, log capacity, publishing (the model host's part)
  int ack_every_events = 1000;   // a Stream acknowledges after this many processed events...
  int ack_every_ms = 50;         // ...or this long after the first unacknowledged one
  // A SeedStream steps its window in device jobs of about this long each, with other instruments' ticks between them.
  absl::Duration seed_job_time = absl::Microseconds(250);
  int64_t max_read_count = 65536;      // most convictions per ReadConvictions page...
  // ...and at most this many bytes of entries (ReadEntryBytes): a page stays within the 4 MiB that gRPC's clients
  // receive unless raised (grpcio's, C++'s) at any --stream_read_max and horizon count; past INT_MAX entries a page
  // could not be built at all.
  int64_t max_read_bytes = 4'000'000;
  int64_t max_unprocessed_per_call = 16384;  // a Stream call reads no further request while it has this many
                                             // accepted events not yet processed (back-pressure on the client)
  int64_t max_pending_events = 1 << 20;  // no Stream call reads a further request while the daemon holds this many
                                         // accepted events not yet processed, over all calls (bounds its memory)
  // The device worker releases a running resident step (ModelHost::ReleaseIdleDevice) after this long without work.
  absl::Duration resident_idle_period = absl::Seconds(1);
  // Tests only: the tick with this number (the first is 1) loses the device (Backend::InjectDeviceLoss) instead of
  // running; 0, never.
  int64_t inject_device_loss_at_tick = 0;
  // Tests only: a Stream call sleeps this long after cancelling its ack alarm, before it takes its lock again, so that
  // the alarm's callback runs within the Cancel's window (which must not end the call) whenever the alarm was due.
  absl::Duration pause_after_alarm_cancel = absl::ZeroDuration();
  // Tests only: runs on the device worker after a failed tick has stopped its instruments, before their Stream calls
  // hear of it (StreamSink::OnFailed), so that a test can send a call's next request in between.
  std::function<void()> before_failure_notices;
};

// What one Stream call hears back about the events it submitted; called on the device worker's thread, outside
// the batcher's lock. After the call that delivers its last outstanding event, the batcher no longer touches it.
class StreamSink {
 public:
  struct Processed {
    std::string_view instrument;  // valid during the call
    uint64_t seq;
  };
  virtual void OnProcessed(std::span<const Processed> events, int64_t weights_version) = 0;
  // `count` of the sink's events were dropped unprocessed because the device failed a tick: `status` says why, and
  // which of the sink's instruments stopped at which sequence number.
  virtual void OnFailed(const absl::Status& status, int64_t count) = 0;

 protected:
  ~StreamSink() = default;
};

// Thread-safe. gRPC handlers validate and queue events here (Submit), featurizing LOBSTER rows on arrival with the
// instrument's featurizer so that a bad row is refused at once with nothing processed; the device worker runs the
// ticks. Each tick takes the oldest pending event of EVERY instrument that has one (so instruments advance at the
// same pace however busy the others are, and each instrument's events keep their order), runs one ForwardStepInto
// under the published weights, and appends their log entries once it succeeded. A tick the device fails stops its
// instruments: their events from the failed one on are dropped (the sinks hear which), nothing of them enters the
// logs or the sequence numbers, and each takes no event until ResetStream, SeedStream or CloseStream; then it takes
// them again from the first dropped. An instrument never skips an event. At most one tick job waits in the worker's
// streaming queue; it queues the next while events remain. Reads, seeds, resets and closes are streaming-priority
// jobs too, so they see the logs between ticks.
class StreamBatcher {
 public:
  StreamBatcher(DeviceWorker& worker, const StreamOptions& options, ServerMetrics& metrics);

  // Validates and queues `request`'s events in order for `sink`. Returns how many were accepted; a refusal stops
  // at the refused event (its index, instrument and sequence number in the message), the ones before it stay
  // accepted. Every accepted event reaches the sink through OnProcessed or OnFailed.
  struct Submitted {
    int64_t accepted = 0;
    absl::Status status;
  };
  Submitted Submit(const v1::StreamRequest& request, StreamSink* sink);
  // `sink`'s call sends no further events (it finishes): its instruments are no longer fed by it (StopFeeding).
  void StopFeeding(const StreamSink* sink) ABSL_LOCKS_EXCLUDED(mu_);
  // `sink`'s call has ended (its reactor is going): Submit no longer holds it among the failed calls, and it feeds
  // no instrument.
  void ForgetSink(const StreamSink* sink) ABSL_LOCKS_EXCLUDED(mu_);

  // Each runs on the device worker; with a `caller` whose client stopped waiting before the worker took it up, it
  // does nothing and returns CallerGone's status (the client was told the call failed).
  absl::StatusOr<v1::SeedStreamResponse> Seed(const v1::SeedStreamRequest& request,
                                              const grpc::ServerContextBase* caller = nullptr);
  absl::StatusOr<v1::ReadConvictionsResponse> Read(const v1::ReadConvictionsRequest& request,
                                                   const grpc::ServerContextBase* caller = nullptr);
  // `while_fed`: even while open Stream calls feed it (else refused then: CheckNotFedLocked).
  absl::Status Reset(const std::string& instrument, bool while_fed, const grpc::ServerContextBase* caller = nullptr);
  // The events it processed.
  absl::StatusOr<uint64_t> Close(const std::string& instrument, const grpc::ServerContextBase* caller = nullptr);
  // A page of the live streams (ListStreams), taken kListChunk at a time under the lock.
  v1::ListStreamsResponse List(const v1::ListStreamsRequest& request) const;
  // Whether a Stream call with events waiting may read another request: fewer than options.max_pending_events
  // accepted events wait for the device. A call held back looks again when its events are processed (every tick
  // takes one of each instrument); one with none waiting reads a request regardless, so the daemon holds at most one
  // request of each live call more than the limit. A call that was not `held` before and is now counts in the
  // metrics.
  bool RoomToRead(bool held);
  // Counts `events` a Stream call read after its failure, its refused event or the drain, and took no further, as
  // refused (call_ended).
  void NoteNotTaken(int events);
  // Everything but the weights version (the model host's).
  void FillStatus(v1::StreamingStatus& status) const;
  // What clients have not read back yet: accepted events still to process (each will log a conviction) and logged
  // convictions past the end of every read of their stream (StreamTable::Unread). A draining daemon waits for both.
  struct Unread {
    int64_t events = 0;
    uint64_t convictions = 0;
    int streams = 0;  // streams with unread convictions
    bool none() const { return events == 0 && convictions == 0; }
  };
  Unread NotReadBack() const ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon exits: every event still queued is dropped unprocessed, its instrument stopped there, and each call
  // whose events they were told which instruments resume from which seq (UNAVAILABLE). A Stream call finishes only
  // once its events are processed, and the listener's close waits for every call: events nobody will read the
  // convictions of held the exit for as long as they took. Runs on the worker after the ticks launched so far
  // (their sinks hear of them first); returns how many events it dropped.
  absl::StatusOr<int64_t> DropQueuedAtExit();

  // Runs `change` (on the worker thread: InitModel, LoadCheckpoint, SetOptimizer), which replaces the backend and
  // with it every state slot and log, only while no stream is live: FAILED_PRECONDITION otherwise. New streams are
  // refused (UNAVAILABLE) while it runs; afterwards the batcher takes the new model's normalizer (FollowModel).
  template <typename Change>
  auto ChangeModel(ModelHost& host, Change change) -> decltype(change());
  // Takes the model's normalizer (and with it its feature count) from `host` again: after ChangeModel's change and
  // SetNormalizer, which keeps the streams. Their queued events were checked against the normalizer they came under,
  // and the ticks standardize them with the new one: an instrument with one that standardizes beyond the bound now
  // stops at its first event not processed, as one whose output overflowed does, its queued events dropped.
  void FollowModel(ModelHost& host) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pending {
    float dt;
    uint64_t seq;
    StreamSink* sink;
    std::chrono::steady_clock::time_point received;
  };
  struct SlotQueue {
    std::string instrument;
    std::deque<Pending> events;
    std::deque<float> x;                 // [events, F] features of the pending events
    bool ready = false;                  // in ready_
    // Exchange time of the first event since the stream opened, was reset or seeded: LOBSTER times count from it.
    std::optional<int64_t> base_time_ns;
    absl::Status stopped;                 // FAILED_PRECONDITION once a failed tick stopped the stream, until reset
    bool seeding = false;                 // a SeedStream runs on it: its events are refused meanwhile
    // No event has stepped its state since it was zeroed (opened, reset): the next one accepted is its first, whose
    // Δt is 0 whatever it carries (MODEL.md §1), as a seed window's first is.
    bool zero_state = true;
    // Whether the stream's events are LOBSTER rows (else feature vectors), from its first event or seed until a
    // reset: the featurizer's previous mid and time would skip events of the other kind.
    std::optional<bool> lobster;
    // The open Stream calls that sent it events. ResetStream and a SeedStream of the live stream refuse it meanwhile:
    // either replaced the state under the feed's next events without a word to it (its convictions then differed
    // from a continuous run's, the run ending "all acknowledged").
    std::vector<const StreamSink*> feeders;
  };
  // A SeedStream from the job that claims its slot to the one that gives it back (stream_batcher.cc).
  struct SeedProgress;
  struct Notice {
    StreamSink* sink;
    int slot;
    uint64_t seq;
    std::chrono::steady_clock::time_point received;
  };
  // What a sink hears of its events that were not processed (OnFailed), told outside the lock.
  struct Failure {
    StreamSink* sink;
    absl::Status status;
    int64_t count;
  };
  // A tick the device may still be running: its events' sinks hear of them once it has finished.
  struct LaunchedTick {
    int64_t weights_version;
    std::vector<Notice> notices;
  };

  // The instrument's slot for a new event, opening the stream on first use.
  absl::StatusOr<int> OpenLocked(const std::string& instrument) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the slot and forgets its stream; the caller has zeroed its device state, or nothing ran on it.
  absl::Status CloseSlotLocked(int slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Validates one event and queues it on its instrument's slot, which it opens on first use (and frees again when
  // it refuses the event that opened it). `reason` names the metric label of a refusal.
  absl::Status AcceptLocked(const v1::StreamEvent& event, StreamSink* sink, std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AcceptLocked's checks that need the instrument's stream, then the queueing.
  absl::Status QueueLocked(const v1::StreamEvent& event, StreamSink* sink, int slot, std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The instrument's slot for a reset, close or seed: refused while it has events queued or a seed runs on it.
  absl::StatusOr<int> IdleSlotLocked(const std::string& instrument) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The instrument's StreamInfo, appended to `response`.
  void AddStreamInfoLocked(const StreamTable::InstrumentInfo& info, v1::ListStreamsResponse& response) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a SeedStream job leaves to do.
  enum class SeedNext { kDone, kAnotherPart, kStartAfterPublication };
  // SeedStream's jobs on the worker thread. The first claims the slot (`seeding`), featurizes the window, zeroes the
  // slot and steps the first part, unless a training publication waits for other seeds' holds (it is then tried
  // again); each next one steps another part; the last part (FinishSeed) or a failure (FailSeed) gives the slot back.
  // While one seed's parts remain, training's publications wait (ModelHost::HoldPublication): the whole window runs
  // under one weights version.
  absl::StatusOr<SeedNext> StartSeed(ModelHost& host, SeedProgress& seed);
  absl::StatusOr<SeedNext> ContinueSeed(ModelHost& host, SeedProgress& seed);
  absl::StatusOr<SeedNext> StepSeedPart(ModelHost& host, SeedProgress& seed, Backend& backend);
  void FinishSeed(ModelHost& host, SeedProgress& seed);
  // Gives the slot back after `failure` (returned): a stream the seed opened closes, one that its failed seed may have
  // written stops.
  absl::Status FailSeed(ModelHost& host, SeedProgress& seed, absl::Status failure);
  void ScheduleTickLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One tick on the worker thread.
  void Tick(ModelHost& host);
  // A stopped instrument's queued events leave its queue for dropped_ (their sinks hear of them afterwards); the
  // caller takes it out of ready_ and rewinds its sequence numbers.
  void DropQueuedLocked(int slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a failed tick, or a device that could not say whether the launched ticks finished: stops the instruments of
  // every launched tick not known finished (launched_) and of the failed one (notices_), drops their queued events and
  // the log entries of those ticks, and tells every sink concerned. Where streaming could not start (`device_configured`
  // false) the instruments close instead: the device never held them.
  void StopFailedStreams(const absl::Status& cause, bool device_configured);
  // Asks the device which launched ticks have finished (Backend::CheckTicks, `wait_for_ticks` passed on), stops the
  // instruments whose outputs came out not finite (StopNonFiniteStreams), then tells the finished ticks' sinks that
  // their events were processed. Returns what CheckTicks returned where it failed (launched_ is left as it was).
  absl::Status FinishTicks(Backend& backend, bool wait_for_ticks);
  // FinishTicks; a device that cannot tell stops the launched ticks' instruments (StopFailedStreams).
  void FinishTicksOrStop(Backend& backend, bool wait_for_ticks);
  // FinishTicks after every tick so far, where streaming runs, before a read, reset, seed or close (none of which
  // may miss the entries to drop, and a reset or a seed forgets which of its slot's were not finite).
  void FinishTicksBefore(ModelHost& host);
  // Whether events wait for a tick.
  bool TickToFollow() const ABSL_LOCKS_EXCLUDED(mu_);
  // Each instrument of `found` loses its log entries from the first event that was not finite on, with its queued
  // events and those of launched_ and of the tick being launched (notices_), and takes no events until ResetStream,
  // SeedStream or CloseStream, then from that event's sequence number; the sinks of the events dropped hear why.
  void StopNonFiniteStreams(std::span<const NonFiniteOutput> found);
  // FollowModel's stop of each instrument with a queued event beyond the bound under normalizer_: what the sinks of
  // the events dropped are to hear.
  std::vector<Failure> StopQueuedBeyondTheBoundLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each instrument stopped with its events in dropped_: one failure for each sink, naming why they stopped.
  std::vector<Failure> StoppedFailuresLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads slot names without the lock: only the worker thread, which calls it, closes streams.
  void Notify(std::span<Notice> notices, int64_t weights_version) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // pending_ changed by `delta` (negative: processed or dropped); the metric follows it.
  void AddPendingLocked(int64_t delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  DeviceWorker& worker_;
  const StreamOptions options_;
  ServerMetrics& metrics_;

  mutable absl::Mutex mu_;
  StreamTable table_ ABSL_GUARDED_BY(mu_);
  std::vector<SlotQueue> queues_ ABSL_GUARDED_BY(mu_);  // by slot
  std::vector<int> ready_ ABSL_GUARDED_BY(mu_);         // slots with pending events
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool tick_queued_ ABSL_GUARDED_BY(mu_) = false;
  bool changing_model_ ABSL_GUARDED_BY(mu_) = false;
  // The model's, empty without one: every event's features must standardize in range.
  Normalizer normalizer_ ABSL_GUARDED_BY(mu_);
  int NFeaturesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return static_cast<int>(normalizer_.mean.size()); }
  uint64_t overwritten_reported_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<float> accept_x_ ABSL_GUARDED_BY(mu_);  // one event's features, reused
  // The calls whose events a start of streaming that failed dropped, closing their instruments, until each call
  // ends: Submit refuses what they send after it. The failure reaches a call only after the lock is let go, and a
  // request it read meanwhile reopened a closed instrument at that request's first seq, from a zero state: the events
  // before it were lost, and the resend the failure's status invites was refused as repeated.
  absl::flat_hash_set<const StreamSink*> failed_sinks_ ABSL_GUARDED_BY(mu_);
  // The slots each open Stream call fed (SlotQueue::feeders), until it stops feeding.
  absl::flat_hash_map<const StreamSink*, std::vector<int>> fed_ ABSL_GUARDED_BY(mu_);
  // The refusal to `verb` (reset, seed) an instrument that open Stream calls feed; OK where none does (or it has no
  // stream). Checked before IdleSlotLocked: a feed's events are queued or not by when the call came.
  absl::Status CheckNotFedLocked(const std::string& instrument, const char* verb) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The tick's buffers, reused (worker thread only).
  std::vector<float> tick_x_, tick_dt_;
  std::vector<int32_t> tick_slots_;
  std::vector<int64_t> tick_log_indices_;
  std::vector<Notice> notices_, dropped_;
  // Ticks launched and not yet known finished, oldest first, and vectors of notices to reuse (worker thread only).
  std::deque<LaunchedTick> launched_;
  std::vector<std::vector<Notice>> spare_notices_;
  std::vector<StreamSink::Processed> processed_;
  int64_t ticks_started_ = 0;
};

template <typename Change>
auto StreamBatcher::ChangeModel(ModelHost& host, Change change) -> decltype(change()) {
  {
    absl::MutexLock lock(&mu_);
    if (table_.active() > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          table_.active(), " live stream(s) hold state on the current model; close them (CloseStream) first"));
    }
    changing_model_ = true;
  }
  auto result = change();
  FollowModel(host);
  absl::MutexLock lock(&mu_);
  changing_model_ = false;
  return result;
}

}  // namespace perception::server
