// Ctrl-C for a command that stops where it can say how to go on: once armed, the first SIGINT, SIGTERM or SIGHUP asks
// it to stop, a second runs what the command armed it with (perceptionctl: cancel its calls) or else ends the
// process, a third ends the process as the signal would have. Signals the caller ignores stay ignored.
#pragma once

#include <signal.h>

#include <atomic>
#include <string>
#include <thread>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace perception {

class Interruption {
 public:
  // Blocks the signals in the calling thread, and so in every thread started after it: construct it before any other
  // thread starts (a gRPC channel's, CUDA's). Until Arm, a signal ends the process as it would have without this.
  // `on_first` and `on_second` go to stderr as each signal comes, after the program's name.
  Interruption(std::string on_first, std::string on_second);
  ~Interruption();
  Interruption(const Interruption&) = delete;
  Interruption& operator=(const Interruption&) = delete;

  // Until the Armed it returns goes: the command stops where it can (a stream's sending, a training run's steps);
  // before, there is nothing it could report. A second signal then runs `on_second_signal` (the watcher's thread),
  // where given, and otherwise ends the process; once the Armed is gone it ends the process.
  class Armed {
   public:
    Armed(Armed&& other) noexcept : interruption_(std::exchange(other.interruption_, nullptr)) {}
    Armed& operator=(Armed&&) = delete;
    ~Armed();

   private:
    friend class Interruption;
    explicit Armed(Interruption& interruption) : interruption_(&interruption) {}
    Interruption* interruption_;
  };
  [[nodiscard]] Armed Arm(absl::AnyInvocable<void()> on_second_signal = nullptr);

  // Whether the first signal came; WaitForRequest waits up to `timeout` for it.
  bool Requested() const { return requested_.HasBeenNotified(); }
  bool WaitForRequest(absl::Duration timeout) const { return requested_.WaitForNotificationWithTimeout(timeout); }

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
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  // Run at the second signal while armed; held under mu_ so that the Armed's end waits for a run in progress.
  absl::AnyInvocable<void()> on_second_signal_ ABSL_GUARDED_BY(mu_);
  absl::Notification requested_;
  std::atomic<bool> stop_ = false;
  std::thread watcher_;
};

}  // namespace perception
