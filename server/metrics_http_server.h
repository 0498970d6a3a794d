// A minimal HTTP/1.1 responder for GET /metrics on its own thread (prometheus-cpp's civetweb Exposer cannot start
// its threads in a process that has cuBLASLt loaded; see shared/design/ARCHITECTURE.md).
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace perception::server {

class MetricsHttpServer {
 public:
  // Listens on `address` ("host:port"; port 0 picks a free one) and answers GET /metrics with `render()`, one
  // connection at a time: scrapes are rare and small, and a stalled client is cut off after a few seconds.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  std::function<std::string()> render);
  ~MetricsHttpServer();  // stops listening and joins the thread

  int port() const { return port_; }

 private:
  MetricsHttpServer(int listen_fd, int port, std::array<int, 2> wake_pipe, std::function<std::string()> render);
  void Serve();
  void Answer(int connection) const;

  const int listen_fd_;
  const int port_;
  const std::array<int, 2> wake_pipe_;  // written once to stop the thread
  const std::function<std::string()> render_;
  std::thread thread_;
};

}  // namespace perception::server
