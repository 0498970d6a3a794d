// Ctrl-C for a command that stops where it can say how to resume: once armed, the first SIGINT, SIGTERM or SIGHUP
// asks it to stop, a second cancels its calls, a third ends the process as the signal would have. Signals the caller
// ignores stay ignored.
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
  // thread starts (the gRPC channel's). Until Arm, a signal ends the process as it would have without this.
  // `on_first` and `on_second` go to stderr as each signal comes.
  Interruption(std::string on_first, std::string on_second);
  ~Interruption();
  Interruption(const Interruption&) = delete;
  Interruption& operator=(const Interruption&) = delete;

  // From here on the command stops where it can (its stream's sending); before, there is nothing it could report.
  void Arm() { armed_ = true; }
  // Whether the first signal came; WaitForRequest waits up to `timeout` for it.
  bool Requested() const { return requested_.HasBeenNotified(); }
  bool WaitForRequest(absl::Duration timeout) const { return requested_.WaitForNotificationWithTimeout(timeout); }
  // The calls the second signal cancels.
  CallCancellation& calls() { return calls_; }

  // The command stopped where the first signal asked it to (rather than finishing its work all the same).
  void Stopped();
  // Where a signal stopped the command (Stopped), the process then ends by that signal, as the shell expects of an
  // interrupted command: a script run by bash stops at a child that a SIGINT ended, and goes on after one that exited
  // (exit 130 ran the script's next command). Called once the command has said where it stopped; one that finished
  // its work all the same, failed or not, exits as it would have.
  static void EndByTheSignalReceived();

 private:
  // The watcher thread: takes the blocked signals one by one (sigtimedwait, so that it can stop).
  void Watch();

  const std::string on_first_, on_second_;
  sigset_t signals_;
  std::atomic<bool> armed_ = false;
  absl::Notification requested_;
  CallCancellation calls_;
  std::atomic<bool> stop_ = false;
  std::thread watcher_;
};

}  // namespace perception::client
