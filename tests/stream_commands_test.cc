// perceptionctl's streaming commands without a daemon: the resume advice that ends a failed stream's error, the
// table `streams` prints.
#include "client/stream_commands.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace perception::client {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// --first 100 --count 50 --start_seq 1001: events 100..149 carry seq 1001..1050.
StreamOptions Options(int64_t count) {
  StreamOptions options;
  options.first = 100;
  options.count = count;
  options.start_seq = 1001;
  return options;
}

TEST(ResumeAdvice, NamesTheFlagsThatCarryOnAfterTheLastAcknowledgedEvent) {
  for (const absl::StatusCode code : {absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kInternal}) {
    EXPECT_THAT(ResumeAdvice(Options(50), 50, 1010, code),
                HasSubstr("acknowledged through seq 1010 (resume with --first 110 --count 40 --start_seq 1011,"));
    EXPECT_THAT(ResumeAdvice(Options(0), 50, 1010, code),
                HasSubstr("acknowledged through seq 1010 (resume with --first 110 --start_seq 1011,"));
  }
}

// UNAVAILABLE: the daemon drained, lost its device or could not be reached, and one that restarts holds no state for
// the instrument. The advice that continued after the last acknowledged event then started it from a zero state
// without a word; it now seeds the state from the events before it: the run's own --seed-window, else
// kResumeSeedEvents, as far as the files (and sequence numbers from 1) go. It also names the resume from the
// instrument's end_seq where the daemon kept it after all (UNAVAILABLE from a connection that failed).
TEST(ResumeAdvice, AfterUnavailableTheResumeSeedsTheStateAgain) {
  const absl::StatusCode unavailable = absl::StatusCode::kUnavailable;
  EXPECT_THAT(ResumeAdvice(Options(50), 50, 1010, unavailable),
              HasSubstr("once it is back, resume with --first 0 --count 150 --start_seq 901 --seed-window 110, whose "
                        "110 events before seq 1011 seed the state again. Where the daemon kept the instrument (a "
                        "connection that failed), that seed is refused; resume instead from its end_seq E in "
                        "`perceptionctl streams` with --first 110 + (E - 1011) --count 40 - (E - 1011) (where that is "
                        "0, nothing is left) --start_seq E)"));
  StreamOptions seeded = Options(0);
  seeded.seed_window = 20;
  EXPECT_THAT(ResumeAdvice(seeded, 50, 1010, unavailable),
              HasSubstr("resume with --first 90 --start_seq 991 --seed-window 20, whose 20 events before seq 1011"));
  StreamOptions far = Options(0);
  far.first = 5000;
  far.start_seq = 1;
  EXPECT_THAT(ResumeAdvice(far, 50, 10, unavailable),
              HasSubstr("resume with --first 5000 --start_seq 1 --seed-window 10,"))
      << "no sequence number below 1, --start_seq's least";
  far.start_seq = 100000;
  EXPECT_THAT(ResumeAdvice(far, 50, 100009, unavailable),
              HasSubstr(absl::StrCat("resume with --first ", 5010 - kResumeSeedEvents, " --start_seq ",
                                     100010 - kResumeSeedEvents, " --seed-window ", kResumeSeedEvents, ",")));
}

// A call that failed once every event was acknowledged (a drain, the watchdog on the call's end) advised
// `--count 0`, which means all the rest of the files, or, without --count, a --first past the files' end.
TEST(ResumeAdvice, SaysNothingIsLeftWhenTheLastEventWasAcknowledged) {
  for (const int64_t count : {int64_t{50}, int64_t{0}}) {
    const std::string advice = ResumeAdvice(Options(count), 50, 1050, absl::StatusCode::kUnavailable);
    EXPECT_THAT(advice, HasSubstr("acknowledged through seq 1050: the daemon acknowledged every event, so nothing is "
                                  "left to resume"));
    EXPECT_THAT(advice, Not(HasSubstr("--count 0")));
    EXPECT_THAT(advice, Not(HasSubstr("--first")));
  }
}

// A run that seeded and then failed before any acknowledgement: the instrument is listed (the seed opened it) with
// end_seq 0, where the advice's --start_seq E read 0, a number the client refuses; running the same command again is
// the resume. Once E is past 0, the resume from it streams on without the seed.
TEST(ResumeAdvice, AfterASeedAndNoAcknowledgementSaysToRunTheCommandAgain) {
  StreamOptions seeded = Options(50);
  seeded.seed_window = 20;
  const std::string advice = ResumeAdvice(seeded, 50, 0, absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(advice, HasSubstr("with --first 120 + (E - 1021) --count 30 - (E - 1021) (where that is 0, nothing "
                                "is left) --start_seq E and without "
                                "--seed-window; where it is not listed, or listed with end_seq 0 (the seed opened it, "
                                "no event processed), the daemon took none: run the same command again)"));
  EXPECT_THAT(ResumeAdvice(Options(50), 50, 0, absl::StatusCode::kInternal),
              HasSubstr("--start_seq E; where it is not listed, or listed with end_seq 0 (no event processed), the "
                        "daemon took none: run the same command again)"));
  EXPECT_THAT(ResumeAdvice(seeded, 50, 1030, absl::StatusCode::kInternal),
              HasSubstr("(resume with --first 130 --count 20 --start_seq 1031 and without --seed-window, or from"));
  // --reseed goes with the seed: kept alone, it is refused ("--reseed applies to --seed-window N").
  seeded.reseed = true;
  EXPECT_THAT(ResumeAdvice(seeded, 50, 1030, absl::StatusCode::kInternal),
              HasSubstr("--start_seq 1031 and without --seed-window and --reseed, or from"));
  EXPECT_THAT(ResumeAdvice(seeded, 50, 0, absl::StatusCode::kDeadlineExceeded),
              HasSubstr("--start_seq E and without --seed-window and --reseed; where"));
}

// A continuation (events 100..149 as seq 1001..1050) refused UNAVAILABLE before the daemon took any (it was
// draining) was told to resume from its end_seq (during the drain, the old run's next number: the same command) or,
// unlisted, to run the same command again: on the restarted daemon, holding no state for the instrument, either
// started it from a zero state at seq 1001, convictions off a continuous run's without a word. The seeded rerun
// comes first now; the same command stays the advice where it starts the instrument anyway (from the files' first
// event or seq 1) or seeds it itself, and for other codes.
TEST(ResumeAdvice, AContinuationNoneOfWhichWasTakenIsSeededOnTheRestartedDaemon) {
  StreamOptions options = Options(50);
  options.instrument = "AMZN";
  EXPECT_THAT(ResumeAdvice(options, 50, 0, absl::StatusCode::kUnavailable),
              HasSubstr("; the daemon acknowledged none of its events (the daemon is going or gone, and one that "
                        "restarts holds no state for AMZN: once it is back, run this command with --first 0 --count "
                        "150 --start_seq 901 --seed-window 100, whose 100 events before seq 1001 seed the state. "
                        "Where the daemon kept the instrument (a connection that failed), it may have taken some: "
                        "resume from the instrument's end_seq E"));
  EXPECT_THAT(ResumeAdvice(options, 50, 0, absl::StatusCode::kDeadlineExceeded),
              HasSubstr("the daemon took none: run the same command again)"));
  StreamOptions seeded = options;
  seeded.seed_window = 20;
  StreamOptions from_the_start = options;
  from_the_start.first = 0;
  StreamOptions from_seq_1 = options;
  from_seq_1.start_seq = 1;
  for (const StreamOptions& same : {seeded, from_the_start, from_seq_1}) {
    EXPECT_THAT(ResumeAdvice(same, 50, 0, absl::StatusCode::kUnavailable),
                HasSubstr("the daemon took none: run the same command again)"));
  }
}

// A failure that stopped the instrument (events 100..149 as seq 1001..1050, stopped after 1010) said "resume with
// --seed-window N --reseed as well": added to the resume's --first 110 --start_seq 1011, the seed took events
// 110..109+N and the stream started N events late, and the refusal's "--start_seq 1011-N continues it" then
// renumbered every later event. The seed's flags are spelled out, each event on its own number.
TEST(StoppedResumeAdvice, SpellsOutASeedOfTheEventsBeforeTheResumePoint) {
  StreamOptions options = Options(50);
  options.instrument = "AMZN";
  EXPECT_THAT(StoppedResumeAdvice(options, 50, 1010),
              HasSubstr(". The instrument is stopped: before resuming, run `perceptionctl streams reset AMZN` (its "
                        "state zeroed), or resume with --first 0 --count 150 --start_seq 901 --seed-window 110 "
                        "--reseed, whose 110 events before seq 1011 seed its state"));
  options.seed_window = 20;
  EXPECT_THAT(StoppedResumeAdvice(options, 50, 1010),
              HasSubstr("resume with --first 90 --count 60 --start_seq 991 --seed-window 20 --reseed, whose 20 events "
                        "before seq 1011 seed its state"));
  EXPECT_THAT(StoppedResumeAdvice(options, 50, 0),
              HasSubstr("or resume with --seed-window N --reseed as well, --first and --start_seq each moved back by N "
                        "(and --count on by N)"))
      << "the resume point is the instrument's end_seq, not known here";
}

// A seeded stream that would not start at the instrument's next number: the --start_seq that starts it there names
// the event that then takes that number, and the --first that keeps the command's numbering (event i as seq
// i + (start_seq - first)) goes beside it; the advice once named --start_seq alone, which renumbered a resume's
// events where --first had not been moved back by the seed window.
TEST(SeedingContinuation, NamesTheEventThatTakesTheNextNumberAndTheFirstThatKeepsTheNumbering) {
  StreamOptions options = Options(300);  // events 100..399 as seq 1001..1300
  options.seed_window = 100;             // the stream after the seed would start at seq 1101 (event 200)
  EXPECT_EQ(SeedingContinuation(options, 300, 1011),
            " (--start_seq 911 continues it, the files' event 200 taking seq 1011; to keep this command's numbering "
            "instead, event i as seq i + (start_seq - first), --first 10 --count 390 --start_seq 911)");
  EXPECT_EQ(SeedingContinuation(options, 300, 1201),
            " (--start_seq 1101 continues it, the files' event 200 taking seq 1201; to keep this command's numbering "
            "instead, event i as seq i + (start_seq - first), --first 200 --count 200 --start_seq 1101)");
  EXPECT_EQ(SeedingContinuation(options, 300, 1301),
            " (--start_seq 1201 continues it, the files' event 200 taking seq 1301)")
      << "the numbering puts seq 1301 on event 400, past the command's last";
  EXPECT_EQ(SeedingContinuation(options, 300, 1000),
            " (--start_seq 900 continues it, the files' event 200 taking seq 1000)")
      << "event -1 does not exist";
  EXPECT_EQ(SeedingContinuation(options, 300, 100), "") << "no sequence number below 1";
  options.count = 0;  // to the files' end
  EXPECT_THAT(SeedingContinuation(options, 300, 1011), HasSubstr("--first 10 --start_seq 911)"));
}

// A row per stream, full 64-bit counts, and under a row why it takes no events or that a seed runs on it.
TEST(StreamsTable, ShowsEachStreamWithItsStoppedAndSeedingLines) {
  v1::ListStreamsResponse response;
  v1::StreamInfo& live = *response.add_streams();
  live.set_instrument("AMZN");
  live.set_slot(3);
  live.set_processed_events(5'000'000'000);
  live.set_pending_events(12);
  live.set_oldest_retained_seq(4'000'000'001);
  live.set_end_seq(5'000'000'001);
  v1::StreamInfo& stopped = *response.add_streams();
  stopped.set_instrument("AAPL");
  stopped.set_slot(0);
  stopped.set_stopped("a logged event's logits are not finite");
  stopped.set_seeding(true);
  const std::string table = StreamsTable(response);
  EXPECT_EQ(table,
            "instrument        slot    processed   pending   oldest_seq      end_seq\n"
            "AMZN                 3   5000000000        12   4000000001   5000000001\n"
            "AAPL                 0            0         0            0            0\n"
            "  stopped: a logged event's logits are not finite\n"
            "  seeding: a SeedStream runs on it\n");
  EXPECT_EQ(StreamsTable(v1::ListStreamsResponse()),
            "instrument        slot    processed   pending   oldest_seq      end_seq\n");
}

}  // namespace
}  // namespace perception::client
