// GET /metrics over plain sockets: accept, read the request head, answer, close.
#include "server/metrics_http_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace perception::server {
namespace {

constexpr int kIoTimeoutSeconds = 5;
constexpr size_t kMaxRequestHead = 8192;

absl::Status Errno(absl::string_view what, const std::string& address) {
  return absl::UnavailableError(absl::StrCat("metrics ", what, " ", address, ": ", std::strerror(errno)));
}

// "host:port" or "[v6]:port"; an empty host listens on every interface.
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::pair{host, address.substr(colon + 1)};
}

absl::StatusOr<int> Listen(const std::string& address) {
  auto host_port = SplitHostPort(address);
  if (!host_port.ok()) return host_port.status();
  const auto& [host, port] = *host_port;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int error = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
      error != 0) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", address, "': ", ::gai_strerror(error)));
  }
  const int fd = ::socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, found->ai_protocol);
  const int reuse = 1;
  const bool ok = fd >= 0 && ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &reuse, sizeof(reuse)) == 0 &&
                  ::bind(fd, found->ai_addr, found->ai_addrlen) == 0 && ::listen(fd, 16) == 0;
  ::freeaddrinfo(found);
  if (!ok) {
    const absl::Status status = Errno("cannot listen on", address);
    if (fd >= 0) ::close(fd);
    return status;
  }
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage bound{};
  socklen_t size = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &size);
  const uint16_t port = bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                    : reinterpret_cast<sockaddr_in*>(&bound)->sin_port;
  return ntohs(port);
}

// Reads until the end of the request head; the body of a GET is empty.
std::string ReadRequestHead(int connection) {
  std::string head;
  char chunk[1024];
  while (head.size() < kMaxRequestHead && head.find("\r\n\r\n") == std::string::npos) {
    const ssize_t n = ::recv(connection, chunk, sizeof(chunk), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    head.append(chunk, static_cast<size_t>(n));
  }
  return head;
}

void SendAll(int connection, absl::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(connection, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the scraper went away; nothing to do
    bytes.remove_prefix(static_cast<size_t>(n));
  }
}

std::string Response(absl::string_view status, absl::string_view content_type, absl::string_view body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type, "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const std::string& address,
                                                                            std::function<std::string()> render) {
  absl::StatusOr<int> fd = Listen(address);
  if (!fd.ok()) return fd.status();
  std::array<int, 2> wake_pipe;
  if (::pipe2(wake_pipe.data(), O_CLOEXEC) != 0) {
    const absl::Status status = Errno("cannot create the wake pipe for", address);
    ::close(*fd);
    return status;
  }
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(*fd, BoundPort(*fd), wake_pipe, std::move(render)));
}

MetricsHttpServer::MetricsHttpServer(int listen_fd, int port, std::array<int, 2> wake_pipe,
                                     std::function<std::string()> render)
    : listen_fd_(listen_fd),
      port_(port),
      wake_pipe_(wake_pipe),
      render_(std::move(render)),
      thread_(&MetricsHttpServer::Serve, this) {}

MetricsHttpServer::~MetricsHttpServer() {
  const char stop = 1;
  if (::write(wake_pipe_[1], &stop, 1) != 1) spdlog::error("metrics: cannot wake the server thread");
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
}

void MetricsHttpServer::Serve() {
  pollfd watched[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
  while (true) {
    if (::poll(watched, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("metrics: poll failed: {}", std::strerror(errno));
      return;
    }
    if (watched[1].revents != 0) return;
    const int connection = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;  // the client went away between poll and accept
    const timeval timeout{kIoTimeoutSeconds, 0};
    ::setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    ::setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    Answer(connection);
    ::close(connection);
  }
}

void MetricsHttpServer::Answer(int connection) const {
  const std::string head = ReadRequestHead(connection);
  const absl::string_view request_line = absl::string_view(head).substr(0, head.find("\r\n"));
  // "METHOD TARGET VERSION"; a query string on the target is ignored.
  const size_t method_end = request_line.find(' ');
  const size_t target_end = request_line.find(' ', method_end + 1);
  if (method_end == absl::string_view::npos || target_end == absl::string_view::npos) {
    SendAll(connection, Response("400 Bad Request", "text/plain", "malformed request line\n"));
    return;
  }
  const absl::string_view method = request_line.substr(0, method_end);
  absl::string_view target = request_line.substr(method_end + 1, target_end - method_end - 1);
  target = target.substr(0, target.find('?'));
  if (target != "/metrics") {
    SendAll(connection, Response("404 Not Found", "text/plain", "only /metrics is served here\n"));
  } else if (method != "GET") {
    SendAll(connection, Response("405 Method Not Allowed", "text/plain", "use GET\n"));
  } else {
    SendAll(connection, Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", render_()));
  }
}

}  // namespace perception::server
