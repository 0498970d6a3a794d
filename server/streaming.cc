// The Stream call's reactor.
#include "server/streaming.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "server/proto_convert.h"
#include "server/raw_messages.h"

namespace perception::server {

template <typename Change>
void StreamReactor::Update(Change change) {
  std::optional<grpc::Status> finish;
  grpc::Alarm* cancel = nullptr;
  {
    absl::MutexLock lock(&mu_);
    change();
    finish = AdvanceLocked();
    if (cancel_alarm_ && alarm_pending_ && !cancelling_) {
      cancel = alarm_.get();
      cancelling_ = true;
    }
    cancel_alarm_ = false;
  }
  // Outside the lock: the alarm's callback takes it. The alarm may fire meanwhile; its callback then cannot finish
  // the call (which lets gRPC delete the reactor, and the alarm with it) while `cancelling_` holds it open.
  if (cancel != nullptr) {
    cancel->Cancel();
    if (options_.pause_after_alarm_cancel > absl::ZeroDuration()) absl::SleepFor(options_.pause_after_alarm_cancel);
    absl::MutexLock lock(&mu_);
    cancelling_ = false;
    finish = AdvanceLocked();  // the call ends here if the alarm's callback ran meanwhile, or at that callback
    cancel_alarm_ = false;
  }
  if (finish.has_value()) Finish(*std::move(finish));
}

StreamReactor::StreamReactor(StreamBatcher& batcher, const StreamOptions& options, LiveCalls& registry,
                             absl::AnyInvocable<void(const absl::Status&)> on_finish)
    : batcher_(batcher), options_(options), registry_(registry), on_finish_(std::move(on_finish)) {
  registry_.Join(this, [this] { Update([] {}); });
}

void StreamReactor::Drain(const absl::Status& status) {
  Update([&] {
    if (input_done_) return;  // a call the client half-closed still ends OK once its events are processed
    error_ = status;
    outranked_ = "the call stopped reading its requests when the daemon began to drain";
    input_done_ = true;
  });
}

void StreamReactor::OnReadDone(bool ok) {
  // Parsed outside the lock (a request may take milliseconds), which the device worker takes to deliver processed
  // events; the buffer stays in `incoming_` meanwhile, so that no other read starts before this one is taken.
  v1::StreamRequest request;
  absl::Status parsed;
  if (ok) parsed = ParseRequest(*ReadInProgress(), request);
  Update([&] {
    incoming_.reset();
    if (!ok) {
      input_done_ = true;
      return;
    }
    if (broken_) return;
    if (!error_.ok()) {  // (a read already under way when the call's failure or the drain came)
      if (parsed.ok()) NoteNotTakenLocked(request);
      return;
    }
    if (!parsed.ok()) {
      error_ = parsed;
      outranked_ = "a request of this call could not be parsed";
      input_done_ = true;
      return;
    }
    // Under this reactor's lock: the worker's OnProcessed for these events waits until the counts are updated.
    const StreamBatcher::Submitted submitted = batcher_.Submit(request, this);
    unprocessed_ += submitted.accepted;
    if (request.ack() && submitted.accepted > 0) AwaitLocked(request, submitted.accepted);
    if (!submitted.status.ok()) {
      error_ = submitted.status;
      outranked_ = "a request of this call was refused";
      input_done_ = true;
    }
  });
}

grpc::ByteBuffer* StreamReactor::ReadInProgress() {
  absl::MutexLock lock(&mu_);
  return incoming_.get();
}

void StreamReactor::NoteNotTakenLocked(const v1::StreamRequest& request) {
  batcher_.NoteNotTaken(request.events_size());
  for (const v1::StreamEvent& event : request.events()) {
    ++not_taken_events_;
    if (!not_taken_.insert(event.instrument()).second || not_taken_named_.size() >= kInstrumentsNamed) continue;
    not_taken_named_.push_back(absl::StrCat("'", ShownInstrumentId(event.instrument()), "' from seq ", event.seq()));
  }
}

void StreamReactor::AwaitLocked(const v1::StreamRequest& request, int64_t accepted) {
  const uint64_t id = ++ack_requests_;
  absl::flat_hash_map<absl::string_view, uint64_t> last_seq;  // of each instrument in the accepted events
  for (int i = 0; i < accepted; ++i) last_seq[request.events(i).instrument()] = request.events(i).seq();
  for (const auto& [instrument, seq] : last_seq) awaited_[instrument].push_back({seq, id});
  instruments_awaited_[id] = static_cast<int>(last_seq.size());
}

void StreamReactor::OnProcessed(std::span<const Processed> events, int64_t weights_version) {
  Update([&] {
    for (const Processed& event : events) {
      const absl::string_view instrument(event.instrument.data(), event.instrument.size());
      unacked_[instrument] = event.seq;
      const auto awaited = awaited_.find(instrument);
      if (awaited == awaited_.end() || awaited->second.front().seq != event.seq) continue;
      const auto request = instruments_awaited_.find(awaited->second.front().request);
      if (--request->second == 0) {
        instruments_awaited_.erase(request);
        requested_ack_due_ = true;
      }
      awaited->second.pop_front();
      if (awaited->second.empty()) awaited_.erase(awaited);
    }
    const auto n = static_cast<int64_t>(events.size());
    unacked_events_ += n;
    processed_ += n;
    unprocessed_ -= n;
    weights_version_ = weights_version;
  });
}

void StreamReactor::OnFailed(const absl::Status& status, int64_t count) {
  Update([&] {
    unprocessed_ -= count;
    // The failure, which names where each instrument resumes, outranks a refusal of one of the call's requests (one
    // read while the failure was on its way, refused because the failed tick had stopped its instrument, or before)
    // and a drain that reached the call first (a lost device begins one as it fails the ticks).
    // A later failure (another tick's, another stop) is named after the first: its instruments stopped too. A lost
    // device's code (UNAVAILABLE: retry once the daemon is back) outranks the others.
    if (error_.ok()) {
      error_ = status;
    } else if (outranked_ != nullptr) {
      besides_ = absl::StrCat(". Besides, ", outranked_, ": ", error_.message());
      error_ = status;
      outranked_ = nullptr;
    } else {
      const absl::StatusCode code = absl::IsUnavailable(status) ? status.code() : error_.code();
      error_ = absl::Status(code, absl::StrCat(error_.message(), ". Then ", status.message()));
    }
    input_done_ = true;
  });
}

void StreamReactor::OnAlarm(bool ok) {
  Update([&] {
    alarm_pending_ = false;
    alarm_fired_ = ok;
  });
}

void StreamReactor::OnWriteDone(bool ok) {
  Update([&] {
    writing_ = false;
    broken_ = broken_ || !ok;
  });
}

void StreamReactor::OnCancel() {
  Update([&] { broken_ = true; });
}

void StreamReactor::OnDone() {
  // gRPC runs OnDone once every other reaction has returned, an order its own (uninstrumented) atomics keep; taking
  // the lock the reactions write under shows ThreadSanitizer that order too, before the reactor is freed.
  absl::Status outcome;
  {
    absl::MutexLock lock(&mu_);
    outcome = outcome_;
  }
  on_finish_(outcome);
  registry_.Remove(this);
  batcher_.ForgetSink(this);  // (before the address can be another call's)
  delete this;
}

bool StreamReactor::AckDueLocked() {
  if (unacked_.empty()) return false;
  const bool input_over = input_done_ && unprocessed_ == 0;
  return requested_ack_due_ || alarm_fired_ || input_over || unacked_events_ >= options_.ack_every_events;
}

std::optional<grpc::Status> StreamReactor::AdvanceLocked() {
  if (finished_) return std::nullopt;
  if (!broken_) {
    // StartWrite, StartRead and Alarm::Set are safe under the lock: gRPC runs no reaction inside them.
    if (!writing_ && AckDueLocked()) {
      v1::StreamResponse response;
      for (const auto& [instrument, seq] : unacked_) {
        v1::InstrumentAck& ack = *response.add_acks();
        ack.set_instrument(instrument);
        ack.set_last_seq(seq);
      }
      response.set_processed_events(processed_);
      response.set_weights_version(weights_version_);
      SerializeResponse(response, outgoing_);
      unacked_.clear();
      unacked_events_ = 0;
      alarm_fired_ = false;
      requested_ack_due_ = false;
      writing_ = true;
      StartWrite(&outgoing_);
    }
    const bool may_read = incoming_ == nullptr && !input_done_ && unprocessed_ < options_.max_unprocessed_per_call;
    // A call none of whose events waits reads one request whatever the bound: it gets no OnProcessed to look again
    // on, and one that waited for room would lose every race for it to the calls that do.
    held_ = may_read && unprocessed_ > 0 && !batcher_.RoomToRead(held_);
    if (may_read && !held_) {
      incoming_ = std::make_unique<grpc::ByteBuffer>();
      StartRead(incoming_.get());
    }
    if (!unacked_.empty() && !alarm_pending_) {
      alarm_fired_ = false;
      retired_alarm_ = std::move(alarm_);  // its callback has run; the one before it goes now
      alarm_ = std::make_unique<grpc::Alarm>();
      alarm_pending_ = true;
      alarm_->Set(std::chrono::system_clock::now() + std::chrono::milliseconds(options_.ack_every_ms),
                  [this](bool ok) { OnAlarm(ok); });
    }
  }
  // The batcher refers to this reactor until every accepted event is processed, the response must outlive its
  // write and the alarm its callback: finish only when all are done. A read still in progress is fine: it
  // completes (not ok) once the call is finished.
  const bool ending = broken_ || (input_done_ && unacked_.empty());
  if (!ending || unprocessed_ > 0 || writing_ || cancelling_) return std::nullopt;
  if (alarm_pending_) {
    cancel_alarm_ = true;
    return std::nullopt;
  }
  finished_ = true;
  // Before the status leaves: a client that has it may reset or seed the instruments at once.
  batcher_.StopFeeding(this);
  absl::Status status =
      broken_ ? absl::CancelledError("the client cancelled the stream or stopped reading its acknowledgements")
              : error_;
  if (!broken_ && !status.ok()) {
    std::string message(status.message());
    if (not_taken_events_ > 0) {
      std::string named = absl::StrJoin(not_taken_named_, ", ");
      if (const size_t more = not_taken_.size() - not_taken_named_.size(); more > 0) {
        absl::StrAppend(&named, " and ", more, " more instruments");
      }
      absl::StrAppend(&message, ". ", not_taken_events_, " events of this call read after that were not taken: ",
                      named);
    }
    status = absl::Status(status.code(), absl::StrCat(message, besides_));
  }
  outcome_ = status;
  return ToGrpcStatus(status);
}

}  // namespace perception::server
