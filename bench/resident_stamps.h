// The resident step's device time an event, from the stamps it records on the device's clocks (bench_stream).
#pragma once

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/percentile.h"
#include "kernels/stream_step.h"

namespace perception {

struct ResidentDeviceTimes {
  int events = 0;              // the stamped events summarized (after the skipped ones)
  double cycles_per_ns = 0;    // the multiprocessor's clock over the run: its cycles against the global timer's ns
  double busy_median_us = 0;   // ring entry found whole → just before the answer's store, by the cycle counter
  double busy_p99_us = 0;
  double busy_timer_median_us = 0;  // the same by the global timer (a cross-check)
  double period_median_us = 0;  // one answer → the next (the device's time an event back to back, its poll included)
};

// Summarizes `stamps` (TakeResidentStamps: one launch's events, in order) past the first `skip` (the launch's and the
// weights' first loads). The cycle counter is the one multiprocessor's that stamped them all, which one launch keeps;
// it is converted to µs at its rate against the global timer from the first event to the last, so the timer's
// granularity does not enter a single event's figure. Fails where the stamps are not consecutive events in order on
// both clocks, or give a rate that is not a clock's.
inline absl::StatusOr<ResidentDeviceTimes> SummarizeResidentStamps(
    const std::vector<kernels::StreamResidentStamp>& stamps, size_t skip) {
  if (stamps.size() < skip + 2) {
    return absl::FailedPreconditionError(
        absl::StrCat("resident stamps: ", stamps.size(), " events stamped, need more than ", skip + 1));
  }
  for (size_t i = skip; i < stamps.size(); ++i) {
    const kernels::StreamResidentStamp& s = stamps[i];
    const bool in_order = s.done_cycles >= s.seen_cycles && s.done_ns >= s.seen_ns && s.seen_ns != 0;
    const bool follows =
        i == skip || (s.event == stamps[i - 1].event + 1 && s.seen_cycles >= stamps[i - 1].done_cycles);
    if (!in_order || !follows) {
      return absl::FailedPreconditionError(
          absl::StrCat("resident stamps: event ", s.event, " is not stamped in one launch's order after event ",
                       i > 0 ? stamps[i - 1].event : s.event));
    }
  }
  const kernels::StreamResidentStamp &first = stamps[skip], &last = stamps.back();
  ResidentDeviceTimes t;
  t.events = static_cast<int>(stamps.size() - skip);
  t.cycles_per_ns = static_cast<double>(last.done_cycles - first.seen_cycles) /
                    static_cast<double>(last.done_ns - first.seen_ns);
  if (!(t.cycles_per_ns > 0.5 && t.cycles_per_ns < 3.0)) {
    return absl::FailedPreconditionError(absl::StrCat("resident stamps: ", t.cycles_per_ns,
                                                      " cycles a ns between the first and last event (not one clock)"));
  }
  std::vector<double> busy, busy_timer, period;
  for (size_t i = skip; i < stamps.size(); ++i) {
    const kernels::StreamResidentStamp& s = stamps[i];
    busy.push_back(static_cast<double>(s.done_cycles - s.seen_cycles) / t.cycles_per_ns * 1e-3);
    busy_timer.push_back(static_cast<double>(s.done_ns - s.seen_ns) * 1e-3);
    if (i > skip) period.push_back(static_cast<double>(s.done_cycles - stamps[i - 1].done_cycles) / t.cycles_per_ns * 1e-3);
  }
  t.busy_median_us = Median(busy);
  t.busy_p99_us = Percentile(busy, 0.99);
  t.busy_timer_median_us = Median(busy_timer);
  t.period_median_us = Median(period);
  return t;
}

}  // namespace perception
