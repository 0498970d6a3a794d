// LOBSTER reader, feature transform and labels (MODEL.md §1.1–§1.2).
#include "engine/lobster.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/config.h"
#include "engine/input_file.h"
#include "engine/status_macros.h"

namespace perception {
namespace {

constexpr int kMessageColumns = 6;
constexpr double kBasisPoints = 1e4;

// The shortest text that reads back as `seconds`: StrCat's six significant digits would print two close
// message times alike.
std::string FormatTime(double seconds) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof(text), seconds);
  return std::string(text, error == std::errc() ? end : text);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::error_code error;
  // A folder opens as a stream and reads as nothing, which would be reported as a file without rows.
  if (std::filesystem::is_directory(path, error)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is a folder, not a LOBSTER file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return InputNotOpened(errno != 0 ? errno : EIO, absl::StrCat("cannot open ", path));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return std::move(text).str();
}

constexpr absl::string_view kUtf8ByteOrderMark = "\xEF\xBB\xBF";

// A field as an error quotes it: bytes that do not print (a carriage return, a byte-order mark) escaped, where the
// terminal showed a field that looked valid, or a line overwritten by the message's own tail.
std::string Shown(absl::string_view field) {
  std::string shown;
  for (const char c : field) {
    if (c == '\r') {
      shown += "\\r";
    } else if (c == '\t') {
      shown += "\\t";
    } else if (absl::ascii_isprint(static_cast<unsigned char>(c))) {
      shown += c;
    } else {
      absl::StrAppend(&shown, "\\x", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    }
  }
  return shown;
}

// A CSV file in memory, walked line by line so that every error can name "<path>:<line>".
class CsvLines {
 public:
  // A UTF-8 byte-order mark (a spreadsheet's export) is not part of the first field.
  CsvLines(const std::string& path, std::string text) : path_(path), text_(std::move(text)) {
    if (absl::StartsWith(text_, kUtf8ByteOrderMark)) position_ = kUtf8ByteOrderMark.size();
  }

  // Advances to the next line and splits it at commas; false once the text is used up. Empty lines at the end
  // are not rows: an editor or a concatenation easily leaves one, and refusing the whole file for it helps no one.
  bool Next() {
    if (text_.find_first_not_of("\r\n", position_) == std::string::npos) return false;
    size_t end = text_.find('\n', position_);
    if (end == std::string::npos) end = text_.size();
    absl::string_view line(text_.data() + position_, end - position_);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    position_ = end + 1;
    ++line_number_;
    Split(line);
    return true;
  }

  const std::vector<absl::string_view>& fields() const { return fields_; }
  int line_number() const { return line_number_; }

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ":", line_number_, ": ", what));
  }
  absl::Status ColumnCountError(size_t expected, absl::string_view why) const {
    return Error(absl::StrCat("found ", fields_.size(), " columns, expected ", expected, why));
  }

  absl::Status ParseInteger(size_t column, int64_t& value) const {
    const absl::string_view field = fields_[column];
    const auto [end, error] = std::from_chars(field.data(), field.data() + field.size(), value);
    if (error == std::errc::result_out_of_range && end == field.data() + field.size()) {
      return Error(absl::StrCat("column ", column + 1, " is out of a 64-bit integer's range: '", Shown(field), "'"));
    }
    if (field.empty() || error != std::errc() || end != field.data() + field.size()) {
      return Error(absl::StrCat("column ", column + 1, " is not an integer: '", Shown(field), "'"));
    }
    return absl::OkStatus();
  }

  absl::Status ParseTime(size_t column, double& value) const {
    const absl::string_view field = fields_[column];
    const auto [end, error] = std::from_chars(field.data(), field.data() + field.size(), value);
    if (field.empty() || error != std::errc() || end != field.data() + field.size() || !std::isfinite(value)) {
      return Error(absl::StrCat("column ", column + 1, " is not a time in seconds: '", Shown(field), "'"));
    }
    return absl::OkStatus();
  }

 private:
  void Split(absl::string_view line) {
    fields_.clear();
    size_t start = 0;
    for (size_t comma = line.find(','); comma != absl::string_view::npos; comma = line.find(',', start)) {
      fields_.push_back(line.substr(start, comma - start));
      start = comma + 1;
    }
    fields_.push_back(line.substr(start));
  }

  std::string path_;
  std::string text_;
  size_t position_ = 0;
  int line_number_ = 0;
  std::vector<absl::string_view> fields_;
};

// Takes the file's column count from its first row (a multiple of 4) and data.levels from it when 0, then checks
// every row: as wide as the first, which holds at least data.levels levels (a deeper file gives its first ones).
absl::Status CheckOrderbookColumns(const CsvLines& lines, LobsterData& data, size_t& file_columns) {
  const size_t columns = lines.fields().size();
  if (file_columns == 0) {
    if (columns % 4 != 0) {
      return lines.Error(
          absl::StrCat("found ", columns, " columns, not a multiple of 4 (ask_px, ask_sz, bid_px, bid_sz per level)"));
    }
    if (data.levels == 0) data.levels = static_cast<int>(columns / 4);
    const size_t needed = 4 * static_cast<size_t>(data.levels);
    if (columns < needed) {
      return lines.Error(absl::StrCat("found ", columns, " columns, expected at least ", needed, " (4 per level, ",
                                      data.levels, " levels)"));
    }
    file_columns = columns;
  }
  if (columns != file_columns) {
    return lines.ColumnCountError(file_columns, absl::StrCat(" (4 per level, ", file_columns / 4, " levels)"));
  }
  return absl::OkStatus();
}

absl::Status ReadOrderbook(const std::string& path, LobsterData& data) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  CsvLines lines(path, std::move(text));
  size_t file_columns = 0;
  while (lines.Next()) {
    RETURN_IF_ERROR(CheckOrderbookColumns(lines, data, file_columns));
    const size_t row_start = data.book.size(), kept = 4 * static_cast<size_t>(data.levels);
    data.book.resize(row_start + file_columns);
    for (size_t column = 0; column < file_columns; ++column) {
      RETURN_IF_ERROR(lines.ParseInteger(column, data.book[row_start + column]));
    }
    data.book.resize(row_start + kept);
    const absl::Status row = ValidateBookRow(std::span<const int64_t>(data.book).subspan(row_start));
    if (!row.ok()) return lines.Error(row.message());
  }
  if (lines.line_number() == 0) return absl::InvalidArgumentError(absl::StrCat(path, ": no rows"));
  return absl::OkStatus();
}

absl::StatusOr<LobsterMessage> ParseMessage(const CsvLines& lines) {
  if (lines.fields().size() != kMessageColumns) return lines.ColumnCountError(kMessageColumns, "");
  LobsterMessage message;
  int64_t type = 0, direction = 0;
  RETURN_IF_ERROR(lines.ParseTime(0, message.time));
  RETURN_IF_ERROR(lines.ParseInteger(1, type));
  RETURN_IF_ERROR(lines.ParseInteger(2, message.order_id));
  RETURN_IF_ERROR(lines.ParseInteger(3, message.size));
  RETURN_IF_ERROR(lines.ParseInteger(4, message.price));
  RETURN_IF_ERROR(lines.ParseInteger(5, direction));
  if (const absl::Status valid = ValidateTypeAndDirection(type, direction); !valid.ok()) {
    return lines.Error(valid.message());
  }
  message.type = static_cast<int>(type);
  message.direction = static_cast<int>(direction);
  return message;
}

absl::Status ReadMessages(const std::string& path, LobsterData& data) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  CsvLines lines(path, std::move(text));
  while (lines.Next()) {
    ASSIGN_OR_RETURN(LobsterMessage message, ParseMessage(lines));
    if (!data.messages.empty() && message.time < data.messages.back().time) {
      return lines.Error(absl::StrCat("time ", FormatTime(message.time), " is earlier than the previous line's ",
                                      FormatTime(data.messages.back().time)));
    }
    data.messages.push_back(message);
  }
  if (lines.line_number() == 0) return absl::InvalidArgumentError(absl::StrCat(path, ": no rows"));
  return absl::OkStatus();
}

// Names the first line that one file has and the other lacks.
absl::Status CheckRowCounts(const LobsterData& data) {
  const size_t book_rows = data.book.size() / (4 * static_cast<size_t>(data.levels));
  const size_t message_rows = data.messages.size();
  if (book_rows == message_rows) return absl::OkStatus();
  const bool book_longer = book_rows > message_rows;
  const size_t shorter = book_longer ? message_rows : book_rows;
  return absl::InvalidArgumentError(absl::StrCat(
      book_longer ? data.orderbook_path : data.message_path, ":", shorter + 1, ": row has no counterpart in ",
      book_longer ? data.message_path : data.orderbook_path, ", which has only ", shorter, " rows"));
}

// One side of one level: (price − mid)/mid·1e4 and log1p(size), or 0 and 0 for an empty level. The
// numerator 2·price − (ask_px1 + bid_px1) is exact in integers.
void WriteSide(int64_t price, int64_t size, int64_t empty_price, int64_t doubled_mid, float* out) {
  if (price == empty_price) {
    out[0] = 0.f;
    out[1] = 0.f;
    return;
  }
  out[0] = static_cast<float>(static_cast<double>(2 * price - doubled_mid) / doubled_mid * kBasisPoints);
  out[1] = static_cast<float>(std::log1p(static_cast<double>(size)));
}

double Imbalance(int64_t ask_size, int64_t bid_size) {
  const int64_t total = bid_size + ask_size;
  return total == 0 ? 0.0 : static_cast<double>(bid_size - ask_size) / total;
}

// (mid/previous_mid − 1)·1e4, 0 for the first event. The ratio of doubled mids equals the ratio of mids, and
// the numerator, a difference of integers, is exact.
double MidReturn(int64_t doubled_mid, std::optional<int64_t> previous_doubled_mid) {
  if (!previous_doubled_mid.has_value()) return 0.0;
  return static_cast<double>(doubled_mid - *previous_doubled_mid) / *previous_doubled_mid * kBasisPoints;
}

}  // namespace

absl::StatusOr<LobsterData> ReadLobster(const std::string& orderbook_path, const std::string& message_path,
                                        int levels) {
  if (levels < 0) return absl::InvalidArgumentError(absl::StrCat("levels must be >= 0, got ", levels));
  LobsterData data;
  data.levels = levels;
  data.orderbook_path = orderbook_path;
  data.message_path = message_path;
  RETURN_IF_ERROR(ReadOrderbook(orderbook_path, data));
  RETURN_IF_ERROR(ReadMessages(message_path, data));
  RETURN_IF_ERROR(CheckRowCounts(data));
  return data;
}

absl::Status CheckLobsterFeatureCount(int levels, int n_features, absl::string_view consumer) {
  if (LobsterFeatureCount(levels) == n_features) return absl::OkStatus();
  const int model_levels = (n_features - 8) / 4;
  const bool a_book_fits = n_features > 8 && (n_features - 8) % 4 == 0;
  std::string remedy;
  if (a_book_fits && model_levels < levels) {
    remedy = absl::StrCat("; --levels ", model_levels, " reads the file's first ", model_levels);
  } else if (!a_book_fits) {
    // A preset's own feature count (tiny's 6) that no book gives: the model must be made for the files.
    remedy = absl::StrCat("; no LOBSTER book gives ", n_features, " (4 per level + 8): make the model for these files ",
                          "with --levels ", levels, " (perceptiond: --init_levels ", levels, ")");
  }
  return absl::InvalidArgumentError(absl::StrCat(consumer, " takes ", n_features, " features but ", levels,
                                                 " book levels give ", LobsterFeatureCount(levels), remedy));
}

absl::Status ValidateBookRow(std::span<const int64_t> book_row) {
  if (book_row.size() < 4) {
    return absl::InvalidArgumentError(absl::StrCat("book row has ", book_row.size(), " values, level 1 needs 4"));
  }
  const int64_t ask = book_row[0], bid = book_row[2];
  if (bid <= 0 || ask <= bid || ask >= kEmptyAskPrice) {
    return absl::InvalidArgumentError(absl::StrCat("no mid: level 1 has ask ", ask, " and bid ", bid,
                                                   " (both sides need a real price, with ask > bid)"));
  }
  constexpr int64_t kMaxSize = int64_t{1} << 53;
  for (size_t i = 0; i < book_row.size(); ++i) {
    const int64_t value = book_row[i];
    const bool ask_side = i % 4 < 2, is_size = i % 2 == 1;
    const int64_t empty_price = ask_side ? kEmptyAskPrice : kEmptyBidPrice;
    const bool size_in_range = value >= 0 && value <= kMaxSize;
    // An empty level has size 0 (MODEL.md §1.1): shares beside the dummy price mean a garbled row, whose size the
    // featurizer would silently drop.
    const bool size_on_empty_level = is_size && value != 0 && book_row[i - 1] == empty_price;
    const bool valid = is_size ? size_in_range && !size_on_empty_level
                               : value == empty_price || (value > 0 && value < kEmptyAskPrice);
    if (valid) continue;
    const std::string what =
        absl::StrCat("level ", i / 4 + 1, ask_side ? " ask " : " bid ", is_size ? "size " : "price ", value);
    if (!is_size) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is neither a price in 1..", kEmptyAskPrice - 1,
                                                     " (1e-4 dollars) nor the empty level's ", empty_price));
    }
    return absl::InvalidArgumentError(
        size_in_range ? absl::StrCat(what, " is not 0 beside the empty level's price ", empty_price)
                      : absl::StrCat(what, " is not a share count in 0..2^53"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTypeAndDirection(int64_t type, int64_t direction) {
  if (type < 1 || type > 7) return absl::InvalidArgumentError(absl::StrCat("event type ", type, " is not in 1..7"));
  if (direction != 1 && direction != -1) {
    return absl::InvalidArgumentError(absl::StrCat("direction ", direction, " is not +1 or -1"));
  }
  return absl::OkStatus();
}

int64_t TimeNanoseconds(double seconds) { return std::llround(seconds * 1e9); }

namespace {

int64_t MessageNanoseconds(const LobsterMessage& message) {
  return message.time_ns.value_or(TimeNanoseconds(message.time));
}

}  // namespace

LobsterFeaturizer::LobsterFeaturizer(int levels) : levels_(levels) {}

std::string LobsterFeatureName(int feature, int levels) {
  static constexpr const char* kLevelColumns[] = {"ask_px", "ask_sz", "bid_px", "bid_sz"};
  static constexpr const char* kTail[] = {"imbalance", "mid_return", "type1", "type2",
                                          "type3",     "type4",      "type5", "direction"};
  const int book_features = 4 * levels;
  if (feature >= 0 && feature < book_features) return absl::StrCat(kLevelColumns[feature % 4], feature / 4 + 1);
  if (feature >= book_features && feature < LobsterFeatureCount(levels)) return kTail[feature - book_features];
  return absl::StrCat("feature ", feature);
}

int LobsterFeaturizer::n_features() const { return LobsterFeatureCount(levels_); }

absl::Status LobsterFeaturizer::Validate(std::span<const int64_t> book_row, const LobsterMessage& message,
                                         std::span<float> features) const {
  if (book_row.size() != 4 * static_cast<size_t>(levels_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("book row has ", book_row.size(), " values, expected ", 4 * levels_, " for ", levels_, " levels"));
  }
  RETURN_IF_ERROR(ValidateBookRow(book_row));
  RETURN_IF_ERROR(ValidateTypeAndDirection(message.type, message.direction));
  if (features.size() != static_cast<size_t>(n_features())) {
    return absl::InvalidArgumentError(
        absl::StrCat("feature buffer has ", features.size(), " values, expected ", n_features()));
  }
  if (!(std::abs(message.time) <= kMaxLobsterTimeSeconds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("message time ", FormatTime(message.time), " is not within ±", kMaxLobsterTimeSeconds, " s"));
  }
  if (last_doubled_mid_.has_value() && MessageNanoseconds(message) < last_time_ns_) {
    return absl::InvalidArgumentError(absl::StrCat("time ", FormatTime(message.time),
                                                   " is earlier than the previous event's ",
                                                   FormatTime(static_cast<double>(last_time_ns_) * 1e-9)));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> LobsterFeaturizer::Next(std::span<const int64_t> book_row, const LobsterMessage& message,
                                               std::span<float> features) {
  RETURN_IF_ERROR(Validate(book_row, message, features));
  const int64_t doubled_mid = DoubledMid(book_row);
  float* out = features.data();
  for (int level = 0; level < levels_; ++level) {
    const int64_t* quote = book_row.data() + 4 * level;  // ask_px, ask_sz, bid_px, bid_sz
    WriteSide(quote[0], quote[1], kEmptyAskPrice, doubled_mid, out);
    WriteSide(quote[2], quote[3], kEmptyBidPrice, doubled_mid, out + 2);
    out += 4;
  }
  *out++ = static_cast<float>(Imbalance(book_row[1], book_row[3]));
  *out++ = static_cast<float>(MidReturn(doubled_mid, last_doubled_mid_));
  for (int type = 1; type <= 5; ++type) *out++ = message.type == type ? 1.f : 0.f;
  *out = static_cast<float>(message.direction);

  // From whole nanoseconds: the difference of the two doubles would carry their rounding (about 7e-12 s near
  // 34,200 s), which differs between a file's absolute times and a stream's times relative to its first event.
  const int64_t time_ns = MessageNanoseconds(message);
  const double dt = last_doubled_mid_.has_value() ? static_cast<double>(time_ns - last_time_ns_) * 1e-9 : 0.0;
  last_doubled_mid_ = doubled_mid;
  last_time_ns_ = time_ns;
  return dt;
}

void LobsterFeaturizer::Reset() {
  last_doubled_mid_.reset();
  last_time_ns_ = 0;
}

std::optional<double> LobsterFeaturizer::last_mid() const {
  if (!last_doubled_mid_.has_value()) return std::nullopt;
  return static_cast<double>(*last_doubled_mid_) / 2;
}

std::optional<int64_t> LobsterFeaturizer::last_time_ns() const {
  if (!last_doubled_mid_.has_value()) return std::nullopt;
  return last_time_ns_;
}

void ComputeLabels(std::span<const int64_t> doubled_mids, std::span<const int> horizons, std::span<float> labels,
                   std::span<float> mask) {
  const size_t n = doubled_mids.size(), n_horizons = horizons.size();
  // prefix[i] = Σ_{j<i} doubled_mids[j]; int64 holds it for any real price series (2e10 per mid, 4e8 events).
  std::vector<int64_t> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + doubled_mids[i];
  for (size_t t = 0; t < n; ++t) {
    for (size_t h = 0; h < n_horizons; ++h) {
      const size_t k = static_cast<size_t>(horizons[h]);
      const size_t at = t * n_horizons + h;
      if (t + k >= n) {
        labels[at] = 0.f;
        mask[at] = 0.f;
        continue;
      }
      // mean(mid[t+1..t+k]) vs mid[t], compared as sums so that "equal" is exact.
      const int64_t future_sum = prefix[t + k + 1] - prefix[t + 1];
      const int64_t present_sum = static_cast<int64_t>(k) * doubled_mids[t];
      labels[at] = future_sum > present_sum ? 1.f : 0.f;
      mask[at] = future_sum != present_sum ? 1.f : 0.f;
    }
  }
}

}  // namespace perception
