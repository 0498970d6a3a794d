// perceptionctl's live-streaming commands: replay a LOBSTER file as a feed, read convictions back, load-test.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "client/lobster_commands.h"
#include "client/perception_client.h"

namespace perception::client {

struct StreamOptions {
  LobsterFiles files;
  std::string instrument;
  double rate = 0;         // events per second; 0: as fast as the daemon takes them
  int seed_window = 0;     // the first N events seed the state (SeedStream); streaming starts at event N + 1
  bool reseed = false;     // seed even an instrument that already has events, replacing its live state
  int64_t first = 0;       // the first event of the files to use (0-based): seed window and stream start there
  int64_t count = 0;       // events to use from `first` on; 0: all the rest
  uint64_t start_seq = 1;  // the sequence number of event `first`; the events after it follow on
};

// What StreamLobster checks of `options` before it reads the files or calls the daemon (perceptionctl checks it
// before --wait waits): INVALID_ARGUMENT naming the flag.
absl::Status CheckStreamOptions(const StreamOptions& options);

// Replays the files as a live feed of one instrument, the k-th event used (0-based, seed window included) with
// sequence number start_seq + k, and returns once the daemon acknowledged the last one; prints events/s. Refuses
// to seed an instrument that already has events unless `reseed`. A failure says through which sequence number the
// daemon acknowledged and the flags that resume from there. `interruption`'s first signal stops the sending, the
// events sent are waited for, and the run fails CANCELLED saying where to resume; its second cancels the call.
absl::Status StreamLobster(PerceptionClient& client, const StreamOptions& options,
                           Interruption* interruption = nullptr);

// Events before the resume point that seed the state of an instrument a restarted daemon no longer holds, where the
// failed run had no --seed-window (the demo's seed).
inline constexpr int64_t kResumeSeedEvents = 500;

// The end of a failed `stream`'s error once the daemon acknowledged through `acked` of the `n` events used (seed
// window included): the flags that resume after it, or, when it acknowledged the last one, that nothing is left to
// resume; with none acknowledged (0), how to resume from the instrument's end_seq, since the daemon may have taken
// some. Where the call ended UNAVAILABLE (`code`: the daemon drained, lost its device or could not be
// reached) the resume seeds the state again from the events before it: a daemon that restarted holds none for the
// instrument, and a plain resume would start it from zero without a word.
std::string ResumeAdvice(const StreamOptions& options, int64_t n, uint64_t acked, absl::StatusCode code);

// The end of a failed `stream`'s error where the failure stopped the instrument (a failed tick, an output not
// finite): the resume flags alone are refused ("stopped at seq N") until a reset or a seed. The seed's flags are
// spelled out (--first, --start_seq and --count moved back by the window): --seed-window added to the plain resume's,
// as this once advised, seeded with the events after the resume point, and the renumbering that its refusal then
// suggested put every later conviction on another event's number.
std::string StoppedResumeAdvice(const StreamOptions& options, int64_t n, uint64_t acked);

// Where a seeded stream of `n` events (seed window included) would not start at the instrument's next sequence number
// `next`: the --start_seq that starts it there (naming the files' event that then takes `next`), and, where that
// event is one of the command's, the --first (and --count, the same last event kept) that keep the command's
// numbering (event i as seq i + (start_seq − first)). Which one is right depends on which event `next` belongs to:
// --start_seq alone, all this once advised, put a resume's later convictions on other events' numbers where --first
// had not been moved back by the seed window. Empty where no sequence number from 1 reaches `next`.
std::string SeedingContinuation(const StreamOptions& options, int64_t n, uint64_t next);

// `perceptionctl streams`: a row per live stream (its slot, processed and pending events, the retained log's sequence
// numbers), under it why a stopped stream takes no events and whether a SeedStream runs on it.
std::string StreamsTable(const v1::ListStreamsResponse& response);

// Writes every retained conviction of `instrument` from `from_seq` on as CSV: a header row, then
// `seq,conviction,p1,...,pH` per event; prints what it wrote. `from_seq` 0 starts at the log's oldest entry, and
// starts over (a few times) should the stream overwrite what the read has yet to reach. The file is replaced only
// once every page is in, so a refused read leaves an existing file as it was.
// What WriteConvictions checks of its arguments before it calls the daemon, `out_path` writable among them.
absl::Status CheckConvictionsOptions(const std::string& instrument, const std::string& out_path);

absl::Status WriteConvictions(PerceptionClient& client, const std::string& instrument, uint64_t from_seq,
                              const std::string& out_path);

struct BenchOptions {
  int instruments = 1;
  int64_t events = 10000;  // in all, spread round-robin over the instruments
  double rate = 0;         // events per second in all; 0: as fast as the daemon takes them
  int connections = 1;     // Stream calls, each with its share of the instruments
  int in_flight = 8;       // unacknowledged requests per connection (each holds one event per instrument)
};

// The most events one bench keeps the latencies of.
inline constexpr int64_t kMaxBenchEvents = 100'000'000;

// What Bench checks of `options` before it calls the daemon.
absl::Status CheckBenchOptions(const BenchOptions& options);

// A load generator of synthetic feature events; reports events/s, latency (send to acknowledgement) p50, p99 and
// p99.9, and what the daemon refused. Its instruments are named bench-0, bench-1, ...; at the end it closes those
// the daemon has a stream of. Interrupted (`interruption`, may be null), it sends no further event, reports the
// events sent once acknowledged, closes its instruments all the same, and returns CANCELLED.
absl::Status Bench(PerceptionClient& client, const BenchOptions& options, Interruption* interruption = nullptr);

}  // namespace perception::client
