// UnacknowledgedTcpBytes, what the daemon's exit waits on before it closes connections: bytes a peer has not taken
// count until it takes them.
#include "server/calls_in_flight.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"

namespace perception::server {
namespace {

// A loopback TCP connection whose receiving end takes little into its buffer; both ends closed at scope exit.
class LoopbackConnection {
 public:
  LoopbackConnection() {
    const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int small = 4096;  // inherited by the accepted socket: the window the sender fills stays small
    ::setsockopt(listener, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof(address);
    EXPECT_EQ(::bind(listener, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(::listen(listener, 1), 0);
    EXPECT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &size), 0);
    sender = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_EQ(::connect(sender, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0)
        << std::strerror(errno);
    receiver = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    EXPECT_GE(receiver, 0) << std::strerror(errno);
    ::close(listener);
    ::fcntl(sender, F_SETFL, O_NONBLOCK);
  }
  ~LoopbackConnection() {
    ::close(sender);
    ::close(receiver);
  }

  int sender = -1, receiver = -1;
};

TEST(UnacknowledgedTcpBytesTest, CountsWhatAPeerHasNotTakenUntilItTakesIt) {
  const LoopbackConnection connection;
  EXPECT_EQ(UnacknowledgedTcpBytes(), 0) << "this process holds no other TCP socket";
  const std::vector<char> chunk(64 * 1024, 'x');
  int64_t written = 0;
  while (true) {  // until the receiver's window and the sender's buffer are full
    const ssize_t n = ::send(connection.sender, chunk.data(), chunk.size(), MSG_NOSIGNAL);
    if (n <= 0) break;
    written += n;
  }
  ASSERT_GT(written, 0);
  const int64_t queued = UnacknowledgedTcpBytes();
  EXPECT_GT(queued, 0);
  EXPECT_LE(queued, written);

  std::vector<char> sink(written);
  int64_t read = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (read < written && absl::Now() < deadline) {
    const ssize_t n = ::recv(connection.receiver, sink.data(), sink.size(), 0);
    if (n <= 0) break;
    read += n;
  }
  ASSERT_EQ(read, written);
  int64_t left = UnacknowledgedTcpBytes();
  while (left > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
    left = UnacknowledgedTcpBytes();
  }
  EXPECT_EQ(left, 0);
}

}  // namespace
}  // namespace perception::server
