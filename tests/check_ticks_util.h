// What the tests of CheckTicks (Backend's and CudaStreamer's) ask of it: how many ticks run, and that they finish.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/backend.h"

namespace perception::testing {

// How many ticks `checker.CheckTicks(wait_for_ticks)` says may still be running (-1 where it failed); none of the
// tests' outputs is ever found not finite.
template <typename Checker>
int64_t UnfinishedTicks(Checker& checker, bool wait_for_ticks) {
  absl::StatusOr<TicksChecked> checked = checker.CheckTicks(wait_for_ticks);
  EXPECT_TRUE(checked.ok()) << checked.status();
  if (!checked.ok()) return -1;
  EXPECT_TRUE(checked->nonfinite.empty());
  return checked->unfinished;
}

// Asks again without a wait until no tick runs (for at most 5 s), starting from `count` running: no answer may be
// above the one before, and the last must be 0.
template <typename Checker>
void ExpectTicksFinishWithoutAWait(Checker& checker, int64_t count) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (count > 0 && std::chrono::steady_clock::now() < give_up) {
    const int64_t now = UnfinishedTicks(checker, /*wait_for_ticks=*/false);
    EXPECT_LE(now, count) << "a tick finished cannot be running again";
    count = now;
  }
  EXPECT_EQ(count, 0) << "every tick finishes, and CheckTicks learns it without waiting";
}

}  // namespace perception::testing
