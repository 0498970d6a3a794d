// The live bidirectional calls (Stream, Train), so that a drain reaches the idle ones too.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace perception::server {

// A call that ends its input when the daemon drains and then finishes with the drain's status once the work it had
// accepted is answered.
class DrainableCall {
 public:
  virtual void Drain(const absl::Status& status) = 0;

 protected:
  ~DrainableCall() = default;
};

// A call hears of a drain otherwise only when its next request arrives, so an open call with nothing to send kept
// the server's shutdown waiting for its deadline (60 s).
class LiveCalls {
 public:
  // Drains every live call and every call added from now on with `status` (UNAVAILABLE).
  void BeginDrain(const absl::Status& status);
  // Holds `call` until Remove, then drains it at once if the drain began, else calls `start`.
  template <typename Start>
  void Join(DrainableCall* call, Start start) {
    if (const absl::Status draining = Add(call); !draining.ok()) {
      call->Drain(draining);
    } else {
      start();
    }
  }
  // Before the call is deleted: BeginDrain then no longer reaches it.
  void Remove(DrainableCall* call);

 private:
  // Holds `call`; the drain's status once it began (the call must drain itself then), else OK.
  absl::Status Add(DrainableCall* call);

  absl::Mutex mu_;
  absl::Status draining_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<DrainableCall*> live_ ABSL_GUARDED_BY(mu_);
};

}  // namespace perception::server
