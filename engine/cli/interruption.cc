// The signal watcher of Interruption: a thread that takes the blocked signals with sigtimedwait.
#include "engine/cli/interruption.h"

#include <errno.h>
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <utility>

namespace perception {
namespace {

std::atomic<int> received_signal = 0;
std::atomic<bool> command_stopped = false;

// How often the watcher looks whether it should stop.
constexpr timespec kWatchPoll = {0, 100'000'000};

// The signal's default action, in the calling thread: the process ends as if nothing had blocked it.
void DieBy(int signal) {
  std::signal(signal, SIG_DFL);
  sigset_t just_this;
  sigemptyset(&just_this);
  sigaddset(&just_this, signal);
  pthread_sigmask(SIG_UNBLOCK, &just_this, nullptr);
  raise(signal);
}

}  // namespace

Interruption::Interruption(std::string on_first, std::string on_second)
    : on_first_(std::move(on_first)), on_second_(std::move(on_second)) {
  sigemptyset(&signals_);
  for (const int signal : {SIGINT, SIGTERM, SIGHUP}) {
    // One the caller ignores (nohup, a shell's background job) stays ignored: blocked, it would be queued all the
    // same, and taken here.
    struct sigaction action = {};
    if (sigaction(signal, nullptr, &action) == 0 && action.sa_handler == SIG_IGN) continue;
    sigaddset(&signals_, signal);
  }
  pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
  watcher_ = std::thread([this] { Watch(); });
}

Interruption::~Interruption() {
  stop_ = true;
  watcher_.join();
  // A signal that came after the watcher stopped is pending: it now takes its default action, as it would have.
  pthread_sigmask(SIG_UNBLOCK, &signals_, nullptr);
}

Interruption::Armed Interruption::Arm(absl::AnyInvocable<void()> on_second_signal) {
  absl::MutexLock lock(&mu_);
  armed_ = true;
  on_second_signal_ = std::move(on_second_signal);
  return Armed(*this);
}

Interruption::Armed::~Armed() {
  if (interruption_ == nullptr) return;  // moved from
  absl::MutexLock lock(&interruption_->mu_);
  interruption_->armed_ = false;
  interruption_->on_second_signal_ = nullptr;
}

void Interruption::Stopped() { command_stopped = true; }

void Interruption::EndByTheSignalReceived() {
  if (const int signal = received_signal; signal != 0 && command_stopped) DieBy(signal);
}

void Interruption::Watch() {
  for (int count = 0; !stop_;) {
    const int signal = sigtimedwait(&signals_, nullptr, &kWatchPoll);
    if (signal <= 0) continue;
    absl::MutexLock lock(&mu_);
    if (!armed_ || ++count > 2 || (count == 2 && on_second_signal_ == nullptr)) DieBy(signal);
    if (count == 1) {
      received_signal = signal;
      // A pipeline's other commands take the same Ctrl-C: writing to a pipe they closed must fail, not end the
      // process before it says where the run stopped.
      std::signal(SIGPIPE, SIG_IGN);
      std::fprintf(stderr, "%s: %s: %s\n", program_invocation_short_name, strsignal(signal), on_first_.c_str());
      requested_.Notify();
    } else {
      std::fprintf(stderr, "%s: %s again: %s\n", program_invocation_short_name, strsignal(signal), on_second_.c_str());
      on_second_signal_();
    }
  }
}

}  // namespace perception
