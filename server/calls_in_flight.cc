// The gRPC calls the daemon is still answering, counted by an interceptor, and the bytes no peer has acknowledged.
#include "server/calls_in_flight.h"

#include <dirent.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdlib>
#include <string_view>

namespace perception::server {
namespace {

// Open for as long as their clients like, owed nothing.
constexpr std::string_view kUncounted[] = {
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
};

// How often WaitUntilDelivered looks again at the unacknowledged bytes.
constexpr absl::Duration kDeliveryPoll = absl::Milliseconds(5);

// The bytes `fd` has sent or queued and its peer has not acknowledged; 0 for what is not a connected TCP socket.
int64_t UnacknowledgedOn(int fd) {
  struct stat info;
  if (::fstat(fd, &info) != 0 || !S_ISSOCK(info.st_mode)) return 0;
  int protocol = 0;
  socklen_t size = sizeof(protocol);
  if (::getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &protocol, &size) != 0 || protocol != IPPROTO_TCP) return 0;
  int queued = 0;
  return ::ioctl(fd, SIOCOUTQ, &queued) == 0 ? queued : 0;  // (a listening socket has no queue: EINVAL)
}

}  // namespace

int64_t UnacknowledgedTcpBytes() {
  DIR* descriptors = ::opendir("/proc/self/fd");
  if (descriptors == nullptr) return 0;
  int64_t total = 0;
  while (const dirent* entry = ::readdir(descriptors)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == ::dirfd(descriptors)) continue;
    total += UnacknowledgedOn(static_cast<int>(fd));
  }
  ::closedir(descriptors);
  return total;
}

// Lives as long as its call's ServerRpcInfo, which gRPC frees with the call's context once the call is done.
class CallsInFlight::Interceptor final : public grpc::experimental::Interceptor {
 public:
  explicit Interceptor(CallsInFlight& calls) : calls_(calls) { calls_.Begin(); }
  ~Interceptor() override { calls_.End(); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override { methods->Proceed(); }

 private:
  CallsInFlight& calls_;
};

class CallsInFlight::Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(CallsInFlight& calls) : calls_(calls) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    if (info->method() != nullptr) {
      for (const std::string_view uncounted : kUncounted) {
        if (info->method() == uncounted) return nullptr;
      }
    }
    return new Interceptor(calls_);
  }

 private:
  CallsInFlight& calls_;
};

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallsInFlight::Counter() {
  return std::make_unique<Factory>(*this);
}

CallsInFlight::Undelivered CallsInFlight::WaitUntilDelivered(absl::Time deadline) {
  while (true) {
    Undelivered left{.calls = WaitUntilNone(deadline), .bytes = UnacknowledgedTcpBytes()};
    if (left.calls > 0) return left;
    while (left.bytes > 0 && absl::Now() < deadline) {
      absl::SleepFor(kDeliveryPoll);
      left.bytes = UnacknowledgedTcpBytes();
    }
    // A call that came meanwhile (a read still answers in the drain) is waited for in turn.
    left.calls = WaitUntilNone(absl::InfinitePast());
    if (left.calls == 0 || absl::Now() >= deadline) return left;
  }
}

int64_t CallsInFlight::WaitUntilNone(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  const auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
  return in_flight_;
}

void CallsInFlight::Begin() {
  absl::MutexLock lock(&mu_);
  ++in_flight_;
}

void CallsInFlight::End() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

}  // namespace perception::server
