// LogThrottle: at most a burst of lines per kind and period, and the count of those dropped on the next line logged.
#include "server/log_throttle.h"

#include <gtest/gtest.h>

namespace perception::server {
namespace {

TEST(LogThrottle, EachKindLogsABurstAPeriodAndCountsWhatItDropped) {
  absl::Time now = absl::FromUnixSeconds(1'000'000);
  LogThrottle throttle(3, absl::Seconds(10), [&now] { return now; });
  int64_t dropped = -1;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(throttle.Admit("Stream RESOURCE_EXHAUSTED", dropped)) << i;
    EXPECT_EQ(dropped, 0);
  }
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(throttle.Admit("Stream RESOURCE_EXHAUSTED", dropped)) << i;
  EXPECT_TRUE(throttle.Admit("Train CANCELLED", dropped)) << "another kind has its own burst";
  EXPECT_EQ(dropped, 0);
  now += absl::Seconds(9);
  EXPECT_FALSE(throttle.Admit("Stream RESOURCE_EXHAUSTED", dropped)) << "within the period";
  now += absl::Seconds(1);
  ASSERT_TRUE(throttle.Admit("Stream RESOURCE_EXHAUSTED", dropped)) << "a new period";
  EXPECT_EQ(dropped, 6);
  EXPECT_EQ(throttle.DroppedNote(dropped),
            " (6 more of these since the last line were not logged: at most 3 every 10s)");
  EXPECT_EQ(throttle.DroppedNote(0), "");
  ASSERT_TRUE(throttle.Admit("Stream RESOURCE_EXHAUSTED", dropped));
  EXPECT_EQ(dropped, 0) << "counted once";
}

}  // namespace
}  // namespace perception::server
