// The live bidirectional calls, drained together.
#include "server/live_calls.h"

namespace perception::server {

void LiveCalls::BeginDrain(const absl::Status& status) {
  // Under the lock, so that no call is deleted meanwhile: gRPC runs a reactor's OnDone (Remove) on another thread
  // after its Finish, never inside it.
  absl::MutexLock lock(&mu_);
  draining_ = status;
  for (DrainableCall* call : live_) call->Drain(status);
}

absl::Status LiveCalls::Add(DrainableCall* call) {
  absl::MutexLock lock(&mu_);
  live_.insert(call);
  return draining_;
}

void LiveCalls::Remove(DrainableCall* call) {
  absl::MutexLock lock(&mu_);
  live_.erase(call);
}

}  // namespace perception::server
