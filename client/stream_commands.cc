// Live streaming through the daemon: LOBSTER replay, conviction export and the load generator.
#include "client/stream_commands.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "engine/atomic_file.h"
#include "engine/cli/arguments.h"
#include "engine/dataset.h"
#include "engine/lobster.h"
#include "engine/status_macros.h"
#include "perception/v1/instrument_id.h"

namespace perception::client {
namespace {

// Event i of `data` as a stream event (the exchange time is the message time in nanoseconds).
void FillLobsterEvent(const LobsterData& data, size_t i, v1::StreamEvent& event) {
  const LobsterMessage& m = data.messages[i];
  event.set_exchange_time_ns(TimeNanoseconds(m.time));
  v1::LobsterEvent& l = *event.mutable_lobster();
  const std::span<const int64_t> row = data.BookRow(i);
  l.mutable_book()->Assign(row.begin(), row.end());
  l.set_type(m.type);
  l.set_order_id(m.order_id);
  l.set_size(m.size);
  l.set_price(m.price);
  l.set_direction(m.direction);
}

// Where the model's normalizer floored features (constant where it was fitted) that vary in the `n` events from
// `first` (a stream of them, featurized as the daemon does from a fresh start), the warning perception eval gives;
// empty where none does, or where the events cannot be featurized (the daemon refuses such an event as it comes).
std::string FlooredFeaturesWarning(const LobsterData& data, int64_t first, int64_t n, const v1::Model& model) {
  const std::optional<Normalizer> normalizer = NormalizerOf(model);
  if (!normalizer.has_value()) return "";
  const size_t width = 4 * static_cast<size_t>(data.levels);
  LobsterData streamed;
  streamed.levels = data.levels;
  streamed.book.assign(data.book.begin() + first * width, data.book.begin() + (first + n) * width);
  streamed.messages.assign(data.messages.begin() + first, data.messages.begin() + first + n);
  const absl::StatusOr<EventSeries> series = BuildSeries(streamed, std::vector<int>{1});
  return series.ok() ? FlooredFeaturesVaryWarning(*normalizer, *series) : "";
}

// Paces a sender at `rate` events per second (0: no pacing).
class Pacer {
 public:
  explicit Pacer(double rate) : rate_(rate), start_(absl::Now()) {}
  bool paced() const { return rate_ > 0; }
  // When the schedule sends event `sent` (paced only).
  absl::Time Due(int64_t sent) const { return start_ + absl::Seconds(static_cast<double>(sent) / rate_); }
  // Until the schedule sends event `sent`, or an interruption's request to stop comes first.
  void Wait(int64_t sent, const Interruption* interruption = nullptr) const {
    if (!paced()) return;
    const absl::Duration ahead = Due(sent) - absl::Now();
    if (ahead <= absl::ZeroDuration()) return;
    if (interruption != nullptr) {
      interruption->WaitForRequest(ahead);
    } else {
      absl::SleepFor(ahead);
    }
  }

 private:
  double rate_;
  absl::Time start_;
};

// `sorted` not empty.
double Percentile(const std::vector<double>& sorted, double q) {
  const size_t index = std::min(sorted.size() - 1, static_cast<size_t>(std::ceil(q * sorted.size())) - 1);
  return sorted[index];
}

// The daemon's stream of `instrument` (ListStreams), if it has one.
absl::StatusOr<std::optional<v1::StreamInfo>> FindStream(PerceptionClient& client, const std::string& instrument) {
  v1::ListStreamsRequest request;
  request.set_from_instrument(instrument);
  request.set_max_count(1);
  ASSIGN_OR_RETURN(const v1::ListStreamsResponse streams, client.ListStreams(request));
  // (A daemon from before ListStreams' pages answers every stream.)
  for (const v1::StreamInfo& stream : streams.streams()) {
    if (stream.instrument() == instrument) return stream;
  }
  return std::nullopt;
}

// Refuses, before anything is sent, a seed window that would replace the live state of an instrument that already
// has events (unless `reseed`), and a seeded stream whose numbers would not continue the instrument's (one whose
// every event was dropped takes its first again).
absl::Status CheckSeeding(PerceptionClient& client, const StreamOptions& options, int64_t n,
                          uint64_t first_streamed_seq) {
  ASSIGN_OR_RETURN(const std::optional<v1::StreamInfo> stream, FindStream(client, options.instrument));
  if (!stream.has_value() || !stream->has_next_seq()) return absl::OkStatus();
  const uint64_t next = stream->next_seq();
  // A stopped instrument with events takes none until a reset or a seed: "stream without it to continue" would fail
  // too. (One stopped at its first event has no state to lose: a seed starting where it stopped needs no --reseed.)
  if (!stream->stopped().empty() && stream->has_last_accepted_seq() && !options.reseed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "instrument ", options.instrument, " is stopped (", stream->stopped(), "): pass --reseed to let --seed-window "
        "seed it again, the stream after the window starting at seq ", next));
  }
  if (stream->has_last_accepted_seq() && !options.reseed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "instrument ", options.instrument, " already has events (through seq ", stream->last_accepted_seq(),
        "): --seed-window would replace its live state; stream without it to continue (--start_seq ", next,
        "), or pass --reseed to replace the state"));
  }
  if (first_streamed_seq != next) {
    return absl::FailedPreconditionError(absl::StrCat(
        "instrument ", options.instrument, " takes seq ", next, " next, but the stream after the seed window would "
        "start at ", first_streamed_seq, SeedingContinuation(options, n, next)));
  }
  return absl::OkStatus();
}

// How many times a read from the log's oldest entry starts over when the stream overwrites what it reads.
constexpr int kOldestReadAttempts = 5;

// One instrument's conviction log from a sequence number on, as the CSV text `convictions` writes.
struct ConvictionsCsv {
  std::string text;
  int64_t rows = 0, min_version = INT64_MAX, max_version = 0;
  uint64_t first_seq = 0, last_seq = 0;
  uint64_t oldest_seq = 0, end_seq = 0;  // what the log held at the last page: [oldest, end)
};

absl::StatusOr<ConvictionsCsv> ReadConvictionsCsv(PerceptionClient& client, const std::string& instrument,
                                                  uint64_t from_seq) {
  ConvictionsCsv csv;
  v1::ReadConvictionsRequest request;
  request.set_instrument(instrument);
  request.set_from_seq(from_seq);
  request.set_with_probabilities(true);
  while (true) {
    ASSIGN_OR_RETURN(const v1::ReadConvictionsResponse page, client.ReadConvictions(request));
    const int H = page.n_horizons();
    if (csv.text.empty()) {
      csv.text = "seq,conviction";
      for (int h = 1; h <= H; ++h) absl::StrAppend(&csv.text, ",p", h);
      csv.text += "\n";
      csv.first_seq = page.first_seq();
    }
    for (int i = 0; i < page.convictions_size(); ++i) {
      absl::StrAppend(&csv.text, page.seqs(i), absl::StrFormat(",%.9g", page.convictions(i)));
      for (int h = 0; h < H; ++h) absl::StrAppend(&csv.text, absl::StrFormat(",%.9g", page.probabilities(i * H + h)));
      csv.text += "\n";
      csv.last_seq = page.seqs(i);
    }
    if (page.convictions_size() > 0) {
      csv.min_version = std::min(csv.min_version, page.min_weights_version());
      csv.max_version = std::max(csv.max_version, page.max_weights_version());
    }
    csv.rows += page.convictions_size();
    csv.oldest_seq = page.oldest_retained_seq();
    csv.end_seq = page.end_seq();
    if (page.convictions_size() == 0 || page.next_seq() >= page.end_seq()) return csv;
    request.set_from_seq(page.next_seq());
  }
}

// What the instrument's log holds now, [oldest, end), and the sequence number of the first conviction its stream
// logged (before `oldest`, the ring overwrote them); all 0 for an instrument the daemon does not know (the read
// then says so).
struct RetainedLog {
  uint64_t oldest = 0, end = 0, first_logged = 0;
};
RetainedLog RetainedLogOf(const v1::StreamInfo& stream) {
  // processed_events and end_seq count the same finished entries, and a reset keeps the numbers and the log going.
  return RetainedLog{stream.oldest_retained_seq(), stream.end_seq(),
                     stream.end_seq() - std::min(stream.processed_events(), stream.end_seq())};
}
absl::StatusOr<RetainedLog> RetainedLogOf(PerceptionClient& client, const std::string& instrument) {
  ASSIGN_OR_RETURN(const std::optional<v1::StreamInfo> stream, FindStream(client, instrument));
  if (!stream.has_value()) return RetainedLog{};
  return RetainedLogOf(*stream);
}

// Where a log kept `kept` convictions an instrument and `wanted` of them were asked of it: how to keep them all.
std::string KeepThemAllAdvice(const v1::StreamingStatus& streaming, uint64_t wanted) {
  constexpr uint64_t kMaxLogEntries = uint64_t{1} << 30;  // perceptiond's bound on --stream_log_entries
  const uint64_t slots = static_cast<uint64_t>(std::max(streaming.slots(), 1));
  const std::string read_meanwhile = "read them while the instrument streams (perceptionctl convictions --from SEQ)";
  if (wanted * slots <= kMaxLogEntries) {
    return absl::StrCat(read_meanwhile, ", or run perceptiond with --stream_log_entries >= ", wanted * slots,
                        " (each of its ", slots, " slots keeps --stream_log_entries / --stream_slots)");
  }
  return absl::StrCat(read_meanwhile, ", or run perceptiond with --stream_slots <= ", kMaxLogEntries / wanted,
                      " and --stream_log_entries ", kMaxLogEntries, " (each slot keeps --stream_log_entries / ",
                      "--stream_slots, and --stream_log_entries is at most 2^30)");
}

// The largest sequence number the daemon takes (2^64 − 1 is refused: StreamEvent.seq in the proto).
constexpr uint64_t kMaxSeq = UINT64_MAX - 1;

// Refuses up front `n` (>= 1) events numbered from `start_seq` whose last would pass kMaxSeq, where the daemon would
// take the events before it (opening the stream) and refuse the rest, or the numbers would wrap past 2^64.
absl::Status CheckLastSeq(uint64_t start_seq, int64_t n) {
  if (start_seq <= kMaxSeq && static_cast<uint64_t>(n - 1) <= kMaxSeq - start_seq) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--start_seq ", start_seq, " numbers the last of ", n, " events past ", kMaxSeq,
      ", the largest sequence number the daemon takes; with ", n, " events --start_seq must be <= ",
      kMaxSeq - static_cast<uint64_t>(n - 1)));
}

// The resume after seq `acked` (>= 1, or start_seq - 1 for none) of the `n` events used that first seeds the state
// with the events before it: the failed run's window, else kResumeSeedEvents, as far as the files and the sequence
// numbers from 1 (--start_seq's least) go. Its flags, and the events it seeds with.
struct SeededResume {
  std::string flags;
  int64_t seed = 0;
};
SeededResume SeededResumeAfter(const StreamOptions& options, int64_t n, uint64_t acked) {
  const int64_t done = static_cast<int64_t>(acked - options.start_seq) + 1;
  const int64_t resume_first = options.first + done;  // the files' event of seq acked + 1
  const int64_t seed = std::min({options.seed_window > 0 ? int64_t{options.seed_window} : kResumeSeedEvents,
                                 resume_first, static_cast<int64_t>(std::min<uint64_t>(acked, INT64_MAX))});
  return {absl::StrCat("--first ", resume_first - seed,
                       options.count > 0 ? absl::StrCat(" --count ", n - done + seed) : "", " --start_seq ",
                       acked + 1 - seed, " --seed-window ", seed),
          seed};
}

// After UNAVAILABLE with no event acknowledged, a continuation (a run from past the files' first event, on past seq
// 1) that no seed starts: the same command, on a restarted daemon holding no state for the instrument, started it
// from a zero state without a word. The seeded rerun's advice, the events before it seeding it; empty where the same
// command is the rerun (it starts the instrument anyway, or seeds it itself), or for another code.
std::string SeededRerunAdvice(const StreamOptions& options, int64_t n, absl::StatusCode code) {
  if (code != absl::StatusCode::kUnavailable || options.seed_window > 0 || options.first == 0 ||
      options.start_seq <= 1) {
    return "";
  }
  const SeededResume resume = SeededResumeAfter(options, n, options.start_seq - 1);
  return absl::StrCat("the daemon is going or gone, and one that restarts holds no state for ", options.instrument,
                      ": once it is back, run this command with ", resume.flags, ", whose ", resume.seed,
                      " events before seq ", options.start_seq, " seed the state. Where the daemon kept the "
                      "instrument (a connection that failed), it may have taken some: ");
}

// What a resume on the state the daemon holds leaves out of this run's flags: its seed (--reseed without a
// --seed-window is refused).
std::string WithoutSeedFlags(const StreamOptions& options) {
  if (options.seed_window == 0) return "";
  return options.reseed ? " and without --seed-window and --reseed" : " and without --seed-window";
}

// The flags of a run that carries on after seq `acked` (>= start_seq, before the last) of the `n` events used, on the
// state the daemon holds.
std::string ContinuationFlags(const StreamOptions& options, int64_t n, uint64_t acked) {
  const int64_t done = static_cast<int64_t>(acked - options.start_seq) + 1;
  return absl::StrCat("--first ", options.first + done, options.count > 0 ? absl::StrCat(" --count ", n - done) : "",
                      " --start_seq ", acked + 1, WithoutSeedFlags(options));
}

// Refuses, before anything is sent, a stream (without a seed window) whose first number is not the one its instrument
// takes next: the daemon would refuse its first event, and the failed call's advice, which reckons the instrument's
// events as this run's, sent a rerun of `--first 250` onto an instrument at seq 251 to `--first 500 --count -240`.
absl::Status CheckNumbering(PerceptionClient& client, const StreamOptions& options, int64_t n) {
  ASSIGN_OR_RETURN(const std::optional<v1::StreamInfo> stream, FindStream(client, options.instrument));
  if (!stream.has_value() || !stream->has_next_seq() || stream->next_seq() == options.start_seq) {
    return absl::OkStatus();
  }
  const uint64_t next = stream->next_seq(), last = options.start_seq + static_cast<uint64_t>(n - 1);
  std::string ours;  // where the instrument's events are this command's, numbered as it numbers them
  if (next > options.start_seq && next - 1 < last) {
    ours = absl::StrCat("; where its events are this command's, numbered as it numbers them, ",
                        ContinuationFlags(options, n, next - 1), " carries on after them");
  } else if (next > last) {
    ours = "; where its events are this command's, numbered as it numbers them, it has every one of them already";
  }
  // A stopped instrument refuses the renumbered run too, until a reset.
  const std::string stopped =
      stream->stopped().empty()
          ? ""
          : absl::StrCat(". It is stopped as well (", stream->stopped(), "): either run needs `perceptionctl streams "
                         "reset ", options.instrument, "` first (its state zeroed)");
  return absl::FailedPreconditionError(absl::StrCat(
      "instrument ", options.instrument, " takes seq ", next, " next, but this run would start at seq ",
      options.start_seq, ": the daemon would refuse its first event. --start_seq ", next,
      " numbers this run's events after the instrument's", ours, "; to start the instrument afresh, `perceptionctl "
      "streams close ", options.instrument, "` first (its convictions go with it)", stopped));
}

// How far a run the first signal stopped got (`sent` of its `streamed` events), and, where its call did not end well
// (`finished`), what ended it: CANCELLED at a second signal.
std::string InterruptedAfter(int64_t sent, int64_t streamed, const absl::Status& finished) {
  const std::string what = absl::StrCat("interrupted after ", sent, " of ", streamed, " events");
  if (finished.ok()) return what;
  if (absl::IsCancelled(finished)) return absl::StrCat(what, ", the wait for their acknowledgements cancelled");
  return absl::StrCat(what, ", then ", finished.message());
}

// The StoppedResumeAdvice of a stream whose instrument the daemon lists as stopped. Asked only of a daemon that
// answers (a stalled one would hold the question for --timeout as well).
std::string StoppedAdvice(PerceptionClient& client, const StreamOptions& options, int64_t n, uint64_t acked,
                          absl::StatusCode code) {
  if (code == absl::StatusCode::kDeadlineExceeded || code == absl::StatusCode::kUnavailable ||
      code == absl::StatusCode::kCancelled) {
    return "";
  }
  const absl::StatusOr<std::optional<v1::StreamInfo>> stream = FindStream(client, options.instrument);
  if (!stream.ok() || !stream->has_value() || (*stream)->stopped().empty()) return "";
  return StoppedResumeAdvice(options, n, acked);
}

}  // namespace

std::string SeedingContinuation(const StreamOptions& options, int64_t n, uint64_t next) {
  const uint64_t seed = static_cast<uint64_t>(options.seed_window);
  if (next <= seed) return "";  // no --start_seq from 1 reaches it
  const uint64_t start_seq = next - seed;
  const int64_t move = static_cast<int64_t>(start_seq - options.start_seq);  // two's complement: back is negative
  // Keeping the numbering streams from the files' event first + move + N: offered where that is one of this
  // command's events, the same last event kept (--count less the move).
  const bool keeps = options.first + move >= 0 && move < n - options.seed_window;
  const std::string count = options.count > 0 ? absl::StrCat(" --count ", options.count - move) : "";
  const std::string keeping = keeps ? absl::StrCat("; to keep this command's numbering instead, event i as seq i + "
                                                   "(start_seq - first), --first ", options.first + move, count,
                                                   " --start_seq ", start_seq)
                                    : "";
  return absl::StrCat(" (--start_seq ", start_seq, " continues it, the files' event ",
                      options.first + options.seed_window, " taking seq ", next, keeping, ")");
}

std::string StoppedResumeAdvice(const StreamOptions& options, int64_t n, uint64_t acked) {
  const std::string reset = absl::StrCat(". The instrument is stopped: before resuming, run `perceptionctl streams "
                                         "reset ", options.instrument, "` (its state zeroed)");
  const uint64_t last = options.start_seq + static_cast<uint64_t>(n - 1);
  if (acked == 0 || acked >= last) {
    return absl::StrCat(reset, ", or resume with --seed-window N --reseed as well, --first and --start_seq each "
                        "moved back by N (and --count on by N), the N events before the resume point seeding its "
                        "state");
  }
  const SeededResume resume = SeededResumeAfter(options, n, acked);
  return absl::StrCat(reset, ", or resume with ", resume.flags, " --reseed, whose ", resume.seed,
                      " events before seq ", acked + 1, " seed its state");
}

std::string ResumeAdvice(const StreamOptions& options, int64_t n, uint64_t acked, absl::StatusCode code) {
  // None acknowledged: the daemon may have taken events all the same, and their numbers are used (its end_seq says
  // how far), so the same command would be refused.
  if (acked == 0) {
    // The daemon acknowledges what it accepted of a request before refusing an event of it: none acknowledged, it
    // refused the first, and refuses it again (the advice below, reckoned from the instrument's end_seq, named the
    // same command).
    if (code == absl::StatusCode::kInvalidArgument) {
      return absl::StrCat("; the daemon took none of its events: it refuses the first as above until that changes (an "
                          "event earlier than the instrument's last: `perceptionctl streams reset ", options.instrument,
                          "` zeroes its state and its clock, or stream them as another --instrument)");
    }
    const uint64_t first_streamed = options.start_seq + static_cast<uint64_t>(options.seed_window);
    const std::string rerun = SeededRerunAdvice(options, n, code);
    return absl::StrCat(
        "; the daemon acknowledged none of its events", rerun.empty() ? ", but may have taken some" : "", " (", rerun,
        "resume from the instrument's end_seq "
        "E in `perceptionctl streams`, once its pending reads 0 and E stays put for a second (a request the call sent "
        "may still be on its way), with --first ", options.first + options.seed_window,
        " + (E - ", first_streamed, ")",
        options.count > 0 ? absl::StrCat(" --count ", n - options.seed_window, " - (E - ", first_streamed,
                                          ") (where that is 0, nothing is left)")
                          : "",
        " --start_seq E", WithoutSeedFlags(options),
        "; where it is not listed, or listed with end_seq 0 (", options.seed_window > 0 ? "the seed opened it, " : "",
        "no event processed), the daemon took none: run the same command again)");
  }
  const uint64_t last = options.start_seq + static_cast<uint64_t>(n - 1);
  // A call that failed after its last event was acknowledged (the daemon drained, the watchdog gave up on the
  // call's end) leaves nothing to replay: flags for "the rest" would read --count 0 (all the rest of the files) or a
  // --first past their end.
  if (acked >= last) {
    return absl::StrCat("; acknowledged through seq ", acked, ": the daemon acknowledged every event, so nothing is "
                        "left to resume");
  }
  const int64_t done = static_cast<int64_t>(acked - options.start_seq) + 1;
  const int64_t resume_first = options.first + done;  // the files' event of seq acked + 1
  if (code == absl::StatusCode::kUnavailable) {
    // (acked >= 1 and the resume's first event >= 1 here, so the seed is at least one event.)
    const SeededResume resume = SeededResumeAfter(options, n, acked);
    return absl::StrCat(
        "; acknowledged through seq ", acked, " (the daemon is going or gone, and one that restarts holds no state ",
        "for ", options.instrument, ": once it is back, resume with ", resume.flags, ", whose ", resume.seed,
        " events before seq ", acked + 1, " seed the state again. Where the daemon kept the instrument (a connection ",
        "that failed), that seed is refused; resume instead from its end_seq E in `perceptionctl streams` with ",
        "--first ", resume_first, " + (E - ", acked + 1, ")",
        options.count > 0 ? absl::StrCat(" --count ", n - done, " - (E - ", acked + 1, ") (where that is 0, nothing "
                                          "is left)")
                          : "",
        " --start_seq E",
        WithoutSeedFlags(options), ")");
  }
  return absl::StrCat("; acknowledged through seq ", acked, " (resume with ", ContinuationFlags(options, n, acked),
                      ", or from the instrument's end_seq in `perceptionctl streams`, once its pending reads 0 and "
                      "its end_seq stays put for a second, where that differs: the daemon took more than it "
                      "acknowledged)");
}

namespace {

// --instrument as the daemon would take it (an id it refuses was sent, and the refusal's advice was to run the same
// command again).
absl::Status CheckInstrumentFlag(const std::string& instrument) {
  const absl::Status id = v1::CheckInstrumentId(instrument);
  return id.ok() ? id : absl::InvalidArgumentError(absl::StrCat("--instrument: ", id.message()));
}

}  // namespace

absl::Status CheckStreamOptions(const StreamOptions& options) {
  if (options.instrument.empty()) return absl::InvalidArgumentError("stream needs --instrument ID");
  RETURN_IF_ERROR(CheckInstrumentFlag(options.instrument));
  if (options.first < 0 || options.count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--first (", options.first, ") and --count (", options.count,
                                                   ") must be >= 0 (--count 0: to the end of the files)"));
  }
  if (options.start_seq < 1) return absl::InvalidArgumentError("--start_seq must be >= 1, got 0");
  if (options.seed_window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seed-window must be >= 0 (0: no seed), got ", options.seed_window));
  }
  if (options.count > 0 && options.seed_window >= options.count) {
    return absl::InvalidArgumentError(absl::StrCat("--seed-window ", options.seed_window, " leaves nothing of the ",
                                                   options.count, " events of --count to stream"));
  }
  // --reseed only lets a seed replace a live state: without one it would be ignored.
  if (options.reseed && options.seed_window == 0) {
    return absl::InvalidArgumentError("--reseed applies to --seed-window N: there is no seed to let replace a state");
  }
  // Without --count, the files' size decides the last number: StreamLobster checks it once it has read them.
  return CheckLastSeq(options.start_seq, std::max<int64_t>(options.count, 1));
}

absl::Status StreamLobster(PerceptionClient& client, const StreamOptions& options, Interruption* interruption) {
  RETURN_IF_ERROR(CheckStreamOptions(options));
  ASSIGN_OR_RETURN(const LobsterData data,
                   ReadLobster(options.files.orderbook, options.files.messages, options.files.levels));
  ASSIGN_OR_RETURN(const v1::GetStatusResponse daemon, client.GetStatus());
  if (!daemon.has_model()) return absl::FailedPreconditionError("the daemon has no model; run `perceptionctl init`");
  RETURN_IF_ERROR(CheckLobsterFeatureCount(data.levels, daemon.model().config().n_features(), "the model"));
  const int64_t size = static_cast<int64_t>(data.size());
  if (options.first >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--first ", options.first, " is past the end: the files hold only ", size, " events"));
  }
  if (options.count > size - options.first) {
    return absl::InvalidArgumentError(absl::StrCat("--first ", options.first, " --count ", options.count,
                                                   " reaches past the end: the files hold only ", size,
                                                   " events (--count 0: to the end of the files)"));
  }
  const int64_t first = options.first;
  const int64_t n = options.count > 0 ? options.count : size - first;
  if (options.seed_window >= n) {
    return absl::InvalidArgumentError(absl::StrCat("--seed-window ", options.seed_window, " leaves nothing of the ",
                                                   n, " events to stream"));
  }
  RETURN_IF_ERROR(CheckLastSeq(options.start_seq, n));
  if (const std::string warning = FlooredFeaturesWarning(data, first, n, daemon.model()); !warning.empty()) {
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
  }
  // Event k (0-based from `first`) carries seq start_seq + k; the seed window's numbers are not logged.
  const auto seq_of = [&](int64_t k) { return options.start_seq + static_cast<uint64_t>(k); };
  const uint64_t logged = static_cast<uint64_t>(n - options.seed_window);
  const auto kept = static_cast<uint64_t>(std::max<int64_t>(daemon.streaming().log_entries_per_slot(), 0));
  if (logged > kept) {
    // Streaming goes on (the convictions can be read meanwhile), but not as if all of them will be there at the end.
    std::fprintf(stderr,
                 "warning: the daemon's log keeps the last %llu convictions of an instrument, and this run streams "
                 "%llu events: read back after it, the first %llu of its convictions will have been overwritten; to "
                 "keep them, %s\n",
                 static_cast<unsigned long long>(kept), static_cast<unsigned long long>(logged),
                 static_cast<unsigned long long>(logged - kept), KeepThemAllAdvice(daemon.streaming(), logged).c_str());
  }
  if (options.seed_window > 0) {
    RETURN_IF_ERROR(CheckSeeding(client, options, n, seq_of(options.seed_window)));
    v1::SeedStreamRequest seed;
    seed.set_instrument(options.instrument);
    for (int64_t i = 0; i < options.seed_window; ++i) FillLobsterEvent(data, first + i, *seed.add_events());
    ASSIGN_OR_RETURN(const v1::SeedStreamResponse seeded, client.SeedStream(seed));
    std::printf("seeded %s with %lld events in %.3f s\n", options.instrument.c_str(),
                static_cast<long long>(seeded.events()), seeded.device_seconds());
  } else {
    RETURN_IF_ERROR(CheckNumbering(client, options, n));
  }

  CallCancellation calls;  // the stream's, which a second signal cancels
  absl::Mutex mu;
  uint64_t acked = 0;  // guarded by mu
  const std::unique_ptr<EventStream> stream = client.OpenStream(
      [&](const v1::StreamResponse& response) {
        absl::MutexLock lock(&mu);
        for (const v1::InstrumentAck& ack : response.acks()) acked = std::max(acked, ack.last_seq());
      },
      absl::Milliseconds(daemon.streaming().ack_every_ms()), &calls);
  const auto interrupted = [interruption] { return StopRequested(interruption); };
  // At full speed requests carry many events; paced, one event each so that each leaves on time.
  const int per_request = options.rate > 0 ? 1 : 256;
  const Pacer pacer(options.rate);
  const absl::Time start = absl::Now();
  v1::StreamRequest request;
  int64_t i = options.seed_window;  // the next event to send
  bool cut = false;                 // the first signal stopped the sending before event i
  const std::optional<Interruption::Armed> armed = ArmToCancel(interruption, calls);
  while (i < n && !(cut = interrupted())) {
    // The schedule sends event k (0-based) at k / rate: the request waits for the events sent before it, so that the
    // first goes at once (waiting after counting it sent event k at (k + 1) / rate).
    const int64_t sent_before = i - options.seed_window;
    request.Clear();
    for (int k = 0; k < per_request && i < n; ++k, ++i) {
      v1::StreamEvent& event = *request.add_events();
      event.set_instrument(options.instrument);
      event.set_seq(seq_of(i));
      FillLobsterEvent(data, first + i, event);
    }
    pacer.Wait(sent_before, interruption);
    // Not sent: the signal came, or the call ended early (Finish says why).
    if ((cut = interrupted()) || !stream->Write(request)) {
      i -= request.events_size();
      break;
    }
  }
  if (cut) interruption->Stopped();
  absl::Status status = stream->Finish();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const int64_t streamed = n - options.seed_window;
  absl::MutexLock lock(&mu);
  // Interrupted, the events sent, [seed_window, end), are checked as a whole run's would be.
  const int64_t end = cut ? i : n;
  if (cut && end == options.seed_window && status.ok()) {
    return absl::CancelledError("interrupted before any event was sent: run the same command again");
  }
  if (status.ok() && acked != seq_of(end - 1)) {
    status = absl::DataLossError(absl::StrCat("the daemon acknowledged up to seq ", acked, " of ", seq_of(end - 1)));
  }
  const std::string interrupted_after = cut ? InterruptedAfter(end - options.seed_window, streamed, status) : "";
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(cut ? interrupted_after : status.message(),
                                     ResumeAdvice(options, n, acked, status.code()),
                                     StoppedAdvice(client, options, n, acked, status.code())));
  }
  // Whatever the warning before the run foresaw (another client may read or stream the instrument too): what the
  // log still holds of this run now, asked before the run is reported done.
  ASSIGN_OR_RETURN(const std::optional<v1::StreamInfo> listed, FindStream(client, options.instrument));
  // Another client's CloseStream during the run: the log the daemon keeps is not this run's (what it had was
  // dropped, and the events after the close ran from a zeroed state), where the run read as "overwritten", after a
  // line that called it "all acknowledged".
  if (!listed.has_value()) {
    return absl::DataLossError(absl::StrCat("instrument '", options.instrument, "' was closed (CloseStream) during ",
                                            "or right after the run: the daemon holds none of its convictions"));
  }
  const RetainedLog log = RetainedLogOf(*listed);
  if (log.first_logged > seq_of(options.seed_window)) {
    return absl::DataLossError(absl::StrCat(
        "instrument '", options.instrument, "' was closed (CloseStream) during the run and opened afresh by seq ",
        log.first_logged, ": the convictions of seq ", seq_of(options.seed_window), "..", log.first_logged - 1,
        " are gone, and those from seq ", log.first_logged, " on come from a zeroed state, not from the events "
        "before it"));
  }
  if (!cut) {
    std::printf("streamed %lld events of %s (seq %llu..%llu) in %.3f s: %.0f events/s; all acknowledged\n",
                static_cast<long long>(streamed), options.instrument.c_str(),
                static_cast<unsigned long long>(seq_of(options.seed_window)),
                static_cast<unsigned long long>(seq_of(n - 1)), seconds, streamed / std::max(seconds, 1e-9));
  }
  if (log.oldest > seq_of(options.seed_window)) {
    std::printf("its log now holds seq %llu..%llu: the convictions of seq %llu..%llu were overwritten\n",
                static_cast<unsigned long long>(log.oldest), static_cast<unsigned long long>(log.end - 1),
                static_cast<unsigned long long>(seq_of(options.seed_window)),
                static_cast<unsigned long long>(std::min(log.oldest - 1, seq_of(end - 1))));
  }
  if (cut) {
    return absl::CancelledError(absl::StrCat(interrupted_after, ", each acknowledged; acknowledged through seq ", acked,
                                             " (resume with ", ContinuationFlags(options, n, acked), ")"));
  }
  return absl::OkStatus();
}

std::string StreamsTable(const v1::ListStreamsResponse& response) {
  std::string table =
      absl::StrFormat("%-16s %5s %12s %9s %12s %12s\n", "instrument", "slot", "processed", "pending", "oldest_seq",
                      "end_seq");
  for (const v1::StreamInfo& s : response.streams()) {
    absl::StrAppendFormat(&table, "%-16s %5d %12d %9d %12d %12d\n", s.instrument(), s.slot(), s.processed_events(),
                          s.pending_events(), s.oldest_retained_seq(), s.end_seq());
    if (!s.stopped().empty()) absl::StrAppend(&table, "  stopped: ", s.stopped(), "\n");
    if (s.seeding()) absl::StrAppend(&table, "  seeding: a SeedStream runs on it\n");
  }
  return table;
}

absl::Status CheckConvictionsOptions(const std::string& instrument, const std::string& out_path) {
  if (instrument.empty()) return absl::InvalidArgumentError("convictions needs --instrument ID");
  RETURN_IF_ERROR(CheckInstrumentFlag(instrument));
  if (out_path.empty()) return absl::InvalidArgumentError("convictions needs --out FILE.csv");
  // Before any page is read: during a drain, a read counts as the convictions read back, which the daemon then
  // takes with it as it exits.
  return CheckWritableDestination(out_path);
}

absl::Status WriteConvictions(PerceptionClient& client, const std::string& instrument, uint64_t from_seq,
                              const std::string& out_path) {
  RETURN_IF_ERROR(CheckConvictionsOptions(instrument, out_path));
  absl::StatusOr<ConvictionsCsv> csv;
  uint64_t first_logged = 0;  // read from the oldest: the stream's first logged conviction's sequence number
  if (from_seq > 0) {
    csv = ReadConvictionsCsv(client, instrument, from_seq);
  } else {
    // On a live instrument whose log wraps, the stream may overwrite the oldest entry before the read reaches it
    // (OUT_OF_RANGE): start over, ahead of the new oldest by at least what was overwritten meanwhile, but within the
    // first half of what the log holds (further ahead, a writer that lapped the reader would have it start past the
    // log's end and write an empty file as if the log were empty).
    ASSIGN_OR_RETURN(RetainedLog log, RetainedLogOf(client, instrument));
    uint64_t lead = 0;
    for (int attempt = 1;; ++attempt) {
      csv = ReadConvictionsCsv(client, instrument, log.oldest + lead);
      if (csv.ok() || !absl::IsOutOfRange(csv.status()) || attempt == kOldestReadAttempts) break;
      ASSIGN_OR_RETURN(const RetainedLog now, RetainedLogOf(client, instrument));
      lead = std::min(std::max({2 * lead, now.oldest - log.oldest, uint64_t{1}}), (now.end - now.oldest) / 2);
      log = now;
    }
    first_logged = log.first_logged;
  }
  RETURN_IF_ERROR(csv.status());
  RETURN_IF_ERROR(WriteFileAtomically(out_path, csv->text));
  if (csv->rows == 0) {
    const std::string held = csv->end_seq > csv->oldest_seq
                                 ? absl::StrCat("the log holds seq ", csv->oldest_seq, "..", csv->end_seq - 1)
                                 : "the log is empty";
    const std::string from = from_seq > 0 ? absl::StrCat(" from seq ", from_seq) : "";
    std::printf("no convictions of %s%s (%s); wrote only the header to %s\n", instrument.c_str(), from.c_str(),
                held.c_str(), out_path.c_str());
  } else {
    std::printf("%lld convictions of %s (seq %llu..%llu, weights versions %lld..%lld) -> %s\n",
                static_cast<long long>(csv->rows), instrument.c_str(), static_cast<unsigned long long>(csv->first_seq),
                static_cast<unsigned long long>(csv->last_seq), static_cast<long long>(csv->min_version),
                static_cast<long long>(csv->max_version), out_path.c_str());
  }
  if (from_seq == 0 && csv->rows > 0 && csv->first_seq > first_logged) {
    ASSIGN_OR_RETURN(const v1::GetStatusResponse daemon, client.GetStatus());
    std::fprintf(stderr,
                 "warning: the log no longer holds the first %llu convictions of %s (seq %llu..%llu): it keeps the "
                 "last %lld of an instrument and overwrote them; to keep them, %s\n",
                 static_cast<unsigned long long>(csv->first_seq - first_logged), instrument.c_str(),
                 static_cast<unsigned long long>(first_logged), static_cast<unsigned long long>(csv->first_seq - 1),
                 static_cast<long long>(daemon.streaming().log_entries_per_slot()),
                 KeepThemAllAdvice(daemon.streaming(), csv->end_seq - first_logged).c_str());
  }
  return absl::OkStatus();
}

absl::Status CheckBenchOptions(const BenchOptions& options) {
  RETURN_IF_ERROR(CheckAtLeastOne({{"instruments", options.instruments},
                                   {"events", options.events},
                                   {"connections", options.connections},
                                   {"in_flight", options.in_flight}}));
  // Each event's send time and latency are kept for the percentiles (up to 24 bytes an event): a larger run failed
  // deep in a worker thread (std::bad_alloc, abort) or ran the machine out of memory.
  if (options.events > kMaxBenchEvents) {
    return absl::InvalidArgumentError(absl::StrCat("--events ", options.events, " is more than one bench keeps (",
                                                   kMaxBenchEvents, "): run several"));
  }
  return absl::OkStatus();
}

namespace {

// A bench's i-th instrument.
std::string BenchInstrument(int i) { return absl::StrCat("bench-", i); }

// Whether `instrument` is one of a bench's own, bench-0..N-1: a live feed named bench-live (or bench-07) is not.
bool IsBenchInstrument(const std::string& instrument, int instruments) {
  int i = 0;
  return absl::StartsWith(instrument, "bench-") && absl::SimpleAtoi(instrument.substr(6), &i) &&
         instrument == BenchInstrument(i) && i >= 0 && i < instruments;
}

}  // namespace

// Closes the streams of a bench's instruments the daemon has (those whose first event it took: closing the others, no
// event or refused, would add NOT_FOUND refusals to its metrics); the error says what it left open. A call the second
// signal cancelled may leave events queued, and an instrument with events to process is not closed: retried for a
// few seconds while the daemon works through them.
absl::Status CloseBenchStreams(PerceptionClient& client, int instruments) {
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  absl::Status last;
  int open = 0;
  do {
    if (open > 0) absl::SleepFor(absl::Milliseconds(50));
    const absl::StatusOr<v1::ListStreamsResponse> streams = client.ListStreams();
    if (!streams.ok()) {
      return absl::Status(streams.status().code(),
                          absl::StrCat("its streams not closed: ", streams.status().message()));
    }
    open = 0;
    for (const v1::StreamInfo& stream : streams->streams()) {
      if (!IsBenchInstrument(stream.instrument(), instruments)) continue;
      v1::CloseStreamRequest close;
      close.set_instrument(stream.instrument());
      if (absl::StatusOr<v1::CloseStreamResponse> closed = client.CloseStream(close); !closed.ok()) {
        last = closed.status();
        ++open;
      }
    }
  } while (open > 0 && absl::IsFailedPrecondition(last) && absl::Now() < give_up);
  if (open == 0) return absl::OkStatus();
  return absl::Status(last.code(), absl::StrCat(open, " of its streams left open (perceptionctl streams close ID): ",
                                                last.message()));
}

absl::Status Bench(PerceptionClient& client, const BenchOptions& options, Interruption* interruption) {
  RETURN_IF_ERROR(CheckBenchOptions(options));
  ASSIGN_OR_RETURN(const v1::GetStatusResponse status, client.GetStatus());
  if (!status.has_model()) return absl::FailedPreconditionError("the daemon has no model; run `perceptionctl init`");
  const int slots = status.streaming().slots();
  if (options.instruments > slots) {
    return absl::InvalidArgumentError(absl::StrCat("--instruments ", options.instruments, " is more than the daemon's ",
                                                   slots, " stream slots (perceptiond --stream_slots)"));
  }
  const int F = status.model().config().n_features();
  const int C = std::min(options.connections, options.instruments);
  // A fresh start: sequence numbers from 1. Only the streams of this run's instruments an earlier bench left are
  // closed (so that a run adds no NOT_FOUND refusals to the daemon's metrics); every other stream, a live feed's
  // included, is left as it is, and its slot is not this run's.
  // A refused run changes nothing, so the slots are counted before any stream is closed.
  ASSIGN_OR_RETURN(const v1::ListStreamsResponse live, client.ListStreams());
  const auto others = std::ranges::count_if(live.streams(), [&](const v1::StreamInfo& stream) {
    return !IsBenchInstrument(stream.instrument(), options.instruments);
  });
  if (options.instruments > slots - others) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "--instruments ", options.instruments, " is more than the daemon's free stream slots: ", others, " of its ",
        slots, " hold other streams (perceptionctl streams; close some, or bench fewer instruments)"));
  }
  for (const v1::StreamInfo& stream : live.streams()) {
    if (!IsBenchInstrument(stream.instrument(), options.instruments)) continue;
    v1::CloseStreamRequest close;
    close.set_instrument(stream.instrument());
    RETURN_IF_ERROR(client.CloseStream(close).status());
  }

  // Event j goes to instrument j mod N, so the first events % N instruments have one event more than the rest.
  const auto events_of = [&](int instrument) {
    return options.events / options.instruments + (instrument < options.events % options.instruments ? 1 : 0);
  };
  struct Connection {
    std::vector<int> instruments;
    int64_t rounds = 0;  // requests to send, one event per instrument that still has one each
    std::vector<absl::Time> sent;  // by round
    std::vector<double> latencies;
    int64_t sent_events = 0, acked_events = 0;
    bool cut = false;  // the first signal stopped its sending before its last round
    absl::Status status;
  };
  std::vector<Connection> connections(C);
  for (int i = 0; i < options.instruments; ++i) connections[i % C].instruments.push_back(i);
  for (Connection& c : connections) c.rounds = events_of(c.instruments.front());

  const auto interrupted = [interruption] { return StopRequested(interruption); };
  CallCancellation calls;  // every connection's, which a second signal cancels
  const std::optional<Interruption::Armed> armed = ArmToCancel(interruption, calls);
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int ci = 0; ci < C; ++ci) {
    // With fewer events than instruments, a connection whose instruments get none has nothing to send: no call.
    if (connections[ci].rounds == 0) continue;
    threads.emplace_back([&, ci] {
      Connection& c = connections[ci];
      c.sent.resize(c.rounds);
      absl::Mutex mu;
      std::vector<uint64_t> acked(options.instruments, 0);  // guarded by mu; by instrument
      int64_t acked_rounds = 0;                               // guarded by mu: every instrument acked through it
      const std::unique_ptr<EventStream> stream = client.OpenStream([&](const v1::StreamResponse& response) {
        const absl::Time now = absl::Now();
        absl::MutexLock lock(&mu);
        for (const v1::InstrumentAck& ack : response.acks()) {
          int instrument = 0;
          if (!absl::SimpleAtoi(ack.instrument().substr(6), &instrument)) continue;
          for (uint64_t seq = acked[instrument] + 1; seq <= ack.last_seq(); ++seq) {
            c.latencies.push_back(absl::ToDoubleSeconds(now - c.sent[seq - 1]));
          }
          c.acked_events += static_cast<int64_t>(ack.last_seq() - acked[instrument]);
          acked[instrument] = ack.last_seq();
        }
        int64_t through = c.rounds;  // an instrument with all its events acknowledged holds nothing back
        for (const int i : c.instruments) {
          const auto acked_i = static_cast<int64_t>(acked[i]);
          if (acked_i < events_of(i)) through = std::min(through, acked_i);
        }
        acked_rounds = through;
      }, absl::Milliseconds(status.streaming().ack_every_ms()), &calls);
      const Pacer pacer(options.rate * c.instruments.size() / options.instruments);
      std::mt19937 rng(ci);
      std::uniform_real_distribution<float> uniform(-1.f, 1.f);
      v1::StreamRequest request;
      request.set_ack(true);
      for (int64_t r = 0; r < c.rounds; ++r) {
        request.clear_events();
        for (const int i : c.instruments) {
          if (r >= events_of(i)) continue;
          v1::StreamEvent& event = *request.add_events();
          event.set_instrument(BenchInstrument(i));
          event.set_seq(static_cast<uint64_t>(r + 1));
          v1::FeatureEvent& features = *event.mutable_features();
          for (int f = 0; f < F; ++f) features.add_features(uniform(rng));
          features.set_dt(0.01f);
        }
        const int64_t events_before = r * static_cast<int64_t>(c.instruments.size());
        pacer.Wait(events_before, interruption);
        {
          const auto may_send = [&] { return r - acked_rounds < options.in_flight; };
          absl::MutexLock lock(&mu);
          // A call the daemon ended acknowledges nothing more: the next Write fails and Finish says why.
          while (!mu.AwaitWithTimeout(absl::Condition(&may_send), absl::Milliseconds(20)) && !stream->ended() &&
                 !interrupted()) {
          }
          if ((c.cut = interrupted())) break;
          // Paced, latency runs from when the schedule sends the request, so that the time it waited for the
          // in-flight window behind a slow daemon counts (no coordinated omission); unpaced, from its send.
          c.sent[r] = pacer.paced() ? pacer.Due(events_before) : absl::Now();
        }
        if (!stream->Write(request)) break;
        c.sent_events += request.events_size();
      }
      c.status = stream->Finish();
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const bool cut = std::ranges::any_of(connections, &Connection::cut);
  if (cut) interruption->Stopped();
  // (Not a refusal: the run reports such calls apart.)
  const auto cancelled_by_the_second_signal = [cut](const Connection& c) { return cut && absl::IsCancelled(c.status); };

  std::vector<double> latencies;
  int64_t sent = 0, acked = 0;
  std::vector<std::string> refusals;
  for (const Connection& c : connections) {
    latencies.insert(latencies.end(), c.latencies.begin(), c.latencies.end());
    sent += c.sent_events;
    acked += c.acked_events;
    if (!c.status.ok() && !cancelled_by_the_second_signal(c)) refusals.push_back(c.status.ToString());
  }
  std::sort(latencies.begin(), latencies.end());
  // With no event acknowledged there is no latency to give: "p50 0.000 ms" read as a very fast daemon.
  const std::string latency =
      latencies.empty() ? "none (no event acknowledged)"
                        : absl::StrFormat("p50 %.3f ms, p99 %.3f ms, p99.9 %.3f ms", 1e3 * Percentile(latencies, 0.5),
                                          1e3 * Percentile(latencies, 0.99), 1e3 * Percentile(latencies, 0.999));
  std::printf(
      "bench%s: %d instruments over %d connection(s), %lld events (%lld sent, %lld acknowledged) in %.3f s: %.0f "
      "events/s\nlatency (%s to acknowledgement): %s\n",
      cut ? " (interrupted)" : "", options.instruments, C, static_cast<long long>(options.events),
      static_cast<long long>(sent),
      static_cast<long long>(acked), seconds, acked / std::max(seconds, 1e-9),
      options.rate > 0 ? "scheduled send" : "send", latency.c_str());
  std::printf("not acknowledged: %lld events (%lld of them sent)%s\n", static_cast<long long>(options.events - acked),
              static_cast<long long>(sent - acked), refusals.empty() ? "" : ":");
  for (const std::string& refusal : refusals) std::printf("  %s\n", refusal.c_str());
  const absl::Status closed = CloseBenchStreams(client, options.instruments);
  const std::string left_open = closed.ok() ? "" : absl::StrCat("; ", closed.message());
  // A connection the daemon refused or lost fails the command, so that a script can tell (the numbers are above).
  for (const Connection& c : connections) {
    if (c.status.ok() || cancelled_by_the_second_signal(c)) continue;
    return absl::Status(c.status.code(), absl::StrCat(cut ? "interrupted, then " : "", refusals.size(), " of ", C,
                                                      " connection(s) failed; the first: ", c.status.message(),
                                                      left_open));
  }
  const auto cancelled = std::ranges::count_if(connections, cancelled_by_the_second_signal);
  if (cancelled > 0) {
    return absl::CancelledError(absl::StrCat("interrupted, then the wait for acknowledgements cancelled on ", cancelled,
                                             " of ", C, " connection(s)", left_open));
  }
  if (cut) {
    return absl::CancelledError(absl::StrCat("interrupted after ", sent, " of ", options.events,
                                             " events sent: the report above is theirs",
                                             left_open.empty() ? ", its instruments closed" : left_open));
  }
  if (!closed.ok()) return absl::Status(closed.code(), absl::StrCat("the bench ran", left_open));
  return absl::OkStatus();
}

}  // namespace perception::client
