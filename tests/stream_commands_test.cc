// perceptionctl's streaming commands without a daemon: the resume advice that ends a failed stream's error.
#include "client/stream_commands.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
  EXPECT_THAT(ResumeAdvice(Options(50), 50, 1010),
              HasSubstr("acknowledged through seq 1010 (resume with --first 110 --count 40 --start_seq 1011,"));
  EXPECT_THAT(ResumeAdvice(Options(0), 50, 1010),
              HasSubstr("acknowledged through seq 1010 (resume with --first 110 --start_seq 1011,"));
}

// A call that failed once every event was acknowledged (a drain, the watchdog on the call's end) advised
// `--count 0`, which means all the rest of the files, or, without --count, a --first past the files' end.
TEST(ResumeAdvice, SaysNothingIsLeftWhenTheLastEventWasAcknowledged) {
  for (const int64_t count : {int64_t{50}, int64_t{0}}) {
    const std::string advice = ResumeAdvice(Options(count), 50, 1050);
    EXPECT_THAT(advice, HasSubstr("acknowledged through seq 1050: the daemon acknowledged every event, so nothing is "
                                  "left to resume"));
    EXPECT_THAT(advice, Not(HasSubstr("--count 0")));
    EXPECT_THAT(advice, Not(HasSubstr("--first")));
  }
}

}  // namespace
}  // namespace perception::client
