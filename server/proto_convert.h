// Conversions between the gRPC messages and the engine's types; every conversion from a request validates.
#pragma once

#include <optional>
#include <span>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/cpu_reference.h"
#include "engine/dataset.h"
#include "engine/optimizer.h"
#include "grpcpp/support/status.h"
#include "perception/v1/perception.pb.h"
#include "server/model_host.h"

namespace perception::server {

// The architecture of an InitModel request: the preset or full config, then the overrides, validated.
absl::StatusOr<ModelConfig> ModelConfigFromRequest(const v1::InitModelRequest& request);
v1::ModelConfig ToProto(const ModelConfig& config);

// Absent optional fields take the engine's defaults; validated.
absl::StatusOr<OptimizerConfig> OptimizerFromProto(const v1::OptimizerSettings& settings);
v1::OptimizerSettings ToProto(const OptimizerConfig& optimizer);

// Equal sizes, finite values, inv_std > 0 (the size against the model is the model host's check).
absl::StatusOr<Normalizer> NormalizerFromProto(const v1::Normalizer& normalizer);

v1::Model ToProto(const ModelInfo& model);

// The same code and message as gRPC's status (the two code enumerations agree number for number).
grpc::Status ToGrpcStatus(const absl::Status& status);

// A view of a batch that ValidateBatch accepted; valid while `batch` lives.
BatchView<float> ViewOf(const v1::Batch& batch);

}  // namespace perception::server
