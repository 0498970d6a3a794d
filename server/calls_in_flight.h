// The gRPC calls the daemon is still answering, counted by an interceptor, and the bytes its connections have sent
// that no peer has acknowledged yet: what the exit waits for before it closes connections clients keep open.
#pragma once

#include <cstdint>
#include <memory>

#include <grpcpp/support/server_interceptor.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace perception::server {

// The bytes this process's TCP sockets have sent, or queued to send, that their peers have not acknowledged
// (SIOCOUTQ summed over /proc/self/fd). Zero means every answer written so far is in the clients' kernels, where a
// reset of the connection no longer takes it from them.
int64_t UnacknowledgedTcpBytes();

// gRPC's server shutdown waits for every client connection to close after its GOAWAY, and a C-core client reads an
// idle connection only when its backup poller runs (every 5 s): the daemon's exit waited 5 to 10 s on a client that
// merely kept its channel open, and the full shutdown deadline on an open Health/Watch. The exit instead waits for
// the answers it owes to be delivered (WaitUntilDelivered), then has gRPC close the connections.
class CallsInFlight {
 public:
  // Counts each call of the server it is installed in (ServerBuilder::experimental().SetInterceptorCreators) from
  // when gRPC hands it to its method until gRPC frees it, its status handed to the transport. Health/Watch and
  // reflection streams are not counted: they stay open for as long as their clients like and are owed nothing (a
  // watch has had the drain's NOT_SERVING).
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Counter();

  struct Undelivered {
    int64_t calls = 0;  // still in flight
    int64_t bytes = 0;  // sent but not acknowledged (UnacknowledgedTcpBytes)
  };
  // Waits until no counted call is in flight and every byte sent is acknowledged, or `deadline` passes; what is
  // left. A gRPC send completes once its bytes are in the kernel, and a connection closed with bytes still queued
  // there can lose them: a reset (the answer to any byte the client sends after the close) drops the queue.
  Undelivered WaitUntilDelivered(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Factory;
  class Interceptor;

  void Begin() ABSL_LOCKS_EXCLUDED(mu_);
  void End() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no counted call is in flight or `deadline` passes; the number still in flight.
  int64_t WaitUntilNone(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace perception::server
