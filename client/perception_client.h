// perceptiond's C++ client: one method per RPC, deadlines on unary calls, watchdogs on streams, errors as absl::Status.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"

namespace perception::client {

class ResponseWatchdog;
class CallCancellation;

// One Stream call: requests written from one thread, acknowledgements read on a helper thread. Not thread-safe
// for writing (one writer); Finish once. The call has no deadline as a whole; instead it is cancelled once events
// are outstanding and no acknowledgement came for `ack_timeout` (a stopped daemon or a half-open connection would
// otherwise leave Write or Finish waiting forever).
class EventStream {
 public:
  ~EventStream();  // cancels the call if Finish was not called
  // Sends one request; false once the call has ended (Finish says why).
  bool Write(const v1::StreamRequest& request);
  // Half-closes and waits for the call to end: OK once every accepted event was acknowledged, else the daemon's
  // status (the acknowledgements before it were delivered); DEADLINE_EXCEEDED when it was cancelled for want of
  // an acknowledgement. OK at once when nothing was written (the call never reached the daemon).
  absl::Status Finish();
  // True once the call has ended (all acknowledgements delivered); Finish then says why.
  bool ended() const { return ended_; }

 private:
  friend class PerceptionClient;
  // `ack_timeout`: how long owed acknowledgements may be waited for; `limit` names where it comes from;
  // `cancellation` (may be null) cancels the call from another thread (perceptionctl stream's second Ctrl-C).
  EventStream(v1::Perception::Stub& stub, std::function<void(const v1::StreamResponse&)> on_ack,
              absl::Duration ack_timeout, std::string limit, CallCancellation* cancellation);

  grpc::ClientContext context_;
  const std::unique_ptr<ResponseWatchdog> watchdog_;  // refers to context_, so declared after it
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream_;
  std::function<void(const v1::StreamResponse&)> on_ack_;
  std::thread reader_;
  std::atomic<bool> ended_ = false;
  bool finished_ = false;
  bool wrote_ = false;  // whether Write was called: until then the call has not started (corked metadata)
  CallCancellation* const cancellation_;
};

// Cancels the calls that take it, from any thread, including calls that start after Cancel (perceptionctl train
// --targets: one rank's failure stops the other ranks' streams instead of leaving them to wait on a dead peer).
class CallCancellation {
 public:
  void Cancel();
  bool cancelled() const;

 private:
  friend class PerceptionClient;
  friend class EventStream;
  void Register(grpc::ClientContext* context);
  void Unregister(grpc::ClientContext* context);

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);
};

struct ClientOptions {
  // Deadline of each unary call. The streaming calls have none as a whole: Train is cancelled when no step's
  // response came for this long while steps are outstanding, a Stream call when no acknowledgement came for this
  // long while events are outstanding (DEADLINE_EXCEEDED either way).
  absl::Duration timeout = absl::Seconds(60);
  int max_receive_message_bytes = 64 << 20;  // Evaluate's probabilities can be large
};

// Thread-safe: calls may run concurrently from several threads. A failed call returns the daemon's status code
// and message (or the transport's, e.g. UNAVAILABLE when nothing listens at the target).
class PerceptionClient {
 public:
  explicit PerceptionClient(const std::string& target, ClientOptions options = {});

  absl::StatusOr<v1::GetStatusResponse> GetStatus();
  absl::StatusOr<v1::InitModelResponse> InitModel(const v1::InitModelRequest& request);
  absl::StatusOr<v1::SetNormalizerResponse> SetNormalizer(const v1::SetNormalizerRequest& request);
  absl::StatusOr<v1::SetOptimizerResponse> SetOptimizer(const v1::SetOptimizerRequest& request);
  absl::StatusOr<v1::LoadCheckpointResponse> LoadCheckpoint(const v1::LoadCheckpointRequest& request);
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(const v1::SaveCheckpointRequest& request);
  absl::StatusOr<v1::TrainStepResponse> TrainStep(const v1::TrainStepRequest& request);
  absl::StatusOr<v1::EvaluateResponse> Evaluate(const v1::EvaluateRequest& request);

  // Live streaming. OpenStream starts a Stream call (cancelled when events wait longer than options.timeout for an
  // acknowledgement, beyond `ack_every`: the daemon's acknowledgement interval, GetStatus.streaming.ack_every_ms,
  // which a paced stream's events may wait out, or when `cancellation` is cancelled); `on_ack` sees each
  // acknowledgement on the stream's reader thread.
  std::unique_ptr<EventStream> OpenStream(std::function<void(const v1::StreamResponse&)> on_ack,
                                          absl::Duration ack_every = absl::ZeroDuration(),
                                          CallCancellation* cancellation = nullptr);
  absl::StatusOr<v1::SeedStreamResponse> SeedStream(const v1::SeedStreamRequest& request);
  absl::StatusOr<v1::ReadConvictionsResponse> ReadConvictions(const v1::ReadConvictionsRequest& request);
  absl::StatusOr<v1::ResetStreamResponse> ResetStream(const v1::ResetStreamRequest& request);
  absl::StatusOr<v1::CloseStreamResponse> CloseStream(const v1::CloseStreamRequest& request);
  // A page of the live streams: request.max_count of them from request.from_instrument on.
  absl::StatusOr<v1::ListStreamsResponse> ListStreams(const v1::ListStreamsRequest& request);
  // Every live stream, asked kListStreamsPage at a time, so that no answer outgrows a receive limit (a stream opened
  // or closed meanwhile may be listed or not).
  static constexpr uint32_t kListStreamsPage = 10'000;
  absl::StatusOr<v1::ListStreamsResponse> ListStreams();

  // Streams `steps` batches through Train. `next_batch(i, request)` fills batch i (0-based), the first on the calling
  // thread before the call opens and the rest on a helper thread, at most kTrainAhead batches ahead of the responses,
  // or answers false to end the stream before step i (the steps sent are still answered; at step 0, no call opens);
  // `on_response` sees each step's response, in order, on the calling thread. Returns the
  // stream's status: OK once every step sent is answered, else the first failure's (CANCELLED when `cancellation`
  // was cancelled; DEADLINE_EXCEEDED when no response came within options.timeout while steps were outstanding), its
  // message ending with the model's step as GetStatus reads it after the stream ended, beside the last response's:
  // steps running when a stream ends are applied without a response.
  static constexpr int kTrainAhead = 4;
  absl::Status Train(int steps, absl::FunctionRef<bool(int, v1::TrainStepRequest&)> next_batch,
                     absl::FunctionRef<void(const v1::TrainStepResponse&)> on_response,
                     CallCancellation* cancellation = nullptr);

  // The daemon's health (grpc.health.v1) for `service` ("" for the daemon as a whole).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(const std::string& service = "");
  // Waits until the daemon reports SERVING, for at most `timeout`; DEADLINE_EXCEEDED after it.
  absl::Status WaitUntilServing(absl::Duration timeout);

  const std::string& target() const { return target_; }

 private:
  // The longest a failed Train waits for GetStatus to tell the model's step.
  static constexpr absl::Duration kStepReadTimeout = absl::Seconds(5);

  // What a failed Train's message ends with: the model's step now and the last response's (`failure`: the
  // call's status; one this side cut may have left a step running).
  std::string StepAfterFailedTrain(std::optional<int64_t> last_answered_step, absl::StatusCode failure);
  template <typename Request, typename Response, typename Stub>
  absl::StatusOr<Response> Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                                Stub& stub, const Request& request, absl::Duration timeout);

  const std::string target_;
  const ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Perception::Stub> perception_;
  const std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

}  // namespace perception::client
