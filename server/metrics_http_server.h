// A minimal HTTP/1.1 responder for GET /metrics on its own thread (prometheus-cpp's civetweb Exposer cannot start
// its threads in a process that has cuBLASLt loaded; see ../shared/design/ARCHITECTURE.md from the repository root).
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace perception::server {

class MetricsHttpServer {
 public:
  // Listens on `address` ("host:port"; port 0 picks a free one) and answers GET /metrics with `render()`. One thread
  // polls the listener and every open connection (up to 16; a new one takes the slot of the longest-connected client
  // still to send its head); each connection has 2 s in all to send its request head and take its answer, so idle or
  // trickling clients, however many, neither delay a concurrent scrape nor hold a slot for long, and the destructor
  // does not wait for them. A head over 8 KiB is answered 431. When accept fails for want
  // of descriptors or memory, the listener rests 100 ms (logged at most every 10 s) instead of spinning.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  std::function<std::string()> render);
  ~MetricsHttpServer();  // stops listening, drops the open connections and joins the thread

  int port() const { return port_; }

 private:
  MetricsHttpServer(int listen_fd, int port, std::array<int, 2> wake_pipe, std::function<std::string()> render);
  struct Connection;

  void Serve();
  // Reads what `connection` sent until its request head is complete, then sends it the answer.
  void Advance(Connection& connection) const;
  // The whole HTTP answer to the request whose head is `head`.
  std::string Respond(absl::string_view head) const;

  const int listen_fd_;
  const int port_;
  const std::array<int, 2> wake_pipe_;  // written once to stop the thread
  const std::function<std::string()> render_;
  std::thread thread_;
};

}  // namespace perception::server
