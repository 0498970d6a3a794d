// perceptionctl train's progress: how many of the bar's cells a run's steps fill, also for runs of many millions, and
// the pace and time left it shows.
#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <string>

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

// The pace counts from the first answer: the first step also carries the run's start (the daemon's first step at a
// shape runs eagerly, before its graph is captured), and a slow one made the early ETAs far too long. Before a
// second answer there is no pace to show.
TEST(TrainingProgress, ThePaceCountsFromTheFirstAnswer) {
  using std::chrono::milliseconds;
  TrainingProgress::Clock::time_point now{};
  TrainingProgress progress(101, 1, /*terminal=*/false, [&now] { return now; });
  testing::internal::CaptureStdout();
  now += milliseconds(5000);  // a slow first step
  progress.Update(0.7, 1.0);
  now += milliseconds(100);
  progress.Update(0.6, 1.0);
  now += milliseconds(100);
  progress.Update(0.5, 1.0);
  const std::string lines = testing::internal::GetCapturedStdout();
  EXPECT_NE(lines.find("step 1/101  loss 0.70000  grad_norm 1.0000  -- steps/s  ETA --:--\n"), std::string::npos)
      << lines;
  // 2 steps in 0.2 s after the first: 10 steps/s, 98 steps left.
  EXPECT_NE(lines.find("step 2/101  loss 0.60000  grad_norm 1.0000  10.00 steps/s  ETA 0:10\n"), std::string::npos)
      << lines;
  EXPECT_NE(lines.find("step 3/101  loss 0.50000  grad_norm 1.0000  10.00 steps/s  ETA 0:10\n"), std::string::npos)
      << lines;
}

// On a terminal a note ends the bar's line, showing the steps answered since its last draw first: steps within the
// redraw interval of the draw before them were not drawn, and the note after them left an empty line (the bar's line,
// never drawn again, ended a second time) and hid how far the run had got.
TEST(TrainingProgress, ANoteOnATerminalShowsTheLastStepAndLeavesNoEmptyLine) {
  using std::chrono::milliseconds;
  TrainingProgress::Clock::time_point now{};
  TrainingProgress progress(6, 1, /*terminal=*/true, [&now] { return now; });
  testing::internal::CaptureStdout();
  progress.Note("model step 0: validation loss 0.70000");
  now += milliseconds(5000);
  progress.Update(0.7, 1.0);
  now += milliseconds(10);
  progress.Update(0.6, 1.0);
  progress.Note("model step 2: validation loss 0.65000");
  now += milliseconds(10);
  progress.Update(0.5, 1.0);
  progress.Note("model step 3: validation loss 0.60000");
  progress.Note("saved the best model so far");
  progress.Finish();
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(out.find("\n\n"), std::string::npos) << out;
  EXPECT_NE(out.find("\rstep 2/6 [##########....................] loss 0.60000  100.00 steps/s  ETA 0:00 \nmodel step 2: "),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("loss 0.50000  100.00 steps/s  ETA 0:00 \nmodel step 3: validation loss 0.60000\nsaved the best"),
            std::string::npos)
      << out;
  EXPECT_TRUE(out.starts_with("model step 0: validation loss 0.70000\n\rstep 1/6 ")) << out;
  EXPECT_TRUE(out.ends_with("saved the best model so far\n")) << out;
}

}  // namespace
}  // namespace perception::client
