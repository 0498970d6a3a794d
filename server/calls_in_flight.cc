// The gRPC calls the daemon is still answering, counted by an interceptor.
#include "server/calls_in_flight.h"

#include <string_view>

namespace perception::server {
namespace {

constexpr std::string_view kHealthWatch = "/grpc.health.v1.Health/Watch";

}  // namespace

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
    if (info->method() != nullptr && info->method() == kHealthWatch) return nullptr;
    return new Interceptor(calls_);
  }

 private:
  CallsInFlight& calls_;
};

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallsInFlight::Counter() {
  return std::make_unique<Factory>(*this);
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
