// The Perception service's handlers.
#include "server/perception_service.h"

#include <chrono>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "server/log_throttle.h"
#include "server/proto_convert.h"
#include "server/stopwatch.h"
#include "server/training.h"
#include "spdlog/spdlog.h"

#ifndef PERCEPTION_VERSION
#error "PERCEPTION_VERSION must be defined by the build"
#endif

namespace perception::server {
namespace {

// The model after a change to it, or the change's error.
absl::StatusOr<v1::Model> ModelAfter(const absl::Status& change, const ModelHost& host) {
  if (!change.ok()) return change;
  return ToProto(*host.Status().model);
}

// How loudly a call that did not succeed is logged. A plain refusal is the client's business; RESOURCE_EXHAUSTED
// may be the device's memory running out rather than a full queue, and a client that gave up is worth a note;
// DATA_LOSS (a replica divergence, a corrupt checkpoint), a lost device's UNAVAILABLE (IsRefusal) and the daemon's
// own failures need an operator.
spdlog::level::level_enum LogLevelOf(absl::StatusCode code) {
  if (code == absl::StatusCode::kResourceExhausted) return spdlog::level::warn;
  if (IsRefusal(code)) return spdlog::level::debug;
  switch (code) {
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kAborted:
      return spdlog::level::err;
    default:
      return spdlog::level::warn;
  }
}

void Record(ServerMetrics& metrics, std::string_view method, ServerMetrics::RpcKind kind, const absl::Status& status,
            const Stopwatch& since) {
  metrics.ObserveRpc(method, kind, status.code(), since.Seconds());
  if (status.ok()) return;
  // Calls that did not succeed, logged at most kLoggedLinesPerKind a kLoggedLinesPeriod by method and code.
  static LogThrottle* const throttle = new LogThrottle();
  int64_t dropped = 0;
  if (!throttle->Admit(absl::StrCat(std::string(method), " ", absl::StatusCodeToString(status.code())), dropped)) {
    return;
  }
  spdlog::log(LogLevelOf(status.code()), "{} {}: {}{}", method, IsRefusal(status.code()) ? "refused" : "failed",
              status.ToString(), throttle->DroppedNote(dropped));
}

// The outcome a streaming call's client saw. Where it cancelled the call, or its deadline passed, it never got the
// status the call finished with: a read that fails as the client goes away ends the input as its half-close would,
// and the call may finish OK before gRPC reports the cancellation.
absl::Status AsTheClientSawIt(const absl::Status& finished, const grpc::CallbackServerContext& context) {
  if (!context.IsCancelled()) return finished;
  const bool deadline_passed = std::chrono::system_clock::now() >= context.deadline();
  const absl::StatusCode code =
      deadline_passed ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kCancelled;
  // (The daemon's own exit also cancels the calls its shutdown deadline cuts; the log says so before.)
  const char* what = deadline_passed ? "the call's deadline passed"
                                     : "the call was cancelled (the client cancelled or went away, or the exit cut it)";
  // (CANCELLED is the call's own note of the client's going: the reactor saw it first.)
  if (finished.ok() || absl::IsCancelled(finished)) return absl::Status(code, what);
  return absl::Status(code, absl::StrCat(what, "; the daemon had finished it with ", finished.ToString()));
}

}  // namespace

PerceptionService::PerceptionService(DeviceWorker& worker, StreamBatcher& streams, const StreamOptions& stream_options,
                                     const CheckpointDirectory& checkpoints, const Limits& limits,
                                     ServerMetrics& metrics)
    : worker_(worker),
      streams_(streams),
      stream_options_(stream_options),
      checkpoints_(checkpoints),
      limits_(limits),
      metrics_(metrics) {}

void PerceptionService::BeginDrain() {
  draining_ = true;
  metrics_.SetDraining();
  live_calls_.BeginDrain(Admit());
}

absl::Status PerceptionService::Admit() const {
  if (!draining_) return absl::OkStatus();
  return absl::UnavailableError(
      "perceptiond is draining before it exits: no new work is accepted; GetStatus, ListStreams and ReadConvictions "
      "answer until it stops listening (through --drain_grace, then while convictions wait to be read back, up to "
      "--drain_for_reads): read back the convictions you need now, they go with the exit");
}

template <typename Handler>
grpc::Status PerceptionService::Answer(std::string_view method, Handler handler, WhileDraining while_draining) {
  const Stopwatch stopwatch;
  absl::Status status = while_draining == WhileDraining::kAnswered ? absl::OkStatus() : Admit();
  if (status.ok()) status = handler();
  Record(metrics_, method, ServerMetrics::RpcKind::kUnary, status, stopwatch);
  return ToGrpcStatus(status);
}

grpc::Status PerceptionService::GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                                          v1::GetStatusResponse* response) {
  return Answer("GetStatus", [&] {
    const HostStatus status = worker_.status();
    response->set_version(PERCEPTION_VERSION);
    response->mutable_device()->set_name(status.device_name);
    response->mutable_device()->set_memory_bytes(status.memory_bytes);
    response->mutable_device()->set_precision(status.precision);
    if (status.model.has_value()) *response->mutable_model() = ToProto(*status.model);
    v1::Limits& limits = *response->mutable_limits();
    limits.set_max_message_bytes(limits_.max_message_bytes);
    limits.set_max_batch(limits_.max_batch);
    limits.set_max_window(limits_.max_window);
    limits.set_queue_depth(limits_.queue_depth);
    response->set_queued_jobs(worker_.queued_jobs());
    response->set_draining(draining_.load());
    v1::StreamingStatus& streaming = *response->mutable_streaming();
    streams_.FillStatus(streaming);
    if (status.model.has_value()) streaming.set_weights_version(status.model->published_weights_version);
    if (status.data_parallel.has_value()) {
      v1::DataParallelStatus& parallel = *response->mutable_data_parallel();
      parallel.set_rank(status.data_parallel->rank);
      parallel.set_world_size(status.data_parallel->world_size);
      parallel.set_replica_check_every(status.data_parallel->check_every);
      parallel.set_replica_checks(status.replica_checks);
    }
    return absl::OkStatus();
  }, WhileDraining::kAnswered);
}

grpc::Status PerceptionService::InitModel(grpc::ServerContext* context, const v1::InitModelRequest* request,
                                          v1::InitModelResponse* response) {
  return Answer("InitModel", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const ModelConfig config, ModelConfigFromRequest(*request));
    ASSIGN_OR_RETURN(const OptimizerConfig optimizer, OptimizerFromProto(request->optimizer()));
    std::optional<Normalizer> normalizer;
    if (request->has_normalizer()) {
      ASSIGN_OR_RETURN(normalizer, NormalizerFromProto(request->normalizer()));
    }
    ASSIGN_OR_RETURN(*response->mutable_model(),
                     CreateModel(config, optimizer, request->seed(), normalizer, request->replace(), context));
    return absl::OkStatus();
  });
}

absl::StatusOr<v1::Model> PerceptionService::CreateModel(const ModelConfig& config, const OptimizerConfig& optimizer,
                                                         uint64_t seed, const std::optional<Normalizer>& normalizer,
                                                         bool replace, const grpc::ServerContextBase* caller) {
  RETURN_IF_ERROR(CheckTrainingShapeWithinLimits(config, limits_));
  return worker_.Run(
      JobPriority::kTraining,
      [&](ModelHost& host) -> absl::StatusOr<v1::Model> {
        // Before the live streams' refusal: closing them first would only lead to this one.
        RETURN_IF_ERROR(host.CheckInitMayReplace(replace));
        return streams_.ChangeModel(
            host, [&] { return ModelAfter(host.Init(config, optimizer, seed, normalizer, replace), host); });
      },
      caller);
}

absl::StatusOr<PerceptionService::LoadedModel> PerceptionService::LoadModel(
    const std::string& name, absl::string_view source, const std::optional<OptimizerConfig>& optimizer,
    const grpc::ServerContextBase* caller) {
  ASSIGN_OR_RETURN(const std::string path, checkpoints_.Resolve(name, source));
  return worker_.Run(
      JobPriority::kTraining,
      [&](ModelHost& host) {
        return streams_.ChangeModel(host, [&]() -> absl::StatusOr<LoadedModel> {
          ASSIGN_OR_RETURN(const double seconds, host.Load(path, optimizer, limits_));
          return LoadedModel{ToProto(*host.Status().model), seconds};
        });
      },
      caller);
}

grpc::Status PerceptionService::SetNormalizer(grpc::ServerContext* context, const v1::SetNormalizerRequest* request,
                                              v1::SetNormalizerResponse* response) {
  return Answer("SetNormalizer", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const Normalizer normalizer, NormalizerFromProto(request->normalizer()));
    ASSIGN_OR_RETURN(*response->mutable_model(),
                     worker_.Run(
                         JobPriority::kTraining,
                         [&](ModelHost& host) {
                           const absl::Status set = host.SetNormalizer(normalizer);
                           streams_.FollowModel(host);
                           return ModelAfter(set, host);
                         },
                         context));
    return absl::OkStatus();
  });
}

grpc::Status PerceptionService::SetOptimizer(grpc::ServerContext* context, const v1::SetOptimizerRequest* request,
                                             v1::SetOptimizerResponse* response) {
  return Answer("SetOptimizer", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const OptimizerConfig optimizer, OptimizerFromProto(request->optimizer()));
    ASSIGN_OR_RETURN(*response->mutable_model(),
                     worker_.Run(
                         JobPriority::kTraining,
                         [&](ModelHost& host) {
                           return streams_.ChangeModel(host,
                                                       [&] { return ModelAfter(host.SetOptimizer(optimizer), host); });
                         },
                         context));
    return absl::OkStatus();
  });
}

grpc::Status PerceptionService::LoadCheckpoint(grpc::ServerContext* context, const v1::LoadCheckpointRequest* request,
                                               v1::LoadCheckpointResponse* response) {
  return Answer("LoadCheckpoint", [&]() -> absl::Status {
    std::optional<OptimizerConfig> optimizer;
    if (request->has_optimizer()) {
      ASSIGN_OR_RETURN(optimizer, OptimizerFromProto(request->optimizer()));
    }
    ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(request->name(), "name", optimizer, context));
    *response->mutable_model() = std::move(loaded.model);
    response->set_seconds(loaded.seconds);
    return absl::OkStatus();
  });
}

grpc::Status PerceptionService::SaveCheckpoint(grpc::ServerContext* context, const v1::SaveCheckpointRequest* request,
                                               v1::SaveCheckpointResponse* response) {
  return Answer("SaveCheckpoint", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const std::string path, checkpoints_.ResolveForWriting(request->name(), "name"));
    ASSIGN_OR_RETURN(const SaveOutcome saved,
                     worker_.Run(JobPriority::kTraining, [&](ModelHost& host) { return host.Save(path); }, context));
    response->set_name(request->name());
    response->set_step(saved.step);
    response->set_bytes(saved.bytes);
    response->set_seconds(saved.seconds);
    return absl::OkStatus();
  });
}

grpc::Status PerceptionService::TrainStep(grpc::ServerContext* context, const v1::TrainStepRequest* request,
                                          v1::TrainStepResponse* response) {
  return Answer("TrainStep", [&]() -> absl::Status {
    const HostStatus status = worker_.status();
    ASSIGN_OR_RETURN(const std::optional<Normalizer> checked_under,
                     ValidateBeforeTheJob(request->batch(), limits_, status));
    const Stopwatch queued;
    // A data-parallel rank takes every step its peers take, even one its client gave up on: skipping it would leave
    // them waiting in the step's all-reduce until the collective timeout aborts the job.
    const grpc::ServerContextBase* caller = status.data_parallel.has_value() ? nullptr : context;
    ASSIGN_OR_RETURN(*response, worker_.Run(
                                    JobPriority::kTraining,
                                    [&](ModelHost& host) {
                                      return TrainOnDevice(host, request->batch(), /*next=*/nullptr, queued,
                                                           CheckedUnder(checked_under));
                                    },
                                    caller));
    return absl::OkStatus();
  });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* PerceptionService::Train(
    grpc::CallbackServerContext* context) {
  return new TrainReactor(
      worker_, limits_, live_calls_,
      [this, context, stopwatch = Stopwatch()](const absl::Status& status) {
        Record(metrics_, "Train", ServerMetrics::RpcKind::kBidirectional, AsTheClientSawIt(status, *context),
               stopwatch);
      });
}

grpc::Status PerceptionService::Evaluate(grpc::ServerContext* context, const v1::EvaluateRequest* request,
                                         v1::EvaluateResponse* response) {
  return Answer("Evaluate", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const std::optional<Normalizer> checked_under,
                     ValidateBeforeTheJob(request->batch(), limits_, worker_.status()));
    ASSIGN_OR_RETURN(const Evaluation evaluation,
                     worker_.Run(
                         JobPriority::kTraining,
                         [&](ModelHost& host) {
                           return host.Evaluate(ViewOf(request->batch()), request->return_probabilities(),
                                                CheckedUnder(checked_under));
                         },
                         context));
    response->set_loss(evaluation.loss);
    response->set_masked_labels(evaluation.masked_labels);
    for (const HorizonScore& score : evaluation.horizons) {
      v1::HorizonAccuracy& horizon = *response->add_horizons();
      horizon.set_horizon_events(score.horizon_events);
      horizon.set_masked_labels(score.masked_labels);
      horizon.set_correct(score.correct);
      horizon.set_accuracy(score.masked_labels > 0 ? static_cast<double>(score.correct) / score.masked_labels : 0);
    }
    response->mutable_probabilities()->Assign(evaluation.probabilities.begin(), evaluation.probabilities.end());
    response->set_step(evaluation.step);
    response->set_device_seconds(evaluation.device_seconds);
    return absl::OkStatus();
  });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* PerceptionService::Stream(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(
      streams_, stream_options_, live_calls_,
      [this, context, stopwatch = Stopwatch()](const absl::Status& status) {
        Record(metrics_, "Stream", ServerMetrics::RpcKind::kBidirectional, AsTheClientSawIt(status, *context),
               stopwatch);
      });
}

grpc::Status PerceptionService::SeedStream(grpc::ServerContext* context, const v1::SeedStreamRequest* request,
                                           v1::SeedStreamResponse* response) {
  return Answer("SeedStream", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(*response, streams_.Seed(*request, context));
    return absl::OkStatus();
  });
}

grpc::Status PerceptionService::ReadConvictions(grpc::ServerContext* context, const v1::ReadConvictionsRequest* request,
                                                v1::ReadConvictionsResponse* response) {
  return Answer("ReadConvictions", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(*response, streams_.Read(*request, context));
    return absl::OkStatus();
  }, WhileDraining::kAnswered);
}

grpc::Status PerceptionService::ResetStream(grpc::ServerContext* context, const v1::ResetStreamRequest* request,
                                            v1::ResetStreamResponse*) {
  return Answer("ResetStream", [&] { return streams_.Reset(request->instrument(), request->while_fed(), context); });
}

grpc::Status PerceptionService::CloseStream(grpc::ServerContext* context, const v1::CloseStreamRequest* request,
                                            v1::CloseStreamResponse* response) {
  return Answer("CloseStream", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const uint64_t processed, streams_.Close(request->instrument(), context));
    response->set_processed_events(processed);
    return absl::OkStatus();
  });
}

grpc::Status PerceptionService::ListStreams(grpc::ServerContext*, const v1::ListStreamsRequest* request,
                                            v1::ListStreamsResponse* response) {
  return Answer("ListStreams", [&] {
    *response = streams_.List(*request);
    return absl::OkStatus();
  }, WhileDraining::kAnswered);
}

}  // namespace perception::server
