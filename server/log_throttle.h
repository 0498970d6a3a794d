// Bounds how many log lines of one kind (a method and a status code) the daemon writes per period.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace perception::server {

// The daemon's bound on the log lines of one kind (a refused call's method and code, a step not taken).
inline constexpr int kLoggedLinesPerKind = 20;
inline constexpr absl::Duration kLoggedLinesPeriod = absl::Seconds(10);

// A client that floods refused or cancelled calls would flood the log line by line (the metrics count every call):
// each kind logs at most `burst` lines a `period`, and the first line after a period that dropped some says how many.
class LogThrottle {
 public:
  LogThrottle(int burst = kLoggedLinesPerKind, absl::Duration period = kLoggedLinesPeriod,
              std::function<absl::Time()> now = [] { return absl::Now(); });

  // Whether a line of `kind` is logged now; where it is, `dropped` is how many of the kind were not since the last.
  bool Admit(const std::string& kind, int64_t& dropped);
  // What a line admitted with `dropped` adds to say so: empty where none was dropped.
  std::string DroppedNote(int64_t dropped) const;

 private:
  struct Window {
    absl::Time start;
    int logged = 0;
    int64_t dropped = 0;
  };
  const int burst_;
  const absl::Duration period_;
  const std::function<absl::Time()> now_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Window> windows_ ABSL_GUARDED_BY(mu_);
};

}  // namespace perception::server
