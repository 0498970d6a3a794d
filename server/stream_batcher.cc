// The stream batcher: receipt and validation of live events, the ticks, and the log reads, seeds, resets, closes.
#include "server/stream_batcher.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/config.h"
#include "engine/device_loss.h"
#include "engine/host_allocation.h"
#include "engine/status_macros.h"
#include "server/stopwatch.h"
#include "spdlog/spdlog.h"

namespace perception::server {

std::string ShownInstrumentId(absl::string_view instrument) {
  constexpr size_t kShownBytes = 32;
  // An id refused for its control characters is shown escaped: a newline in it would break the log line it is in.
  const auto shown = [](absl::string_view id) {
    return absl::c_any_of(id, [](char c) { return absl::ascii_iscntrl(static_cast<unsigned char>(c)); })
               ? absl::CHexEscape(id)
               : std::string(id);
  };
  if (instrument.size() <= kMaxInstrumentIdBytes) return shown(instrument);
  return absl::StrCat(shown(instrument.substr(0, kShownBytes)), "... (", instrument.size(), " bytes)");
}

namespace {

using Clock = std::chrono::steady_clock;

// "event 3 (instrument 'AAPL', seq 17): ": where a refused event sits in its request.
std::string Where(int index, const v1::StreamEvent& event) {
  return absl::StrCat("event ", index, " (instrument '", ShownInstrumentId(event.instrument()), "', seq ", event.seq(),
                      "): ");
}

absl::Status Prefixed(const absl::Status& status, const std::string& prefix) {
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

// The checks that need no stream state: the payload's shape and values against the model's feature count.
// `reason` names the metric label of a refusal.
absl::Status CheckPayload(const v1::StreamEvent& event, int n_features, std::string& reason) {
  reason = "features";
  switch (event.payload_case()) {
    case v1::StreamEvent::kFeatures: {
      const v1::FeatureEvent& f = event.features();
      if (f.features_size() != n_features) {
        return absl::InvalidArgumentError(
            absl::StrCat("has ", f.features_size(), " features but the model takes ", n_features));
      }
      for (int i = 0; i < f.features_size(); ++i) {
        if (!std::isfinite(f.features(i))) {
          return absl::InvalidArgumentError(
              absl::StrFormat("feature %d is %g; features must be finite", i, f.features(i)));
        }
      }
      if (!std::isfinite(f.dt()) || f.dt() < 0.f) {
        return absl::InvalidArgumentError(absl::StrFormat("dt is %g; dt must be finite and >= 0 (seconds)", f.dt()));
      }
      return absl::OkStatus();
    }
    case v1::StreamEvent::kLobster: {
      reason = "book";
      const v1::LobsterEvent& l = event.lobster();
      const int values = l.book_size();
      if (values == 0 || values % 4 != 0 || LobsterFeatureCount(values / 4) != n_features) {
        return absl::InvalidArgumentError(absl::StrCat(
            "book row has ", values, " values but the model's ", n_features,
            " features need 4 per level for (n_features - 8) / 4 levels"));
      }
      RETURN_IF_ERROR(ValidateBookRow(std::span<const int64_t>(l.book().data(), values)));
      return ValidateTypeAndDirection(l.type(), l.direction());
    }
    default:
      return absl::InvalidArgumentError("carries neither a LOBSTER row nor a feature vector");
  }
}

LobsterMessage MessageOf(const v1::LobsterEvent& l, int64_t time_ns) {
  return {.time = static_cast<double>(time_ns) * 1e-9, .type = l.type(), .order_id = l.order_id(), .size = l.size(),
          .price = l.price(), .direction = l.direction(), .time_ns = time_ns};
}

// Nanoseconds from the stream's first event; INVALID_ARGUMENT where the difference of the two int64s overflows.
absl::StatusOr<int64_t> RelativeNanoseconds(int64_t time_ns, int64_t base_ns) {
  int64_t difference = 0;
  if (__builtin_sub_overflow(time_ns, base_ns, &difference)) {
    return absl::InvalidArgumentError(absl::StrCat("exchange_time_ns ", time_ns, " is too far from the stream's first ",
                                                   "event's ", base_ns));
  }
  return difference;
}

// Features and Δt of one event; LOBSTER rows advance `featurizer` (a copy the caller keeps on success), their times
// counted from `base_time_ns` (the stream's first event's; this event's for a stream without one). `reason` names
// the metric label of a refusal.
absl::Status Featurize(const v1::StreamEvent& event, std::optional<int64_t> base_time_ns,
                       LobsterFeaturizer* featurizer, std::span<float> x, float& dt, std::string& reason) {
  if (event.has_features()) {
    std::copy(event.features().features().begin(), event.features().features().end(), x.begin());
    dt = event.features().dt();
    return absl::OkStatus();
  }
  const v1::LobsterEvent& l = event.lobster();
  const int64_t base = base_time_ns.value_or(event.exchange_time_ns());
  reason = "exchange_time";
  ASSIGN_OR_RETURN(const int64_t time_ns, RelativeNanoseconds(event.exchange_time_ns(), base));
  // Told here in the client's own terms: the featurizer sees times counted from the stream's first event.
  if (const std::optional<int64_t> previous = featurizer->last_time_ns(); previous && time_ns < *previous) {
    return absl::InvalidArgumentError(absl::StrCat("exchange_time_ns ", event.exchange_time_ns(),
                                                   " is earlier than the previous event's ", base + *previous, " (by ",
                                                   absl::FormatDuration(absl::Nanoseconds(*previous - time_ns)), ")"));
  }
  // The row, its type and direction passed CheckPayload: what the featurizer refuses now is the event's time
  // (beyond the bound on a stream's times).
  ASSIGN_OR_RETURN(const double seconds, featurizer->Next(std::span<const int64_t>(l.book().data(), l.book_size()),
                                                          MessageOf(l, time_ns), x));
  dt = static_cast<float>(seconds);
  return absl::OkStatus();
}

}  // namespace

StreamBatcher::StreamBatcher(DeviceWorker& worker, const StreamOptions& options, ServerMetrics& metrics)
    : worker_(worker),
      options_(options),
      metrics_(metrics),
      table_(options.device.slots, options.device.log_entries_total / options.device.slots),
      queues_(options.device.slots) {}

absl::StatusOr<int> StreamBatcher::OpenLocked(const std::string& instrument) {
  if (absl::StatusOr<int> slot = table_.SlotOf(instrument); slot.ok()) return slot;
  if (changing_model_) return absl::UnavailableError("the model is being replaced; retry");
  ASSIGN_OR_RETURN(const int slot, table_.Open(instrument));
  queues_[slot] = SlotQueue{};
  queues_[slot].instrument = instrument;
  metrics_.SetActiveStreams(table_.active());
  return slot;
}

absl::Status StreamBatcher::CloseSlotLocked(int slot) {
  RETURN_IF_ERROR(table_.Close(queues_[slot].instrument));
  queues_[slot] = SlotQueue{};
  metrics_.SetActiveStreams(table_.active());
  return absl::OkStatus();
}

absl::Status StreamBatcher::AcceptLocked(const v1::StreamEvent& event, StreamSink* sink, std::string& reason) {
  reason = "instrument";
  RETURN_IF_ERROR(CheckInstrumentId(event.instrument()));
  RETURN_IF_ERROR(CheckPayload(event, NFeaturesLocked(), reason));
  reason = "sequence";
  if (event.seq() == UINT64_MAX) {  // checked before the stream opens, as every event's own values are
    return absl::InvalidArgumentError(absl::StrCat("sequence number ", event.seq(),
                                                   " is the largest there is; numbers must stay below it"));
  }
  absl::StatusOr<int> slot = table_.SlotOf(event.instrument());
  const bool opens = !slot.ok();
  if (opens) slot = OpenLocked(event.instrument());
  if (!slot.ok()) {
    reason = slot.status().code() == absl::StatusCode::kUnavailable ? "model_change" : "capacity";
    return slot.status();
  }
  const absl::Status queued = QueueLocked(event, sink, *slot, reason);
  // A stream the refused event would have opened is not left behind holding a slot: nothing of it reached the device.
  if (!queued.ok() && opens) CloseSlotLocked(*slot).IgnoreError();
  return queued;
}

absl::Status StreamBatcher::QueueLocked(const v1::StreamEvent& event, StreamSink* sink, int slot,
                                        std::string& reason) {
  SlotQueue& queue = queues_[slot];
  reason = "stopped";
  RETURN_IF_ERROR(queue.stopped);
  reason = "seeding";
  if (queue.seeding) {
    return absl::FailedPreconditionError(absl::StrCat("instrument '", queue.instrument, "' is being seeded; send its ",
                                                      "events once SeedStream has answered"));
  }
  reason = "payload";
  const bool lobster = event.has_lobster();
  if (queue.lobster.has_value() && *queue.lobster != lobster) {
    return absl::InvalidArgumentError(absl::StrCat(
        "instrument '", queue.instrument, "' streams ", *queue.lobster ? "LOBSTER rows" : "feature vectors", "; ",
        lobster ? "a LOBSTER row" : "a feature vector", " cannot follow them (the rows' Δt and mid return would skip ",
        "the other events): reset or close the stream first"));
  }
  // Before the features: a repeated event (a client resending what it is unsure was processed) is refused as
  // repeated, not for the time or book its featurizer, which is past it, would find out of order.
  reason = "sequence";
  RETURN_IF_ERROR(table_.CheckNextSeq(slot, event.seq()));
  std::vector<float>& x = accept_x_;
  x.resize(NFeaturesLocked());
  float dt = 0;
  std::optional<LobsterFeaturizer> trial;  // committed only once the sequence number is accepted too
  reason = "book";
  if (event.has_lobster()) {
    ASSIGN_OR_RETURN(LobsterFeaturizer * featurizer, table_.Featurizer(slot, event.lobster().book_size() / 4));
    trial = *featurizer;
    RETURN_IF_ERROR(Featurize(event, queue.base_time_ns, &*trial, x, dt, reason));
  } else {
    RETURN_IF_ERROR(Featurize(event, queue.base_time_ns, nullptr, x, dt, reason));
  }
  reason = lobster ? "book" : "features";
  RETURN_IF_ERROR(CheckStandardizedRange(normalizer_, x));
  reason = "sequence";
  RETURN_IF_ERROR(table_.Accept(slot, event.seq()));
  if (std::exchange(queue.zero_state, false)) dt = 0.f;
  if (trial.has_value()) {
    *table_.Featurizer(slot, trial->levels()).value() = *trial;
    if (!queue.base_time_ns.has_value()) queue.base_time_ns = event.exchange_time_ns();
  }
  queue.lobster = lobster;
  queue.x.insert(queue.x.end(), x.begin(), x.end());
  queue.events.push_back({dt, event.seq(), sink, Clock::now()});
  if (absl::c_find(queue.feeders, sink) == queue.feeders.end()) {
    queue.feeders.push_back(sink);
    fed_[sink].push_back(slot);
  }
  AddPendingLocked(1);
  if (!queue.ready) {
    queue.ready = true;
    ready_.push_back(slot);
  }
  return absl::OkStatus();
}

void StreamBatcher::FollowModel(ModelHost& host) {
  const HostStatus status = host.Status();
  std::vector<Failure> failures;
  {
    absl::MutexLock lock(&mu_);
    normalizer_ = status.model.has_value() ? status.model->normalizer : Normalizer{};
    failures = StopQueuedBeyondTheBoundLocked();
  }
  for (const Failure& failure : failures) failure.sink->OnFailed(failure.status, failure.count);
  // The stop may have taken every event a tick was to follow with: the tick queued then finds none and returns, and
  // the ticks launched before, unfinished when they launched, would wait for their sinks to hear of them until some
  // other call asked the device.
  if (!failures.empty() && !TickToFollow()) FinishTicksBefore(host);
}

StreamBatcher::Submitted StreamBatcher::Submit(const v1::StreamRequest& request, StreamSink* sink) {
  Submitted submitted;
  absl::MutexLock lock(&mu_);
  if (NFeaturesLocked() == 0) {
    metrics_.RejectStreamEvent("no_model");
    submitted.status = absl::FailedPreconditionError("no model: call InitModel or LoadCheckpoint first");
    NoteNotTaken(std::max(request.events_size() - 1, 0));  // (the request's other events: the call has ended)
    return submitted;
  }
  if (request.events_size() == 0) {  // nothing to process, so its `ack` would never come
    metrics_.RejectStreamEvent("empty");
    submitted.status = absl::InvalidArgumentError("a Stream request carries one or more events; this one has none");
    return submitted;
  }
  if (failed_sinks_.contains(sink)) {
    metrics_.RejectStreamEvent("call_ended");
    submitted.status = Prefixed(absl::FailedPreconditionError("this call's earlier events were not processed "
                                                              "(streaming could not start): the call ends with that "
                                                              "failure"),
                                Where(0, request.events(0)));
    NoteNotTaken(request.events_size() - 1);
    return submitted;
  }
  for (int i = 0; i < request.events_size(); ++i) {
    std::string reason;
    if (absl::Status status = AcceptLocked(request.events(i), sink, reason); !status.ok()) {
      metrics_.RejectStreamEvent(reason);
      submitted.status = Prefixed(status, Where(i, request.events(i)));
      NoteNotTaken(request.events_size() - i - 1);  // (the request's events after it: the call has ended)
      break;
    }
    ++submitted.accepted;
  }
  if (submitted.accepted > 0) ScheduleTickLocked();
  return submitted;
}

void StreamBatcher::ScheduleTickLocked() {
  if (tick_queued_ || ready_.empty()) return;
  const absl::Status queued =
      worker_.Enqueue(JobPriority::kStreaming, [this](ModelHost& host) { Tick(host); }, /*bounded=*/false);
  if (queued.ok()) {
    tick_queued_ = true;
  } else {
    spdlog::warn("streaming tick not queued: {}", queued.ToString());  // the worker stopped
  }
}

void StreamBatcher::Tick(ModelHost& host) {
  absl::StatusOr<Backend*> backend = host.StreamingBackend();
  const int64_t version = host.published_weights_version();
  tick_x_.clear();
  tick_dt_.clear();
  tick_slots_.clear();
  tick_log_indices_.clear();
  notices_.clear();
  bool more = false;  // events wait for the next tick
  {
    absl::MutexLock lock(&mu_);
    tick_queued_ = false;
    AddPendingLocked(-static_cast<int64_t>(ready_.size()));  // the tick takes one event of each ready slot
    size_t kept = 0;
    for (const int slot : ready_) {
      SlotQueue& queue = queues_[slot];
      const Pending event = queue.events.front();
      queue.events.pop_front();
      tick_x_.insert(tick_x_.end(), queue.x.begin(), queue.x.begin() + NFeaturesLocked());
      queue.x.erase(queue.x.begin(), queue.x.begin() + NFeaturesLocked());
      tick_dt_.push_back(event.dt);
      tick_slots_.push_back(slot);
      notices_.push_back({event.sink, slot, event.seq, event.received});
      tick_log_indices_.push_back(table_.NextLogEntry(slot));
      // Its entry joins the log now, unfinished, so that from here until the device finishes the tick ListStreams
      // and the drain's count of what is unread include the event; a tick that fails drops it again.
      table_.Append(slot, static_cast<uint64_t>(version));
      if (!queue.events.empty()) {
        ready_[kept++] = slot;
      } else {
        queue.ready = false;
      }
    }
    ready_.resize(kept);
    more = kept > 0;
    metrics_.AddConvictionsOverwritten(table_.overwritten_total() - overwritten_reported_);
    overwritten_reported_ = table_.overwritten_total();
  }
  if (notices_.empty()) return;
  absl::Status status = backend.status();
  const Stopwatch stopwatch;
  if (status.ok()) {
    // A tick that runs the host out of memory fails as a device error would: its instruments stop, the daemon goes on.
    status = ++ticks_started_ == options_.inject_device_loss_at_tick
                 ? (*backend)->InjectDeviceLoss()
                 : RunOrExhausted("this tick", [&] {
                     return (*backend)->ForwardStepInto({tick_x_, tick_dt_, tick_slots_, tick_log_indices_});
                   });
  }
  if (status.ok()) {
    metrics_.ObserveStreamTick(static_cast<int>(notices_.size()), stopwatch.Seconds());
    std::vector<Notice> notices;
    if (!spare_notices_.empty()) {
      notices = std::move(spare_notices_.back());
      spare_notices_.pop_back();
    }
    notices.swap(notices_);
    launched_.push_back({version, std::move(notices)});
    // Where no tick follows at once, the device's answer is all that is left to wait for: the tick's sinks hear of
    // their events as soon as it has finished. While ticks follow, the next tick is prepared meanwhile instead.
    FinishTicksOrStop(**backend, /*wait_for_ticks=*/!more);
    // An instrument stopped there (an output not finite) may have taken with it every event that was to follow:
    // then no tick follows to wait for these.
    if (more && !launched_.empty() && !TickToFollow()) FinishTicksOrStop(**backend, /*wait_for_ticks=*/true);
  } else {
    // The ticks launched before it first: finished where the device can still say so (the failure may be this
    // tick's alone), else they fail with it.
    if (backend.ok() && !launched_.empty()) FinishTicks(**backend, /*wait_for_ticks=*/true).IgnoreError();
    StopFailedStreams(status, backend.ok());
  }
  notices_.clear();
  absl::MutexLock lock(&mu_);
  ScheduleTickLocked();
}

absl::Status StreamBatcher::FinishTicks(Backend& backend, bool wait_for_ticks) {
  absl::StatusOr<TicksChecked> checked = backend.CheckTicks(wait_for_ticks);
  if (!checked.ok()) {
    spdlog::error("could not learn which streaming ticks finished: {}", checked.status().ToString());
    return checked.status();
  }
  if (!checked->nonfinite.empty()) StopNonFiniteStreams(checked->nonfinite);
  for (const double seconds : checked->device_seconds) {
    metrics_.ObserveStreamTickDeviceTime(seconds, /*resident=*/false);
  }
  for (const double seconds : checked->resident_seconds) {
    metrics_.ObserveStreamTickDeviceTime(seconds, /*resident=*/true);
  }
  const Clock::time_point now = Clock::now();
  while (static_cast<int64_t>(launched_.size()) > checked->unfinished) {
    LaunchedTick& tick = launched_.front();
    {
      absl::MutexLock lock(&mu_);
      for (const Notice& notice : tick.notices) {
        // Never expected: each launched notice is finished once, or dropped with its entries before.
        if (const absl::Status broken = table_.TickFinished(notice.slot); !broken.ok()) {
          spdlog::error("stream bookkeeping: {}", broken.ToString());
        }
      }
    }
    for (const Notice& notice : tick.notices) {
      metrics_.ObserveStreamEventLatency(std::chrono::duration<double>(now - notice.received).count());
    }
    Notify(tick.notices, tick.weights_version);
    tick.notices.clear();
    spare_notices_.push_back(std::move(tick.notices));
    launched_.pop_front();
  }
  return absl::OkStatus();
}

namespace {

// Calls `each` with every run of `notices` (anything with a `sink`) that shares a sink.
template <typename Notice, typename Each>
void ForEachSink(std::span<Notice> notices, Each each) {
  std::stable_sort(notices.begin(), notices.end(), [](const Notice& a, const Notice& b) { return a.sink < b.sink; });
  for (size_t i = 0; i < notices.size();) {
    size_t j = i;
    while (j < notices.size() && notices[j].sink == notices[i].sink) ++j;
    each(notices.subspan(i, j - i));
    i = j;
  }
}

// A failure message's list of the instruments of one sink's `events`: `name(event)` for each instrument's first event,
// up to kInstrumentsNamed, joined by `separator`, then `more(count)` for the instruments not named.
template <typename Event, typename Name, typename More>
std::string NameInstruments(std::span<const Event> events, int slots, absl::string_view separator, Name name,
                            More more) {
  std::vector<bool> seen(slots);
  size_t instruments = 0;
  std::string named;
  for (const Event& event : events) {
    if (seen[event.slot]) continue;
    seen[event.slot] = true;
    if (++instruments > kInstrumentsNamed) continue;
    absl::StrAppend(&named, instruments > 1 ? separator : "", name(event));
  }
  if (instruments > kInstrumentsNamed) absl::StrAppend(&named, more(instruments - kInstrumentsNamed));
  return named;
}

// "'A' from seq 7, 'B' from seq 3 and 2 more instruments": where each instrument of one sink's `events` resumes,
// `instrument(slot)` naming it and `resume_seq(slot)` its first event not processed.
template <typename Event, typename InstrumentOf, typename ResumeSeqOf>
std::string NameResumePoints(std::span<const Event> events, int slots, InstrumentOf instrument,
                             ResumeSeqOf resume_seq) {
  return NameInstruments(
      events, slots, ", ",
      [&](const Event& event) {
        return absl::StrCat("'", instrument(event.slot), "' from seq ", resume_seq(event.slot));
      },
      [](size_t more) { return absl::StrCat(" and ", more, " more instruments"); });
}

// The code a Stream call ends with when a tick took its events: UNAVAILABLE on a lost device (retry once the daemon
// is back), INTERNAL for a tick the device failed, and where streaming could not start RESOURCE_EXHAUSTED for want of
// memory (as the flags' own refusals), else FAILED_PRECONDITION (the model cannot stream).
absl::StatusCode FailedTickCode(const absl::Status& cause, bool device_configured) {
  if (!DeviceLostStatus().ok()) return absl::StatusCode::kUnavailable;
  if (device_configured) return absl::StatusCode::kInternal;
  return cause.code() == absl::StatusCode::kResourceExhausted ? cause.code() : absl::StatusCode::kFailedPrecondition;
}

// Zeroes the slot's state on the device; nothing to do where streaming never started (its first tick failed).
absl::Status ResetDeviceSlot(ModelHost& host, int slot) {
  if (!host.streaming_configured()) return absl::OkStatus();
  ASSIGN_OR_RETURN(Backend* const backend, host.StreamingBackend());
  return backend->ResetSlot(slot);
}

}  // namespace

void StreamBatcher::DropQueuedLocked(int slot) {
  SlotQueue& queue = queues_[slot];
  for (const Pending& event : queue.events) dropped_.push_back({event.sink, slot, event.seq, event.received});
  AddPendingLocked(-static_cast<int64_t>(queue.events.size()));
  queue.events.clear();
  queue.x.clear();
  queue.ready = false;
}

void StreamBatcher::StopFailedStreams(const absl::Status& cause, bool device_configured) {
  // The launched ticks' events come first: a sink's and a slot's first event is then its first one not processed.
  std::vector<Notice> failed;
  for (LaunchedTick& tick : launched_) failed.insert(failed.end(), tick.notices.begin(), tick.notices.end());
  spdlog::error("streaming failed with {} events in ticks launched before ({} ticks) and {} in the tick launched: {}",
                failed.size(), launched_.size(), notices_.size(), cause.ToString());
  launched_.clear();
  failed.insert(failed.end(), notices_.begin(), notices_.end());
  std::vector<Failure> failures;
  {
    absl::MutexLock lock(&mu_);
    dropped_.clear();
    // A lost device takes every slot's state and log with it, and the daemon exits to be restarted: the instruments
    // start again from a seed, not from their states.
    const bool device_lost = !DeviceLostStatus().ok();
    // Where streaming never started, no instrument has a state or a log entry on the device (a model changes only with
    // no live stream), so the failed ones close instead of stopping: their slots go back, nothing is to be reset, and
    // the next event of each opens it afresh.
    const bool close_failed = !device_configured && !device_lost;
    // Where each instrument stopping resumes: its first event not processed, whichever call sent it.
    std::vector<std::optional<uint64_t>> resume_seq(table_.capacity());
    std::vector<std::string> instruments(table_.capacity());
    for (const Notice& notice : failed) {
      if (resume_seq[notice.slot].has_value()) continue;
      resume_seq[notice.slot] = notice.seq;
      SlotQueue& queue = queues_[notice.slot];
      instruments[notice.slot] = queue.instrument;
      DropQueuedLocked(notice.slot);
      if (close_failed) continue;
      queue.stopped = absl::FailedPreconditionError(absl::StrCat(
          "instrument '", queue.instrument, "' stopped at seq ", notice.seq, " when the device failed its tick (",
          cause.message(), "); it takes no events until ResetStream, SeedStream or CloseStream, then from seq ",
          notice.seq));
      table_.DropFrom(notice.slot, table_.EntryOfSeq(notice.slot, notice.seq));
    }
    std::erase_if(ready_, [&](int slot) { return !queues_[slot].ready; });
    failed.insert(failed.end(), dropped_.begin(), dropped_.end());
    for (int slot = 0; close_failed && slot < table_.capacity(); ++slot) {
      if (resume_seq[slot].has_value()) CloseSlotLocked(slot).IgnoreError();
    }
    if (close_failed) {
      for (const Notice& notice : failed) failed_sinks_.insert(notice.sink);
    }
    const char* what = device_configured ? "the device failed a streaming tick" : "streaming could not start";
    const char* remedy = device_lost    ? ". The daemon exits to be restarted, and every instrument's state and unread "
                                          "convictions were on the lost device: once it is back, seed each instrument "
                                          "named again (SeedStream), then stream from the seq named"
                         : close_failed ? ". Nothing of them reached the device, and each instrument named was closed: "
                                          "its events may be sent again, from any seq, once the daemon can stream"
                                        : ". Each instrument named stopped: it takes no events until ResetStream, "
                                          "SeedStream or CloseStream, then from the seq named";
    ForEachSink(std::span<Notice>(failed), [&](std::span<const Notice> events) {
      const std::string stopped = NameResumePoints(
          events, table_.capacity(), [&](int slot) { return instruments[slot]; },
          [&](int slot) { return *resume_seq[slot]; });
      const std::string message = absl::StrCat(what, " (", cause.message(), "); ", events.size(),
                                               " events of this call were not processed: ", stopped, remedy);
      failures.push_back({events.front().sink, absl::Status(FailedTickCode(cause, device_configured), message),
                          static_cast<int64_t>(events.size())});
    });
  }
  metrics_.DropStreamEvents("failed_tick", static_cast<int64_t>(failed.size()));
  if (options_.before_failure_notices) options_.before_failure_notices();
  for (const Failure& failure : failures) failure.sink->OnFailed(failure.status, failure.count);
}

void StreamBatcher::StopNonFiniteStreams(std::span<const NonFiniteOutput> found) {
  std::vector<Failure> failures;
  {
    absl::MutexLock lock(&mu_);
    dropped_.clear();
    for (const NonFiniteOutput& output : found) {
      SlotQueue& queue = queues_[output.slot];
      if (output.entry >= static_cast<int64_t>(table_.processed(output.slot))) continue;  // (dropped before)
      const uint64_t seq = table_.SeqOfEntry(output.slot, output.entry);
      queue.stopped = absl::FailedPreconditionError(absl::StrCat(
          "instrument '", queue.instrument, "' stopped at seq ", seq, ": the model's output for that event was not "
          "finite (float32 overflowed inside the model: its weights, or this stream's features, are beyond what its "
          "arithmetic holds), and the instrument's state with it. Its convictions from seq ", seq, " on were dropped; "
          "it takes no events until ResetStream, SeedStream or CloseStream, then from seq ", seq));
      spdlog::error("{}", queue.stopped.ToString());
      metrics_.ObserveNonFiniteStream();
      const auto drop_later = [&](std::vector<Notice>& notices) {
        std::erase_if(notices, [&](const Notice& notice) {
          const bool dropped = notice.slot == output.slot && notice.seq >= seq;
          if (dropped) dropped_.push_back(notice);
          return dropped;
        });
      };
      for (LaunchedTick& tick : launched_) drop_later(tick.notices);
      // The tick whose launch failed, when its failure is what asked the device: its later event is this stop's.
      drop_later(notices_);
      DropQueuedLocked(output.slot);
      table_.DropFrom(output.slot, output.entry);
    }
    std::erase_if(ready_, [&](int slot) { return !queues_[slot].ready; });
    metrics_.DropStreamEvents("nonfinite_output", static_cast<int64_t>(dropped_.size()));
    failures = StoppedFailuresLocked();
  }
  for (const Failure& failure : failures) failure.sink->OnFailed(failure.status, failure.count);
}

std::vector<StreamBatcher::Failure> StreamBatcher::StoppedFailuresLocked() {
  std::vector<Failure> failures;
  ForEachSink(std::span<Notice>(dropped_), [&](std::span<const Notice> events) {
    const std::string stopped = NameInstruments(
        events, table_.capacity(), " ", [&](const Notice& event) { return queues_[event.slot].stopped.message(); },
        [](size_t more) { return absl::StrCat(". ", more, " more instruments stopped alike"); });
    failures.push_back({events.front().sink,
                        absl::FailedPreconditionError(
                            absl::StrCat(events.size(), " events of this call were not processed. ", stopped)),
                        static_cast<int64_t>(events.size())});
  });
  return failures;
}

std::vector<StreamBatcher::Failure> StreamBatcher::StopQueuedBeyondTheBoundLocked() {
  dropped_.clear();
  const int F = NFeaturesLocked();
  std::vector<float>& x = accept_x_;
  x.resize(F);
  for (int slot = 0; slot < table_.capacity(); ++slot) {
    SlotQueue& queue = queues_[slot];
    for (size_t i = 0; i < queue.events.size(); ++i) {
      std::copy_n(queue.x.begin() + static_cast<std::ptrdiff_t>(i * F), F, x.begin());
      const absl::Status within = CheckStandardizedRange(normalizer_, x);
      if (within.ok()) continue;
      const uint64_t first = queue.events.front().seq;
      queue.stopped = absl::FailedPreconditionError(absl::StrCat(
          "instrument '", queue.instrument, "' stopped at seq ", first, ": its event of seq ", queue.events[i].seq,
          ", queued when SetNormalizer replaced the normalizer, is beyond what the model takes under the new one (",
          within.message(), "). Its queued events from seq ", first, " on were dropped; it takes no events until "
          "ResetStream, SeedStream or CloseStream, then from seq ", first));
      spdlog::error("{}", queue.stopped.ToString());
      table_.DropFrom(slot, table_.EntryOfSeq(slot, first));
      DropQueuedLocked(slot);
      break;
    }
  }
  std::erase_if(ready_, [&](int slot) { return !queues_[slot].ready; });
  metrics_.DropStreamEvents("standardized_bound", static_cast<int64_t>(dropped_.size()));
  return StoppedFailuresLocked();
}

bool StreamBatcher::TickToFollow() const {
  absl::MutexLock lock(&mu_);
  return !ready_.empty();
}

void StreamBatcher::FinishTicksBefore(ModelHost& host) {
  if (!host.streaming_configured()) return;
  absl::StatusOr<Backend*> backend = host.StreamingBackend();
  if (!backend.ok()) return;
  FinishTicksOrStop(**backend, /*wait_for_ticks=*/true);
}

void StreamBatcher::FinishTicksOrStop(Backend& backend, bool wait_for_ticks) {
  if (const absl::Status unknown = FinishTicks(backend, wait_for_ticks); !unknown.ok()) {
    StopFailedStreams(unknown, /*device_configured=*/true);
  }
}

void StreamBatcher::Notify(std::span<Notice> notices, int64_t weights_version) {
  ForEachSink(notices, [&](std::span<const Notice> events) {
    processed_.clear();
    // The slot's instrument name cannot change meanwhile: only this (the worker) thread closes streams.
    for (const Notice& event : events) processed_.push_back({queues_[event.slot].instrument, event.seq});
    events.front().sink->OnProcessed(processed_, weights_version);
  });
}

absl::StatusOr<int> StreamBatcher::IdleSlotLocked(const std::string& instrument) const {
  ASSIGN_OR_RETURN(const int slot, table_.SlotOf(instrument));
  if (queues_[slot].seeding) {
    return absl::FailedPreconditionError(absl::StrCat("instrument '", instrument, "' is being seeded (a SeedStream ",
                                                      "steps its window); try again once it has answered"));
  }
  if (const size_t waiting = queues_[slot].events.size(); waiting > 0) {
    return absl::FailedPreconditionError(absl::StrCat("instrument '", instrument, "' has ", waiting,
                                                      " events not yet processed; wait for their acknowledgement"));
  }
  return slot;
}

namespace {

// What one entry of a ReadConvictions page takes at most: its sequence number (a varint), its conviction and, where
// asked for, its probabilities.
int64_t ReadEntryBytes(int horizons, bool with_probabilities) {
  return 10 + 4 + (with_probabilities ? 4 * int64_t{horizons} : 0);
}

// A seed window's features and Δt, [events, F] and [events].
struct SeedWindow {
  std::vector<float> x, dt;
  std::optional<LobsterFeaturizer> featurizer;  // LOBSTER rows: the previous mid and time after the window
  int64_t base_time_ns = 0;                     // the stream's first event's exchange time
};

absl::StatusOr<SeedWindow> FeaturizeSeedWindow(const v1::SeedStreamRequest& request, const Normalizer& normalizer) {
  const int n_features = static_cast<int>(normalizer.mean.size());
  const int n = request.events_size();
  const bool lobster = request.events(0).has_lobster();
  SeedWindow window;
  window.x.resize(static_cast<size_t>(n) * n_features);
  window.dt.resize(n);
  if (lobster) window.featurizer.emplace(request.events(0).lobster().book_size() / 4);
  window.base_time_ns = request.events(0).exchange_time_ns();  // the window starts the stream afresh
  for (int i = 0; i < n; ++i) {
    const v1::StreamEvent& event = request.events(i);
    std::string reason;
    absl::Status status = CheckPayload(event, n_features, reason);
    if (status.ok() && event.has_lobster() != lobster) {
      status = absl::InvalidArgumentError("a seed window is all LOBSTER rows or all feature vectors");
    }
    const std::span<float> x = std::span<float>(window.x).subspan(static_cast<size_t>(i) * n_features, n_features);
    if (status.ok()) {
      status = Featurize(event, window.base_time_ns, lobster ? &*window.featurizer : nullptr, x, window.dt[i], reason);
    }
    if (status.ok()) status = CheckStandardizedRange(normalizer, x);
    if (!status.ok()) return Prefixed(status, absl::StrCat("seed window event ", i, ": "));
  }
  if (!lobster) window.dt[0] = 0.f;  // the window starts a stream: its first event has no predecessor
  return window;
}

// How many events the next part of a seed steps: about `budget`'s worth at the pace of the part before (at most four
// times as many as it had, so that a part that ran fast by chance does not make the next overrun).
int64_t NextSeedPart(int64_t events, double seconds, absl::Duration budget) {
  const double at_pace = static_cast<double>(events) * absl::ToDoubleSeconds(budget) / std::max(seconds, 1e-9);
  return std::clamp<int64_t>(static_cast<int64_t>(at_pace), 1, 4 * events);
}

}  // namespace

struct StreamBatcher::SeedProgress {
  SeedProgress(const v1::SeedStreamRequest& request, const grpc::ServerContextBase* caller)
      : request(request), caller(caller) {}

  const v1::SeedStreamRequest& request;
  const grpc::ServerContextBase* caller;
  int slot = 0;
  bool claimed = false;            // the slot is the seed's (`seeding`)...
  bool released = false;           // ...until FinishSeed or FailSeed gave it back
  bool opened = false;             // the seed opened the stream
  bool device_written = false;     // the slot's device state was zeroed or stepped
  bool publication_held = false;   // ModelHost::HoldPublication
  std::optional<SeedWindow> window;
  int64_t stepped = 0;             // the window's events stepped so far
  int64_t next_part = 16;          // how many the next part steps: the first few, then NextSeedPart
  int64_t weights_version = 0;     // the published version the window runs under
  double device_seconds = 0;
};

absl::StatusOr<v1::SeedStreamResponse> StreamBatcher::Seed(const v1::SeedStreamRequest& request,
                                                           const grpc::ServerContextBase* caller) {
  RETURN_IF_ERROR(CheckInstrumentId(request.instrument()));
  if (request.events_size() == 0) return absl::InvalidArgumentError("the seed window has no events");
  SeedProgress seed{request, caller};
  // A seed starts only once no training publication waits for other seeds to finish: seeds that overlap one another
  // would otherwise hold the weights streaming reads back for as long as they keep coming.
  absl::StatusOr<SeedNext> next = SeedNext::kStartAfterPublication;
  while (next.ok() && *next == SeedNext::kStartAfterPublication) {
    next = worker_.Run(JobPriority::kStreaming, [&](ModelHost& host) { return StartSeed(host, seed); }, caller);
    if (next.ok() && *next == SeedNext::kStartAfterPublication) absl::SleepFor(absl::Milliseconds(1));
  }
  // Each next part queues behind the ticks that came meanwhile. Unbounded, as ticks are: the seed holds its slot until
  // a job of its own gives it back. Its client's going away is the job's to find (ContinueSeed), for the same reason.
  while (next.ok() && *next == SeedNext::kAnotherPart) {
    next = worker_.Run(JobPriority::kStreaming, [&](ModelHost& host) { return ContinueSeed(host, seed); },
                       /*caller=*/nullptr, /*bounded=*/false);
  }
  if (!next.ok() && seed.claimed && !seed.released) {
    // A job that failed past FailSeed's reach (the host out of memory outside the parts' own guards) gives the slot
    // back in a job of its own; only a worker already stopped (the daemon exiting) takes none.
    worker_
        .Run(JobPriority::kStreaming, [&](ModelHost& host) { return FailSeed(host, seed, next.status()); },
             /*caller=*/nullptr, /*bounded=*/false)
        .IgnoreError();
  }
  RETURN_IF_ERROR(next.status());
  v1::SeedStreamResponse response;
  response.set_events(request.events_size());
  response.set_weights_version(seed.weights_version);
  response.set_device_seconds(seed.device_seconds);
  return response;
}

absl::StatusOr<StreamBatcher::SeedNext> StreamBatcher::StartSeed(ModelHost& host, SeedProgress& seed) {
  FinishTicksBefore(host);  // the seed forgets the slot's
  RETURN_IF_ERROR(host.RequireModel());  // (the window's checks need its feature count)
  if (host.PublicationWaits()) return SeedNext::kStartAfterPublication;
  // The slot is claimed under the lock, then featurized and seeded without it, so that GetStatus, ListStreams and
  // other instruments' events need not wait for a long window; Submit, ResetStream, CloseStream and other seeds refuse
  // this instrument meanwhile (`seeding`). Only this thread, the worker's, ticks, resets, closes or seeds streams or
  // replaces the model.
  Normalizer normalizer;
  {
    absl::MutexLock lock(&mu_);
    if (!seed.request.while_fed()) RETURN_IF_ERROR(CheckNotFedLocked(seed.request.instrument(), "seed"));
    absl::StatusOr<int> claimed = IdleSlotLocked(seed.request.instrument());
    seed.opened = claimed.status().code() == absl::StatusCode::kNotFound;
    if (seed.opened) claimed = OpenLocked(seed.request.instrument());
    ASSIGN_OR_RETURN(seed.slot, claimed);
    queues_[seed.slot].seeding = true;
    seed.claimed = true;
    normalizer = normalizer_;
  }
  // From here every way out gives the slot back (FinishSeed, FailSeed; Seed's own job where a job failed otherwise).
  absl::StatusOr<SeedWindow> window = RunOrExhausted(
      "the seed window's features", [&] { return FeaturizeSeedWindow(seed.request, normalizer); });
  if (!window.ok()) return FailSeed(host, seed, window.status());
  seed.window = *std::move(window);
  // Streaming's device state is set up (and the weights published) only for a window that passed its checks: a
  // refused request changes nothing.
  const absl::StatusOr<Backend*> backend = host.StreamingBackend();
  if (!backend.ok()) return FailSeed(host, seed, backend.status());
  seed.weights_version = host.published_weights_version();
  host.HoldPublication();
  seed.publication_held = true;
  seed.device_written = true;
  if (absl::Status reset = (*backend)->ResetSlot(seed.slot); !reset.ok()) return FailSeed(host, seed, reset);
  return StepSeedPart(host, seed, **backend);
}

absl::StatusOr<StreamBatcher::SeedNext> StreamBatcher::ContinueSeed(ModelHost& host, SeedProgress& seed) {
  // A client that stopped waiting was told the seed failed: the rest of its window is not stepped.
  if (const absl::Status gone = CallerGone(seed.caller); !gone.ok()) {
    return FailSeed(host, seed, absl::Status(gone.code(), absl::StrCat(
        "the window was cut off after ", seed.stepped, " of its ", seed.request.events_size(), " events: ",
        absl::IsDeadlineExceeded(gone) ? "the call's deadline passed" : "the client cancelled the call or went away")));
  }
  // Only SetNormalizer publishes while the seed holds publication: the window's features were checked against the
  // normalizer before it, and its parts would not have run under one set of weights.
  if (host.published_weights_version() != seed.weights_version) {
    return FailSeed(host, seed, absl::AbortedError(absl::StrCat(
        "the weights streaming reads changed (SetNormalizer: version ", seed.weights_version, " to ",
        host.published_weights_version(), ") after ", seed.stepped, " of the window's ", seed.request.events_size(),
        " events; seed it again")));
  }
  const absl::StatusOr<Backend*> backend = host.StreamingBackend();
  if (!backend.ok()) return FailSeed(host, seed, backend.status());
  return StepSeedPart(host, seed, **backend);
}

absl::StatusOr<StreamBatcher::SeedNext> StreamBatcher::StepSeedPart(ModelHost& host, SeedProgress& seed,
                                                                     Backend& backend) {
  const int64_t events = seed.request.events_size(), n = std::min(seed.next_part, events - seed.stepped);
  const size_t F = seed.window->x.size() / events;
  // The ticks launched before it finish first, so that the part is timed alone: a part timed with their device time
  // would size the next smaller, down to one event (and its device_seconds would count their work).
  FinishTicksBefore(host);
  const Stopwatch stopwatch;
  const absl::Status stepped = RunOrExhausted("the seed window", [&] {
    return backend.AdvanceSlot(seed.slot, std::span<const float>(seed.window->x).subspan(seed.stepped * F, n * F),
                               std::span<const float>(seed.window->dt).subspan(seed.stepped, n));
  });
  if (!stepped.ok()) return FailSeed(host, seed, stepped);
  const double seconds = stopwatch.Seconds();
  seed.device_seconds += seconds;
  seed.stepped += n;
  seed.next_part = NextSeedPart(n, seconds, options_.seed_job_time);
  if (seed.stepped < events) return SeedNext::kAnotherPart;
  FinishSeed(host, seed);
  return SeedNext::kDone;
}

void StreamBatcher::FinishSeed(ModelHost& host, SeedProgress& seed) {
  seed.released = true;
  if (std::exchange(seed.publication_held, false)) host.ReleasePublication();
  absl::MutexLock lock(&mu_);
  SlotQueue& queue = queues_[seed.slot];
  queue.seeding = false;
  table_.ResetFeatures(seed.slot);
  if (seed.window->featurizer.has_value()) {
    *table_.Featurizer(seed.slot, seed.window->featurizer->levels()).value() = *seed.window->featurizer;
  }
  queue.base_time_ns = seed.window->base_time_ns;
  queue.lobster = seed.window->featurizer.has_value();
  queue.zero_state = false;
  queue.stopped = absl::OkStatus();
}

absl::Status StreamBatcher::FailSeed(ModelHost& host, SeedProgress& seed, absl::Status failure) {
  seed.released = true;
  if (std::exchange(seed.publication_held, false)) host.ReleasePublication();
  absl::MutexLock lock(&mu_);
  SlotQueue& queue = queues_[seed.slot];
  queue.seeding = false;
  // A stream this seed opened goes again, unless its device state cannot be zeroed for the slot's next owner.
  bool closed = false;
  if (seed.opened && (!seed.device_written || ResetDeviceSlot(host, seed.slot).ok())) {
    closed = CloseSlotLocked(seed.slot).ok();
  }
  // A stream whose state the failed seed may have written (in part, or to values that are not finite) and that stays
  // stops, as after a failed tick: its next events would otherwise step from a state its events did not lead to.
  if (!closed && seed.device_written) {
    const std::optional<uint64_t> next_seq = table_.NextSeq(seed.slot);
    queue.stopped = absl::FailedPreconditionError(absl::StrCat(
        "instrument '", queue.instrument, "' stopped when its seed failed (", failure.message(),
        "); its state is not the one its events led to: it takes no events until ResetStream, SeedStream or "
        "CloseStream, then ",
        next_seq.has_value() ? absl::StrCat("from seq ", *next_seq) : std::string("from any seq (none yet)")));
  }
  return failure;
}

absl::StatusOr<v1::ReadConvictionsResponse> StreamBatcher::Read(const v1::ReadConvictionsRequest& request,
                                                                const grpc::ServerContextBase* caller) {
  RETURN_IF_ERROR(CheckInstrumentId(request.instrument()));
  if (request.max_count() < 0) return absl::InvalidArgumentError("max_count must be >= 0");
  const int64_t max_count = request.max_count() == 0 ? options_.max_read_count
                                                     : std::min(request.max_count(), options_.max_read_count);
  return worker_.Run(JobPriority::kStreaming, [&](ModelHost& host) -> absl::StatusOr<v1::ReadConvictionsResponse> {
    FinishTicksBefore(host);  // no entry read is one of them
    int slot = 0;
    {
      absl::MutexLock lock(&mu_);
      ASSIGN_OR_RETURN(slot, table_.SlotOf(request.instrument()));
    }
    // (Only this thread, the worker's, closes a stream that has taken an event, and a gRPC thread only the slot that
    // its refused first event opened: the slot stays the instrument's.)
    ASSIGN_OR_RETURN(Backend* const backend, host.StreamingBackend());
    const int H = backend->config().n_horizons;
    const int64_t page = std::min(max_count, options_.max_read_bytes / ReadEntryBytes(H, request.with_probabilities()));
    StreamTable::LogRange range;
    {
      absl::MutexLock lock(&mu_);
      absl::StatusOr<StreamTable::LogRange> held = table_.Range(slot, request.from_seq(), std::max<int64_t>(page, 1));
      if (absl::IsOutOfRange(held.status())) metrics_.ObserveOverwrittenRead();
      ASSIGN_OR_RETURN(range, std::move(held));
    }
    v1::ReadConvictionsResponse response;
    response.set_first_seq(range.first_seq);
    response.set_n_horizons(H);
    response.set_next_seq(range.first_seq + range.count);
    response.set_end_seq(range.next_seq);
    response.set_oldest_retained_seq(range.oldest_retained_seq);
    response.set_min_weights_version(static_cast<int64_t>(range.count > 0 ? range.min_weights_version : 0));
    response.set_max_weights_version(static_cast<int64_t>(range.max_weights_version));
    response.mutable_convictions()->Resize(static_cast<int>(range.count), 0.f);
    if (request.with_probabilities()) response.mutable_probabilities()->Resize(static_cast<int>(range.count * H), 0.f);
    int64_t done = 0;
    for (const StreamTable::Segment& segment : range.segments) {
      const std::span<float> convictions(response.mutable_convictions()->mutable_data() + done, segment.count);
      std::span<float> probs;
      if (request.with_probabilities()) {
        probs = std::span<float>(response.mutable_probabilities()->mutable_data() + done * H, segment.count * H);
      }
      RETURN_IF_ERROR(backend->ReadLog(slot, segment.ring_begin, segment.count, convictions, probs));
      done += segment.count;
    }
    response.mutable_seqs()->Reserve(static_cast<int>(range.count));
    for (int64_t i = 0; i < range.count; ++i) response.add_seqs(range.first_seq + i);
    // A caller that stopped waiting while the job ran (its deadline passed, it cancelled) never gets these entries:
    // they stay unread, so that a drain waiting for every conviction to be read back waits for them too.
    if (!CallerGone(caller).ok()) return response;
    absl::MutexLock lock(&mu_);
    table_.MarkRead(slot, response.next_seq());
    return response;
  }, caller);
}

StreamBatcher::Unread StreamBatcher::NotReadBack() const {
  absl::MutexLock lock(&mu_);
  const StreamTable::UnreadEntries logged = table_.Unread();
  return {pending_, logged.entries, logged.streams};
}

absl::StatusOr<int64_t> StreamBatcher::DropQueuedAtExit() {
  // (No job where nothing waits: a long training step or collective ahead of it would only delay the exit.)
  if (NotReadBack().events == 0) return 0;
  return worker_.Run(JobPriority::kStreaming, [&](ModelHost& host) -> absl::StatusOr<int64_t> {
    FinishTicksBefore(host);
    std::vector<Failure> failures;
    int64_t dropped = 0;
    {
      absl::MutexLock lock(&mu_);
      dropped_.clear();
      std::vector<uint64_t> resume_seq(table_.capacity());
      for (int slot = 0; slot < table_.capacity(); ++slot) {
        SlotQueue& queue = queues_[slot];
        if (queue.events.empty()) continue;
        resume_seq[slot] = queue.events.front().seq;
        queue.stopped = absl::UnavailableError(absl::StrCat("instrument '", queue.instrument, "' stopped at seq ",
                                                            resume_seq[slot], ": the daemon exits"));
        DropQueuedLocked(slot);
        table_.ForgetUnprocessed(slot);
      }
      ready_.clear();
      dropped = static_cast<int64_t>(dropped_.size());
      ForEachSink(std::span<Notice>(dropped_), [&](std::span<const Notice> events) {
        const std::string stopped = NameResumePoints(
            events, table_.capacity(), [&](int slot) { return queues_[slot].instrument; },
            [&](int slot) { return resume_seq[slot]; });
        failures.push_back(
            {events.front().sink,
             absl::UnavailableError(absl::StrCat(
                 "the daemon exits: ", events.size(), " events of this call were not processed: ", stopped,
                 ". Every instrument's state and unread convictions go with the exit: once the daemon is back, seed "
                 "each instrument named (SeedStream), then stream from the seq named")),
             static_cast<int64_t>(events.size())});
      });
    }
    for (const Failure& failure : failures) failure.sink->OnFailed(failure.status, failure.count);
    return dropped;
  }, /*caller=*/nullptr, /*bounded=*/false);
}

absl::Status StreamBatcher::Reset(const std::string& instrument, bool while_fed,
                                  const grpc::ServerContextBase* caller) {
  RETURN_IF_ERROR(CheckInstrumentId(instrument));
  return worker_.Run(JobPriority::kStreaming, [&](ModelHost& host) -> absl::Status {
    FinishTicksBefore(host);  // the reset forgets the slot's
    absl::MutexLock lock(&mu_);
    if (!while_fed) RETURN_IF_ERROR(CheckNotFedLocked(instrument, "reset"));
    ASSIGN_OR_RETURN(const int slot, IdleSlotLocked(instrument));
    RETURN_IF_ERROR(ResetDeviceSlot(host, slot));
    table_.ResetFeatures(slot);
    queues_[slot].lobster.reset();
    queues_[slot].base_time_ns.reset();  // the next event is a first event, whatever clock it is on
    queues_[slot].zero_state = true;
    queues_[slot].stopped = absl::OkStatus();
    return absl::OkStatus();
  }, caller);
}

absl::StatusOr<uint64_t> StreamBatcher::Close(const std::string& instrument,
                                               const grpc::ServerContextBase* caller) {
  RETURN_IF_ERROR(CheckInstrumentId(instrument));
  return worker_.Run(JobPriority::kStreaming, [&](ModelHost& host) -> absl::StatusOr<uint64_t> {
    FinishTicksBefore(host);  // the slot's last events are told of (or dropped) while it still has its name
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(const int slot, IdleSlotLocked(instrument));
    const uint64_t processed = table_.finished(slot);
    RETURN_IF_ERROR(ResetDeviceSlot(host, slot));
    RETURN_IF_ERROR(CloseSlotLocked(slot));
    return processed;
  }, caller);
}

v1::ListStreamsResponse StreamBatcher::List(const v1::ListStreamsRequest& request) const {
  v1::ListStreamsResponse response;
  const size_t wanted = request.max_count() > 0 ? request.max_count() : SIZE_MAX;
  std::optional<std::string> from = request.from_instrument();
  while (from.has_value() && static_cast<size_t>(response.streams_size()) < wanted) {
    absl::MutexLock lock(&mu_);
    StreamTable::InstrumentPage page =
        table_.List(*from, std::min(kListChunk, wanted - static_cast<size_t>(response.streams_size())));
    for (const StreamTable::InstrumentInfo& info : page.instruments) AddStreamInfoLocked(info, response);
    from = std::move(page.next);
  }
  if (from.has_value()) response.set_next_instrument(*from);
  return response;
}

void StreamBatcher::AddStreamInfoLocked(const StreamTable::InstrumentInfo& info,
                                        v1::ListStreamsResponse& response) const {
  v1::StreamInfo& stream = *response.add_streams();
  stream.set_instrument(info.instrument);
  stream.set_slot(info.slot);
  stream.set_processed_events(info.finished);
  stream.set_pending_events(queues_[info.slot].events.size() + info.unfinished);
  if (info.last_seq.has_value()) stream.set_last_accepted_seq(*info.last_seq);
  if (info.next_seq.has_value()) stream.set_next_seq(*info.next_seq);
  stream.set_stopped(std::string(queues_[info.slot].stopped.message()));
  stream.set_seeding(queues_[info.slot].seeding);
  if (absl::StatusOr<StreamTable::LogRange> range = table_.Range(info.slot, UINT64_MAX, 0); range.ok()) {
    stream.set_end_seq(range->next_seq);
    stream.set_oldest_retained_seq(range->oldest_retained_seq);
  }
}

void StreamBatcher::StopFeeding(const StreamSink* sink) {
  absl::MutexLock lock(&mu_);
  const auto fed = fed_.find(sink);
  if (fed == fed_.end()) return;
  // (A slot closed and reopened meanwhile may be listed twice, or hold another instrument this call does not feed.)
  for (const int slot : fed->second) std::erase(queues_[slot].feeders, sink);
  fed_.erase(fed);
}

void StreamBatcher::ForgetSink(const StreamSink* sink) {
  StopFeeding(sink);
  absl::MutexLock lock(&mu_);
  failed_sinks_.erase(sink);
}

absl::Status StreamBatcher::CheckNotFedLocked(const std::string& instrument, const char* verb) const {
  const absl::StatusOr<int> slot = table_.SlotOf(instrument);
  if (!slot.ok()) return absl::OkStatus();  // (no stream: nothing feeds it)
  const size_t open = queues_[*slot].feeders.size();
  if (open == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "instrument '", instrument, "' is fed by ", open, " open Stream call(s): a ", verb, " would "
      "replace its state under their next events without a word to them; ", verb, " it once they have ended, or "
      "with while_fed set where that is meant (a feed that ", verb, "s its own instruments; perceptionctl: "
      "--while_fed). A feed that is gone but whose call stays open: CloseStream ends the stream whatever feeds it"));
}

void StreamBatcher::NoteNotTaken(int events) {
  for (int i = 0; i < events; ++i) metrics_.RejectStreamEvent("call_ended");
}

bool StreamBatcher::RoomToRead(bool held) {
  absl::MutexLock lock(&mu_);
  const bool room = pending_ < options_.max_pending_events;
  if (!room && !held) metrics_.ObserveStreamReadHeld();
  return room;
}

void StreamBatcher::AddPendingLocked(int64_t delta) {
  pending_ += delta;
  metrics_.SetStreamPendingEvents(pending_);
}

void StreamBatcher::FillStatus(v1::StreamingStatus& status) const {
  absl::MutexLock lock(&mu_);
  status.set_slots(table_.capacity());
  status.set_active_streams(table_.active());
  status.set_log_entries_per_slot(table_.log_entries_per_slot());
  status.set_publish_every_steps(options_.device.publish_every_steps);
  status.set_ack_every_events(options_.ack_every_events);
  status.set_ack_every_ms(options_.ack_every_ms);
  status.set_pending_events(pending_);
  status.set_max_pending_events(options_.max_pending_events);
  status.set_max_read_count(options_.max_read_count);
  status.set_overwritten_total(table_.overwritten_total());
}

}  // namespace perception::server
