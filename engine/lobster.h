// LOBSTER order-book files: the reader, the streaming feature transform and the labels of MODEL.md §1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace perception {

// The dummy prices LOBSTER writes for an empty level (always with size 0).
inline constexpr int64_t kEmptyAskPrice = 9999999999;
inline constexpr int64_t kEmptyBidPrice = -9999999999;

// One row of a message file. `time` is seconds after midnight; prices are in 1e-4 dollars.
struct LobsterMessage {
  double time = 0;
  int type = 0;  // 1 new, 2 partial cancel, 3 delete, 4 visible execution, 5 hidden execution, 7 halt
  int64_t order_id = 0;
  int64_t size = 0;
  int64_t price = 0;
  int direction = 0;  // +1 buy (bid side), -1 sell (ask side)
  // The time in whole nanoseconds where the source has them (a stream's exchange_time_ns, relative to its first
  // event), taken instead of rounding `time`: exact at any distance, where a double of seconds rounds the nanoseconds
  // from 2^51 ns (26 days) on.
  std::optional<int64_t> time_ns = std::nullopt;
};

struct LobsterData {
  int levels = 0;
  std::vector<int64_t> book;             // [n, 4*levels]: ask_px, ask_sz, bid_px, bid_sz per level, as in the file
  std::vector<LobsterMessage> messages;  // [n]
  // Where the rows came from, so that later errors can name the line; empty for data built in memory.
  std::string orderbook_path, message_path;

  size_t size() const { return messages.size(); }
  std::span<const int64_t> BookRow(size_t i) const {
    const size_t width = 4 * static_cast<size_t>(levels);
    return std::span<const int64_t>(book).subspan(i * width, width);
  }
};

// Reads a LOBSTER orderbook file and its message file (no header rows). levels = 0 infers the level count
// from the orderbook's column count (a multiple of 4); levels below the file's take its first (best) levels. Every
// error names the file and its 1-based line: wrong column count, a non-numeric field, a type outside 1..7 or a
// direction other than ±1, decreasing times, a book row ValidateBookRow refuses and row counts that differ between
// the two files.
absl::StatusOr<LobsterData> ReadLobster(const std::string& orderbook_path, const std::string& message_path,
                                        int levels = 0);

// OK when `levels` book levels give the `n_features` that `consumer` ("the model", "the checkpoint") takes; else
// INVALID_ARGUMENT saying so, and which --levels reads a deeper file's first levels when that would fit.
absl::Status CheckLobsterFeatureCount(int levels, int n_features, absl::string_view consumer);

// OK when level 1 of `book_row` holds a real price on both sides with ask > bid (MODEL.md §1.1), so the event has
// a mid, and every level's prices are real (positive, below the empty ask's) or its side's empty-level dummy, its
// sizes lie in 0..2^53 (exact in a double, and their sums fit an int64) and a side at the dummy has size 0;
// INVALID_ARGUMENT naming the first value that is not.
absl::Status ValidateBookRow(std::span<const int64_t> book_row);
// OK for a message type in 1..7 and a direction of ±1; INVALID_ARGUMENT otherwise.
absl::Status ValidateTypeAndDirection(int64_t type, int64_t direction);

// ask_px1 + bid_px1: twice the mid, kept as an integer so that comparisons of mids are exact.
inline int64_t DoubledMid(std::span<const int64_t> book_row) { return book_row[0] + book_row[2]; }

// Message times the featurizer accepts: within ±1e9 s (31 years) of their origin, so that nanoseconds fit an int64.
inline constexpr double kMaxLobsterTimeSeconds = 1e9;

// A message time in seconds as whole nanoseconds, rounded to the nearest. Exact for a time written with at most 9
// decimals (as LOBSTER writes them) and below 2^22 s (48 days): the double nearest the decimal is then within
// 0.02 ns of it, once scaled. Δt is computed from whole nanoseconds (these, or a stream's own:
// LobsterMessage::time_ns), so that the file's times after midnight and a stream's times relative to its first event
// (server/stream_batcher.cc) give the same bits.
int64_t TimeNanoseconds(double seconds);

// The name of feature `feature` of MODEL.md §1.1's LOBSTER transform of `levels` book levels, for messages: ask_px1,
// ask_sz1, bid_px1, bid_sz1, …, imbalance, mid_return, type1 … type5, direction; "feature <index>" past them.
std::string LobsterFeatureName(int feature, int levels);

// The feature transform of MODEL.md §1.1 for ONE stream; it keeps the previous mid and message time.
class LobsterFeaturizer {
 public:
  explicit LobsterFeaturizer(int levels);

  int levels() const { return levels_; }
  int n_features() const;  // 4*levels + 8

  // Writes the features (in MODEL.md order, computed in double) into `features` (size n_features()) and returns Δt in
  // seconds, (ns − previous ns)·1e-9 of the message's time_ns or else TimeNanoseconds of its time (0 for the first
  // event of the stream). A book row of the wrong size or one ValidateBookRow refuses, a message
  // ValidateTypeAndDirection refuses, a time beyond kMaxLobsterTimeSeconds or earlier than the previous event or a
  // `features` of the wrong size gives INVALID_ARGUMENT and leaves the state (and `features`) unchanged.
  absl::StatusOr<double> Next(std::span<const int64_t> book_row, const LobsterMessage& message,
                              std::span<float> features);

  // Starts a new stream: the next event is a first event again.
  void Reset();

  // The mid of the last accepted event, in price units (1e-4 dollars); empty before the first.
  std::optional<double> last_mid() const;
  // The time of the last accepted event, in nanoseconds as its message gave it; empty before the first.
  std::optional<int64_t> last_time_ns() const;

 private:
  absl::Status Validate(std::span<const int64_t> book_row, const LobsterMessage& message,
                        std::span<float> features) const;

  int levels_;
  std::optional<int64_t> last_doubled_mid_;
  int64_t last_time_ns_ = 0;
};

// The labels of MODEL.md §1.2 for mids given doubled (ask_px1 + bid_px1), so that "equal" is exact:
// for event t and horizon k, label 1 if mean(mid[t+1..t+k]) > mid[t], 0 if below; mask 0 when equal or
// when t+k is past the data (the label is then 0 too). labels and mask are [n, H], H = horizons.size(),
// with n = doubled_mids.size(); every horizon must be >= 1.
void ComputeLabels(std::span<const int64_t> doubled_mids, std::span<const int> horizons, std::span<float> labels,
                   std::span<float> mask);

}  // namespace perception
