// The perceptiond client: unary calls with deadlines, the Stream and pipelined Train calls with a timeout per
// answer, health checks.
#include "client/perception_client.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
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
  // A peer that vanished without closing the connection (a dead host, a half-open TCP connection) fails the calls
  // on it within about 40 s instead of leaving them to wait. Pings go out only while calls are open, and gRPC sends
  // at most two without data in between, which the daemon's default ping policy accepts.
  arguments.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30'000);
  arguments.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), arguments);
}

}  // namespace

// Cancels a streaming call once it owes answers (step responses, acknowledged events, or its end after the
// half-close) and none came for `timeout`: such calls are open-ended, so a deadline on the whole call cannot tell
// a long run from a daemon that stopped answering.
class ResponseWatchdog {
 public:
  // `unit` names what is owed in the error ("events", "steps"), `limit` where `timeout` comes from.
  ResponseWatchdog(grpc::ClientContext& context, absl::Duration timeout, std::string unit,
                   std::string limit = "--timeout")
      : context_(context),
        timeout_(timeout),
        unit_(std::move(unit)),
        limit_(std::move(limit)),
        thread_([this] { Watch(); }) {}
  ~ResponseWatchdog() { Stop(); }

  // `count` more answers owed; called before the write, so that a write blocked by a stalled daemon is timed too.
  void Owe(int64_t count) {
    absl::MutexLock lock(&mu_);
    if (!OwingLocked()) waiting_since_ = absl::Now();
    owed_ += count;
  }
  // The answers received so far, in all.
  void Answered(int64_t total) {
    absl::MutexLock lock(&mu_);
    if (total <= answered_) return;
    answered_ = total;
    waiting_since_ = absl::Now();
  }
  // After the half-close the call's end is owed as well.
  void OweEnd() {
    absl::MutexLock lock(&mu_);
    if (!OwingLocked()) waiting_since_ = absl::Now();
    end_owed_ = true;
  }
  // The call has ended: nothing more is owed.
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }
  // The call's status, or DEADLINE_EXCEEDED saying what was owed when the watchdog cancelled it.
  absl::Status Explain(absl::Status status) const {
    absl::MutexLock lock(&mu_);
    if (!expired_) return status;
    const std::string owed = owed_ > answered_ ? absl::StrCat(owed_ - answered_, " ", unit_, " unanswered")
                                               : "the end of the call owed";
    return absl::DeadlineExceededError(absl::StrCat("no answer from the daemon for ", absl::FormatDuration(timeout_),
                                                    " (", limit_, ") with ", owed, "; cancelled the call"));
  }

 private:
  bool OwingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return end_owed_ || answered_ < owed_; }

  void Watch() {
    absl::MutexLock lock(&mu_);
    const auto stopping_or_owing = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || OwingLocked(); };
    while (!stopping_) {
      if (!OwingLocked()) {
        mu_.Await(absl::Condition(&stopping_or_owing));
        continue;
      }
      const absl::Time deadline = waiting_since_ + timeout_;  // an answer meanwhile moves it on
      if (absl::Now() >= deadline) {
        expired_ = true;
        context_.TryCancel();
        return;
      }
      mu_.AwaitWithDeadline(absl::Condition(&stopping_), deadline);
    }
  }

  grpc::ClientContext& context_;
  const absl::Duration timeout_;
  const std::string unit_, limit_;
  mutable absl::Mutex mu_;
  int64_t owed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t answered_ ABSL_GUARDED_BY(mu_) = 0;
  bool end_owed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time waiting_since_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool expired_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: it starts once the members above are set
};

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
  const absl::Time deadline = absl::Now() + timeout;
  context.set_deadline(absl::ToChronoTime(deadline));
  Response response;
  const grpc::Status status = (stub.*method)(&context, request, &response);
  // gRPC's own words for its deadline were all a user saw ("DEADLINE_EXCEEDED: Deadline Exceeded"): neither which
  // limit it was nor that the daemon may still be doing what it was asked.
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && absl::Now() >= deadline) {
    return absl::DeadlineExceededError(absl::StrCat(
        "no answer from the daemon within ", absl::FormatDuration(timeout),
        timeout == options_.timeout ? " (--timeout)" : "",
        "; the call was abandoned, and what it asked for may still take effect there"));
  }
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

EventStream::EventStream(v1::Perception::Stub& stub, std::function<void(const v1::StreamResponse&)> on_ack,
                         absl::Duration ack_timeout, std::string limit, CallCancellation* cancellation)
    : watchdog_(std::make_unique<ResponseWatchdog>(context_, ack_timeout, "events", std::move(limit))),
      on_ack_(std::move(on_ack)),
      cancellation_(cancellation) {
  if (cancellation_ != nullptr) cancellation_->Register(&context_);
  // Corked, the call starts with the first Write, which the watchdog times, instead of here, where a daemon that
  // accepts connections but never answers (SIGSTOP) would block unwatched.
  context_.set_initial_metadata_corked(true);
  stream_ = stub.Stream(&context_);
  reader_ = std::thread([this] {
    v1::StreamResponse response;
    while (stream_->Read(&response)) {
      watchdog_->Answered(static_cast<int64_t>(response.processed_events()));
      on_ack_(response);
    }
    watchdog_->Stop();
    ended_ = true;
  });
}

EventStream::~EventStream() {
  if (!finished_) {
    context_.TryCancel();
    reader_.join();
    stream_->Finish();
  }
  if (cancellation_ != nullptr) cancellation_->Unregister(&context_);
}

bool EventStream::Write(const v1::StreamRequest& request) {
  wrote_ = true;
  watchdog_->Owe(request.events_size());
  return stream_->Write(request);
}

absl::Status EventStream::Finish() {
  finished_ = true;
  if (!wrote_) {
    // The call never left the client: its initial metadata waits for the first Write (corked), and WritesDone does
    // not send it, so a half-close would wait for an end the daemon never sends until the watchdog cancels the call
    // (DEADLINE_EXCEEDED). With nothing sent, nothing can have failed: end the call here.
    context_.TryCancel();
    reader_.join();
    stream_->Finish();
    return absl::OkStatus();
  }
  watchdog_->OweEnd();
  stream_->WritesDone();
  reader_.join();  // the daemon ends the call once every accepted event is acknowledged
  return watchdog_->Explain(FromGrpc(stream_->Finish()));
}

std::unique_ptr<EventStream> PerceptionClient::OpenStream(std::function<void(const v1::StreamResponse&)> on_ack,
                                                          absl::Duration ack_every, CallCancellation* cancellation) {
  const bool acks_wait = ack_every > absl::ZeroDuration();
  const std::string limit = acks_wait ? absl::StrCat("--timeout ", absl::FormatDuration(options_.timeout),
                                                     " past the daemon's acknowledgement interval, ",
                                                     absl::FormatDuration(ack_every))
                                      : "--timeout";
  const absl::Duration ack_timeout = options_.timeout + (acks_wait ? ack_every : absl::ZeroDuration());
  return std::unique_ptr<EventStream>(
      new EventStream(*perception_, std::move(on_ack), ack_timeout, limit, cancellation));
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

absl::StatusOr<v1::ListStreamsResponse> PerceptionClient::ListStreams(const v1::ListStreamsRequest& request) {
  return Call(&v1::Perception::Stub::ListStreams, *perception_, request, options_.timeout);
}

absl::StatusOr<v1::ListStreamsResponse> PerceptionClient::ListStreams() {
  v1::ListStreamsResponse every;
  v1::ListStreamsRequest request;
  request.set_max_count(kListStreamsPage);
  do {
    absl::StatusOr<v1::ListStreamsResponse> page = ListStreams(request);
    if (!page.ok()) return page.status();
    // A page must move on, or the loop would ask for it forever.
    if (!page->next_instrument().empty() &&
        (page->streams().empty() || page->next_instrument() <= page->streams().rbegin()->instrument())) {
      return absl::InternalError(absl::StrCat("ListStreams from '", request.from_instrument(), "' answered ",
                                              page->streams_size(), " streams and a next page from '",
                                              page->next_instrument(), "', which does not follow them"));
    }
    for (v1::StreamInfo& stream : *page->mutable_streams()) *every.add_streams() = std::move(stream);
    request.set_from_instrument(page->next_instrument());
  } while (!request.from_instrument().empty());
  return every;
}

void CallCancellation::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (grpc::ClientContext* call : calls_) call->TryCancel();
}

bool CallCancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
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

absl::Status PerceptionClient::Train(int steps, absl::FunctionRef<bool(int, v1::TrainStepRequest&)> next_batch,
                                     absl::FunctionRef<void(const v1::TrainStepResponse&)> on_response,
                                     CallCancellation* cancellation) {
  // A run stopped before its first step opens no call: the call's start is corked until its first write, and one
  // half-closed without a write left Finish waiting until the watchdog cut it.
  v1::TrainStepRequest request;
  if (steps <= 0 || !next_batch(0, request)) return absl::OkStatus();
  grpc::ClientContext context;
  ResponseWatchdog watchdog(context, options_.timeout, "steps");
  context.set_initial_metadata_corked(true);  // the call starts with the first Write, which the watchdog times
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
    for (int i = 0; i < steps; ++i) {
      const auto may_send = [&] { return reading_done || i - answered < kTrainAhead; };
      mu.LockWhen(absl::Condition(&may_send));
      const bool stop = reading_done;
      mu.Unlock();
      if (stop || (i > 0 && !next_batch(i, request))) break;  // (batch 0 is in `request` already)
      watchdog.Owe(1);
      if (!stream->Write(request)) break;  // the stream has ended; Finish says why
    }
    watchdog.OweEnd();
    stream->WritesDone();
  });
  v1::TrainStepResponse response;
  std::optional<int64_t> last_answered_step;
  while (stream->Read(&response)) {
    on_response(response);
    last_answered_step = response.step();
    absl::MutexLock lock(&mu);
    watchdog.Answered(++answered);
  }
  watchdog.Stop();
  {
    absl::MutexLock lock(&mu);
    reading_done = true;
  }
  writer.join();
  absl::Status finished = watchdog.Explain(FromGrpc(stream->Finish()));
  if (finished.ok()) return finished;
  // gRPC's message for a call this side cancelled is the code's name alone.
  if (absl::IsCancelled(finished) && cancellation != nullptr && cancellation->cancelled()) {
    finished = absl::CancelledError("the call was cancelled");
  }
  return absl::Status(finished.code(),
                      absl::StrCat(finished.message(), "; ",
                                   StepAfterFailedTrain(last_answered_step, finished.code())));
}

std::string PerceptionClient::StepAfterFailedTrain(std::optional<int64_t> last_answered_step,
                                                   absl::StatusCode failure) {
  // A step the device was running, or had finished but not answered, when the stream ended is applied without a
  // response, so the last response's step may be behind the model's: the daemon's own count is the one to resume
  // from. Read briefly: a daemon that stopped answering the stream would hold a full timeout for nothing.
  const std::string answered =
      last_answered_step.has_value() ? absl::StrCat("the last response's step was ", *last_answered_step)
                                     : std::string("no step was answered");
  const absl::StatusOr<v1::GetStatusResponse> status =
      Call(&v1::Perception::Stub::GetStatus, *perception_, v1::GetStatusRequest(),
           std::min(options_.timeout, kStepReadTimeout));
  if (!status.ok()) return absl::StrCat(answered, "; the model's step could not be read: ", status.status().message());
  if (!status->has_model()) return absl::StrCat(answered, "; the daemon now holds no model");
  // A call this side cut (its --timeout, a cancel) may have left a step running, which GetStatus does not count yet.
  if (failure == absl::StatusCode::kDeadlineExceeded || failure == absl::StatusCode::kCancelled) {
    return absl::StrCat("the model was at step ", status->model().step(), " when read (GetStatus; ", answered,
                        "), and a step the daemon was running as the call ended still completes: read its step with "
                        "`perceptionctl status` once it is idle before resuming");
  }
  return absl::StrCat("the model is at step ", status->model().step(), " (GetStatus; ", answered, ")");
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
