// The Perception gRPC service: validates each request, runs it on the device worker, answers with gRPC codes.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "server/checkpoint_directory.h"
#include "server/device_worker.h"
#include "server/live_calls.h"
#include "server/metrics.h"
#include "server/request_validation.h"
#include "server/stream_batcher.h"
#include "server/streaming.h"

namespace perception::server {

// Unary calls are synchronous: the handler's thread validates, queues a job and waits for it. Train and Stream
// are callback streams (TrainReactor, StreamReactor) so that they read, run and answer in parallel without a
// thread of their own; raw ones, whose requests the reactors parse (a request gRPC could not parse would read as
// the client's half-close).
class PerceptionService final
    : public v1::Perception::WithRawCallbackMethod_Train<v1::Perception::WithRawCallbackMethod_Stream<
          v1::Perception::Service>> {
 public:
  PerceptionService(DeviceWorker& worker, StreamBatcher& streams, const StreamOptions& stream_options,
                    const CheckpointDirectory& checkpoints, const Limits& limits, ServerMetrics& metrics);

  // From now on every call but the reads (GetStatus, ListStreams, ReadConvictions), and every further batch of an
  // open Train stream, answers UNAVAILABLE; open Stream calls end with it once their accepted events are processed
  // and acknowledged; work already queued finishes. The reads keep answering until the server stops listening, so
  // that clients can read back the convictions of every event the daemon processed.
  void BeginDrain();

  // InitModel's and LoadCheckpoint's work, also perceptiond's for --init_config and --load: the daemon's limits
  // applied, refused while streams hold state on the current model. `config` is valid; LoadModel's `optimizer`,
  // where absent, is the checkpoint's (ModelHost::Load), and a refused name's message opens with `source` (the
  // request's field or the flag that gave it). With a `caller`, nothing is done once it stopped waiting
  // (DeviceWorker::Run).
  absl::StatusOr<v1::Model> CreateModel(const ModelConfig& config, const OptimizerConfig& optimizer, uint64_t seed,
                                        const std::optional<Normalizer>& normalizer, bool replace,
                                        const grpc::ServerContextBase* caller = nullptr);
  struct LoadedModel {
    v1::Model model;
    double seconds = 0;
  };
  absl::StatusOr<LoadedModel> LoadModel(const std::string& name, absl::string_view source,
                                        const std::optional<OptimizerConfig>& optimizer,
                                        const grpc::ServerContextBase* caller = nullptr);

  grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest* request,
                         v1::GetStatusResponse* response) override;
  grpc::Status InitModel(grpc::ServerContext* context, const v1::InitModelRequest* request,
                         v1::InitModelResponse* response) override;
  grpc::Status SetNormalizer(grpc::ServerContext* context, const v1::SetNormalizerRequest* request,
                             v1::SetNormalizerResponse* response) override;
  grpc::Status SetOptimizer(grpc::ServerContext* context, const v1::SetOptimizerRequest* request,
                            v1::SetOptimizerResponse* response) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext* context, const v1::LoadCheckpointRequest* request,
                              v1::LoadCheckpointResponse* response) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext* context, const v1::SaveCheckpointRequest* request,
                              v1::SaveCheckpointResponse* response) override;
  grpc::Status TrainStep(grpc::ServerContext* context, const v1::TrainStepRequest* request,
                         v1::TrainStepResponse* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Train(
      grpc::CallbackServerContext* context) override;
  grpc::Status Evaluate(grpc::ServerContext* context, const v1::EvaluateRequest* request,
                        v1::EvaluateResponse* response) override;

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override;
  grpc::Status SeedStream(grpc::ServerContext* context, const v1::SeedStreamRequest* request,
                          v1::SeedStreamResponse* response) override;
  grpc::Status ReadConvictions(grpc::ServerContext* context, const v1::ReadConvictionsRequest* request,
                               v1::ReadConvictionsResponse* response) override;
  grpc::Status ResetStream(grpc::ServerContext* context, const v1::ResetStreamRequest* request,
                           v1::ResetStreamResponse* response) override;
  grpc::Status CloseStream(grpc::ServerContext* context, const v1::CloseStreamRequest* request,
                           v1::CloseStreamResponse* response) override;
  grpc::Status ListStreams(grpc::ServerContext* context, const v1::ListStreamsRequest* request,
                           v1::ListStreamsResponse* response) override;

 private:
  // UNAVAILABLE while draining.
  absl::Status Admit() const;
  enum class WhileDraining { kRefused, kAnswered };
  // Admits (a kAnswered call also while draining), runs `handler` (→ absl::Status), records the answer's metrics and
  // converts it for gRPC.
  template <typename Handler>
  grpc::Status Answer(std::string_view method, Handler handler, WhileDraining while_draining = WhileDraining::kRefused);

  DeviceWorker& worker_;
  StreamBatcher& streams_;
  const StreamOptions& stream_options_;
  const CheckpointDirectory& checkpoints_;
  const Limits limits_;
  ServerMetrics& metrics_;
  std::atomic<bool> draining_ = false;
  LiveCalls live_calls_;  // the open Stream and Train calls
};

}  // namespace perception::server
