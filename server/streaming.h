// The Stream call: a callback reactor that feeds one client's events to the stream batcher and acknowledges them.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/alarm.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "perception/v1/perception.pb.h"
#include "server/live_calls.h"
#include "server/stream_batcher.h"

namespace perception::server {

// One Stream call. Each request read is validated and queued on the batcher (its events featurized on arrival); no
// further request is read while options.max_unprocessed_per_call of the call's events, or options.max_pending_events of
// all calls' events (unless none of its own), wait for the device, so a fast client is held back by gRPC's flow control
// rather than buffered. Acknowledgements carry, per instrument, the last processed sequence number: one goes out after
// options.ack_every_events processed events, after options.ack_every_ms from the first unacknowledged one (a gRPC
// alarm), when a request with `ack` is wholly processed, and at the end. The first refusal (a request that cannot be
// parsed included: requests are read as bytes, raw_messages.h), or the client's half-close, ends the input; the call
// finishes once every accepted event is processed and acknowledged, with the refusal's status or OK. A drain ends the
// input as a refusal does (LiveCalls). A client that disconnects stops the acknowledgements, not the processing. The
// reactor deletes itself when gRPC is done.
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public StreamSink,
                            public DrainableCall {
 public:
  // `registry` holds the call while it lives; `on_finish` sees the status the call finished with, once gRPC is done
  // with it (OnDone: whether the client went away before that status reached it is known only then).
  StreamReactor(StreamBatcher& batcher, const StreamOptions& options, LiveCalls& registry,
                absl::AnyInvocable<void(const absl::Status&)> on_finish);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  void OnProcessed(std::span<const Processed> events, int64_t weights_version) override;
  void OnFailed(const absl::Status& status, int64_t count) override;
  // Ends the input with `status` (the daemon drains) unless it has ended already.
  void Drain(const absl::Status& status) override;

 private:
  void OnAlarm(bool ok);
  // The buffer of the read in progress (OnReadDone's, until it takes it).
  grpc::ByteBuffer* ReadInProgress();
  template <typename Change>
  void Update(Change change);
  // Starts the reads, writes and alarm the state allows; the status to finish with once the call has ended.
  std::optional<grpc::Status> AdvanceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AckDueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the events of a request read after the call's error (a failure, the drain) as not taken: the final status
  // names them, each instrument from its first such event.
  void NoteNotTakenLocked(const v1::StreamRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records what a request with `ack` waits for: the last of its first `accepted` events of each instrument.
  void AwaitLocked(const v1::StreamRequest& request, int64_t accepted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  StreamBatcher& batcher_;
  const StreamOptions& options_;
  LiveCalls& registry_;
  absl::AnyInvocable<void(const absl::Status&)> on_finish_;

  absl::Mutex mu_;
  std::unique_ptr<grpc::ByteBuffer> incoming_ ABSL_GUARDED_BY(mu_);  // the read in progress, if any
  bool input_done_ ABSL_GUARDED_BY(mu_) = false;  // the client half-closed, a request was refused, or a drain began
  absl::Status error_ ABSL_GUARDED_BY(mu_);  // why the call ends: a device failure, else a refusal or the drain
  // What error_ is where it is a refusal of one of the call's requests or the drain, which a failure (naming where
  // each instrument resumes) outranks and keeps as an aside; null otherwise.
  const char* outranked_ ABSL_GUARDED_BY(mu_) = nullptr;
  // What a failure outranked (". Besides, " the refusal or drain and its message), said last in the final status.
  std::string besides_ ABSL_GUARDED_BY(mu_);
  int64_t unprocessed_ ABSL_GUARDED_BY(mu_) = 0;  // accepted events not yet processed
  // Events read after error_ was set, neither processed nor refused one by one (NoteNotTakenLocked): how many, their
  // instruments, and the first kInstrumentsNamed instruments' first such events, named.
  int64_t not_taken_events_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<std::string> not_taken_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> not_taken_named_ ABSL_GUARDED_BY(mu_);
  bool held_ ABSL_GUARDED_BY(mu_) = false;        // no read started: the daemon's pending events are at their limit
  uint64_t processed_ ABSL_GUARDED_BY(mu_) = 0;
  // Requests with `ack` wait for their own events only (events of other instruments are processed in the same
  // ticks): per instrument, in order, the last sequence number each such request sent of it, and per request the
  // instruments it still waits for. An instrument's events are processed in order, so its next awaited event is the
  // front of its queue.
  struct AwaitedEvent {
    uint64_t seq;
    uint64_t request;
  };
  absl::flat_hash_map<std::string, std::deque<AwaitedEvent>> awaited_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, int> instruments_awaited_ ABSL_GUARDED_BY(mu_);  // request → instruments left
  uint64_t ack_requests_ ABSL_GUARDED_BY(mu_) = 0;      // requests with `ack` so far, numbering them
  bool requested_ack_due_ ABSL_GUARDED_BY(mu_) = false;  // a request with `ack` is wholly processed
  absl::flat_hash_map<std::string, uint64_t> unacked_ ABSL_GUARDED_BY(mu_);  // instrument → last processed seq
  int64_t unacked_events_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t weights_version_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer outgoing_ ABSL_GUARDED_BY(mu_);  // the write in progress
  std::unique_ptr<grpc::Alarm> alarm_ ABSL_GUARDED_BY(mu_), retired_alarm_ ABSL_GUARDED_BY(mu_);
  bool alarm_pending_ ABSL_GUARDED_BY(mu_) = false;  // set and its callback not yet run
  bool alarm_fired_ ABSL_GUARDED_BY(mu_) = false;    // the ack interval has passed
  bool cancel_alarm_ ABSL_GUARDED_BY(mu_) = false;   // the call is ending: cancel the pending alarm
  bool cancelling_ ABSL_GUARDED_BY(mu_) = false;     // a thread is in Alarm::Cancel: the call must not finish yet
  bool broken_ ABSL_GUARDED_BY(mu_) = false;         // cancelled, or the client stopped taking responses
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status outcome_ ABSL_GUARDED_BY(mu_);  // the status the call finished with
};

}  // namespace perception::server
