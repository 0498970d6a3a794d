// Ctrl-C for a command that stops where it can say how to resume: the first SIGINT, SIGTERM or SIGHUP asks it to
// stop, a second cancels its calls, a third ends the process as the signal would have.
#pragma once

#include <signal.h>

#include <atomic>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/perception_client.h"

namespace perception::client {

class Interruption {
 public:
  // Blocks the signals in the calling thread, and so in every thread started after it: construct it before any other
  // thread starts (the gRPC channel's). `on_first` and `on_second` go to stderr as each signal comes.
  Interruption(std::string on_first, std::string on_second);
  ~Interruption();
  Interruption(const Interruption&) = delete;
  Interruption& operator=(const Interruption&) = delete;

  // Whether the first signal came; WaitForRequest waits up to `timeout` for it.
  bool Requested() const { return requested_.HasBeenNotified(); }
  bool WaitForRequest(absl::Duration timeout) const { return requested_.WaitForNotificationWithTimeout(timeout); }
  // The calls the second signal cancels.
  CallCancellation& calls() { return calls_; }

  // The first signal's number, 0 before any: process-wide, so that main can exit 128 + it, as the shell reports a
  // process the signal ended.
  static int Received();

 private:
  void Watch();

  const std::string on_first_, on_second_;
  sigset_t signals_;
  absl::Notification requested_;
  CallCancellation calls_;
  std::atomic<bool> stop_ = false;
  std::thread watcher_;
};

}  // namespace perception::client
