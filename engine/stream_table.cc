// Live-stream bookkeeping: slot assignment, contiguous sequence numbers, conviction-log rings.
#include "engine/stream_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/host_allocation.h"
#include "engine/status_macros.h"

namespace perception {

StreamTable::StreamTable(int slots, int64_t log_entries_per_slot)
    : slots_(std::max(slots, 0)), log_entries_(log_entries_per_slot) {
  for (int s = slots - 1; s >= 0; --s) free_slots_.push_back(s);
}

absl::StatusOr<int> StreamTable::SlotOf(const std::string& instrument) const {
  auto it = by_instrument_.find(instrument);
  if (it == by_instrument_.end()) return absl::NotFoundError(absl::StrCat("unknown instrument '", instrument, "'"));
  return it->second;
}

absl::StatusOr<int> StreamTable::Open(const std::string& instrument) {
  if (auto it = by_instrument_.find(instrument); it != by_instrument_.end()) return it->second;
  if (free_slots_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("all ", slots_.size(), " stream slots are in use; close a stream",
                                                     " or start the daemon with more (perceptiond --stream_slots)"));
  }
  // Allocated before the slot is taken: a log the host cannot hold refuses the stream and leaves the slot free.
  std::vector<uint64_t> weights_versions;
  RETURN_IF_ERROR(AllocateOrExhausted(
      absl::StrCat("the conviction log of a stream (", log_entries_, " entries; perceptiond --stream_log_entries)"),
      [&] { weights_versions.assign(log_entries_, 0); }));
  const int slot = free_slots_.back();
  free_slots_.pop_back();
  Slot& s = slots_[slot];
  s = Slot{};
  s.instrument = instrument;
  s.weights_versions = std::move(weights_versions);
  by_instrument_[instrument] = slot;
  ordered_.insert(instrument);
  return slot;
}

absl::Status StreamTable::Close(const std::string& instrument) {
  auto it = by_instrument_.find(instrument);
  if (it == by_instrument_.end()) return absl::NotFoundError(absl::StrCat("unknown instrument '", instrument, "'"));
  Slot& s = slots_[it->second];
  s = Slot{};
  free_slots_.push_back(it->second);
  ordered_.erase(instrument);
  by_instrument_.erase(it);
  return absl::OkStatus();
}

absl::Status StreamTable::CheckNextSeq(int slot, uint64_t seq) const {
  const Slot& s = slots_[slot];
  if (seq == UINT64_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("instrument '", s.instrument, "': sequence number ", seq,
                                                   " is the largest there is; numbers must stay below it"));
  }
  const std::optional<uint64_t> expected = NextSeq(slot);
  if (expected && seq != *expected) {
    return absl::InvalidArgumentError(absl::StrCat("instrument '", s.instrument, "': sequence number ", seq,
                                                   " out of order, expected ", *expected,
                                                   seq < *expected ? " (repeated)" : " (skipped)"));
  }
  return absl::OkStatus();
}

absl::Status StreamTable::Accept(int slot, uint64_t seq) {
  RETURN_IF_ERROR(CheckNextSeq(slot, seq));
  Slot& s = slots_[slot];
  if (!s.first_seq) s.first_seq = seq;
  s.last_accepted = seq;
  return absl::OkStatus();
}

std::optional<uint64_t> StreamTable::NextSeq(int slot) const {
  const Slot& s = slots_[slot];
  // (An instrument whose every event was dropped takes its first one again: DropFrom's "then from seq N".)
  return s.last_accepted ? std::optional(*s.last_accepted + 1) : s.first_seq;
}

int64_t StreamTable::NextLogEntry(int slot) const { return static_cast<int64_t>(slots_[slot].processed); }

void StreamTable::Append(int slot, uint64_t weights_version) {
  Slot& s = slots_[slot];
  // A full ring's next position holds its oldest entry; otherwise a free position or an entry DropFrom took out.
  if (s.processed - s.oldest == static_cast<uint64_t>(log_entries_)) {
    ++s.oldest;
    ++overwritten_total_;
  }
  s.weights_versions[s.processed % static_cast<uint64_t>(log_entries_)] = weights_version;
  ++s.processed;
  ++s.unfinished;
}

absl::Status StreamTable::TickFinished(int slot) {
  Slot& s = slots_[slot];
  if (s.unfinished == 0) {
    return absl::InternalError(absl::StrCat("slot ", slot, " (instrument '", s.instrument, "', ", s.processed,
                                            " entries) was told a tick finished, but none of its ticks is unfinished"));
  }
  --s.unfinished;
  return absl::OkStatus();
}

uint64_t StreamTable::SeqOfEntry(int slot, int64_t entry) const {
  return slots_[slot].first_seq.value_or(0) + static_cast<uint64_t>(entry);
}

int64_t StreamTable::EntryOfSeq(int slot, uint64_t seq) const {
  return static_cast<int64_t>(seq - *slots_[slot].first_seq);
}

void StreamTable::DropFrom(int slot, int64_t entry) {
  Slot& s = slots_[slot];
  const uint64_t first_unfinished = s.processed - s.unfinished;
  s.processed = std::min(s.processed, static_cast<uint64_t>(entry));
  s.unfinished = s.processed - std::min(s.processed, first_unfinished);
  s.read = std::min(s.read, s.processed);
  s.oldest = std::min(s.oldest, s.processed);
  ForgetUnprocessed(slot);
}

void StreamTable::ForgetUnprocessed(int slot) {
  Slot& s = slots_[slot];
  if (s.processed == 0) {
    s.last_accepted.reset();  // (first_seq stays: the next event accepted must carry it)
  } else {
    s.last_accepted = *s.first_seq + s.processed - 1;
  }
}

absl::StatusOr<StreamTable::LogRange> StreamTable::Range(int slot, uint64_t from_seq, int64_t max_count) const {
  const Slot& s = slots_[slot];
  LogRange range;
  const uint64_t first = s.first_seq.value_or(0);
  const uint64_t oldest_retained = s.oldest;
  range.next_seq = first + finished(slot);
  range.oldest_retained_seq = first + std::min(oldest_retained, finished(slot));
  if (from_seq < range.oldest_retained_seq && oldest_retained > 0) {
    return absl::OutOfRangeError(absl::StrCat("instrument '", s.instrument, "': convictions before sequence number ",
                                              range.oldest_retained_seq, " were overwritten (asked from ", from_seq,
                                              "); the oldest retained is ", range.oldest_retained_seq));
  }
  range.first_seq = std::max(from_seq, range.oldest_retained_seq);
  if (range.first_seq >= range.next_seq || max_count <= 0) {
    range.first_seq = std::min(range.first_seq, range.next_seq);
    return range;
  }
  range.count = static_cast<int64_t>(std::min<uint64_t>(range.next_seq - range.first_seq, max_count));
  const uint64_t processed_index = range.first_seq - first;  // position in the instrument's whole history
  int64_t ring = static_cast<int64_t>(processed_index % static_cast<uint64_t>(log_entries_));
  const int64_t head = std::min<int64_t>(range.count, log_entries_ - ring);
  range.segments.push_back({ring, head});
  if (head < range.count) range.segments.push_back({0, range.count - head});
  range.min_weights_version = UINT64_MAX;
  for (const Segment& seg : range.segments) {
    for (int64_t i = seg.ring_begin; i < seg.ring_begin + seg.count; ++i) {
      range.min_weights_version = std::min(range.min_weights_version, s.weights_versions[i]);
      range.max_weights_version = std::max(range.max_weights_version, s.weights_versions[i]);
    }
  }
  return range;
}

void StreamTable::MarkRead(int slot, uint64_t next_seq) {
  Slot& s = slots_[slot];
  if (!s.first_seq || next_seq <= *s.first_seq) return;
  s.read = std::max(s.read, std::min(next_seq - *s.first_seq, s.processed));
}

StreamTable::UnreadEntries StreamTable::Unread() const {
  UnreadEntries unread;
  for (const auto& [instrument, slot] : by_instrument_) {
    const Slot& s = slots_[slot];
    const uint64_t entries = s.processed - std::max(s.read, s.oldest);
    unread.entries += entries;
    unread.streams += entries > 0 ? 1 : 0;
  }
  return unread;
}

absl::StatusOr<LobsterFeaturizer*> StreamTable::Featurizer(int slot, int levels) {
  Slot& s = slots_[slot];
  if (!s.featurizer) s.featurizer = std::make_unique<LobsterFeaturizer>(levels);
  if (s.featurizer->levels() != levels) {
    return absl::InvalidArgumentError(absl::StrCat("instrument '", s.instrument, "': book row has ", levels,
                                                   " levels, earlier rows had ", s.featurizer->levels()));
  }
  return s.featurizer.get();
}

void StreamTable::ResetFeatures(int slot) { slots_[slot].featurizer.reset(); }

StreamTable::InstrumentPage StreamTable::List(absl::string_view from, size_t max_count) const {
  InstrumentPage page;
  auto it = ordered_.lower_bound(from);
  for (; it != ordered_.end() && page.instruments.size() < max_count; ++it) {
    const int slot = by_instrument_.at(*it);
    const Slot& s = slots_[slot];
    page.instruments.push_back({*it, slot, finished(slot), s.unfinished, s.last_accepted, NextSeq(slot)});
  }
  if (it != ordered_.end()) page.next = *it;
  return page;
}

}  // namespace perception
