// The stall watch's thread.
#include "server/stall_watch.h"

#include <utility>

namespace perception::server {

StallWatch::StallWatch(const DeviceWorker& worker, absl::Duration limit, absl::Duration period,
                       std::function<void(absl::Duration)> on_stall, std::function<void()> on_recover)
    : worker_(worker),
      limit_(limit),
      period_(period),
      on_stall_(std::move(on_stall)),
      on_recover_(std::move(on_recover)),
      thread_(&StallWatch::Watch, this) {}

StallWatch::~StallWatch() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void StallWatch::Watch() {
  bool stalled = false;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), period_)) return;
    }
    const absl::Duration busy = worker_.busy_for();
    if (!stalled && busy > limit_) {
      stalled = true;
      on_stall_(busy);
    } else if (stalled && busy <= limit_) {
      stalled = false;
      on_recover_();
    }
  }
}

}  // namespace perception::server
