// GET /metrics over plain non-blocking sockets: one poll loop accepts, reads each request head, answers and closes.
#include "server/metrics_http_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "server/listen_address.h"
#include "spdlog/spdlog.h"

namespace perception::server {
namespace {

using Clock = std::chrono::steady_clock;

// A scrape takes milliseconds; a connection that has not sent its head and taken its answer by then is dropped,
// however it trickles, so that it does not hold one of the few slots.
constexpr Clock::duration kConnectionDeadline = std::chrono::seconds(2);
// Connections served at once. A new one takes the slot of the longest-connected client still to send its request head,
// else of the longest-connected one that has its answer and is only left to close (one that never reads or closes
// would hold the slot to its deadline), so that a client holding many connections does not delay every scrape by up
// to kConnectionDeadline; it waits in the listen backlog only while every slot is still sending its answer.
constexpr size_t kMaxConnections = 16;
constexpr size_t kMaxRequestHead = 8192;
// Once its answer is sent, what a client still sends is read and dropped until it closes, up to this much: closing
// with bytes unread would reset the connection, and the client could lose the answer.
constexpr size_t kMaxDrained = 65536;
// Accept fails without taking the pending connection from the backlog when the process is out of descriptors or
// memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the listener stays readable, and polling it again at once would spin.
constexpr std::chrono::milliseconds kAcceptBackoff(100);
constexpr Clock::duration kAcceptReportInterval = std::chrono::seconds(10);

absl::Status Errno(absl::string_view what, const std::string& address) {
  return absl::UnavailableError(absl::StrCat("metrics ", what, " ", address, ": ", std::strerror(errno)));
}

// "host:port" or "[v6]:port"; an empty host listens on every interface.
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& address) {
  if (const absl::Status port = CheckListenPort(address); !port.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address ", port.message()));
  }
  const size_t colon = address.rfind(':');
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
  // Non-blocking: a client that resets its connection between poll and accept must not block the thread in accept.
  const int fd = ::socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, found->ai_protocol);
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

// True when a failed recv or send only has to be tried again once poll says so.
bool WouldBlock() { return errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK; }

// Reads and drops what a draining connection (`drained` bytes dropped so far) has sent and not been read, up to
// kMaxDrained in all, without waiting: closing with bytes unread would reset it, and the reset may lose its answer.
void DropUnread(int fd, size_t drained) {
  char chunk[1024];
  while (drained <= kMaxDrained) {
    const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    drained += static_cast<size_t>(n);
  }
}

// Milliseconds from now until `deadline`, rounded up so that poll does not wake just before it; 0 once past.
int PollTimeoutMs(Clock::time_point deadline) {
  const std::chrono::milliseconds left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(left.count(), 0));
}

// Where the request head ends, past its blank line; npos while it has none. A line may end in a bare LF (RFC 9112
// §2.2 lets a recipient take it for CRLF), so the blank line is "\n\n" as well as "\n\r\n".
size_t HeadEnd(absl::string_view head) {
  const size_t lf = head.find("\n\n"), crlf = head.find("\n\r\n");
  return std::min(lf == absl::string_view::npos ? lf : lf + 2, crlf == absl::string_view::npos ? crlf : crlf + 3);
}

// `headers`: further header lines, each ending in CRLF.
std::string Response(absl::string_view status, absl::string_view content_type, absl::string_view body,
                     absl::string_view headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type, "\r\nContent-Length: ", body.size(),
                      "\r\n", headers, "Connection: close\r\n\r\n", body);
}

// The path of a request target in origin form ("/metrics?q") or in the absolute form a server must also accept
// (RFC 9112 §3.2.2: "http://host:port/metrics"), without its query.
absl::string_view TargetPath(absl::string_view target) {
  if (const size_t scheme_end = target.find("://"); scheme_end != absl::string_view::npos &&
                                                   absl::EqualsIgnoreCase(target.substr(0, scheme_end), "http")) {
    const size_t path_start = target.find('/', scheme_end + 3);
    target = path_start == absl::string_view::npos ? "/" : target.substr(path_start);
  }
  return target.substr(0, target.find('?'));
}

// Failures of accept other than a client that left first: after each the listener rests for kAcceptBackoff, and
// they are logged at most once per kAcceptReportInterval.
class AcceptFailures {
 public:
  void Record(int error, Clock::time_point now) {
    resume_ = now + kAcceptBackoff;
    ++unreported_;
    if (now < last_report_ + kAcceptReportInterval) return;
    spdlog::warn("metrics: cannot accept a connection: {} ({} time(s) since the last report); the listener rests "
                 "{} ms after each",
                 std::strerror(error), unreported_, kAcceptBackoff.count());
    last_report_ = now;
    unreported_ = 0;
  }
  // When the listener may be polled again.
  Clock::time_point resume() const { return resume_; }

 private:
  Clock::time_point resume_ = Clock::time_point::min();
  Clock::time_point last_report_ = Clock::time_point::min();
  int unreported_ = 0;
};

}  // namespace

struct MetricsHttpServer::Connection {
  Connection(int fd, Clock::time_point deadline) : fd(fd), deadline(deadline) {}

  int fd;
  Clock::time_point deadline;
  std::string head;        // the request head received so far
  bool answering = false;  // the head is complete and `answer` is set
  std::string answer;
  size_t sent = 0;        // bytes of `answer` sent
  bool draining = false;  // the answer is sent and the write side shut: what the client still sends is dropped
  size_t drained = 0;     // bytes dropped so far
  bool done = false;      // answered and closed by the client, or failed
};

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
  std::vector<Connection> connections;
  std::vector<pollfd> watched;
  AcceptFailures accept_failures;
  // The connection a new one may take the slot of (kMaxConnections), or connections.end() when every one is still
  // sending its answer. One that has its answer (its write side shut) keeps it through the close: what it sent since
  // is read first (DropUnread), so that the close does not reset it.
  const auto evictable = [&connections] {
    const auto sending = [](const Connection& connection) { return connection.answering && !connection.draining; };
    const auto found = std::ranges::min_element(connections, {}, [&](const Connection& connection) {
      return std::pair(sending(connection) ? 2 : connection.answering ? 1 : 0, connection.deadline);
    });
    return found != connections.end() && !sending(*found) ? found : connections.end();
  };
  const auto room = [&] { return connections.size() < kMaxConnections || evictable() != connections.end(); };
  while (true) {
    const bool resting = Clock::now() < accept_failures.resume();
    // The wake pipe, the listener (ignored, as fd -1, while every slot is answering or it rests), then each connection.
    watched = {{wake_pipe_[0], POLLIN, 0}, {room() && !resting ? listen_fd_ : -1, POLLIN, 0}};
    Clock::time_point next_deadline = resting ? accept_failures.resume() : Clock::time_point::max();
    for (const Connection& connection : connections) {
      const bool sending = connection.answering && !connection.draining;
      watched.push_back({connection.fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0});
      next_deadline = std::min(next_deadline, connection.deadline);
    }
    const int timeout_ms = next_deadline == Clock::time_point::max() ? -1 : PollTimeoutMs(next_deadline);
    if (::poll(watched.data(), watched.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("metrics: poll failed: {}", std::strerror(errno));
      break;
    }
    if (watched[0].revents != 0) break;
    for (size_t i = 0; i < connections.size(); ++i) {
      if (watched[i + 2].revents != 0) Advance(connections[i]);
    }
    const Clock::time_point now = Clock::now();
    std::erase_if(connections, [now](const Connection& connection) {
      const bool over = connection.done || now >= connection.deadline;
      if (over) ::close(connection.fd);
      return over;
    });
    if (watched[1].revents != 0 && room()) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        if (connections.size() >= kMaxConnections) {
          const auto dropped = evictable();
          if (dropped->draining) DropUnread(dropped->fd, dropped->drained);
          ::close(dropped->fd);
          connections.erase(dropped);
        }
        connections.emplace_back(fd, now + kConnectionDeadline);
      } else if (!WouldBlock() && errno != ECONNABORTED) {
        accept_failures.Record(errno, now);
      }
    }
  }
  for (const Connection& connection : connections) ::close(connection.fd);
}

void MetricsHttpServer::Advance(Connection& connection) const {
  char chunk[1024];
  if (connection.draining) {
    const ssize_t n = ::recv(connection.fd, chunk, sizeof(chunk), 0);
    connection.drained += static_cast<size_t>(std::max<ssize_t>(n, 0));
    connection.done = n == 0 || (n < 0 && !WouldBlock()) || connection.drained > kMaxDrained;
    return;
  }
  if (!connection.answering) {
    const ssize_t n = ::recv(connection.fd, chunk, sizeof(chunk), 0);
    if (n < 0) {
      connection.done = !WouldBlock();
      return;
    }
    connection.head.append(chunk, static_cast<size_t>(n));
    const size_t end = HeadEnd(connection.head);
    if (end == std::string::npos ? connection.head.size() > kMaxRequestHead : end > kMaxRequestHead) {
      connection.answer = Response("431 Request Header Fields Too Large", "text/plain",
                                   absl::StrCat("the request head is over ", kMaxRequestHead, " bytes\n"));
    } else if (end != std::string::npos || n == 0) {
      // n == 0: the client sent all it will; it is answered from what there is. The body of a GET is empty.
      connection.answer = Respond(connection.head);
    } else {
      return;
    }
    connection.answering = true;
  }
  const absl::string_view rest = absl::string_view(connection.answer).substr(connection.sent);
  const ssize_t n = ::send(connection.fd, rest.data(), rest.size(), MSG_NOSIGNAL);
  if (n < 0) {
    connection.done = !WouldBlock();  // the scraper went away: nothing to do but close
    return;
  }
  connection.sent += static_cast<size_t>(n);
  if (connection.sent < connection.answer.size()) return;
  // The client sees the answer end now; it is closed once the client closes too (see kMaxDrained). shutdown fails
  // only when the client has reset the connection already.
  connection.draining = true;
  connection.done = ::shutdown(connection.fd, SHUT_WR) != 0;
}

std::string MetricsHttpServer::Respond(absl::string_view head) const {
  // Empty lines before the request line are ignored (RFC 9112 §2.2): some clients end their previous request so.
  while (absl::ConsumePrefix(&head, "\r\n") || absl::ConsumePrefix(&head, "\n")) {
  }
  absl::string_view request_line = head.substr(0, head.find('\n'));
  absl::ConsumeSuffix(&request_line, "\r");
  // "METHOD TARGET VERSION".
  const size_t method_end = request_line.find(' ');
  const size_t target_end = request_line.find(' ', method_end + 1);
  if (method_end == absl::string_view::npos || target_end == absl::string_view::npos) {
    return Response("400 Bad Request", "text/plain", "malformed request line\n");
  }
  const absl::string_view method = request_line.substr(0, method_end);
  const absl::string_view target = request_line.substr(method_end + 1, target_end - method_end - 1);
  // The answer is HTTP/1.1's: a request of another major version was answered 200 all the same (RFC 9110 §15.6.6).
  const absl::string_view version = request_line.substr(target_end + 1);
  if (!absl::StartsWith(version, "HTTP/")) {
    return Response("400 Bad Request", "text/plain", "malformed request line\n");
  }
  if (version != "HTTP/1.0" && version != "HTTP/1.1") {
    return Response("505 HTTP Version Not Supported", "text/plain", "use HTTP/1.1\n");
  }
  if (TargetPath(target) != "/metrics") {
    return Response("404 Not Found", "text/plain", "only /metrics is served here\n");
  }
  if (method != "GET" && method != "HEAD") {
    return Response("405 Method Not Allowed", "text/plain", "use GET or HEAD\n", "Allow: GET, HEAD\r\n");
  }
  const std::string exposition = render_();
  std::string answer = Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", exposition);
  if (method == "HEAD") answer.resize(answer.size() - exposition.size());  // GET's head, Content-Length included
  return answer;
}

}  // namespace perception::server
