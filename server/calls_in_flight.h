// The gRPC calls the daemon is still answering, counted by an interceptor, so that its exit need not wait on idle
// connections.
#pragma once

#include <cstdint>
#include <memory>

#include <grpcpp/support/server_interceptor.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace perception::server {

// gRPC's server shutdown waits for every client connection to close after its GOAWAY, and a C-core client reads an
// idle connection only when its backup poller runs (every 5 s): the daemon's exit waited 5 to 10 s on a client that
// merely kept its channel open, and the full shutdown deadline on an open Health/Watch. With the calls counted, the
// exit waits for what it owes (an answer to every call in flight) and closes the connections then.
class CallsInFlight {
 public:
  // Counts each call of the server it is installed in (ServerBuilder::experimental().SetInterceptorCreators) from
  // the call's start until gRPC frees it, after its status is sent. Health/Watch is not counted: a watch is open for
  // as long as its client likes and is owed nothing but the NOT_SERVING the drain already sent it.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Counter();

  // Waits until no counted call is in flight or `deadline` passes; the number still in flight.
  int64_t WaitUntilNone(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Factory;
  class Interceptor;

  void Begin() ABSL_LOCKS_EXCLUDED(mu_);
  void End() ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace perception::server
