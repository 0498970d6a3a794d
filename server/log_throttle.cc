// Per-kind log rate bound.
#include "server/log_throttle.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace perception::server {

LogThrottle::LogThrottle(int burst, absl::Duration period, std::function<absl::Time()> now)
    : burst_(burst), period_(period), now_(std::move(now)) {}

bool LogThrottle::Admit(const std::string& kind, int64_t& dropped) {
  const absl::Time now = now_();
  absl::MutexLock lock(&mu_);
  Window& window = windows_[kind];
  if (now - window.start >= period_) {
    window.start = now;
    window.logged = 0;
  }
  if (window.logged >= burst_) {
    ++window.dropped;
    return false;
  }
  ++window.logged;
  dropped = std::exchange(window.dropped, 0);
  return true;
}

std::string LogThrottle::DroppedNote(int64_t dropped) const {
  if (dropped == 0) return "";
  return absl::StrCat(" (", dropped, " more of these since the last line were not logged: at most ", burst_, " every ",
                      absl::FormatDuration(period_), ")");
}

}  // namespace perception::server
