// Streaming on the engine: the stream table's bookkeeping and the CPU backend's forward_step_into, seeding and logs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "engine/backend.h"
#include "engine/cpu_reference.h"
#include "engine/dataset.h"
#include "engine/stream_table.h"
#include "tests/check_ticks_util.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using ::testing::HasSubstr;

// An event processed and its tick finished.
void AppendFinished(StreamTable& table, int slot, uint64_t weights_version) {
  table.Append(slot, weights_version);
  ASSERT_TRUE(table.TickFinished(slot).ok());
}

// Every instrument the table lists, in byte order of their ids.
std::vector<StreamTable::InstrumentInfo> Listed(const StreamTable& table) {
  return table.List("", SIZE_MAX).instruments;
}

TEST(StreamTableTest, SlotsAreAssignedReusedAndBounded) {
  StreamTable table(2, 4);
  EXPECT_EQ(*table.Open("AAPL"), 0);
  EXPECT_EQ(*table.Open("AMZN"), 1);
  EXPECT_EQ(*table.Open("AAPL"), 0);  // the same instrument keeps its slot
  EXPECT_EQ(table.active(), 2);
  EXPECT_EQ(table.Open("MSFT").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(table.SlotOf("MSFT").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(table.Close("AAPL").ok());
  EXPECT_EQ(*table.Open("MSFT"), 0);
  EXPECT_EQ(table.Close("AAPL").code(), absl::StatusCode::kNotFound);
  ASSERT_EQ(Listed(table).size(), 2u);
  EXPECT_EQ(Listed(table)[0].instrument, "AMZN");
}

// ListStreams' pages: from an id on (inclusive, whether or not it has a stream), at most a count, and the id that
// follows the last listed.
TEST(StreamTableTest, ListsAPageFromAnIdOnInByteOrder) {
  StreamTable table(8, 2);
  for (const char* instrument : {"c", "a", "e", "B", "b", "d"}) ASSERT_TRUE(table.Open(instrument).ok());
  const auto ids = [](const StreamTable::InstrumentPage& page) {
    std::vector<std::string> listed;
    for (const StreamTable::InstrumentInfo& info : page.instruments) listed.push_back(info.instrument);
    return listed;
  };
  StreamTable::InstrumentPage page = table.List("", 2);
  EXPECT_EQ(ids(page), (std::vector<std::string>{"B", "a"}));  // byte order: upper case first
  EXPECT_EQ(page.next, "b");
  page = table.List(*page.next, 3);
  EXPECT_EQ(ids(page), (std::vector<std::string>{"b", "c", "d"}));
  EXPECT_EQ(page.next, "e");
  page = table.List(*page.next, 3);
  EXPECT_EQ(ids(page), (std::vector<std::string>{"e"}));
  EXPECT_FALSE(page.next.has_value());
  page = table.List("bb", 2);
  EXPECT_EQ(ids(page), (std::vector<std::string>{"c", "d"}));
  EXPECT_EQ(page.next, "e");
  EXPECT_EQ(page.instruments[0].slot, *table.SlotOf("c"));
  EXPECT_TRUE(table.List("z", 3).instruments.empty());
  EXPECT_FALSE(table.List("z", 3).next.has_value());
  // A closed instrument leaves the order; one opened again joins it.
  ASSERT_TRUE(table.Close("c").ok());
  EXPECT_EQ(ids(table.List("b", 2)), (std::vector<std::string>{"b", "d"}));
  ASSERT_TRUE(table.Open("c").ok());
  EXPECT_EQ(ids(table.List("b", 2)), (std::vector<std::string>{"b", "c"}));
}

TEST(StreamTableTest, SequenceNumbersMustBeContiguous) {
  StreamTable table(2, 8);
  const int slot = *table.Open("AMZN");
  ASSERT_TRUE(table.Accept(slot, 1000).ok());  // any first number
  ASSERT_TRUE(table.Accept(slot, 1001).ok());
  EXPECT_THAT(table.Accept(slot, 1001).message(), HasSubstr("sequence number 1001 out of order, expected 1002 (repeated)"));
  EXPECT_THAT(table.Accept(slot, 1005).message(), HasSubstr("expected 1002 (skipped)"));
  EXPECT_TRUE(table.Accept(slot, 1002).ok());  // a rejected event changes nothing
  const int last = *table.Open("LAST");
  EXPECT_THAT(table.Accept(last, UINT64_MAX).message(), HasSubstr("is the largest there is"));
  ASSERT_TRUE(table.Accept(last, UINT64_MAX - 1).ok());
  EXPECT_FALSE(table.Accept(last, UINT64_MAX).ok());
}

// What a drain waits to be read back: the entries each log still holds past the furthest read's end. A read's end
// marks everything before it read (a client that skips entries has caught up all the same); overwritten entries
// can no longer be read, so they are not waited for; a closed stream's log is gone.
TEST(StreamTableTest, UnreadEntriesAreThoseRetainedPastTheFurthestRead) {
  StreamTable table(3, 4);
  const int amzn = *table.Open("AMZN"), aapl = *table.Open("AAPL");
  (void)table.Open("IDLE");  // open, nothing processed
  auto process = [&](int slot, uint64_t first, int count) {
    for (uint64_t seq = first; seq < first + count; ++seq) {
      ASSERT_TRUE(table.Accept(slot, seq).ok());
      AppendFinished(table, slot, 1);
    }
  };
  process(amzn, 100, 3);
  process(aapl, 7, 2);
  EXPECT_EQ(table.Unread().entries, 5u);
  EXPECT_EQ(table.Unread().streams, 2);

  table.MarkRead(amzn, 102);  // a page of 100 and 101
  EXPECT_EQ(table.Unread().entries, 3u);
  table.MarkRead(amzn, 101);  // an older page moves nothing back
  EXPECT_EQ(table.Unread().entries, 3u);
  table.MarkRead(aapl, 9);    // up to the end
  EXPECT_EQ(table.Unread().entries, 1u);
  EXPECT_EQ(table.Unread().streams, 1);
  table.MarkRead(amzn, 99);   // before the stream's first number: nothing
  EXPECT_EQ(table.Unread().entries, 1u);

  process(amzn, 103, 5);  // 8 processed, the ring of 4 holds 104..107; 102 and 103 are overwritten
  EXPECT_EQ(table.Unread().entries, 4u);
  table.MarkRead(amzn, 1000);  // past the end: everything processed
  EXPECT_EQ(table.Unread().entries, 0u);
  EXPECT_EQ(table.Unread().streams, 0);

  process(aapl, 9, 1);
  ASSERT_TRUE(table.Close("AAPL").ok());
  EXPECT_EQ(table.Unread().entries, 0u);
}

// A stream whose unprocessed events were dropped (a failed tick) takes them again from the first one dropped,
// and its log keeps one entry a processed event, in sequence order.
TEST(StreamTableTest, ForgettingUnprocessedEventsRewindsToTheLastProcessed) {
  StreamTable table(2, 8);
  const int slot = *table.Open("AMZN");
  for (uint64_t seq = 40; seq < 45; ++seq) ASSERT_TRUE(table.Accept(slot, seq).ok());
  AppendFinished(table, slot, 1);  // 40 and 41 processed, 42..44 waiting
  AppendFinished(table, slot, 1);
  table.ForgetUnprocessed(slot);
  EXPECT_EQ(table.processed(slot), 2u);
  EXPECT_THAT(table.Accept(slot, 45).message(), HasSubstr("expected 42 (skipped)"));
  ASSERT_TRUE(table.Accept(slot, 42).ok());
  EXPECT_EQ(table.NextLogEntry(slot), 2);
  AppendFinished(table, slot, 2);
  absl::StatusOr<StreamTable::LogRange> r = table.Range(slot, 0, 10);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_seq, 40u);
  EXPECT_EQ(r->next_seq, 43u);
  EXPECT_EQ(r->max_weights_version, 2u);
  // With nothing processed, the stream takes its first number again, not another (that would skip events; a new
  // start is CloseStream's).
  const int fresh = *table.Open("AAPL");
  ASSERT_TRUE(table.Accept(fresh, 7).ok());
  table.ForgetUnprocessed(fresh);
  EXPECT_THAT(table.Accept(fresh, 9).message(), HasSubstr("expected 7 (skipped)"));
  EXPECT_THAT(table.Accept(fresh, 3).message(), HasSubstr("expected 7 (repeated)"));
  ASSERT_TRUE(table.Accept(fresh, 7).ok());
  AppendFinished(table, fresh, 1);
  EXPECT_EQ(table.Range(fresh, 0, 10)->first_seq, 7u);
}

TEST(StreamTableTest, RingsWrapCountOverwritesAndAnswerRanges) {
  StreamTable table(2, 4);
  const int slot = *table.Open("X");
  for (uint64_t seq = 10; seq < 16; ++seq) {  // six events into a ring of four
    ASSERT_TRUE(table.Accept(slot, seq).ok());
    EXPECT_EQ(table.NextLogEntry(slot), static_cast<int64_t>(seq - 10));
    AppendFinished(table, slot, /*weights_version=*/seq / 2);
  }
  EXPECT_EQ(table.overwritten_total(), 2u);
  // Retained: seq 12..15 at ring positions 2, 3, 0, 1.
  absl::StatusOr<StreamTable::LogRange> all = table.Range(slot, 0, 100);
  EXPECT_THAT(all.status().message(), HasSubstr("the oldest retained is 12"));
  EXPECT_EQ(all.status().code(), absl::StatusCode::kOutOfRange);
  absl::StatusOr<StreamTable::LogRange> r = table.Range(slot, 12, 100);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_seq, 12u);
  EXPECT_EQ(r->count, 4);
  ASSERT_EQ(r->segments.size(), 2u);
  EXPECT_EQ(r->segments[0].ring_begin, 2);
  EXPECT_EQ(r->segments[0].count, 2);
  EXPECT_EQ(r->segments[1].ring_begin, 0);
  EXPECT_EQ(r->segments[1].count, 2);
  EXPECT_EQ(r->min_weights_version, 6u);
  EXPECT_EQ(r->max_weights_version, 7u);
  EXPECT_EQ(r->next_seq, 16u);
  r = table.Range(slot, 14, 1);  // paged
  EXPECT_EQ(r->count, 1);
  EXPECT_EQ(r->segments[0].ring_begin, 0);
  r = table.Range(slot, 16, 10);  // nothing new yet
  EXPECT_EQ(r->count, 0);
  // A fresh stream with nothing overwritten answers from its oldest entry.
  const int other = *table.Open("Y");
  ASSERT_TRUE(table.Accept(other, 500).ok());
  AppendFinished(table, other, 1);
  r = table.Range(other, 0, 10);
  EXPECT_EQ(r->first_seq, 500u);
  EXPECT_EQ(r->count, 1);
}

// Entries whose outputs were not finite leave the log: it ends before the first, the stream takes its sequence number
// next, and what the ring no longer holds (overwritten by a dropped entry) is not claimed as retained.
TEST(StreamTableTest, DroppingEntriesEndsTheLogBeforeThemAndRewindsTheSequence) {
  StreamTable table(1, 4);
  const int slot = *table.Open("X");
  for (uint64_t seq = 10; seq < 18; ++seq) ASSERT_TRUE(table.Accept(slot, seq).ok());
  for (int i = 0; i < 6; ++i) AppendFinished(table, slot, 1);  // 10..15 processed (ring: 12..15), 16, 17 waiting
  table.MarkRead(slot, 16);
  EXPECT_EQ(table.SeqOfEntry(slot, 5), 15u);
  EXPECT_EQ(table.EntryOfSeq(slot, 15), 5);
  EXPECT_EQ(table.EntryOfSeq(slot, 17), 7) << "an event waiting has its entry to come";
  table.DropFrom(slot, 5);  // 15 went non-finite
  EXPECT_EQ(table.processed(slot), 5u);
  EXPECT_EQ(table.NextLogEntry(slot), 5);
  EXPECT_THAT(table.Accept(slot, 16).message(), HasSubstr("expected 15"));
  absl::StatusOr<StreamTable::LogRange> r = table.Range(slot, 0, 10);
  EXPECT_THAT(r.status().message(), HasSubstr("the oldest retained is 12"));
  r = table.Range(slot, 12, 10);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->count, 3);  // 12..14
  EXPECT_EQ(r->next_seq, 15u);
  EXPECT_EQ(table.Unread().entries, 0u) << "a read past the dropped entries read everything left";
  ASSERT_TRUE(table.Accept(slot, 15).ok());  // resent after a reset
  AppendFinished(table, slot, 2);
  EXPECT_EQ(table.overwritten_total(), 2u) << "rewriting a dropped entry overwrites nothing retained";
  EXPECT_EQ(table.Unread().entries, 1u);
  r = table.Range(slot, 12, 10);
  EXPECT_EQ(r->count, 4);
  EXPECT_EQ(r->max_weights_version, 2u);
  table.DropFrom(slot, 0);  // everything: the stream takes its first number again
  EXPECT_EQ(table.Range(slot, 0, 10)->count, 0);
  EXPECT_THAT(table.Accept(slot, 3).message(), HasSubstr("expected 10 (repeated)"));
  EXPECT_TRUE(table.Accept(slot, 10).ok());
}

// A drop of more than a ring's length: the entries appended again after it are retained, read and counted unread. They
// were taken for overwritten (the ring's newest position was reckoned from the dropped entries) until the stream
// caught up with them, so reads of them failed OUT_OF_RANGE and a drain did not wait for them.
TEST(StreamTableTest, EntriesAppendedAfterALongDropAreRetained) {
  StreamTable table(1, 10);
  const int slot = *table.Open("X");
  for (uint64_t seq = 1; seq <= 25; ++seq) {
    ASSERT_TRUE(table.Accept(slot, seq).ok());
    AppendFinished(table, slot, 1);  // the ring holds 16..25
  }
  EXPECT_EQ(table.overwritten_total(), 15u);
  table.DropFrom(slot, 12);  // 13..25 leave; 1..12 were overwritten by 16..25
  EXPECT_THAT(table.Range(slot, 1, 100).status().message(), HasSubstr("the oldest retained is 13"));
  for (uint64_t seq = 13; seq <= 14; ++seq) {
    ASSERT_TRUE(table.Accept(slot, seq).ok());
    AppendFinished(table, slot, 2);
  }
  absl::StatusOr<StreamTable::LogRange> r = table.Range(slot, 13, 100);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_seq, 13u);
  EXPECT_EQ(r->count, 2);
  EXPECT_EQ(r->max_weights_version, 2u);
  EXPECT_EQ(table.Unread().entries, 2u);
  EXPECT_EQ(table.overwritten_total(), 15u) << "the appended entries took dropped entries' positions";
  for (uint64_t seq = 15; seq <= 30; ++seq) {
    ASSERT_TRUE(table.Accept(slot, seq).ok());
    AppendFinished(table, slot, 3);
  }
  EXPECT_EQ(table.overwritten_total(), 23u) << "once the ring is full again, each entry overwrites the oldest";
  r = table.Range(slot, 1, 100);
  EXPECT_THAT(r.status().message(), HasSubstr("the oldest retained is 21"));
  r = table.Range(slot, 21, 100);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->count, 10);
  // A drop into unfinished entries of a full ring, then of everything: what is appended after each is all retained.
  for (uint64_t seq = 31; seq <= 33; ++seq) {
    ASSERT_TRUE(table.Accept(slot, seq).ok());
    table.Append(slot, 4);  // 31..33 launched, not finished
  }
  table.DropFrom(slot, 31);  // 32 went non-finite: 32 and 33 leave, 31 is still running
  EXPECT_EQ(table.Unread().entries, 8u) << "24..31: the ring less the two entries the drop took out";
  EXPECT_THAT(table.Range(slot, 1, 100).status().message(), HasSubstr("the oldest retained is 24"));
  table.DropFrom(slot, 0);
  EXPECT_EQ(table.Unread().entries, 0u);
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    ASSERT_TRUE(table.Accept(slot, seq).ok());
    AppendFinished(table, slot, 5);
  }
  r = table.Range(slot, 1, 100);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_seq, 1u);
  EXPECT_EQ(r->count, 3);
  EXPECT_EQ(table.Unread().entries, 3u);
}

// A launched tick's entries join the log at once (the next event's entry follows them), but reads and listings count
// only those whose ticks the device has finished; dropping entries keeps that count right on both sides of the drop.
TEST(StreamTableTest, EntriesOfUnfinishedTicksAreNeitherReadNorListedUntilTheirTicksFinish) {
  StreamTable table(1, 8);
  const int slot = *table.Open("X");
  for (uint64_t seq = 20; seq < 26; ++seq) ASSERT_TRUE(table.Accept(slot, seq).ok());
  for (int i = 0; i < 5; ++i) table.Append(slot, 1);  // 20..24 launched, 25 waiting
  ASSERT_TRUE(table.TickFinished(slot).ok());
  ASSERT_TRUE(table.TickFinished(slot).ok());  // 20 and 21 finished
  EXPECT_EQ(table.processed(slot), 5u);
  EXPECT_EQ(table.finished(slot), 2u);
  EXPECT_EQ(table.NextLogEntry(slot), 5);
  absl::StatusOr<StreamTable::LogRange> r = table.Range(slot, 0, 10);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first_seq, 20u);
  EXPECT_EQ(r->count, 2);
  EXPECT_EQ(r->next_seq, 22u);
  ASSERT_EQ(Listed(table).size(), 1u);
  EXPECT_EQ(Listed(table)[0].finished, 2u);
  EXPECT_EQ(Listed(table)[0].unfinished, 3u);

  table.DropFrom(slot, 3);  // 23 went non-finite: 22 is still running, 23 and 24 leave
  EXPECT_EQ(table.finished(slot), 2u);
  EXPECT_EQ(Listed(table)[0].unfinished, 1u);
  ASSERT_TRUE(table.TickFinished(slot).ok());
  EXPECT_EQ(table.Range(slot, 0, 10)->next_seq, 23u);
  EXPECT_EQ(Listed(table)[0].unfinished, 0u);
  // A tick told finished twice is a broken invariant of the caller's, reported, not a count gone negative.
  const absl::Status twice = table.TickFinished(slot);
  EXPECT_EQ(twice.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(twice.message(), HasSubstr("instrument 'X'"));
  EXPECT_EQ(table.finished(slot), 3u);

  ASSERT_TRUE(table.Accept(slot, 23).ok());
  table.Append(slot, 2);
  table.DropFrom(slot, 1);  // into the finished entries: everything from 21 leaves, nothing is left unfinished
  EXPECT_EQ(table.finished(slot), 1u);
  EXPECT_EQ(Listed(table)[0].unfinished, 0u);
  EXPECT_EQ(table.Range(slot, 0, 10)->next_seq, 21u);
}

TEST(StreamTableTest, FeaturizerKeepsItsLevelCount) {
  StreamTable table(1, 4);
  const int slot = *table.Open("AAPL");
  ASSERT_TRUE(table.Featurizer(slot, 10).ok());
  EXPECT_THAT(table.Featurizer(slot, 1).status().message(), HasSubstr("book row has 1 levels, earlier rows had 10"));
  table.ResetFeatures(slot);
  EXPECT_TRUE(table.Featurizer(slot, 1).ok());
}

// A log the host cannot hold (here one larger than a vector holds: the same refusal as running out of memory, in
// every build) refuses the stream, and its slot stays free. The allocation threw on a gRPC thread and the slot,
// taken first, was lost.
TEST(StreamTableTest, ALogTheHostCannotHoldRefusesTheStreamAndKeepsItsSlot) {
  StreamTable table(1, int64_t{1} << 62);
  for (int attempt = 0; attempt < 2; ++attempt) {
    const absl::StatusOr<int> opened = table.Open("AAPL");
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(opened.status().message(),
                HasSubstr("cannot allocate the conviction log of a stream (4611686018427387904 entries; perceptiond "
                          "--stream_log_entries)"));
    EXPECT_EQ(table.active(), 0);
    EXPECT_EQ(table.SlotOf("AAPL").status().code(), absl::StatusCode::kNotFound);
  }
}

// Streams several instruments interleaved, one event per instrument per tick, and checks every conviction against
// the sequence path over that instrument's own events. Runs on every backend: "cpu" here, "cuda" where a device
// exists (skipped with the reason elsewhere).
class StreamingBackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    config_ = *NamedConfig("tiny");
    layout_ = std::make_unique<ParamLayout>(config_);
    absl::StatusOr<std::unique_ptr<Backend>> backend =
        MakeBackend(GetParam(), config_, OptimizerConfig{}, testing::RandomParams(*layout_, 61));
    if (!backend.ok() && backend.status().code() == absl::StatusCode::kFailedPrecondition) {
      GTEST_SKIP() << "backend " << GetParam() << " unavailable: " << backend.status().message();
    }
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    ASSERT_TRUE(backend_->ConfigureStreaming(kSlots, kLogEntries).ok());
  }
  // The CPU's step and sequence paths are the same float code, so they agree to rounding; on CUDA the step kernel
  // and the sequence kernels sum in different orders (MODEL.md §8's 1e-5).
  double tolerance() const { return GetParam() == "cpu" ? 1e-6 : 1e-5; }
  static std::vector<float> ExpectedConvictions(Backend& backend, const testing::RandomBatch& events) {
    const int H = backend.config().n_horizons;
    std::vector<float> logits(events.dt.size() * H), out;
    EXPECT_TRUE(backend.ForwardStream(events.x, events.dt, logits).ok());
    for (size_t i = 0; i < events.dt.size(); ++i) {
      out.push_back(Conviction<float>(std::span<const float>(logits).subspan(i * H, H)));
    }
    return out;
  }
  static constexpr int kSlots = 4;
  static constexpr int64_t kLogEntries = 64;
  ModelConfig config_;
  std::unique_ptr<ParamLayout> layout_;
  std::unique_ptr<Backend> backend_;
};

// Three instruments interleaved in ticks (slot numbers not in instrument order; the third skips every third tick, so
// ticks differ in size and its log entries, each at its tick's index, leave gaps): every instrument's convictions and
// probabilities equal its own sequence path's.
TEST_P(StreamingBackendTest, InterleavedStreamsEqualTheirOwnSequencePaths) {
  const int F = config_.n_features, H = config_.n_horizons, n = 40;
  std::vector<testing::RandomBatch> streams;
  for (int s = 0; s < 3; ++s) streams.push_back(testing::MakeRandomBatch(config_, 1, n, 70 + s));
  for (int t = 0; t < n; ++t) {
    std::vector<float> x, dt;
    std::vector<int32_t> slots;
    std::vector<int64_t> log_indices;
    for (int s = 0; s < 3; ++s) {
      if (s == 2 && t % 3 == 0) continue;  // instrument 2 is quieter: ticks of different sizes
      x.insert(x.end(), streams[s].x.begin() + t * F, streams[s].x.begin() + (t + 1) * F);
      dt.push_back(streams[s].dt[t]);
      slots.push_back(s == 0 ? 3 : s);  // slot numbers need not follow instrument order
      log_indices.push_back(t);
    }
    ASSERT_TRUE(backend_->ForwardStepInto({x, dt, slots, log_indices}).ok());
  }
  for (int s = 0; s < 3; ++s) {
    // The instrument's events (instrument 2's: those at t % 3 != 0, each logged at entry t) by the sequence path.
    std::vector<int> times;
    std::vector<float> x, dt;
    for (int t = 0; t < n; ++t) {
      if (s == 2 && t % 3 == 0) continue;
      times.push_back(t);
      x.insert(x.end(), streams[s].x.begin() + t * F, streams[s].x.begin() + (t + 1) * F);
      dt.push_back(streams[s].dt[t]);
    }
    std::vector<float> logits(times.size() * H);
    ASSERT_TRUE(backend_->ForwardStream(x, dt, logits).ok());
    std::vector<float> got(n), probs(n * H);
    ASSERT_TRUE(backend_->ReadLog(s == 0 ? 3 : s, 0, n, got, probs).ok());
    for (size_t i = 0; i < times.size(); ++i) {
      const int t = times[i];
      const std::span<const float> expected_logits = std::span<const float>(logits).subspan(i * H, H);
      EXPECT_NEAR(got[t], Conviction<float>(expected_logits), tolerance()) << "stream " << s << " event " << t;
      for (int h = 0; h < H; ++h) {
        EXPECT_NEAR(probs[t * H + h], 1.0 / (1.0 + std::exp(-static_cast<double>(expected_logits[h]))), tolerance())
            << "stream " << s << " event " << t << " horizon " << h;
      }
    }
    std::vector<float> latest(H);
    ASSERT_TRUE(backend_->ReadSlotProbabilities(s == 0 ? 3 : s, latest).ok());
    const auto last = probs.begin() + times.back() * H;
    EXPECT_EQ(std::vector<float>(last, last + H), latest);
  }
}

TEST_P(StreamingBackendTest, SeededSlotContinuesLikeTheConcatenation) {
  const int F = config_.n_features, seed_len = 13, tail = 11;
  const testing::RandomBatch all = testing::MakeRandomBatch(config_, 1, seed_len + tail, 80);
  ASSERT_TRUE(backend_->SeedSlot(1, std::span<const float>(all.x).first(seed_len * F),
                                 std::span<const float>(all.dt).first(seed_len)).ok());
  for (int t = seed_len; t < seed_len + tail; ++t) {
    const int32_t slot = 1;
    const int64_t index = t - seed_len;
    ASSERT_TRUE(backend_->ForwardStepInto({std::span<const float>(all.x).subspan(t * F, F),
                                           std::span<const float>(all.dt).subspan(t, 1), {&slot, 1}, {&index, 1}})
                    .ok());
  }
  const std::vector<float> expected = ExpectedConvictions(*backend_, all);
  std::vector<float> got(tail);
  ASSERT_TRUE(backend_->ReadLog(1, 0, tail, got, {}).ok());
  for (int i = 0; i < tail; ++i) EXPECT_NEAR(got[i], expected[seed_len + i], tolerance()) << i;
  // Reset forgets the seed: the next event behaves like a first event.
  ASSERT_TRUE(backend_->ResetSlot(1).ok());
  const int32_t slot = 1;
  const int64_t index = 0;
  ASSERT_TRUE(backend_->ForwardStepInto({std::span<const float>(all.x).first(F), std::span<const float>(all.dt).first(1),
                                         {&slot, 1}, {&index, 1}}).ok());
  ASSERT_TRUE(backend_->ReadLog(1, 0, 1, std::span<float>(got).first(1), {}).ok());
  EXPECT_NEAR(got[0], expected[0], tolerance());
}

// The daemon steps a long seed window in parts, between other instruments' ticks: the parts must end in the state
// the whole window does, bit for bit, so that the next event's conviction is the one a single seed gives.
TEST_P(StreamingBackendTest, AWindowAdvancedInPartsEndsWhereTheWholeWindowDoes) {
  const int F = config_.n_features, window = 29;
  const testing::RandomBatch all = testing::MakeRandomBatch(config_, 1, window + 1, 81);
  const auto x = [&](int begin, int n) { return std::span<const float>(all.x).subspan(begin * F, n * F); };
  const auto dt = [&](int begin, int n) { return std::span<const float>(all.dt).subspan(begin, n); };
  ASSERT_TRUE(backend_->SeedSlot(1, x(0, window), dt(0, window)).ok());
  ASSERT_TRUE(backend_->ResetSlot(2).ok());
  for (const auto& [begin, n] : {std::pair{0, 1}, std::pair{1, 12}, std::pair{13, 16}}) {
    ASSERT_TRUE(backend_->AdvanceSlot(2, x(begin, n), dt(begin, n)).ok()) << begin;
  }
  const int32_t slots[2] = {1, 2};
  const int64_t indices[2] = {0, 0};
  const std::vector<float> next_x = [&] {
    std::vector<float> twice(x(window, 1).begin(), x(window, 1).end());
    twice.insert(twice.end(), twice.begin(), twice.end());
    return twice;
  }();
  const float next_dt[2] = {all.dt[window], all.dt[window]};
  ASSERT_TRUE(backend_->ForwardStepInto({next_x, next_dt, slots, indices}).ok());
  const int H = config_.n_horizons;
  std::vector<float> whole(H), parts(H);
  ASSERT_TRUE(backend_->ReadSlotProbabilities(1, whole).ok());
  ASSERT_TRUE(backend_->ReadSlotProbabilities(2, parts).ok());
  EXPECT_EQ(whole, parts);
  // And it is a seeded state, not a fresh one: a fresh slot's first event gives other probabilities.
  ASSERT_TRUE(backend_->ResetSlot(3).ok());
  const int32_t fresh = 3;
  ASSERT_TRUE(backend_->ForwardStepInto({x(window, 1), dt(window, 1), {&fresh, 1}, {&indices[0], 1}}).ok());
  std::vector<float> unseeded(H);
  ASSERT_TRUE(backend_->ReadSlotProbabilities(3, unseeded).ok());
  EXPECT_NE(whole, unseeded);
}

TEST_P(StreamingBackendTest, StreamingReadsThePublishedWeightsOnly) {
  const int F = config_.n_features;
  const testing::RandomBatch event = testing::MakeRandomBatch(config_, 1, 1, 90);
  const testing::RandomBatch train = testing::MakeRandomBatch(config_, config_.batch, config_.window, 91);
  const int32_t slot = 0;
  const int64_t index = 0;
  auto conviction_now = [&]() {
    EXPECT_TRUE(backend_->ResetSlot(0).ok());
    EXPECT_TRUE(backend_->ForwardStepInto({std::span<const float>(event.x).first(F), event.dt, {&slot, 1}, {&index, 1}}).ok());
    float c = 0;
    EXPECT_TRUE(backend_->ReadLog(0, 0, 1, {&c, 1}, {}).ok());
    return c;
  };
  const float before = conviction_now();
  ASSERT_TRUE(backend_->TrainStep(train.view()).ok());
  EXPECT_EQ(conviction_now(), before) << "a training step alone must not change what streaming reads";
  ASSERT_TRUE(backend_->PublishWeights().ok());
  EXPECT_NE(conviction_now(), before);
}

TEST_P(StreamingBackendTest, MalformedTicksAreRefused) {
  const int F = config_.n_features;
  const std::vector<float> x(2 * F, 0.5f), dt = {0.1f, 0.2f};
  const std::vector<int32_t> twice = {1, 1}, outside = {0, kSlots};
  const std::vector<int64_t> indices = {0, 1}, bad_index = {0, -1};
  const std::vector<int32_t> fine = {0, 1};
  EXPECT_THAT(backend_->ForwardStepInto({x, dt, twice, indices}).message(), HasSubstr("slot 1 twice in one tick"));
  EXPECT_EQ(backend_->ForwardStepInto({x, dt, outside, indices}).code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(backend_->ForwardStepInto({x, dt, fine, bad_index}).message(), HasSubstr("log entry number -1"));
  EXPECT_THAT(backend_->ForwardStepInto({std::span<const float>(x).first(F), dt, fine, indices}).message(),
              HasSubstr("disagree on the event count"));
  EXPECT_TRUE(backend_->ForwardStepInto({x, dt, fine, indices}).ok());
}

// An event whose every feature standardizes to just inside ±kMaxStandardizedFeature, signs alternating, amid random
// ones: every conviction stays finite, before, at and after it, and equals the sequence path over the same events,
// whose logits are MODEL.md's (a float64 evaluation) within §8's 1e-5. A feature of 3e38 here (standardized to
// infinity) made every later conviction NaN; up to the old bound of 1e24 the outputs stayed finite but not MODEL.md's
// (the RMSNorms' sums of squares overflowed to a scale of 0: relative error 0.89 at 6.7e19, a review found).
TEST_P(StreamingBackendTest, FeaturesAtTheStandardizedBoundKeepTheStateFiniteAndTheOutputsModelMds) {
  const int F = config_.n_features, n = 24, extreme = 8;
  testing::RandomBatch events = testing::MakeRandomBatch(config_, 1, n, 90);
  const std::vector<float> params = testing::RandomParams(*layout_, 61);  // SetUp's
  const float* mean = params.data() + layout_->tensor(layout_->norm_mean).offset;
  const float* inv_std = params.data() + layout_->tensor(layout_->norm_inv_std).offset;
  for (int f = 0; f < F; ++f) {
    const float standardized = (f % 2 == 0 ? 0.99f : -0.99f) * kMaxStandardizedFeature;
    events.x[extreme * F + f] = mean[f] + standardized / inv_std[f];
  }
  ASSERT_TRUE(CheckStandardizedRange({{mean, mean + F}, {inv_std, inv_std + F}},
                                     std::span<const float>(events.x).subspan(extreme * F, F))
                  .ok());
  for (int t = 0; t < n; ++t) {
    const int32_t slot = 1;
    const int64_t index = t;
    ASSERT_TRUE(backend_->ForwardStepInto({std::span<const float>(events.x).subspan(t * F, F),
                                           std::span<const float>(events.dt).subspan(t, 1), {&slot, 1}, {&index, 1}})
                    .ok());
  }
  std::vector<float> got(n);
  ASSERT_TRUE(backend_->ReadLog(1, 0, n, got, {}).ok());
  const std::vector<float> expected = ExpectedConvictions(*backend_, events);
  for (int t = 0; t < n; ++t) {
    EXPECT_TRUE(std::isfinite(got[t])) << "event " << t << ": " << got[t];
    EXPECT_NEAR(got[t], expected[t], tolerance()) << "event " << t;
  }
  const int H = config_.n_horizons;
  std::vector<float> logits(static_cast<size_t>(n) * H);
  ASSERT_TRUE(backend_->ForwardStream(events.x, events.dt, logits).ok());
  const CpuReference<double> reference(*layout_, 1);
  const std::vector<double> params64(params.begin(), params.end());
  const std::vector<double> x64(events.x.begin(), events.x.end()), dt64(events.dt.begin(), events.dt.end());
  const std::vector<double> no_labels(static_cast<size_t>(n) * H);
  std::vector<double> logits64(static_cast<size_t>(n) * H);
  reference.Forward(params64, BatchView<double>{1, n, x64, dt64, no_labels, no_labels}, logits64);
  double diff = 0, norm = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    diff += (logits[i] - logits64[i]) * (logits[i] - logits64[i]);
    norm += logits64[i] * logits64[i];
  }
  EXPECT_LE(std::sqrt(diff / norm), 1e-5) << "MODEL.md §8 against float64";
}

// A feature of 3e38 (infinite once standardized) makes one instrument's logits NaN, and its state with them, amid
// two that stay finite in the same ticks. Entry numbers run past the ring (a log entry goes to number mod the ring).
// A slot's first non-finite entry since it was last reported or reset is reported, with its number: its later events
// are not finite either (the state), until a reset, after which the slot streams finite outputs again.
TEST_P(StreamingBackendTest, EachSlotsFirstNonFiniteOutputIsReportedWithItsEntryNumber) {
  const int F = config_.n_features, n = 10, overflow_at = 4;
  const std::vector<int32_t> slots = {2, 0, 3};
  const int64_t first_entry = 3 * kLogEntries + 60;  // ring positions 60..63, then 0..5
  std::vector<testing::RandomBatch> events;
  for (int s = 0; s < 3; ++s) events.push_back(testing::MakeRandomBatch(config_, 1, n, 40 + s));
  for (int f = 0; f < F; ++f) events[1].x[overflow_at * F + f] = 3e38f;  // slot 0's event 4
  auto tick = [&](int t, std::span<const int32_t> tick_slots) {
    std::vector<float> x, dt;
    std::vector<int64_t> entries;
    for (size_t i = 0; i < tick_slots.size(); ++i) {
      const testing::RandomBatch& e = events[i];
      x.insert(x.end(), e.x.begin() + t * F, e.x.begin() + (t + 1) * F);
      dt.push_back(e.dt[t]);
      entries.push_back(first_entry + t);
    }
    ASSERT_TRUE(backend_->ForwardStepInto({x, dt, tick_slots, entries}).ok()) << "tick " << t;
  };
  auto take = [&] {
    absl::StatusOr<TicksChecked> checked = backend_->CheckTicks(/*wait_for_ticks=*/true);
    EXPECT_TRUE(checked.ok()) << checked.status();
    if (!checked.ok()) return std::vector<NonFiniteOutput>{};
    EXPECT_EQ(checked->unfinished, 0) << "after a wait";
    return checked->nonfinite;
  };
  for (int t = 0; t < overflow_at; ++t) tick(t, slots);
  EXPECT_TRUE(take().empty()) << "nothing overflowed yet";
  tick(overflow_at, slots);
  EXPECT_EQ(take(), (std::vector<NonFiniteOutput>{{0, first_entry + overflow_at}}));
  for (int t = overflow_at + 1; t < n; ++t) tick(t, slots);
  EXPECT_EQ(take(), (std::vector<NonFiniteOutput>{{0, first_entry + overflow_at + 1}})) << "the first since";
  EXPECT_TRUE(take().empty()) << "reported once";
  std::vector<float> stuck(1);
  ASSERT_TRUE(backend_->ReadLog(0, (first_entry + n - 1) % kLogEntries, 1, stuck, {}).ok());
  EXPECT_TRUE(std::isnan(stuck[0])) << "slot 0's state stays non-finite until a reset";

  // The other two slots' convictions are the sequence path's over their own events, wherever the ring put them.
  for (const int s : {0, 2}) {
    const std::vector<float> expected = ExpectedConvictions(*backend_, events[s]);
    for (int t = 0; t < n; ++t) {
      std::vector<float> got(1);
      ASSERT_TRUE(backend_->ReadLog(slots[s], (first_entry + t) % kLogEntries, 1, got, {}).ok());
      EXPECT_NEAR(got[0], expected[t], tolerance()) << "slot " << slots[s] << " event " << t;
    }
  }

  ASSERT_TRUE(backend_->ResetSlot(0).ok());
  const std::vector<int32_t> slot0 = {0};
  tick(0, slot0);  // (events[0]'s first event, finite)
  EXPECT_TRUE(take().empty()) << "after a reset the slot is finite again";
  for (int f = 0; f < F; ++f) events[0].x[1 * F + f] = -3e38f;
  tick(1, slot0);
  EXPECT_EQ(take(), (std::vector<NonFiniteOutput>{{0, first_entry + 1}})) << "and reported again after the reset";
}

// CheckTicks counts the ForwardStepInto calls that may still be running: never more than were queued, never more on
// a later look, none once they are done or it waited. The CPU's ticks have finished when ForwardStepInto returns.
TEST_P(StreamingBackendTest, CheckTicksCountsTheTicksStillRunningUntilNone) {
  const int F = config_.n_features, kTicks = 20;
  const testing::RandomBatch events = testing::MakeRandomBatch(config_, 1, kTicks * kSlots, 51);
  const std::vector<int32_t> slots = {0, 1, 2, 3};
  auto queue = [&](int first_tick, int ticks) {
    for (int t = first_tick; t < first_tick + ticks; ++t) {
      const std::vector<int64_t> entries(kSlots, t);
      ASSERT_TRUE(backend_->ForwardStepInto({std::span<const float>(events.x).subspan(t * kSlots * F, kSlots * F),
                                             std::span<const float>(events.dt).subspan(t * kSlots, kSlots), slots,
                                             entries})
                      .ok());
    }
  };
  queue(0, kTicks);
  const int64_t unfinished = testing::UnfinishedTicks(*backend_, /*wait_for_ticks=*/false);
  EXPECT_GE(unfinished, 0);
  EXPECT_LE(unfinished, kTicks);
  if (GetParam() == "cpu") {
    EXPECT_EQ(unfinished, 0);
  }
  testing::ExpectTicksFinishWithoutAWait(*backend_, unfinished);
  queue(kTicks / 2, kTicks / 2);
  EXPECT_EQ(testing::UnfinishedTicks(*backend_, /*wait_for_ticks=*/true), 0);
}

// A seed window with an event of features 3e38 (infinite once standardized) leads to a state that is not finite:
// SeedSlot says so; a finite window seeds the slot again, and its next event's conviction is finite.
TEST_P(StreamingBackendTest, ASeedWhoseStateIsNotFiniteIsRefusedAndAFiniteOneSeedsTheSlotAgain) {
  const int F = config_.n_features, n = 6;
  testing::RandomBatch window = testing::MakeRandomBatch(config_, 1, n, 57);
  const std::vector<float> finite_x = window.x;
  std::fill_n(window.x.begin() + 2 * F, F, 3e38f);
  const absl::Status refused = backend_->SeedSlot(1, window.x, window.dt);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("the seed window leads to a state that is not finite"));
  ASSERT_TRUE(backend_->SeedSlot(1, finite_x, window.dt).ok());
  const int32_t slot = 1;
  const int64_t entry = 0;
  ASSERT_TRUE(backend_->ForwardStepInto({std::span<const float>(finite_x).first(F),
                                         std::span<const float>(window.dt).first(1), {&slot, 1}, {&entry, 1}})
                  .ok());
  absl::StatusOr<TicksChecked> checked = backend_->CheckTicks(/*wait_for_ticks=*/true);
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_TRUE(checked->nonfinite.empty());
  std::vector<float> conviction(1);
  ASSERT_TRUE(backend_->ReadLog(1, 0, 1, conviction, {}).ok());
  EXPECT_TRUE(std::isfinite(conviction[0])) << conviction[0];
}

// Streaming logs the host cannot hold are refused (they threw std::bad_alloc on the daemon's device worker, which
// ended the daemon), and the configuration before them stays whole: its slots still step and read back.
TEST(CpuStreamingTest, LogsTheHostCannotHoldAreRefusedAndTheLastConfigurationStays) {
  const ModelConfig config = *NamedConfig("tiny");
  const ParamLayout layout(config);
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      MakeBackend("cpu", config, OptimizerConfig{}, testing::RandomParams(layout, 62));
  ASSERT_TRUE(backend.ok()) << backend.status();
  ASSERT_TRUE((*backend)->ConfigureStreaming(2, 8).ok());
  const absl::Status refused = (*backend)->ConfigureStreaming(1, int64_t{1} << 62);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("cannot allocate the streams' states and conviction logs (1 slots of "
                                           "4611686018427387904 entries; perceptiond --stream_slots, "
                                           "--stream_log_entries)"));
  const testing::RandomBatch events = testing::MakeRandomBatch(config, 1, 1, 63);
  const std::vector<int32_t> slots = {1};
  const std::vector<int64_t> entries = {7};
  ASSERT_TRUE((*backend)->ForwardStepInto({events.x, events.dt, slots, entries}).ok());
  std::vector<float> conviction(1), probs(config.n_horizons);
  ASSERT_TRUE((*backend)->ReadLog(1, 7, 1, conviction, probs).ok());
  EXPECT_TRUE(std::isfinite(conviction[0]));
  EXPECT_NE(conviction[0], 0.f);
}

INSTANTIATE_TEST_SUITE_P(Backends, StreamingBackendTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace perception
