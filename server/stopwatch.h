// Elapsed time since construction, for the durations the daemon reports in responses and metrics.
#pragma once

#include <chrono>

namespace perception::server {

class Stopwatch {
 public:
  double Seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point start_ = Clock::now();
};

}  // namespace perception::server
