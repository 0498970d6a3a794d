// The /metrics responder against clients that connect and send nothing or trickle their request: scrapes beside
// them are answered at once, the slow ones are dropped at their deadline, and the destructor does not wait for them.
// Heads over the limit or with bare LF line ends, requests as HTTP/1.1 allows them, and a process out of file
// descriptors (its process metrics too).
#include "server/metrics_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/metrics.h"
#include "tests/captured_log.h"

namespace perception::server {
namespace {

using ::perception::testing::CapturedLog;
using ::testing::Contains;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// A loopback connection to `port`, closed when it goes out of scope.
class Client {
 public:
  explicit Client(int port) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~Client() { ::close(fd_); }

  bool connected() const { return connected_; }
  bool Send(const std::string& bytes) const {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }
  // Everything the server sends until it closes the connection, or what came before `timeout`. `error`, when given,
  // is set to the errno of a failed read (ECONNRESET: the server reset the connection), else to 0.
  std::string ReadToEnd(std::chrono::milliseconds timeout, int* error = nullptr) const {
    if (error != nullptr) *error = 0;
    const Clock::time_point deadline = Clock::now() + timeout;
    std::string received;
    char chunk[4096];
    while (Clock::now() < deadline) {
      pollfd readable{fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (::poll(&readable, 1, static_cast<int>(left.count()) + 1) <= 0) continue;
      const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
      if (n < 0 && error != nullptr) *error = errno;
      if (n <= 0) return received;
      received.append(chunk, static_cast<size_t>(n));
    }
    return received;
  }

 private:
  const int fd_;
  bool connected_ = false;
};

// A client that sends a request head one byte every 100 ms on its own thread, never reaching the head's end, until
// `Stop` or the server drops it; its bytes run out after about 16 s, so that a server that waits for it is seen to be
// slow instead of hanging the test.
class Trickler {
 public:
  explicit Trickler(int port)
      : thread_([this, port] {
          Client client(port);
          const std::string head = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + std::string(120, 'a');
          for (size_t i = 0; i < head.size() && !stop_ && client.Send(head.substr(i, 1)); ++i) {
            sent_ = i + 1;
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
        }) {}
  ~Trickler() { Stop(); }

  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  size_t sent() const { return sent_; }

 private:
  std::atomic<bool> stop_ = false;
  std::atomic<size_t> sent_ = 0;
  std::thread thread_;
};

std::unique_ptr<MetricsHttpServer> StartServer() {
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1:0", [] { return std::string("perception_test_metric 1\n"); });
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

void WaitUntilTrickling(const Trickler& trickler) {
  const Clock::time_point start = Clock::now();
  while (trickler.sent() < 2 && SecondsSince(start) < 5) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_GE(trickler.sent(), 2u);
}

// What a scrape of `port` got (a new connection, the usual GET, read until the server closed) and how many seconds it
// took from connecting.
std::pair<std::string, double> TimedScrape(int port) {
  const Clock::time_point asked = Clock::now();
  const Client scraper(port);
  EXPECT_TRUE(scraper.connected());
  EXPECT_TRUE(scraper.Send("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
  std::string answer = scraper.ReadToEnd(std::chrono::seconds(10));
  return {std::move(answer), SecondsSince(asked)};
}

// getaddrinfo takes a port past 65535 and keeps its low 16 bits: the server listened where no scrape would look.
TEST(MetricsHttpServerTest, APortPast65535IsRefused) {
  const auto render = [] { return std::string("perception_test_metric 1\n"); };
  for (const std::string address : {"127.0.0.1:99999", "127.0.0.1:65536", "127.0.0.1:", "127.0.0.1"}) {
    const absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server = MetricsHttpServer::Start(address, render);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_THAT(std::string(server.status().message()), ::testing::HasSubstr("metrics address '" + address + "'"));
  }
  EXPECT_TRUE(MetricsHttpServer::Start("127.0.0.1:0", render).ok());
}

TEST(MetricsHttpServerTest, AScrapeIsAnsweredAtOnceBesideAnIdleAndATricklingClient) {
  const std::unique_ptr<MetricsHttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  const Clock::time_point opened = Clock::now();
  const Client idle(server->port());  // as a port probe leaves it: connected, nothing sent
  ASSERT_TRUE(idle.connected());
  Trickler trickler(server->port());
  WaitUntilTrickling(trickler);

  const auto [answer, seconds] = TimedScrape(server->port());
  EXPECT_LT(seconds, 1.0);
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(answer, HasSubstr("\r\n\r\nperception_test_metric 1\n"));

  // The idle client is dropped, without an answer, at its 2 s deadline.
  EXPECT_EQ(idle.ReadToEnd(std::chrono::seconds(10)), "");
  EXPECT_LT(SecondsSince(opened), 3.0);
}

// More idle connections than slots (a port scanner's, or a client that holds them open): each new one takes the slot
// of the longest-connected client that has not sent its head, so the scrape behind them is not kept waiting for their
// deadlines.
TEST(MetricsHttpServerTest, AScrapeIsAnsweredAtOnceBehindMoreIdleClientsThanSlots) {
  const std::unique_ptr<MetricsHttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  std::vector<std::unique_ptr<Client>> idle;
  for (int i = 0; i < 24; ++i) {
    idle.push_back(std::make_unique<Client>(server->port()));
    ASSERT_TRUE(idle.back()->connected());
  }
  const auto [answer, seconds] = TimedScrape(server->port());
  EXPECT_LT(seconds, 1.0);
  EXPECT_THAT(answer, HasSubstr("\r\n\r\nperception_test_metric 1\n"));
  // The first to connect gave up its slot, closed unanswered already.
  const Clock::time_point read = Clock::now();
  EXPECT_EQ(idle.front()->ReadToEnd(std::chrono::seconds(1)), "");
  EXPECT_LT(SecondsSince(read), 0.5);
}

// More clients than slots that send their request and then neither read the answer nor close: each held its slot to
// its 2 s deadline once answered, and a scrape behind them waited for those deadlines. A new connection now takes the
// slot of one that has its answer, which stays readable there.
TEST(MetricsHttpServerTest, AScrapeIsAnsweredAtOnceBehindMoreAnsweredClientsThanSlotsThatDoNotClose) {
  const std::unique_ptr<MetricsHttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  std::vector<std::unique_ptr<Client>> silent;
  for (int i = 0; i < 24; ++i) {
    silent.push_back(std::make_unique<Client>(server->port()));
    ASSERT_TRUE(silent.back()->connected());
    ASSERT_TRUE(silent.back()->Send("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
  }
  const auto [answer, seconds] = TimedScrape(server->port());
  EXPECT_LT(seconds, 1.0);
  EXPECT_THAT(answer, HasSubstr("\r\n\r\nperception_test_metric 1\n"));
  EXPECT_THAT(silent.front()->ReadToEnd(std::chrono::seconds(1)), HasSubstr("\r\n\r\nperception_test_metric 1\n"))
      << "the first client's answer survives its slot's being taken";
}

TEST(MetricsHttpServerTest, TheDestructorDoesNotWaitForATricklingClient) {
  std::unique_ptr<MetricsHttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  Trickler trickler(server->port());
  WaitUntilTrickling(trickler);

  const Clock::time_point stopping = Clock::now();
  server.reset();
  EXPECT_LT(SecondsSince(stopping), 1.0);
}

// A head over the 8 KiB limit was answered 200 from its first 8 KiB, and the connection closed with the rest unread:
// a reset, which can lose the answer. A head of 8192 bytes is answered; one byte more is refused with 431, and the
// client reads the whole answer and the connection's orderly end.
TEST(MetricsHttpServerTest, AHeadOverTheLimitIsRefusedWith431AndAnOrderlyClose) {
  const std::unique_ptr<MetricsHttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  const std::string start = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: ";
  const std::string largest = start + std::string(8192 - start.size() - 4, 'a') + "\r\n\r\n";
  ASSERT_EQ(largest.size(), 8192u);
  const struct {
    std::string head;
    std::string status_line;
  } cases[] = {
      {largest, "HTTP/1.1 200 OK\r\n"},
      {start + "a" + largest.substr(start.size()), "HTTP/1.1 431 Request Header Fields Too Large\r\n"},
      // Twice the limit, so that much of it is still unread when the answer is sent.
      {start + std::string(16384, 'a') + "\r\n\r\n", "HTTP/1.1 431 Request Header Fields Too Large\r\n"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.head.size());
    const Client client(server->port());
    ASSERT_TRUE(client.connected());
    ASSERT_TRUE(client.Send(c.head));
    int error = -1;
    const std::string answer = client.ReadToEnd(std::chrono::seconds(10), &error);
    EXPECT_THAT(answer, StartsWith(c.status_line));
    EXPECT_EQ(error, 0) << std::strerror(error);
  }
}

// RFC 9112 §2.2 lets a recipient take a bare LF for a line's end. A head ending in "\n\n" was never seen whole: the
// client was dropped at its 2 s deadline without an answer.
TEST(MetricsHttpServerTest, AHeadWithBareLineFeedsIsAnswered) {
  const std::unique_ptr<MetricsHttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  for (const std::string head : {"GET /metrics HTTP/1.1\nHost: 127.0.0.1\n\n", "GET /metrics HTTP/1.1\r\n\n"}) {
    SCOPED_TRACE(::testing::PrintToString(head));
    const Clock::time_point asked = Clock::now();
    const Client client(server->port());
    ASSERT_TRUE(client.connected());
    ASSERT_TRUE(client.Send(head));
    const std::string answer = client.ReadToEnd(std::chrono::seconds(10));
    EXPECT_LT(SecondsSince(asked), 1.0);
    EXPECT_THAT(answer, StartsWith("HTTP/1.1 200 OK\r\n"));
    EXPECT_THAT(answer, HasSubstr("\r\n\r\nperception_test_metric 1\n"));
  }
}

// What `head` sent on a new connection to `port` got back, read until the server closed.
std::string Exchange(int port, const std::string& head) {
  const Client client(port);
  EXPECT_TRUE(client.connected());
  EXPECT_TRUE(client.Send(head));
  return client.ReadToEnd(std::chrono::seconds(10));
}

// As HTTP/1.1 asks of a server (RFC 9112, 9110): an empty line before the request line is ignored, a target in
// absolute form is accepted, HEAD gets GET's head without the body, and a 405 names the methods allowed. The first
// three were answered 400, 404 and 405, the last without its Allow header.
TEST(MetricsHttpServerTest, RequestsAreAnsweredAsHttp11Asks) {
  const std::unique_ptr<MetricsHttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  const std::string get = Exchange(server->port(), "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  ASSERT_THAT(get, StartsWith("HTTP/1.1 200 OK\r\n"));
  const std::string exposition = "perception_test_metric 1\n";
  ASSERT_THAT(get, ::testing::EndsWith("\r\n\r\n" + exposition));
  const std::string absolute = absl::StrCat("GET http://127.0.0.1:", server->port(), "/metrics?x=1 HTTP/1.1\r\n\r\n");
  for (const std::string& head : {std::string("\r\nGET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"), absolute}) {
    SCOPED_TRACE(::testing::PrintToString(head));
    EXPECT_EQ(Exchange(server->port(), head), get);
  }
  EXPECT_EQ(Exchange(server->port(), "HEAD /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"),
            get.substr(0, get.size() - exposition.size()));
  const std::string post = Exchange(server->port(), "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_THAT(post, StartsWith("HTTP/1.1 405 Method Not Allowed\r\n"));
  EXPECT_THAT(post, HasSubstr("\r\nAllow: GET, HEAD\r\n"));
  EXPECT_THAT(Exchange(server->port(), "GET http://127.0.0.1/other HTTP/1.1\r\n\r\n"),
              StartsWith("HTTP/1.1 404 Not Found\r\n"));
  // Another version was answered 200 as if it were HTTP/1.1.
  EXPECT_EQ(Exchange(server->port(), "GET /metrics HTTP/1.0\r\n\r\n"), get);
  EXPECT_THAT(Exchange(server->port(), "GET /metrics HTTP/2.0\r\n\r\n"),
              StartsWith("HTTP/1.1 505 HTTP Version Not Supported\r\n"));
  EXPECT_THAT(Exchange(server->port(), "GET /metrics SPDY\r\n\r\n"), StartsWith("HTTP/1.1 400 Bad Request\r\n"));
}

// Takes every free file descriptor below a lowered RLIMIT_NOFILE (at most 1024), so that the process can open no
// more until it releases some; gives them and the limit back when it goes out of scope.
class DescriptorsExhausted {
 public:
  DescriptorsExhausted() {
    EXPECT_EQ(::getrlimit(RLIMIT_NOFILE, &saved_), 0) << std::strerror(errno);
    rlimit lowered = saved_;
    lowered.rlim_cur = std::min<rlim_t>(saved_.rlim_cur, 1024);
    EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &lowered), 0) << std::strerror(errno);
    for (int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC); fd >= 0; fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) {
      held_.push_back(fd);
    }
    EXPECT_EQ(errno, EMFILE) << std::strerror(errno);
  }
  ~DescriptorsExhausted() {
    for (int fd : held_) ::close(fd);
    ::setrlimit(RLIMIT_NOFILE, &saved_);
  }

  void ReleaseOne() {
    ASSERT_FALSE(held_.empty());
    ::close(held_.back());
    held_.pop_back();
  }

 private:
  rlimit saved_;
  std::vector<int> held_;
};

double CpuSeconds() {
  rusage usage;
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) * 1e-6;
}

// A process out of descriptors cannot accept: the pending connection stayed in the backlog, the listener readable,
// and the poll loop spun on accept at 100% CPU. The listener now rests between attempts, the failure is logged once,
// and the connection is served as soon as a descriptor is free.
TEST(MetricsHttpServerTest, OutOfDescriptorsTheListenerRestsAndRecovers) {
#ifdef __SANITIZE_ADDRESS__
  // UBSan's check of a virtual call's type probes memory through a pipe it opens: with no descriptor left it reports
  // the logger's buffer as an object of the wrong type (seen in ./dev sanitize), so that run cannot hold this state.
  GTEST_SKIP() << "under AddressSanitizer/UndefinedBehaviorSanitizer, whose checks need descriptors of their own";
#endif
  const CapturedLog log;  // before the server, so that the logger is not swapped under its thread
  const std::unique_ptr<MetricsHttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  DescriptorsExhausted exhausted;
  exhausted.ReleaseOne();  // for the client's socket; the kernel completes its connection in the backlog
  const Client client(server->port());
  ASSERT_TRUE(client.connected());

  // Only the server's thread runs while this one sleeps: a spinning loop would use about the whole 0.5 s.
  const double cpu_before = CpuSeconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_LT(CpuSeconds() - cpu_before, 0.1);

  exhausted.ReleaseOne();  // for the accepted connection
  ASSERT_TRUE(client.Send("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
  EXPECT_THAT(client.ReadToEnd(std::chrono::seconds(10)), StartsWith("HTTP/1.1 200 OK\r\n"));
  const std::vector<std::string> lines = log.lines();
  EXPECT_EQ(std::count_if(lines.begin(), lines.end(),
                          [](const std::string& line) { return line.find("cannot accept") != std::string::npos; }),
            1)
      << ::testing::PrintToString(lines);
  EXPECT_THAT(lines, Contains(HasSubstr("warning|metrics: cannot accept a connection: Too many open files")));
}

// The process metrics of a process out of descriptors: its files in /proc were opened with the metrics, so the scrape
// that should show process_open_fds at the limit does not lose them.
TEST(ProcessMetricsTest, AreRenderedWhileTheProcessIsOutOfDescriptors) {
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "under AddressSanitizer/UndefinedBehaviorSanitizer, whose checks need descriptors of their own";
#endif
  const ServerMetrics metrics;
  const std::string before = metrics.Render();
  EXPECT_THAT(before, ContainsRegex("\nprocess_open_fds [1-9][0-9]*\n"));
  DescriptorsExhausted exhausted;
  const std::string text = metrics.Render();
  EXPECT_THAT(text, ContainsRegex("\nprocess_open_fds [1-9][0-9]*\n"));
  EXPECT_THAT(text, ContainsRegex("\nprocess_cpu_seconds_total [0-9.e+-]+\n"));
  EXPECT_THAT(text, ContainsRegex("\nprocess_start_time_seconds [0-9.e+-]+\n"));
}

}  // namespace
}  // namespace perception::server
