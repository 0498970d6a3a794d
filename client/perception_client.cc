// The perceptiond client: unary calls with deadlines, the pipelined Train stream, health checks.
#include "client/perception_client.h"

#include <algorithm>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace perception::client {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const ClientOptions& options) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  arguments.SetMaxSendMessageSize(-1);  // the daemon enforces its own limit and says so
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), arguments);
}

void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

PerceptionClient::PerceptionClient(const std::string& target, ClientOptions options)
    : target_(target),
      options_(options),
      channel_(MakeChannel(target, options)),
      perception_(v1::Perception::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {}

template <typename Request, typename Response, typename Stub>
absl::StatusOr<Response> PerceptionClient::Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                                             Response*),
                                                Stub& stub, const Request& request, absl::Duration timeout) {
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  Response response;
  const grpc::Status status = (stub.*method)(&context, request, &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

absl::StatusOr<v1::GetStatusResponse> PerceptionClient::GetStatus() {
  return Call(&v1::Perception::Stub::GetStatus, *perception_, v1::GetStatusRequest(), options_.timeout);
}

absl::StatusOr<v1::InitModelResponse> PerceptionClient::InitModel(const v1::InitModelRequest& request) {
  return Call(&v1::Perception::Stub::InitModel, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::SetNormalizerResponse> PerceptionClient::SetNormalizer(const v1::SetNormalizerRequest& request) {
  return Call(&v1::Perception::Stub::SetNormalizer, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::SetOptimizerResponse> PerceptionClient::SetOptimizer(const v1::SetOptimizerRequest& request) {
  return Call(&v1::Perception::Stub::SetOptimizer, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::LoadCheckpointResponse> PerceptionClient::LoadCheckpoint(const v1::LoadCheckpointRequest& request) {
  return Call(&v1::Perception::Stub::LoadCheckpoint, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::SaveCheckpointResponse> PerceptionClient::SaveCheckpoint(const v1::SaveCheckpointRequest& request) {
  return Call(&v1::Perception::Stub::SaveCheckpoint, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::TrainStepResponse> PerceptionClient::TrainStep(const v1::TrainStepRequest& request) {
  return Call(&v1::Perception::Stub::TrainStep, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::EvaluateResponse> PerceptionClient::Evaluate(const v1::EvaluateRequest& request) {
  return Call(&v1::Perception::Stub::Evaluate, *perception_, request, options_.timeout);
}

EventStream::EventStream(v1::Perception::Stub& stub, std::function<void(const v1::StreamResponse&)> on_ack)
    : stream_(stub.Stream(&context_)), on_ack_(std::move(on_ack)) {
  reader_ = std::thread([this] {
    v1::StreamResponse response;
    while (stream_->Read(&response)) on_ack_(response);
    ended_ = true;
  });
}

EventStream::~EventStream() {
  if (!finished_) {
    context_.TryCancel();
    reader_.join();
    stream_->Finish();
  }
}

bool EventStream::Write(const v1::StreamRequest& request) { return stream_->Write(request); }

absl::Status EventStream::Finish() {
  finished_ = true;
  stream_->WritesDone();
  reader_.join();  // the daemon ends the call once every accepted event is acknowledged
  return FromGrpc(stream_->Finish());
}

std::unique_ptr<EventStream> PerceptionClient::OpenStream(std::function<void(const v1::StreamResponse&)> on_ack) {
  return std::unique_ptr<EventStream>(new EventStream(*perception_, std::move(on_ack)));
}

absl::StatusOr<v1::SeedStreamResponse> PerceptionClient::SeedStream(const v1::SeedStreamRequest& request) {
  return Call(&v1::Perception::Stub::SeedStream, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::ReadConvictionsResponse> PerceptionClient::ReadConvictions(
    const v1::ReadConvictionsRequest& request) {
  return Call(&v1::Perception::Stub::ReadConvictions, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::ResetStreamResponse> PerceptionClient::ResetStream(const v1::ResetStreamRequest& request) {
  return Call(&v1::Perception::Stub::ResetStream, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::CloseStreamResponse> PerceptionClient::CloseStream(const v1::CloseStreamRequest& request) {
  return Call(&v1::Perception::Stub::CloseStream, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::ListStreamsResponse> PerceptionClient::ListStreams() {
  return Call(&v1::Perception::Stub::ListStreams, *perception_, v1::ListStreamsRequest(), options_.timeout);
}

void CallCancellation::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (grpc::ClientContext* call : calls_) call->TryCancel();
}

void CallCancellation::Register(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  calls_.insert(context);
  if (cancelled_) context->TryCancel();
}

void CallCancellation::Unregister(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  calls_.erase(context);
}

absl::Status PerceptionClient::Train(int steps, absl::FunctionRef<void(int, v1::TrainStepRequest&)> next_batch,
                                     absl::FunctionRef<void(const v1::TrainStepResponse&)> on_response,
                                     CallCancellation* cancellation) {
  grpc::ClientContext context;
  SetDeadline(context, options_.timeout * std::max(steps, 1));
  const std::unique_ptr<grpc::ClientReaderWriter<v1::TrainStepRequest, v1::TrainStepResponse>> stream =
      perception_->Train(&context);
  if (cancellation != nullptr) cancellation->Register(&context);
  const absl::Cleanup unregister = [&] {
    if (cancellation != nullptr) cancellation->Unregister(&context);
  };

  absl::Mutex mu;
  int answered = 0;           // guarded by mu
  bool reading_done = false;  // guarded by mu; releases the writer when the stream ends early
  std::thread writer([&] {
    v1::TrainStepRequest request;
    for (int i = 0; i < steps; ++i) {
      const auto may_send = [&] { return reading_done || i - answered < kTrainAhead; };
      mu.LockWhen(absl::Condition(&may_send));
      const bool stop = reading_done;
      mu.Unlock();
      if (stop) break;
      next_batch(i, request);
      if (!stream->Write(request)) break;  // the stream has ended; Finish says why
    }
    stream->WritesDone();
  });
  v1::TrainStepResponse response;
  while (stream->Read(&response)) {
    on_response(response);
    absl::MutexLock lock(&mu);
    ++answered;
  }
  {
    absl::MutexLock lock(&mu);
    reading_done = true;
  }
  writer.join();
  return FromGrpc(stream->Finish());
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> PerceptionClient::Health(
    const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  absl::StatusOr<grpc::health::v1::HealthCheckResponse> response =
      Call(&grpc::health::v1::Health::Stub::Check, *health_, request, options_.timeout);
  if (!response.ok()) return response.status();
  return response->status();
}

absl::Status PerceptionClient::WaitUntilServing(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::DeadlineExceededError("no answer yet");
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_wait_for_ready(true);  // wait for the daemon to start listening instead of failing at once
    context.set_deadline(absl::ToChronoTime(deadline));
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health_->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    if (status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) return absl::OkStatus();
    last = status.ok() ? absl::UnavailableError("the daemon reports NOT_SERVING") : FromGrpc(status);
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat("perceptiond at ", target_, " is not serving after ",
                                                  absl::FormatDuration(timeout), ": ", last.message()));
}

}  // namespace perception::client
