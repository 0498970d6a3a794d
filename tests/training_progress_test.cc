// perceptionctl train's progress bar: how many of its cells a run's steps fill, also for runs of many millions.
#include <gtest/gtest.h>

#include <limits>

#include "client/training_progress.h"

namespace perception::client {
namespace {

TEST(FilledBarCells, FillInProportionRoundingDown) {
  EXPECT_EQ(FilledBarCells(0, 200, 30), 0);
  EXPECT_EQ(FilledBarCells(1, 200, 30), 0);
  EXPECT_EQ(FilledBarCells(7, 200, 30), 1);
  EXPECT_EQ(FilledBarCells(100, 200, 30), 15);
  EXPECT_EQ(FilledBarCells(199, 200, 30), 29);
  EXPECT_EQ(FilledBarCells(200, 200, 30), 30);
  EXPECT_EQ(FilledBarCells(0, 0, 30), 30) << "a run of no steps is done";
}

// 30 · done overflowed an int from 71,582,789 steps on: the bar's length came out negative and building it threw,
// which ended perceptionctl in the middle of a long run on a terminal.
TEST(FilledBarCells, LongRunsPastTheOldOverflow) {
  EXPECT_EQ(FilledBarCells(71'582'788, 100'000'000, 30), 21);
  EXPECT_EQ(FilledBarCells(71'582'789, 100'000'000, 30), 21);
  const int most = std::numeric_limits<int>::max();
  EXPECT_EQ(FilledBarCells(most / 2, most, 30), 14);
  EXPECT_EQ(FilledBarCells(most, most, 30), 30);
}

}  // namespace
}  // namespace perception::client
