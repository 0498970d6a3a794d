// A race `./dev tsan` must call ours: a mutex of ours destroyed with no ordering after another thread unlocked it
// (tests/tsan/caught_race_test.py runs it under the preloaded annotations and classifies its reports). The mutex
// guards nothing, so that every access of the race is the annotations' own.
#include <atomic>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace {

void LockOnce(absl::Mutex* mu, std::atomic<bool>* unlocked) {
  mu->Lock();
  mu->Unlock();
  // Relaxed: TSan sees no ordering from here to the delete below.
  unlocked->store(true, std::memory_order_relaxed);
}

}  // namespace

int main() {
  auto* mu = new absl::Mutex;
  std::atomic<bool> unlocked{false};
  std::thread locker(LockOnce, mu, &unlocked);
  while (!unlocked.load(std::memory_order_relaxed)) {
  }
  delete mu;
  locker.join();
  return 0;
}
