// Host-side bookkeeping of live streams: instrument → state slot, sequence numbers, conviction-log rings.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/lobster.h"

namespace perception {

// Which instruments own which backend slots, and where each processed event's conviction sits in its slot's log.
// Sequence numbers are contiguous per instrument: the first event may carry any number, each later one must carry
// the previous + 1, so that nothing is lost or processed twice and a log entry's sequence number follows from its
// position. Each slot's log is a ring of `log_entries_per_slot` entries; older entries are overwritten (counted).
// The conviction values themselves live in the backend (device memory for CUDA); this table holds only indices.
// Not thread-safe: the daemon's stream batcher owns it.
class StreamTable {
 public:
  StreamTable(int slots, int64_t log_entries_per_slot);

  int capacity() const { return static_cast<int>(slots_.size()); }
  int64_t log_entries_per_slot() const { return log_entries_; }
  int active() const { return static_cast<int>(by_instrument_.size()); }
  uint64_t overwritten_total() const { return overwritten_total_; }

  // The instrument's slot, NOT_FOUND if it has none.
  absl::StatusOr<int> SlotOf(const std::string& instrument) const;
  // The instrument's slot, opening one on first use; RESOURCE_EXHAUSTED when every slot is taken.
  absl::StatusOr<int> Open(const std::string& instrument);
  // Frees the instrument's slot and forgets its log; the caller also resets the backend's slot state.
  absl::Status Close(const std::string& instrument);

  // Whether the slot would accept `seq`: it must be NextSeq where it has one (INVALID_ARGUMENT naming it otherwise),
  // and below UINT64_MAX so that one past it has a number.
  absl::Status CheckNextSeq(int slot, uint64_t seq) const;
  // Receipt of an event whose `seq` CheckNextSeq takes (its error otherwise). Accepted events are then processed in
  // order.
  absl::Status Accept(int slot, uint64_t seq);
  // The sequence number the slot takes next: the last accepted + 1, or its first accepted where every event it took
  // was dropped; none (any number) before its first event.
  std::optional<uint64_t> NextSeq(int slot) const;
  // The number of the log entry that the slot's oldest accepted, unprocessed event takes (entries are numbered from 0
  // in the stream's processing order; the ring keeps number n at position n mod log_entries_per_slot).
  int64_t NextLogEntry(int slot) const;
  // That event's tick launches under `weights_version`: its entry (NextLogEntry) joins the log, unfinished (the
  // device has yet to finish it) until TickFinished; a tick that fails drops it (DropFrom).
  void Append(int slot, uint64_t weights_version);
  // The device finished the tick of the slot's oldest unfinished entry: Range and List count it from now on.
  // INTERNAL (and nothing changes) where the slot has no unfinished entry: the caller's bookkeeping of launched ticks
  // has gone wrong.
  absl::Status TickFinished(int slot);
  // The slot's accepted events not yet processed are dropped: the next event accepted must carry the last
  // processed sequence number + 1 (the first one accepted, where none was processed).
  void ForgetUnprocessed(int slot);
  // The sequence number of the slot's log entry `entry` (< processed(slot)).
  uint64_t SeqOfEntry(int slot, int64_t entry) const;
  // The entry number that the slot's accepted event `seq` takes, or took.
  int64_t EntryOfSeq(int slot, uint64_t seq) const;
  // Entries from number `entry` on leave the log (their outputs were not finite, or their ticks' fate is unknown),
  // with every accepted event after them: the log ends before it, and the next event accepted must carry its sequence
  // number.
  void DropFrom(int slot, int64_t entry);
  // Entries in the log, finished or not.
  uint64_t processed(int slot) const { return slots_[slot].processed; }
  // Of them, those whose ticks the device has finished (the oldest ones).
  uint64_t finished(int slot) const { return slots_[slot].processed - slots_[slot].unfinished; }

  struct Segment {
    int64_t ring_begin;  // index in the slot's ring
    int64_t count;
  };
  struct LogRange {
    uint64_t first_seq = 0;  // sequence number of the first entry returned
    int64_t count = 0;
    std::vector<Segment> segments;  // at most two, in order (the ring may wrap)
    uint64_t min_weights_version = 0, max_weights_version = 0;
    uint64_t oldest_retained_seq = 0, next_seq = 0;  // what the log holds now: [oldest, next)
  };
  // Up to `max_count` finished entries from `from_seq` on (from the oldest retained when from_seq is older and
  // nothing was overwritten). OUT_OF_RANGE naming the oldest retained sequence number when entries at or after
  // from_seq have been overwritten.
  absl::StatusOr<LogRange> Range(int slot, uint64_t from_seq, int64_t max_count) const;
  // A read returned the slot's entries up to `next_seq` (exclusive; ReadConvictionsResponse.next_seq): the client
  // has caught up to there, whatever it skipped before.
  void MarkRead(int slot, uint64_t next_seq);
  // Entries the logs still hold that no read has reached (MarkRead), and how many streams have any: what a client
  // would lose if the logs went now.
  struct UnreadEntries {
    uint64_t entries = 0;
    int streams = 0;
  };
  UnreadEntries Unread() const;

  // The per-instrument LOBSTER featurizer (previous mid and time), created on first use with `levels`;
  // INVALID_ARGUMENT if the instrument's book rows had another level count before.
  absl::StatusOr<LobsterFeaturizer*> Featurizer(int slot, int levels);
  // Starts the instrument's stream afresh (featurizer forgotten); sequence numbers and the log continue.
  void ResetFeatures(int slot);

  struct InstrumentInfo {
    std::string instrument;
    int slot;
    uint64_t finished;  // events processed since the stream opened, their ticks finished
    uint64_t unfinished;  // events whose ticks the device may still be running
    std::optional<uint64_t> last_seq;  // last accepted sequence number
    std::optional<uint64_t> next_seq;  // NextSeq
  };
  // At most `max_count` instruments, in byte order of their ids from `from` on (inclusive), and the id that follows
  // the last listed (nullopt at the end): work in proportion to the count, not to the streams open.
  struct InstrumentPage {
    std::vector<InstrumentInfo> instruments;
    std::optional<std::string> next;
  };
  InstrumentPage List(absl::string_view from, size_t max_count) const;

 private:
  struct Slot {
    std::string instrument;
    std::optional<uint64_t> first_seq, last_accepted;
    uint64_t processed = 0;
    uint64_t unfinished = 0;  // the newest of the processed entries whose ticks may still run
    // The oldest entry the ring still holds. The retained entries, [oldest, processed), are at most a ring's length
    // and each at its own position; entries DropFrom took out stay written at theirs until appended again.
    uint64_t oldest = 0;
    uint64_t read = 0;  // entries of the whole history up to the furthest read's end (MarkRead)
    std::vector<uint64_t> weights_versions;  // ring, sized on open
    std::unique_ptr<LobsterFeaturizer> featurizer;
  };

  std::vector<Slot> slots_;
  std::vector<int> free_slots_;  // a stack: the most recently freed slot is reused first
  std::unordered_map<std::string, int> by_instrument_;
  absl::btree_set<std::string> ordered_;  // by_instrument_'s ids in byte order, for List's pages
  int64_t log_entries_;
  uint64_t overwritten_total_ = 0;
};

}  // namespace perception
