// Notices a device job that runs far longer than any should (a hung kernel, a wait that never returns), so that the
// daemon can say so through its health and a supervisor can restart it: the device worker itself cannot.
#pragma once

#include <functional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/device_worker.h"

namespace perception::server {

class StallWatch {
 public:
  // Every `period`, compares how long the worker's current job has run with `limit`: `on_stall(busy)` runs once
  // when a job passes it, `on_recover()` once that job has ended. Both run on the watch's own thread.
  StallWatch(const DeviceWorker& worker, absl::Duration limit, absl::Duration period,
             std::function<void(absl::Duration busy)> on_stall, std::function<void()> on_recover);
  ~StallWatch();  // stops the thread; nothing runs after it returns

 private:
  void Watch();

  const DeviceWorker& worker_;
  const absl::Duration limit_, period_;
  const std::function<void(absl::Duration)> on_stall_;
  const std::function<void()> on_recover_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace perception::server
