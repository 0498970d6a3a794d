// Message ↔ engine conversions for the Perception service.
#include "server/proto_convert.h"

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

namespace perception::server {
namespace {

std::span<const float> Floats(const google::protobuf::RepeatedField<float>& values) {
  return {values.data(), static_cast<size_t>(values.size())};
}

ModelConfig FromProto(const v1::ModelConfig& c) {
  ModelConfig config;
  config.n_features = c.n_features();
  config.d_model = c.d_model();
  config.n_layers = c.n_layers();
  config.expand = c.expand();
  config.headdim = c.headdim();
  config.d_state = c.d_state();
  config.d_conv = c.d_conv();
  config.cfc_units = c.cfc_units();
  config.cfc_backbone = c.cfc_backbone();
  config.grn_hidden = c.grn_hidden();
  config.horizons.assign(c.horizons().begin(), c.horizons().end());
  config.n_horizons = static_cast<int>(config.horizons.size());
  config.window = c.window();
  config.batch = c.batch();
  if (c.has_warmup()) config.warmup = c.warmup();  // (else ModelConfig's default, MODEL.md §1.2's)
  return config;
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfigFromRequest(const v1::InitModelRequest& request) {
  ModelConfig config;
  switch (request.architecture_case()) {
    case v1::InitModelRequest::kConfigName: {
      ASSIGN_OR_RETURN(config, NamedConfig(request.config_name()));
      break;
    }
    case v1::InitModelRequest::kConfig:
      config = FromProto(request.config());
      break;
    case v1::InitModelRequest::ARCHITECTURE_NOT_SET:
      return absl::InvalidArgumentError("InitModel needs config_name or config");
  }
  switch (request.features_case()) {
    case v1::InitModelRequest::kLevels:
      if (request.levels() < 1 || request.levels() > kMaxLobsterLevels) {
        return absl::InvalidArgumentError(
            absl::StrCat("levels must be in [1, ", kMaxLobsterLevels, "], got ", request.levels()));
      }
      config.n_features = LobsterFeatureCount(request.levels());
      break;
    case v1::InitModelRequest::kNFeatures:
      config.n_features = request.n_features();
      break;
    case v1::InitModelRequest::FEATURES_NOT_SET:
      break;
  }
  if (request.batch() < 0 || request.window() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch (", request.batch(), ") and window (", request.window(),
                                                   ") must be positive, or 0 to keep the config's"));
  }
  if (request.batch() > 0) config.batch = request.batch();
  if (request.window() > 0) config.window = request.window();
  if (request.has_warmup()) config.warmup = request.warmup();
  if (request.has_config() && !request.config().has_warmup() && !request.has_warmup() &&
      config.warmup >= config.window) {
    return absl::InvalidArgumentError(absl::StrCat("config.warmup is absent, and its default (MODEL.md §1.2's ",
                                                   config.warmup, ") is not below the window (", config.window,
                                                   "): give warmup"));
  }
  RETURN_IF_ERROR(ValidateConfig(config));
  return config;
}

v1::ModelConfig ToProto(const ModelConfig& config) {
  v1::ModelConfig c;
  c.set_n_features(config.n_features);
  c.set_d_model(config.d_model);
  c.set_n_layers(config.n_layers);
  c.set_expand(config.expand);
  c.set_headdim(config.headdim);
  c.set_d_state(config.d_state);
  c.set_d_conv(config.d_conv);
  c.set_cfc_units(config.cfc_units);
  c.set_cfc_backbone(config.cfc_backbone);
  c.set_grn_hidden(config.grn_hidden);
  c.mutable_horizons()->Assign(config.horizons.begin(), config.horizons.end());
  c.set_window(config.window);
  c.set_batch(config.batch);
  c.set_warmup(config.warmup);
  return c;
}

absl::StatusOr<OptimizerConfig> OptimizerFromProto(const v1::OptimizerSettings& settings) {
  OptimizerConfig optimizer;
  if (settings.has_lr()) optimizer.lr = settings.lr();
  if (settings.has_weight_decay()) optimizer.weight_decay = settings.weight_decay();
  if (settings.has_max_grad_norm()) optimizer.max_grad_norm = settings.max_grad_norm();
  switch (settings.schedule()) {
    case v1::LR_SCHEDULE_CONSTANT:
      optimizer.schedule = LrSchedule::kConstant;
      break;
    case v1::LR_SCHEDULE_WARMUP_COSINE:
      optimizer.schedule = LrSchedule::kWarmupCosine;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown lr schedule ", settings.schedule()));
  }
  optimizer.warmup_steps = settings.warmup_steps();
  optimizer.total_steps = settings.total_steps();
  optimizer.min_lr = settings.min_lr();
  RETURN_IF_ERROR(ValidateOptimizerConfig(optimizer));
  return optimizer;
}

v1::OptimizerSettings ToProto(const OptimizerConfig& optimizer) {
  v1::OptimizerSettings settings;
  settings.set_lr(optimizer.lr);
  settings.set_weight_decay(optimizer.weight_decay);
  settings.set_max_grad_norm(optimizer.max_grad_norm);
  settings.set_schedule(optimizer.schedule == LrSchedule::kWarmupCosine ? v1::LR_SCHEDULE_WARMUP_COSINE
                                                                        : v1::LR_SCHEDULE_CONSTANT);
  settings.set_warmup_steps(optimizer.warmup_steps);
  settings.set_total_steps(optimizer.total_steps);
  settings.set_min_lr(optimizer.min_lr);
  return settings;
}

absl::StatusOr<Normalizer> NormalizerFromProto(const v1::Normalizer& normalizer) {
  RETURN_IF_ERROR(ValidateNormalizer(Floats(normalizer.mean()), Floats(normalizer.inv_std())));
  return Normalizer{{normalizer.mean().begin(), normalizer.mean().end()},
                    {normalizer.inv_std().begin(), normalizer.inv_std().end()}};
}

v1::Model ToProto(const ModelInfo& model) {
  v1::Model m;
  *m.mutable_config() = ToProto(model.config);
  m.set_step(model.step);
  m.set_weights_version(model.weights_version);
  m.set_trained_parameters(model.trained_parameters);
  m.set_normalizer_fitted(model.normalizer_fitted);
  *m.mutable_optimizer() = ToProto(model.optimizer);
  m.mutable_normalizer()->mutable_mean()->Assign(model.normalizer.mean.begin(), model.normalizer.mean.end());
  m.mutable_normalizer()->mutable_inv_std()->Assign(model.normalizer.inv_std.begin(), model.normalizer.inv_std.end());
  return m;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

BatchView<float> ViewOf(const v1::Batch& batch) {
  return {batch.batch(),      batch.window(),         Floats(batch.x()),
          Floats(batch.dt()), Floats(batch.labels()), Floats(batch.mask())};
}

}  // namespace perception::server
