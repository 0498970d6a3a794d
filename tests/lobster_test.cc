// Tests of the LOBSTER reader, the feature transform and the labels against hand-computed rows of the shipped files.
#include "engine/lobster.h"

#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/lobster_samples.h"

namespace perception {
namespace {

using ::testing::HasSubstr;
using testing::ShippedLobsterPath;

constexpr int kAaplFeatures = 48;  // 4·10 + 8
constexpr int kAmznFeatures = 12;  // 4·1 + 8
// Offsets of the trailing features (after the 4·levels book features), MODEL.md §1.1 order.
constexpr int kImbalance = 0, kMidReturn = 1, kTypeOneHot = 2, kDirection = 7;

LobsterData ReadShipped(const std::string& stock, int levels) {
  absl::StatusOr<LobsterData> data =
      ReadLobster(ShippedLobsterPath(stock, "orderbook", levels), ShippedLobsterPath(stock, "message", levels));
  EXPECT_TRUE(data.ok()) << data.status();
  return data.ok() ? *std::move(data) : LobsterData{};
}

LobsterData Aapl() { return ReadShipped("AAPL", 10); }
LobsterData Amzn() { return ReadShipped("AMZN", 1); }

// The features and Δt of file line `line` (1-based), streaming every earlier line first.
struct Featurized {
  std::vector<float> features;
  double dt = -1;
};
Featurized FeaturizeLine(const LobsterData& data, size_t line) {
  LobsterFeaturizer featurizer(data.levels);
  Featurized out{std::vector<float>(featurizer.n_features()), -1};
  for (size_t i = 0; i < line; ++i) {
    absl::StatusOr<double> dt = featurizer.Next(data.BookRow(i), data.messages[i], out.features);
    EXPECT_TRUE(dt.ok()) << "line " << i + 1 << ": " << dt.status();
    if (dt.ok()) out.dt = *dt;
  }
  return out;
}

// The four features of book level `level` (1-based): ask offset, log1p(ask size), bid offset, log1p(bid size).
void ExpectLevel(const std::vector<float>& features, int level, double ask_bp, double ask_log_size, double bid_bp,
                 double bid_log_size) {
  SCOPED_TRACE("level " + std::to_string(level));
  const size_t at = 4 * static_cast<size_t>(level - 1);
  EXPECT_FLOAT_EQ(features[at], ask_bp);
  EXPECT_FLOAT_EQ(features[at + 1], ask_log_size);
  EXPECT_FLOAT_EQ(features[at + 2], bid_bp);
  EXPECT_FLOAT_EQ(features[at + 3], bid_log_size);
}

// The eight trailing features: imbalance, mid return, type one-hot (1..5), direction.
void ExpectTail(const std::vector<float>& features, int levels, double imbalance, double mid_return, int type,
                int direction) {
  const size_t tail = 4 * static_cast<size_t>(levels);
  EXPECT_FLOAT_EQ(features[tail + kImbalance], imbalance);
  EXPECT_FLOAT_EQ(features[tail + kMidReturn], mid_return);
  for (int t = 1; t <= 5; ++t) {
    EXPECT_EQ(features[tail + kTypeOneHot + t - 1], t == type ? 1.f : 0.f) << "one-hot slot of type " << t;
  }
  EXPECT_EQ(features[tail + kDirection], static_cast<float>(direction));
}

TEST(ReadLobster, InfersTenLevelsAndReadsEveryAaplRow) {
  const LobsterData data = Aapl();
  EXPECT_EQ(data.levels, 10);
  // 999 rows: both files end without a final newline, so `wc -l` (and the data README) count 998.
  ASSERT_EQ(data.size(), 999u);
  ASSERT_EQ(data.book.size(), 999u * 40);
  // Line 1: 5859400,200,5853300,18,...,5879000,500,5842700,300 / 34200.004241176,1,16113575,18,5853300,1
  EXPECT_EQ(data.BookRow(0)[0], 5859400);
  EXPECT_EQ(data.BookRow(0)[3], 18);
  EXPECT_EQ(data.BookRow(0)[39], 300);
  const LobsterMessage& first = data.messages[0];
  EXPECT_DOUBLE_EQ(first.time, 34200.004241176);
  EXPECT_EQ(first.type, 1);
  EXPECT_EQ(first.order_id, 16113575);
  EXPECT_EQ(first.size, 18);
  EXPECT_EQ(first.price, 5853300);
  EXPECT_EQ(first.direction, 1);
  // Line 999, the unterminated last one: 5857100,100,5853500,18,...,5849900,2 / 34249.086375027,1,18259338,18,5853500,1
  EXPECT_EQ(data.BookRow(998)[0], 5857100);
  EXPECT_EQ(data.BookRow(998)[2], 5853500);
  EXPECT_EQ(data.BookRow(998)[39], 2);
  EXPECT_DOUBLE_EQ(data.messages[998].time, 34249.086375027);
  EXPECT_EQ(data.messages[998].order_id, 18259338);
  EXPECT_EQ(data.messages[998].direction, 1);
}

// Fewer levels than the file holds: its first (best) levels of every row, the same messages.
TEST(ReadLobster, TakesTheFirstLevelsOfADeeperFile) {
  const LobsterData ten = Aapl();
  for (const int levels : {1, 5}) {
    const absl::StatusOr<LobsterData> fewer = ReadLobster(ShippedLobsterPath("AAPL", "orderbook", 10),
                                                          ShippedLobsterPath("AAPL", "message", 10), levels);
    ASSERT_TRUE(fewer.ok()) << fewer.status();
    EXPECT_EQ(fewer->levels, levels);
    ASSERT_EQ(fewer->size(), ten.size());
    ASSERT_EQ(fewer->book.size(), ten.size() * 4 * levels);
    for (size_t i = 0; i < ten.size(); ++i) {
      ASSERT_THAT(fewer->BookRow(i), ::testing::ElementsAreArray(ten.BookRow(i).subspan(0, 4 * levels))) << i;
      ASSERT_EQ(fewer->messages[i].time, ten.messages[i].time) << i;
    }
  }
}

TEST(ReadLobster, InfersOneLevelAndReadsTheWholeAmznDay) {
  const LobsterData data = Amzn();
  EXPECT_EQ(data.levels, 1);
  ASSERT_EQ(data.size(), 57515u);
  ASSERT_EQ(data.book.size(), 57515u * 4);
  // Line 1: 2239500,100,2231800,100 / 34200.017459617,5,0,1,2238200,-1
  EXPECT_EQ(data.BookRow(0)[2], 2231800);
  EXPECT_EQ(data.messages[0].type, 5);
  EXPECT_EQ(data.messages[0].direction, -1);
  // Line 57515: 2206400,100,2205100,249 / 57599.95935965,3,287174077,100,2206300,-1
  EXPECT_EQ(data.BookRow(57514)[3], 249);
  EXPECT_DOUBLE_EQ(data.messages[57514].time, 57599.95935965);
  EXPECT_EQ(data.messages[57514].price, 2206300);
}

TEST(ReadLobster, AcceptsTheFilesLevelCountAndRefusesMore) {
  const std::string orderbook = ShippedLobsterPath("AAPL", "orderbook", 10);
  const std::string message = ShippedLobsterPath("AAPL", "message", 10);
  absl::StatusOr<LobsterData> ten = ReadLobster(orderbook, message, 10);
  ASSERT_TRUE(ten.ok()) << ten.status();
  EXPECT_EQ(ten->size(), 999u);
  absl::StatusOr<LobsterData> eleven = ReadLobster(orderbook, message, 11);
  ASSERT_FALSE(eleven.ok());
  EXPECT_EQ(eleven.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(eleven.status().message(), HasSubstr(orderbook + ":1: found 40 columns, expected at least 44"));
}

// Writes a small orderbook/message pair into the test's temp folder.
class ReadLobsterErrors : public ::testing::Test {
 protected:
  absl::Status Read(const std::string& orderbook_text, const std::string& message_text, int levels = 0) {
    const std::string stem =
        ::testing::TempDir() + "/" + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    orderbook_ = stem + "_orderbook.csv";
    message_ = stem + "_message.csv";
    std::ofstream(orderbook_) << orderbook_text;
    std::ofstream(message_) << message_text;
    return ReadLobster(orderbook_, message_, levels).status();
  }

  void ExpectError(const absl::Status& status, const std::string& file_and_line, const std::string& what) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(file_and_line));
    EXPECT_THAT(std::string(status.message()), HasSubstr(what));
  }

  std::string orderbook_, message_;
};

// Three valid level-1 events; each test breaks one thing.
constexpr char kBook[] = "2239500,100,2231800,100\n2239500,100,2238100,21\n2239500,100,2237500,100\n";
constexpr char kMessages[] =
    "34200.017459617,5,0,1,2238200,-1\n34200.18960767,1,11885113,21,2238100,1\n"
    "34200.190226476,4,11885113,21,2238100,1\n";

TEST_F(ReadLobsterErrors, TheValidPairReads) { EXPECT_TRUE(Read(kBook, kMessages).ok()); }

// A trailing blank line (or a few, with CR) once failed the whole file with "found 1 columns, expected 8".
TEST_F(ReadLobsterErrors, TrailingEmptyLinesAreNotRows) {
  for (const char* tail : {"\n", "\n\n", "\r\n", "\n\r\n"}) {
    SCOPED_TRACE(::testing::PrintToString(tail));
    EXPECT_TRUE(Read(std::string(kBook) + tail, std::string(kMessages) + tail).ok());
    const absl::StatusOr<LobsterData> data = ReadLobster(orderbook_, message_);
    ASSERT_TRUE(data.ok()) << data.status();
    EXPECT_EQ(data->size(), 3u);
    EXPECT_EQ(data->book.size(), 12u);
  }
  // An empty line before a row is no trailing blank: it still names its line.
  ExpectError(Read(kBook, std::string("\n") + kMessages), message_ + ":1:", "found 1 columns, expected 6");
}

TEST_F(ReadLobsterErrors, MoreOrderbookRowsThanMessages) {
  const absl::Status status = Read(std::string(kBook) + "2239500,100,2237500,90\n", kMessages);
  ExpectError(status, orderbook_ + ":4:", "no counterpart in " + message_ + ", which has only 3 rows");
}

TEST_F(ReadLobsterErrors, MoreMessagesThanOrderbookRows) {
  const absl::Status status = Read("2239500,100,2231800,100\n2239500,100,2238100,21\n", kMessages);
  ExpectError(status, message_ + ":3:", "no counterpart in " + orderbook_ + ", which has only 2 rows");
}

TEST_F(ReadLobsterErrors, OrderbookColumnsNotAMultipleOfFour) {
  ExpectError(Read("2239500,100,2231800,100,5\n", "34200.1,1,1,1,2231800,1\n"),
              orderbook_ + ":1:", "found 5 columns, not a multiple of 4");
}

TEST_F(ReadLobsterErrors, OrderbookRowWiderThanTheFirst) {
  ExpectError(Read("2239500,100,2231800,100\n2239500,100,2238100,21,2240000,5,2230000,7\n", kMessages),
              orderbook_ + ":2:", "found 8 columns, expected 4 (4 per level, 1 levels)");
}

TEST_F(ReadLobsterErrors, OrderbookShallowerThanTheGivenLevels) {
  ExpectError(Read(kBook, kMessages, 2), orderbook_ + ":1:",
              "found 4 columns, expected at least 8 (4 per level, 2 levels)");
}

TEST_F(ReadLobsterErrors, MessageWithFiveColumns) {
  ExpectError(Read(kBook, "34200.017459617,5,0,1,2238200,-1\n34200.18960767,1,11885113,21,2238100\n"),
              message_ + ":2:", "found 5 columns, expected 6");
}

TEST_F(ReadLobsterErrors, NonNumericOrderbookField) {
  ExpectError(Read("2239500,100,2231800,100\n2239500,1x0,2238100,21\n", kMessages),
              orderbook_ + ":2:", "column 2 is not an integer: '1x0'");
}

TEST_F(ReadLobsterErrors, NonNumericTime) {
  ExpectError(Read(kBook,
                   "34200.017459617,5,0,1,2238200,-1\n34200.18960767,1,11885113,21,2238100,1\n"
                   "noon,4,11885113,21,2238100,1\n"),
              message_ + ":3:", "column 1 is not a time in seconds: 'noon'");
}

// A spreadsheet's export starts with a UTF-8 byte-order mark: it was read as part of the first field, refused as "not
// an integer: '2239500'" (the mark does not print). It is skipped; a byte that does not print elsewhere is escaped in
// the message, where a lone carriage return (old Mac line ends) overwrote the line on a terminal.
TEST_F(ReadLobsterErrors, AByteOrderMarkIsSkippedAndUnprintableBytesAreEscaped) {
  EXPECT_TRUE(Read(std::string("\xEF\xBB\xBF") + kBook, std::string("\xEF\xBB\xBF") + kMessages).ok());
  ExpectError(Read("2239500,100,2231800,1\r00\n", kMessages), orderbook_ + ":1:",
              "column 4 is not an integer: '1\\r00'");
  ExpectError(Read(kBook, std::string("34200.017459617,5,0,1,2238200,-1\n\xEF\xBB\xBF") + (kMessages + 33)),
              message_ + ":2:", "column 1 is not a time in seconds: '\\xef\\xbb\\xbf34200.18960767'");
}

// A value past int64's range was reported as "not an integer".
TEST_F(ReadLobsterErrors, OrderbookFieldPastInt64) {
  ExpectError(Read("2239500,100,2231800,100\n99999999999999999999,100,2238100,21\n", kMessages),
              orderbook_ + ":2:", "column 1 is out of a 64-bit integer's range: '99999999999999999999'");
}

TEST_F(ReadLobsterErrors, FractionalType) {
  ExpectError(Read(kBook, "34200.017459617,5.0,0,1,2238200,-1\n"),
              message_ + ":1:", "column 2 is not an integer: '5.0'");
}

TEST_F(ReadLobsterErrors, UnknownTypeAndDirection) {
  ExpectError(Read(kBook, "34200.017459617,8,0,1,2238200,-1\n"), message_ + ":1:", "event type 8 is not in 1..7");
  ExpectError(Read(kBook, "34200.017459617,5,0,1,2238200,0\n"), message_ + ":1:", "direction 0 is not +1 or -1");
}

TEST_F(ReadLobsterErrors, DecreasingTime) {
  ExpectError(Read(kBook,
                   "34200.017459617,5,0,1,2238200,-1\n34200.18960767,1,11885113,21,2238100,1\n"
                   "34200.1,4,11885113,21,2238100,1\n"),
              message_ + ":3:", "time 34200.1 is earlier than the previous line's 34200.18960767");
}

TEST_F(ReadLobsterErrors, BidAtOrAboveAsk) {
  ExpectError(Read("2239500,100,2231800,100\n2238100,100,2238100,21\n2239500,100,2237500,100\n", kMessages),
              orderbook_ + ":2:", "no mid: level 1 has ask 2238100 and bid 2238100");
}

TEST_F(ReadLobsterErrors, DummyLevelOnePrices) {
  ExpectError(Read("2239500,100,2231800,100\n2239500,100,2238100,21\n9999999999,0,2237500,100\n", kMessages),
              orderbook_ + ":3:", "no mid: level 1 has ask 9999999999 and bid 2237500");
  ExpectError(Read("2239500,100,-9999999999,0\n2239500,100,2238100,21\n2239500,100,2237500,100\n", kMessages),
              orderbook_ + ":1:", "no mid: level 1 has ask 2239500 and bid -9999999999");
}

TEST_F(ReadLobsterErrors, NegativeSizesAndPricesOutsideTheirRange) {
  ExpectError(Read("2239500,100,2231800,100\n2239500,-1,2238100,21\n2239500,100,2237500,100\n", kMessages),
              orderbook_ + ":2:", "level 1 ask size -1 is not a share count in 0..2^53");
  ExpectError(Read("2239500,100,2231800,100,2239600,5,0,5\n2239500,100,2238100,21,2239600,5,2238000,5\n"
                   "2239500,100,2237500,100,2239600,5,2237400,5\n",
                   kMessages),
              orderbook_ + ":1:", "level 2 bid price 0 is neither a price in 1..9999999998");
}

// An empty level has size 0 (MODEL.md §1.1); shares beside a dummy price were read and then dropped by the featurizer.
TEST_F(ReadLobsterErrors, SharesOnAnEmptyLevel) {
  ExpectError(Read("2239500,100,2231800,100,2239600,5,2231700,5\n2239500,100,2238100,21,9999999999,7,2238000,5\n"
                   "2239500,100,2237500,100,9999999999,0,2237400,5\n",
                   kMessages),
              orderbook_ + ":2:", "level 2 ask size 7 is not 0 beside the empty level's price 9999999999");
  ExpectError(Read("2239500,100,2231800,100,2239600,5,2231700,5\n2239500,100,2238100,21,2239600,5,2238000,5\n"
                   "2239500,100,2237500,100,2239600,5,-9999999999,1\n",
                   kMessages),
              orderbook_ + ":3:", "level 2 bid size 1 is not 0 beside the empty level's price -9999999999");
  // Both sides empty with size 0 still read.
  EXPECT_TRUE(Read("2239500,100,2231800,100,9999999999,0,-9999999999,0\n2239500,100,2238100,21,2239600,5,2238000,5\n"
                   "2239500,100,2237500,100,9999999999,0,2237400,5\n",
                   kMessages)
                  .ok());
}

TEST_F(ReadLobsterErrors, MissingFile) {
  const absl::StatusOr<LobsterData> data = ReadLobster("/nonexistent/orderbook.csv", "/nonexistent/message.csv");
  EXPECT_EQ(data.status().code(), absl::StatusCode::kNotFound);
  // The system's reason with the path: "cannot open" alone hid a refused permission as a missing file.
  EXPECT_THAT(data.status().message(), HasSubstr("cannot open /nonexistent/orderbook.csv: No such file or directory"));
}

// A path through a file names no file either: NOT_FOUND, as a missing one (not FAILED_PRECONDITION, abseil's code for
// ENOTDIR), with the system's reason.
TEST_F(ReadLobsterErrors, APathThroughAFileIsNotFound) {
  ASSERT_TRUE(Read(kBook, kMessages).ok());
  const std::string through = orderbook_ + "/orderbook.csv";
  const absl::StatusOr<LobsterData> data = ReadLobster(through, through);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(data.status().message(), HasSubstr(absl::StrCat("cannot open ", through, ": Not a directory")));
}

// A folder opened as a stream that reads nothing, and was reported as a file without rows.
TEST_F(ReadLobsterErrors, AFolderIsNamedAsOne) {
  const std::string folder = ::testing::TempDir();
  const absl::StatusOr<LobsterData> data = ReadLobster(folder, folder);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument) << data.status();
  EXPECT_THAT(data.status().message(), HasSubstr(absl::StrCat(folder, " is a folder, not a LOBSTER file")));
}

TEST(LobsterFeaturizer, AaplFirstEvent) {
  const Featurized line1 = FeaturizeLine(Aapl(), 1);
  ASSERT_EQ(line1.features.size(), static_cast<size_t>(kAaplFeatures));
  EXPECT_EQ(line1.dt, 0.0);  // first event of the stream
  // ask 5859400 (size 200), bid 5853300 (size 18): mid 5856350;
  // (5859400-5856350)/5856350*1e4 = 3050/5856350*1e4 = 5.208022061522962, log1p(200) = 5.303304908059076,
  // (5853300-5856350)/5856350*1e4 = -5.208022061522962, log1p(18) = 2.9444389791664403.
  ExpectLevel(line1.features, 1, 5.208022061522962, 5.303304908059076, -5.208022061522962, 2.9444389791664403);
  // level 2: ask 5859800 (200), bid 5853000 (150): 3450/5856350*1e4 = 5.891041348280072,
  // -3350/5856350*1e4 = -5.720286526590795, log1p(150) = 5.017279836814924.
  ExpectLevel(line1.features, 2, 5.891041348280072, 5.303304908059076, -5.720286526590795, 5.017279836814924);
  // level 10: ask 5879000 (500), bid 5842700 (300): 22650/5856350*1e4 = 38.67596711262134,
  // -13650/5856350*1e4 = -23.308033160586373, log1p(500) = 6.2166061010848646, log1p(300) = 5.707110264748875.
  ExpectLevel(line1.features, 10, 38.67596711262134, 6.2166061010848646, -23.308033160586373, 5.707110264748875);
  // imbalance (18-200)/(18+200) = -0.8348623853211009; mid return 0 (first event); type 1; direction +1 (buy).
  ExpectTail(line1.features, 10, -0.8348623853211009, 0.0, 1, 1);
}

TEST(LobsterFeaturizer, AaplMidChangeAtLine4) {
  const Featurized line4 = FeaturizeLine(Aapl(), 4);
  // line 3: time 34200.004447484, ask 5859400, bid 5853300 (mid 5856350);
  // line 4: 34200.025551909,1,16120456,18,5859100,-1 with ask 5859100 (18), bid 5853300 (18): mid 5856200.
  // Δt = 34200.025551909 - 34200.004447484 = 0.021104425 s.
  EXPECT_NEAR(line4.dt, 0.021104425, 1e-9);
  // (5859100-5856200)/5856200*1e4 = 2900/5856200*1e4 = 4.952016666097469; log1p(18) = 2.9444389791664403.
  ExpectLevel(line4.features, 1, 4.952016666097469, 2.9444389791664403, -4.952016666097469, 2.9444389791664403);
  // imbalance (18-18)/36 = 0; mid return (5856200/5856350 - 1)*1e4 = -150/5856350*1e4 = -0.25613223253340145;
  // a new sell limit order: type 1, direction -1.
  ExpectTail(line4.features, 10, 0.0, -0.25613223253340145, 1, -1);
}

TEST(LobsterFeaturizer, AaplVisibleExecutionAtLine38) {
  const Featurized line38 = FeaturizeLine(Aapl(), 38);
  // line 37: 34200.275016159 with mid (5857500+5857300)/2 = 5857400; line 38: 34200.275057494,4,3647217,1,5857300,1
  // with ask 5857500 (57), bid 5857300 (19): mid 5857400 again. Δt = 0.000041335 s.
  EXPECT_NEAR(line38.dt, 0.000041335, 1e-9);
  // ±100/5857400*1e4 = ±0.17072421210776112; log1p(57) = 4.060443010546419, log1p(19) = 2.995732273553991.
  ExpectLevel(line38.features, 1, 0.17072421210776112, 4.060443010546419, -0.17072421210776112, 2.995732273553991);
  // imbalance (19-57)/(19+57) = -0.5; mid unchanged: return 0; type 4 (visible execution) of a buy order.
  ExpectTail(line38.features, 10, -0.5, 0.0, 4, 1);
}

TEST(LobsterFeaturizer, AaplHiddenExecutionAtLine46) {
  const Featurized line46 = FeaturizeLine(Aapl(), 46);
  // line 46: 34200.275072491,5,0,100,5857900,-1, the same time as line 45: Δt = 0.
  EXPECT_EQ(line46.dt, 0.0);
  // ask 5858000 (4), bid 5857300 (9): mid 5857650; ±350/5857650*1e4 = ±0.5975092400536051;
  // log1p(4) = 1.6094379124341003, log1p(9) = 2.302585092994046.
  ExpectLevel(line46.features, 1, 0.5975092400536051, 1.6094379124341003, -0.5975092400536051, 2.302585092994046);
  // imbalance (9-4)/13 = 0.38461538461538464; line 45 had the same mid: return 0; type 5, sell side.
  ExpectTail(line46.features, 10, 0.38461538461538464, 0.0, 5, -1);
}

TEST(LobsterFeaturizer, AmznFirstTwoEvents) {
  const LobsterData data = Amzn();
  const Featurized line1 = FeaturizeLine(data, 1);
  ASSERT_EQ(line1.features.size(), static_cast<size_t>(kAmznFeatures));
  EXPECT_EQ(line1.dt, 0.0);
  // ask 2239500 (100), bid 2231800 (100): mid 2235650; ±3850/2235650*1e4 = ±17.220942455214367;
  // log1p(100) = 4.61512051684126.
  ExpectLevel(line1.features, 1, 17.220942455214367, 4.61512051684126, -17.220942455214367, 4.61512051684126);
  // imbalance (100-100)/200 = 0; first event: return 0; a hidden execution (type 5) against a sell order.
  ExpectTail(line1.features, 1, 0.0, 0.0, 5, -1);

  const Featurized line2 = FeaturizeLine(data, 2);
  // Δt = 34200.18960767 - 34200.017459617 = 0.172148053 s.
  EXPECT_NEAR(line2.dt, 0.172148053, 1e-9);
  // ask 2239500 (100), bid 2238100 (21): mid 2238800; ±700/2238800*1e4 = ±3.1266750044666787;
  // log1p(21) = 3.091042453358316.
  ExpectLevel(line2.features, 1, 3.1266750044666787, 4.61512051684126, -3.1266750044666787, 3.091042453358316);
  // imbalance (21-100)/121 = -0.6528925619834711;
  // return (2238800/2235650 - 1)*1e4 = 3150/2235650*1e4 = 14.08986200881257.
  ExpectTail(line2.features, 1, -0.6528925619834711, 14.08986200881257, 1, 1);
}

// The time column's text in whole nanoseconds, read digit by digit: the exact value the file states.
std::vector<int64_t> ExactNanoseconds(const std::string& message_path) {
  std::vector<int64_t> times;
  std::ifstream in(message_path);
  for (std::string line; std::getline(in, line);) {
    const std::string time = line.substr(0, line.find(','));
    const size_t point = time.find('.');
    std::string fraction = point == std::string::npos ? "" : time.substr(point + 1);
    EXPECT_LE(fraction.size(), 9u) << time;
    fraction.resize(9, '0');
    times.push_back(std::stoll(time.substr(0, point)) * 1'000'000'000 + std::stoll(fraction));
  }
  return times;
}

// Δt once differed in the last float bit between the file (a difference of absolute seconds near 34,200) and a
// stream (client/stream_commands.cc sends TimeNanoseconds(time); server/stream_batcher.cc featurizes seconds since
// the stream's first event, (ns − first ns)·1e-9): 5,303 of the AMZN day's events. Both must give the exact
// (ns − previous ns)·1e-9 of the file's decimal times, as float32 too.
TEST(LobsterFeaturizer, DtIsTheSameFromTheFileAndFromAStream) {
  const LobsterData data = Amzn();
  const std::vector<int64_t> exact_ns = ExactNanoseconds(ShippedLobsterPath("AMZN", "message", 1));
  ASSERT_EQ(exact_ns.size(), data.size());
  LobsterFeaturizer file(1), stream(1);
  std::vector<float> features(kAmznFeatures);
  const int64_t first_ns = TimeNanoseconds(data.messages[0].time);
  size_t differing = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    ASSERT_EQ(TimeNanoseconds(data.messages[i].time), exact_ns[i]) << "line " << i + 1;
    const absl::StatusOr<double> file_dt = file.Next(data.BookRow(i), data.messages[i], features);
    LobsterMessage relative = data.messages[i];
    relative.time = static_cast<double>(TimeNanoseconds(data.messages[i].time) - first_ns) * 1e-9;
    const absl::StatusOr<double> stream_dt = stream.Next(data.BookRow(i), relative, features);
    ASSERT_TRUE(file_dt.ok() && stream_dt.ok()) << "line " << i + 1;
    const double expected = i == 0 ? 0.0 : static_cast<double>(exact_ns[i] - exact_ns[i - 1]) * 1e-9;
    if (*file_dt != expected || *stream_dt != expected ||
        static_cast<float>(*file_dt) != static_cast<float>(*stream_dt)) {
      ++differing;
    }
  }
  EXPECT_EQ(differing, 0u) << "of " << data.size() << " events";
}

TEST(LobsterFeaturizer, AmznPartialCancellationAtLine652) {
  const Featurized line652 = FeaturizeLine(Amzn(), 652);
  // line 651: 34400.045403237 with ask 2239900 (400), bid 2236000 (507);
  // line 652: 34400.295960669,2,21748178,200,2239900,-1 with ask 2239900 (200), bid 2236000 (507): mid 2237950 both.
  EXPECT_NEAR(line652.dt, 0.250557432, 1e-9);
  // ±1950/2237950*1e4 = ±8.713331397037466; log1p(200) = 5.303304908059076, log1p(507) = 6.230481447578482.
  ExpectLevel(line652.features, 1, 8.713331397037466, 5.303304908059076, -8.713331397037466, 6.230481447578482);
  // imbalance (507-200)/707 = 0.43422913719943423; return 0; type 2.
  ExpectTail(line652.features, 1, 0.43422913719943423, 0.0, 2, -1);
}

TEST(LobsterFeaturizer, EmptyLevelsGiveZerosPerSideAndEmptySizesGiveZeroImbalance) {
  LobsterFeaturizer featurizer(2);
  ASSERT_EQ(featurizer.n_features(), 16);
  std::vector<float> features(16, -7.f);
  // The shipped AAPL rows have no empty level, so: level 2 holds a bid but no ask; level-1 sizes are both 0.
  const std::vector<int64_t> row = {1000100, 0, 999900, 0, kEmptyAskPrice, 0, 999800, 30};
  ASSERT_TRUE(featurizer.Next(row, LobsterMessage{100.0, 3, 1, 5, 1000100, -1}, features).ok());
  // mid 1000000: ±100/1000000*1e4 = ±1; log1p(0) = 0.
  EXPECT_FLOAT_EQ(features[0], 1.0);
  EXPECT_EQ(features[1], 0.f);
  EXPECT_FLOAT_EQ(features[2], -1.0);
  EXPECT_EQ(features[3], 0.f);
  // Empty ask at level 2: 0 and 0; its bid: -200/1000000*1e4 = -2, log1p(30) = 3.4339872044851463.
  EXPECT_EQ(features[4], 0.f);
  EXPECT_EQ(features[5], 0.f);
  EXPECT_FLOAT_EQ(features[6], -2.0);
  EXPECT_FLOAT_EQ(features[7], 3.4339872044851463);
  EXPECT_EQ(features[8], 0.f);  // imbalance with both level-1 sizes 0

  // Now the bid side of level 2 is empty and the ask side real.
  const std::vector<int64_t> bid_empty = {1000100, 10, 999900, 30, 1000500, 40, kEmptyBidPrice, 0};
  ASSERT_TRUE(featurizer.Next(bid_empty, LobsterMessage{100.5, 1, 2, 40, 1000500, -1}, features).ok());
  // level 2 ask: 500/1000000*1e4 = 5, log1p(40) = 3.713572066704308; imbalance (30-10)/40 = 0.5.
  EXPECT_FLOAT_EQ(features[4], 5.0);
  EXPECT_FLOAT_EQ(features[5], 3.713572066704308);
  EXPECT_EQ(features[6], 0.f);
  EXPECT_EQ(features[7], 0.f);
  EXPECT_FLOAT_EQ(features[8], 0.5);
}

TEST(LobsterFeaturizer, HaltGivesNoTypeAndKeepsDirection) {
  LobsterFeaturizer featurizer(1);
  std::vector<float> features(12, -7.f);
  ASSERT_TRUE(
      featurizer
          .Next(std::vector<int64_t>{2239500, 100, 2231800, 100}, LobsterMessage{34200.0, 7, 0, 0, 0, 1}, features)
          .ok());
  ExpectTail(features, 1, 0.0, 0.0, /*type=*/7, 1);  // type 7 matches none of the one-hot slots 1..5
}

// A cross trade (an auction's execution) is accepted, and like a halt sets none of MODEL.md's five type columns.
TEST(LobsterFeaturizer, CrossTradeGivesNoTypeAndKeepsDirection) {
  LobsterFeaturizer featurizer(1);
  std::vector<float> features(12, -7.f);
  ASSERT_TRUE(
      featurizer
          .Next(std::vector<int64_t>{2239500, 100, 2231800, 100}, LobsterMessage{34200.0, 6, 0, 0, 0, -1}, features)
          .ok());
  ExpectTail(features, 1, 0.0, 0.0, /*type=*/6, -1);
}

TEST(LobsterFeaturizer, RejectedEventsLeaveTheStateUnchanged) {
  LobsterFeaturizer featurizer(1);
  std::vector<float> features(12);
  EXPECT_FALSE(featurizer.last_mid().has_value());
  // Accepted: mid (2000200+1999800)/2 = 2000000 at t = 10 s.
  ASSERT_TRUE(
      featurizer.Next(std::vector<int64_t>{2000200, 5, 1999800, 5}, LobsterMessage{10.0, 1, 1, 5, 1999800, 1}, features)
          .ok());
  ASSERT_EQ(featurizer.last_mid(), 2000000.0);

  std::vector<float> untouched(12, -7.f);
  const LobsterMessage later{20.0, 1, 2, 5, 2000000, 1};
  const absl::StatusOr<double> crossed =
      featurizer.Next(std::vector<int64_t>{2000000, 5, 2000000, 5}, later, untouched);
  EXPECT_EQ(crossed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(crossed.status().message(), HasSubstr("no mid"));
  const absl::StatusOr<double> dummy_bid =
      featurizer.Next(std::vector<int64_t>{2000200, 5, kEmptyBidPrice, 0}, later, untouched);
  EXPECT_EQ(dummy_bid.status().code(), absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<double> wide_row =
      featurizer.Next(std::vector<int64_t>{2000200, 5, 1999800, 5, 2000300, 1, 1999700, 1}, later, untouched);
  EXPECT_THAT(wide_row.status().message(), HasSubstr("book row has 8 values, expected 4"));
  const absl::StatusOr<double> earlier = featurizer.Next(std::vector<int64_t>{2000600, 5, 1999800, 5},
                                                         LobsterMessage{9.5, 1, 3, 5, 2000600, -1}, untouched);
  EXPECT_THAT(earlier.status().message(), HasSubstr("earlier than the previous event"));
  const absl::StatusOr<double> short_buffer =
      featurizer.Next(std::vector<int64_t>{2000600, 5, 1999800, 5}, later, std::span<float>(untouched).first(11));
  EXPECT_THAT(short_buffer.status().message(), HasSubstr("feature buffer has 11 values, expected 12"));
  EXPECT_EQ(untouched, std::vector<float>(12, -7.f));
  EXPECT_EQ(featurizer.last_mid(), 2000000.0);

  // Accepted at t = 12.5 s with mid (2000600+1999800)/2 = 2000200: Δt and the return relate to the t = 10 s event.
  const absl::StatusOr<double> dt = featurizer.Next(std::vector<int64_t>{2000600, 5, 1999800, 5},
                                                    LobsterMessage{12.5, 1, 4, 5, 2000600, -1}, features);
  ASSERT_TRUE(dt.ok()) << dt.status();
  EXPECT_DOUBLE_EQ(*dt, 2.5);
  EXPECT_FLOAT_EQ(features[4 + kMidReturn], 1.0);  // (2000200/2000000 - 1)*1e4 = 1
  EXPECT_EQ(featurizer.last_mid(), 2000200.0);
}

// A message's whole nanoseconds (a stream's) give Δt exactly at any distance from the origin; its seconds alone round
// them from 2^51 ns (26 days) on: 28 days and 2 ns come back as …003, and the next millisecond as 0.999999 ms.
TEST(LobsterFeaturizer, DtFromWholeNanosecondsIsExactAMonthOn) {
  constexpr int64_t kMonth = 2'419'200'000'000'002, kNext = kMonth + 1'000'000;
  const std::vector<int64_t> row{2000200, 5, 1999800, 5};
  std::vector<float> features(12);
  auto dt_after_a_month = [&](bool whole_nanoseconds) {
    LobsterFeaturizer featurizer(1);
    double dt = -1;
    for (const int64_t ns : {kMonth, kNext}) {
      LobsterMessage message{static_cast<double>(ns) * 1e-9, 1, 1, 5, 1999800, 1};
      if (whole_nanoseconds) message.time_ns = ns;
      const absl::StatusOr<double> next = featurizer.Next(row, message, features);
      EXPECT_TRUE(next.ok()) << next.status();
      dt = next.value_or(-1);
    }
    return dt;
  };
  EXPECT_EQ(dt_after_a_month(true), 1'000'000 * 1e-9);
  EXPECT_NE(dt_after_a_month(false), 1'000'000 * 1e-9) << "(why the stream passes its nanoseconds)";
}

// What a file could not hold but a live stream's client can send: each refused with the value named, the stream's
// state unchanged. Without these checks a size of -1 gave log1p(-1) = -inf and every later conviction NaN.
TEST(LobsterFeaturizer, RefusesSizesPricesTypesAndDirectionsOutsideTheirRanges) {
  LobsterFeaturizer featurizer(2);
  std::vector<float> features(16);
  const std::vector<int64_t> valid{2000200, 5, 1999800, 5, 2000300, 7, 1999700, 9};
  ASSERT_TRUE(featurizer.Next(valid, LobsterMessage{10.0, 1, 1, 5, 1999800, 1}, features).ok());
  const LobsterMessage later{11.0, 1, 2, 5, 2000000, -1};
  const std::vector<std::pair<std::vector<int64_t>, std::string>> rows = {
      {{2000200, -1, 1999800, 5, 2000300, 7, 1999700, 9}, "level 1 ask size -1 is not a share count"},
      {{2000200, 5, 1999800, 5, 2000300, 7, 1999700, -3}, "level 2 bid size -3 is not a share count"},
      {{2000200, 5, 1999800, (int64_t{1} << 53) + 1, 2000300, 7, 1999700, 9}, "level 1 bid size 9007199254740993"},
      {{2000200, 5, 1999800, 5, INT64_MAX, 7, 1999700, 9}, "level 2 ask price 9223372036854775807 is neither"},
      {{2000200, 5, 1999800, 5, 2000300, 7, kEmptyAskPrice, 0}, "level 2 bid price 9999999999 is neither"},
      {{2000200, 5, 1999800, 5, 2000300, 7, -5, 9}, "level 2 bid price -5 is neither"},
      {{2000200, 5, 1999800, 5, kEmptyAskPrice, 3, 1999700, 9}, "level 2 ask size 3 is not 0 beside the empty level's"},
      {{2000200, 5, 1999800, 5, 2000300, 7, kEmptyBidPrice, 9}, "level 2 bid size 9 is not 0 beside the empty level's"},
  };
  std::vector<float> untouched(16, -7.f);
  for (const auto& [row, what] : rows) {
    const absl::StatusOr<double> refused = featurizer.Next(row, later, untouched);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(refused.status().message(), HasSubstr(what));
  }
  EXPECT_THAT(featurizer.Next(valid, LobsterMessage{11.0, 9, 2, 5, 2000000, 1}, untouched).status().message(),
              HasSubstr("event type 9 is not in 1..7"));
  EXPECT_THAT(featurizer.Next(valid, LobsterMessage{11.0, 1, 2, 5, 2000000, 0}, untouched).status().message(),
              HasSubstr("direction 0 is not +1 or -1"));
  EXPECT_EQ(untouched, std::vector<float>(16, -7.f));
  // Empty levels keep their dummies on either side.
  const absl::StatusOr<double> empty_level =
      featurizer.Next(std::vector<int64_t>{2000200, 5, 1999800, 5, kEmptyAskPrice, 0, kEmptyBidPrice, 0}, later,
                      features);
  ASSERT_TRUE(empty_level.ok()) << empty_level.status();
  EXPECT_DOUBLE_EQ(*empty_level, 1.0);
}

TEST(LobsterFeaturizer, ARejectedFirstEventLeavesTheStreamUnstarted) {
  LobsterFeaturizer featurizer(1);
  std::vector<float> features(12);
  EXPECT_FALSE(
      featurizer
          .Next(std::vector<int64_t>{kEmptyAskPrice, 0, 1999800, 5}, LobsterMessage{50.0, 1, 1, 5, 0, 1}, features)
          .ok());
  EXPECT_FALSE(featurizer.last_mid().has_value());
  // The next valid event is still the first: Δt 0 and return 0, even though it is earlier than the rejected one.
  const absl::StatusOr<double> dt = featurizer.Next(std::vector<int64_t>{2000200, 5, 1999800, 5},
                                                    LobsterMessage{10.0, 1, 2, 5, 1999800, 1}, features);
  ASSERT_TRUE(dt.ok()) << dt.status();
  EXPECT_EQ(*dt, 0.0);
  EXPECT_EQ(features[4 + kMidReturn], 0.f);
}

TEST(LobsterFeaturizer, ResetStartsANewStream) {
  LobsterFeaturizer featurizer(1);
  std::vector<float> features(12);
  ASSERT_TRUE(
      featurizer.Next(std::vector<int64_t>{2000200, 5, 1999800, 5}, LobsterMessage{10.0, 1, 1, 5, 1, 1}, features)
          .ok());
  featurizer.Reset();
  EXPECT_FALSE(featurizer.last_mid().has_value());
  // An earlier time and another mid are fine after Reset: Δt 0, return 0.
  const absl::StatusOr<double> dt =
      featurizer.Next(std::vector<int64_t>{3000200, 5, 2999800, 5}, LobsterMessage{5.0, 1, 2, 5, 1, 1}, features);
  ASSERT_TRUE(dt.ok()) << dt.status();
  EXPECT_EQ(*dt, 0.0);
  EXPECT_EQ(features[4 + kMidReturn], 0.f);
  EXPECT_EQ(featurizer.last_mid(), 3000000.0);
}

TEST(ComputeLabels, HandMadeMids) {
  // Mids 5, 6, 4, 5, 5 (doubled 10, 12, 8, 10, 10), horizons 1 and 2.
  const std::vector<int64_t> doubled = {10, 12, 8, 10, 10};
  const std::vector<int> horizons = {1, 2};
  std::vector<float> labels(10, -1.f), mask(10, -1.f);
  ComputeLabels(doubled, horizons, labels, mask);
  // t=0: 12 > 10 up; mean(12, 8) = 10 equal, masked.   t=1: 8 < 12 down; mean(8, 10) = 9 < 12 down.
  // t=2: 10 > 8 up; mean(10, 10) > 8 up.                t=3: 10 = 10 masked; t+2 = 5 past the data.
  // t=4: both past the data.
  EXPECT_EQ(labels, (std::vector<float>{1, 0, 0, 0, 1, 1, 0, 0, 0, 0}));
  EXPECT_EQ(mask, (std::vector<float>{1, 0, 1, 1, 1, 1, 0, 0, 0, 0}));
}

// The AMZN doubled mids, labelled with the given horizons.
struct AmznLabels {
  std::vector<float> labels, mask;
};
AmznLabels LabelAmzn(const std::vector<int>& horizons) {
  const LobsterData data = Amzn();
  std::vector<int64_t> doubled(data.size());
  for (size_t i = 0; i < data.size(); ++i) doubled[i] = DoubledMid(data.BookRow(i));
  AmznLabels out{std::vector<float>(data.size() * horizons.size(), -1.f),
                 std::vector<float>(data.size() * horizons.size(), -1.f)};
  ComputeLabels(doubled, horizons, out.labels, out.mask);
  return out;
}

TEST(ComputeLabels, AmznLine76) {
  const std::vector<int> horizons = {1, 2, 3, 10};
  const AmznLabels amzn = LabelAmzn(horizons);
  ASSERT_EQ(amzn.labels.size(), 57515u * 4);
  const size_t at = 75 * 4;  // line 76
  // Doubled mids from line 76 on: 4480800 | 4480300, 4481300, 4480900, 4480900, 4481300, 4480500, 4480500,
  // 4481300, 4480200, 4480200.
  // k=1: 4480300 < 4480800: down.
  EXPECT_EQ(amzn.labels[at], 0.f);
  EXPECT_EQ(amzn.mask[at], 1.f);
  // k=2: 4480300 + 4481300 = 8961600 = 2*4480800: the mean equals the mid although the mids move: masked.
  EXPECT_EQ(amzn.labels[at + 1], 0.f);
  EXPECT_EQ(amzn.mask[at + 1], 0.f);
  // k=3: 8961600 + 4480900 = 13442500 > 3*4480800 = 13442400: up.
  EXPECT_EQ(amzn.labels[at + 2], 1.f);
  EXPECT_EQ(amzn.mask[at + 2], 1.f);
  // k=10: the ten sum to 44807400 < 10*4480800 = 44808000: down.
  EXPECT_EQ(amzn.labels[at + 3], 0.f);
  EXPECT_EQ(amzn.mask[at + 3], 1.f);
}

TEST(ComputeLabels, AmznEndOfData) {
  const std::vector<int> horizons = {1, 10};
  const AmznLabels amzn = LabelAmzn(horizons);
  // Doubled mids of lines 57505..57515: 4411500 | 4410400, 4410400, 4411200, 4411200, 4411300, 4411300, 4411300,
  // 4411500, 4411400, 4411500.
  // Line 57505 (t = n-11), k=10: t+10 = n-1 is the last event; the ten sum to 44111500 < 10*4411500 = 44115000: down.
  EXPECT_EQ(amzn.labels[57504 * 2 + 1], 0.f);
  EXPECT_EQ(amzn.mask[57504 * 2 + 1], 1.f);
  // Line 57506 (t = n-10), k=10: t+10 = n is past the data, although the nine known mids would say "down".
  EXPECT_EQ(amzn.labels[57505 * 2 + 1], 0.f);
  EXPECT_EQ(amzn.mask[57505 * 2 + 1], 0.f);
  // Line 57514 (t = n-2), k=1: 4411500 > 4411400: up, the last label in the data.
  EXPECT_EQ(amzn.labels[57513 * 2], 1.f);
  EXPECT_EQ(amzn.mask[57513 * 2], 1.f);
  // Line 57515, the last: no future for any horizon.
  EXPECT_EQ(amzn.mask[57514 * 2], 0.f);
  EXPECT_EQ(amzn.mask[57514 * 2 + 1], 0.f);
}

}  // namespace
}  // namespace perception
