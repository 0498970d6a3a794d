// Bad input against the real daemon: each gets the right status code and a message naming the problem, changes
// nothing, and the next valid call succeeds.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "engine/checkpoint.h"
#include "tests/e2e/e2e_util.h"

namespace perception::e2e {
namespace {

using ::testing::HasSubstr;

class ValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Daemon>> daemon =
        Daemon::Start(dir_ / "checkpoints", {"--max_batch=8", "--max_window=64", "--max_message_bytes=1048576"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
  }

  client::PerceptionClient& client() { return daemon_->client(); }

  void InitTiny() { ASSERT_TRUE(client().InitModel(TinyInitRequest(1)).ok()); }

  // A valid training step succeeds and is the next one: refused calls took no step.
  void ExpectNextStepSucceeds() {
    absl::StatusOr<v1::TrainStepResponse> response =
        client().TrainStep(TrainRequest(testing::MakeRandomBatch(config_, 2, 9, 1000 + steps_), config_));
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->step(), ++steps_);
  }

  void Save(const std::string& name) {
    v1::SaveCheckpointRequest request;
    request.set_name(name);
    ASSERT_TRUE(client().SaveCheckpoint(request).ok());
  }

  const ModelConfig config_ = TinyConfig();
  const ScopedTempDir temp_{"validation"};
  const std::filesystem::path& dir_ = temp_.path();
  std::unique_ptr<Daemon> daemon_;
  int steps_ = 0;
};

void ExpectRefused(const absl::Status& status, absl::StatusCode code, const std::string& message_part) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(message_part));
}

TEST_F(ValidationTest, CallsBeforeAnyModelAreFailedPrecondition) {
  const v1::TrainStepRequest step = TrainRequest(testing::MakeRandomBatch(config_, 2, 9, 1), config_);
  ExpectRefused(client().TrainStep(step).status(), absl::StatusCode::kFailedPrecondition, "no model");
  ExpectRefused(client().Evaluate(EvaluateRequest(testing::MakeRandomBatch(config_, 2, 9, 1), config_, false)).status(),
                absl::StatusCode::kFailedPrecondition, "no model");
  v1::SaveCheckpointRequest save;
  save.set_name("x.safetensors");
  ExpectRefused(client().SaveCheckpoint(save).status(), absl::StatusCode::kFailedPrecondition, "no model");
  ExpectRefused(client().SetOptimizer({}).status(), absl::StatusCode::kFailedPrecondition, "no model");
  EXPECT_FALSE(std::filesystem::exists(dir_ / "checkpoints" / "x.safetensors"));
  InitTiny();
  ExpectNextStepSucceeds();
}

TEST_F(ValidationTest, BadBatchesGetTheirCodeAndTheNextStepSucceeds) {
  InitTiny();
  ExpectNextStepSucceeds();
  struct Case {
    std::string name;
    std::function<void(v1::Batch&)> spoil;
    absl::StatusCode code;
    std::string message_part;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<Case> cases = {
      {"x one float short", [](v1::Batch& b) { b.mutable_x()->RemoveLast(); }, absl::StatusCode::kInvalidArgument,
       "x has 107 floats but its shape [2, 9, 6] needs 108"},
      {"features disagree with the model",
       [](v1::Batch& b) {
         b.set_n_features(4);
         b.mutable_x()->Truncate(2 * 9 * 4);
       },
       absl::StatusCode::kInvalidArgument, "batch has 4 features and 3 horizons but the model takes 6 and 3"},
      {"training shape differs",
       [&](v1::Batch& b) { b = ToProto(testing::MakeRandomBatch(config_, 3, 9, 2), config_); },
       absl::StatusCode::kInvalidArgument,
       "batch shape 3 windows x 9 events differs from the model's training shape 2 x 9"},
      {"NaN feature", [&](v1::Batch& b) { b.set_x(17, nan); }, absl::StatusCode::kInvalidArgument,
       "x[17] (window 0, event 2, feature 5) is nan; features must be finite"},
      // Finite, but beyond kMaxStandardizedFeature once standardized (the model's normalizer is the identity):
      // float32 would not compute MODEL.md's step from it, as for such an event streamed.
      {"feature beyond the standardized bound", [&](v1::Batch& b) { b.set_x(17, -2e16f); },
       absl::StatusCode::kInvalidArgument,
       "batch window 0, event 2: feature 5 is -2e+16, -2e+16 standard deviations from the model's normalizer mean; a "
       "feature must stay within 1e+16 of it"},
      // The finiteness and range checks share one pass over x: a feature that is not finite is named as such, and
      // the range is refused after the checks that need no model.
      {"infinite feature", [&](v1::Batch& b) { b.set_x(40, -inf); }, absl::StatusCode::kInvalidArgument,
       "x[40] (window 0, event 6, feature 4) is -inf; features must be finite"},
      {"feature beyond the bound and a negative dt",
       [&](v1::Batch& b) {
         b.set_x(17, -2e16f);
         b.set_dt(3, -0.5f);
       },
       absl::StatusCode::kInvalidArgument, "dt[3] (window 0, event 3) is -0.5; dt must be finite and >= 0"},
      {"infinite dt", [&](v1::Batch& b) { b.set_dt(10, inf); }, absl::StatusCode::kInvalidArgument,
       "dt[10] (window 1, event 1) is inf"},
      {"NaN dt", [&](v1::Batch& b) { b.set_dt(11, nan); }, absl::StatusCode::kInvalidArgument,
       "dt[11] (window 1, event 2) is nan"},
      {"label just above 1", [](v1::Batch& b) { b.set_labels(7, 1.0000001f); }, absl::StatusCode::kInvalidArgument,
       "labels[7] (window 0, event 2, horizon 1) is 1.00000012; labels must be 0 or 1"},
      {"negative dt", [](v1::Batch& b) { b.set_dt(3, -0.5f); }, absl::StatusCode::kInvalidArgument,
       "dt[3] (window 0, event 3) is -0.5; dt must be finite and >= 0"},
      {"label outside {0,1}", [](v1::Batch& b) { b.set_labels(4, 0.5f); }, absl::StatusCode::kInvalidArgument,
       "labels[4] (window 0, event 1, horizon 1) is 0.5; labels must be 0 or 1"},
      {"mask outside {0,1}", [](v1::Batch& b) { b.set_mask(0, 2.f); }, absl::StatusCode::kInvalidArgument,
       "mask[0] (window 0, event 0, horizon 0) is 2; mask values must be 0 or 1"},
      {"empty batch", [](v1::Batch& b) { b = v1::Batch(); }, absl::StatusCode::kInvalidArgument, "empty batch"},
      {"batch over the limit", [&](v1::Batch& b) { b = ToProto(testing::MakeRandomBatch(config_, 9, 9, 3), config_); },
       absl::StatusCode::kResourceExhausted, "batch of 9 windows exceeds the daemon's limit of 8"},
      {"window over the limit",
       [&](v1::Batch& b) { b = ToProto(testing::MakeRandomBatch(config_, 2, 65, 3), config_); },
       absl::StatusCode::kResourceExhausted, "window of 65 events exceeds the daemon's limit of 64"},
      {"message over --max_message_bytes", [](v1::Batch& b) { b.mutable_x()->Resize(300'000, 0.25f); },
       absl::StatusCode::kResourceExhausted, "larger than max"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::TrainStepRequest request = TrainRequest(testing::MakeRandomBatch(config_, 2, 9, 4), config_);
    c.spoil(*request.mutable_batch());
    ExpectRefused(client().TrainStep(request).status(), c.code, c.message_part);
    v1::EvaluateRequest evaluate;
    *evaluate.mutable_batch() = request.batch();
    if (c.name != "training shape differs") {  // Evaluate takes any batch shape within the limits
      ExpectRefused(client().Evaluate(evaluate).status(), c.code, c.message_part);
    }
    ExpectNextStepSucceeds();
  }
  // The same refusal ends a Train stream, after answering the batches before it.
  std::vector<int64_t> answered;
  const absl::Status stream = client().Train(
      3,
      [&](int i, v1::TrainStepRequest& request) {
        request = TrainRequest(testing::MakeRandomBatch(config_, 2, 9, 50 + i), config_);
        if (i == 2) request.mutable_batch()->set_labels(0, -1.f);
        return true;
      },
      [&](const v1::TrainStepResponse& response) { answered.push_back(response.step()); });
  ExpectRefused(stream, absl::StatusCode::kInvalidArgument, "labels[0] (window 0, event 0, horizon 0) is -1");
  EXPECT_EQ(answered, (std::vector<int64_t>{steps_ + 1, steps_ + 2}));
  steps_ += 2;
  ExpectNextStepSucceeds();
  // So does a batch beyond the standardized bound, checked as it is read (off the device worker).
  answered.clear();
  const absl::Status beyond = client().Train(
      2,
      [&](int i, v1::TrainStepRequest& request) {
        request = TrainRequest(testing::MakeRandomBatch(config_, 2, 9, 60 + i), config_);
        if (i == 1) request.mutable_batch()->set_x(6 * 9 + 1, 3e16f);
        return true;
      },
      [&](const v1::TrainStepResponse& response) { answered.push_back(response.step()); });
  ExpectRefused(beyond, absl::StatusCode::kInvalidArgument, "batch window 1, event 0: feature 1 is 3e+16");
  EXPECT_EQ(answered, (std::vector<int64_t>{steps_ + 1}));
  steps_ += 1;
  ExpectNextStepSucceeds();
}

// `tiny` with d_model 12 instead of 8, written out field by field.
v1::ModelConfig WiderTinyConfig() {
  v1::ModelConfig c;
  c.set_n_features(6);
  c.set_d_model(12);
  c.set_n_layers(2);
  c.set_expand(2);
  c.set_headdim(4);
  c.set_d_state(3);
  c.set_d_conv(4);
  c.set_cfc_units(5);
  c.set_cfc_backbone(7);
  c.set_grn_hidden(6);
  for (const int horizon : {10, 20, 50}) c.add_horizons(horizon);
  c.set_window(9);
  c.set_batch(2);
  c.set_warmup(2);
  return c;
}

TEST_F(ValidationTest, InitModelTakesAFullConfigAndRefusesAnInvalidOne) {
  v1::InitModelRequest invalid;
  *invalid.mutable_config() = WiderTinyConfig();
  invalid.mutable_config()->set_headdim(5);
  ExpectRefused(client().InitModel(invalid).status(), absl::StatusCode::kInvalidArgument, "headdim");

  // Every dimension within bounds, their product ~5.6e14 weights: refused, where allocating them crashed the daemon.
  v1::InitModelRequest huge;
  *huge.mutable_config() = WiderTinyConfig();
  huge.mutable_config()->set_d_model(65536);
  huge.mutable_config()->set_expand(1);
  huge.mutable_config()->set_headdim(65536);
  huge.mutable_config()->set_n_layers(65536);
  ExpectRefused(client().InitModel(huge).status(), absl::StatusCode::kInvalidArgument, "parameters, more than");
  v1::InitModelRequest levels = TinyInitRequest(1);
  levels.set_levels(1073741823);  // 4·levels + 8 wrapped to 4 features
  ExpectRefused(client().InitModel(levels).status(), absl::StatusCode::kInvalidArgument,
                "levels must be in [1, 16382]");
  v1::InitModelRequest negative = TinyInitRequest(1);
  negative.set_batch(-2);
  ExpectRefused(client().InitModel(negative).status(), absl::StatusCode::kInvalidArgument,
                "batch (-2) and window (0) must be positive, or 0 to keep the config's");

  v1::InitModelRequest full;
  *full.mutable_config() = WiderTinyConfig();
  absl::StatusOr<v1::InitModelResponse> model = client().InitModel(full);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->model().config().SerializeAsString(), WiderTinyConfig().SerializeAsString());
  absl::StatusOr<v1::TrainStepResponse> step =
      client().TrainStep(TrainRequest(testing::MakeRandomBatch(config_, 2, 9, 1), config_));
  ASSERT_TRUE(step.ok()) << step.status();

  // A full config without warmup takes MODEL.md §1.2's 16: as a plain int32 it read 0, and the clients that build
  // masks from the model's config then scored every position of a window, the cold-start outputs included.
  v1::InitModelRequest without_warmup;
  without_warmup.set_replace(true);
  *without_warmup.mutable_config() = WiderTinyConfig();
  without_warmup.mutable_config()->clear_warmup();
  ExpectRefused(client().InitModel(without_warmup).status(), absl::StatusCode::kInvalidArgument,
                "config.warmup is absent, and its default (MODEL.md §1.2's 16) is not below the window (9): give "
                "warmup");
  without_warmup.mutable_config()->set_window(32);
  model = client().InitModel(without_warmup);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE(model->model().config().has_warmup());
  EXPECT_EQ(model->model().config().warmup(), 16);
}

// A client that floods refused calls does not flood the log: each method and code logs 20 lines every 10 s (the
// metrics count every call), and the next line after the period says how many were left out.
TEST_F(ValidationTest, RefusedCallsAreLoggedAtMostTwentyEveryTenSeconds) {
  v1::InitModelRequest too_wide = TinyInitRequest(1);
  too_wide.set_window(65);
  for (int i = 0; i < 30; ++i) {
    ASSERT_EQ(client().InitModel(too_wide).status().code(), absl::StatusCode::kResourceExhausted);
  }
  const std::string log = daemon_->Log();
  const std::string line = "InitModel refused: RESOURCE_EXHAUSTED: training shape 2 windows x 65 events";
  size_t lines = 0;
  for (size_t at = log.find(line); at != std::string::npos; at = log.find(line, at + 1)) ++lines;
  EXPECT_EQ(lines, 20u) << log;
  absl::StatusOr<std::string> metrics = HttpGet(daemon_->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics,
              HasSubstr("perception_rpc_duration_seconds_count{code=\"RESOURCE_EXHAUSTED\",method=\"InitModel\"} 30"))
      << "the calls are counted all the same";
}

TEST_F(ValidationTest, BadModelRequestsAreRefused) {
  v1::InitModelRequest unknown = TinyInitRequest(1);
  unknown.set_config_name("huge");
  ExpectRefused(client().InitModel(unknown).status(), absl::StatusCode::kInvalidArgument, "unknown config 'huge'");
  v1::InitModelRequest too_wide = TinyInitRequest(1);
  too_wide.set_window(65);
  ExpectRefused(client().InitModel(too_wide).status(), absl::StatusCode::kResourceExhausted,
                "training shape 2 windows x 65 events exceeds the daemon's limits (8 x 64)");
  // Within the batch and window limits, but its batches (4 bytes x 8 x 64 x (600 + 1 + 2 x 3) floats) are beyond
  // --max_message_bytes: the model was made, and its first train failed in gRPC's words.
  v1::InitModelRequest too_heavy = TinyInitRequest(1);
  too_heavy.set_n_features(600);
  too_heavy.set_batch(8);
  too_heavy.set_window(64);
  ExpectRefused(client().InitModel(too_heavy).status(), absl::StatusCode::kResourceExhausted,
                "training shape 8 windows x 64 events makes batches of 1243200 bytes, beyond the daemon's largest "
                "message (--max_message_bytes 1048576): none could be sent; a smaller batch or window fits");
  InitTiny();
  ExpectNextStepSucceeds();

  ExpectRefused(client().InitModel(TinyInitRequest(2)).status(), absl::StatusCode::kFailedPrecondition,
                "a model already exists");
  v1::SetNormalizerRequest short_normalizer;
  short_normalizer.mutable_normalizer()->mutable_mean()->Resize(5, 0.f);
  short_normalizer.mutable_normalizer()->mutable_inv_std()->Resize(5, 1.f);
  ExpectRefused(client().SetNormalizer(short_normalizer).status(), absl::StatusCode::kInvalidArgument,
                "normalizer has 5 features but the model takes 6");
  v1::SetNormalizerRequest zero_scale;
  zero_scale.mutable_normalizer()->mutable_mean()->Resize(6, 0.f);
  zero_scale.mutable_normalizer()->mutable_inv_std()->Resize(6, 1.f);
  zero_scale.mutable_normalizer()->set_inv_std(2, 0.f);
  ExpectRefused(client().SetNormalizer(zero_scale).status(), absl::StatusCode::kInvalidArgument,
                "normalizer feature 2: mean 0, inv_std 0");
  v1::SetOptimizerRequest negative_lr;
  negative_lr.mutable_optimizer()->set_lr(-1);
  ExpectRefused(client().SetOptimizer(negative_lr).status(), absl::StatusCode::kInvalidArgument,
                "optimizer: lr must be positive");
  ExpectNextStepSucceeds();
}

TEST_F(ValidationTest, CheckpointNamesOutsideTheDirectoryMissingOrCorruptAreRefused) {
  InitTiny();
  ExpectNextStepSucceeds();
  const ScopedTempDir outside_temp("outside");
  const std::filesystem::path& outside = outside_temp.path();
  std::filesystem::create_directory_symlink(outside, dir_ / "checkpoints" / "link");
  const v1::EvaluateRequest probe = EvaluateRequest(testing::MakeRandomBatch(config_, 2, 9, 8), config_, true);
  const absl::StatusOr<v1::EvaluateResponse> before = client().Evaluate(probe);
  ASSERT_TRUE(before.ok());

  const std::pair<std::string, std::string> escapes[] = {
      {"../outside.safetensors", "must not contain '..'"},
      {"a/../../outside.safetensors", "must not contain '..'"},
      {(outside / "x.safetensors").string(), "is absolute"},
      {"link/x.safetensors", "does not resolve to a file inside the checkpoint directory"},
      {"", "is empty"},
  };
  for (const auto& [name, message_part] : escapes) {
    SCOPED_TRACE(name);
    v1::SaveCheckpointRequest save;
    save.set_name(name);
    ExpectRefused(client().SaveCheckpoint(save).status(), absl::StatusCode::kInvalidArgument, message_part);
    v1::LoadCheckpointRequest load;
    load.set_name(name);
    ExpectRefused(client().LoadCheckpoint(load).status(), absl::StatusCode::kInvalidArgument, message_part);
  }
  EXPECT_TRUE(std::filesystem::is_empty(outside)) << "nothing was written outside the checkpoint directory";
  EXPECT_FALSE(std::filesystem::exists(dir_ / "outside.safetensors"));

  v1::LoadCheckpointRequest missing;
  missing.set_name("missing.safetensors");
  ExpectRefused(client().LoadCheckpoint(missing).status(), absl::StatusCode::kNotFound, "missing.safetensors");

  std::ofstream(dir_ / "checkpoints" / "garbage.safetensors") << "this is not a safetensors file";
  v1::LoadCheckpointRequest garbage;
  garbage.set_name("garbage.safetensors");
  ExpectRefused(client().LoadCheckpoint(garbage).status(), absl::StatusCode::kDataLoss, "garbage.safetensors");

  Save("good.safetensors");
  const std::filesystem::path good = dir_ / "checkpoints" / "good.safetensors";
  std::filesystem::copy_file(good, dir_ / "checkpoints" / "truncated.safetensors");
  std::filesystem::resize_file(dir_ / "checkpoints" / "truncated.safetensors", std::filesystem::file_size(good) / 2);
  v1::LoadCheckpointRequest truncated;
  truncated.set_name("truncated.safetensors");
  ExpectRefused(client().LoadCheckpoint(truncated).status(), absl::StatusCode::kDataLoss, "truncated.safetensors");

  const absl::StatusOr<v1::EvaluateResponse> after = client().Evaluate(probe);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(EvaluationBits(*after), EvaluationBits(*before)) << "refused loads left the model as it was";
  ExpectNextStepSucceeds();
}

// A checkpoint trained at a shape beyond the daemon's --max_batch/--max_window is refused as InitModel's shape is,
// by LoadCheckpoint and by --load at startup (and --init_config's preset likewise): loaded, its every TrainStep would
// be refused.
TEST_F(ValidationTest, CheckpointsOfATrainingShapeBeyondTheLimitsAreRefused) {
  InitTiny();
  ExpectNextStepSucceeds();
  const v1::EvaluateRequest probe = EvaluateRequest(testing::MakeRandomBatch(config_, 2, 9, 8), config_, true);
  const absl::StatusOr<v1::EvaluateResponse> before = client().Evaluate(probe);
  ASSERT_TRUE(before.ok());

  ModelConfig wide = config_;
  wide.batch = 9;  // the daemon's --max_batch is 8
  const std::vector<float> params = testing::InitialParams(wide, 3);
  const Checkpoint checkpoint{.config = wide,
                              .params = params,
                              .exp_avg = std::vector<float>(params.size()),
                              .exp_avg_sq = std::vector<float>(params.size()),
                              .step = 0,
                              .optimizer = std::nullopt};
  ASSERT_TRUE(SaveCheckpoint((dir_ / "checkpoints" / "wide.safetensors").string(), checkpoint).ok());
  v1::LoadCheckpointRequest load;
  load.set_name("wide.safetensors");
  ExpectRefused(client().LoadCheckpoint(load).status(), absl::StatusCode::kResourceExhausted,
                "training shape 9 windows x 9 events exceeds the daemon's limits (8 x 64)");
  const absl::StatusOr<v1::EvaluateResponse> after = client().Evaluate(probe);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(EvaluationBits(*after), EvaluationBits(*before)) << "the refused load left the model as it was";
  ExpectNextStepSucceeds();

  const absl::StatusOr<std::unique_ptr<Daemon>> preloaded =
      Daemon::Start(dir_ / "checkpoints", {"--max_batch=8", "--load=wide.safetensors"});
  ASSERT_FALSE(preloaded.ok());
  EXPECT_THAT(std::string(preloaded.status().message()), HasSubstr("exceeds the daemon's limits (8 x 4096)"));
  const absl::StatusOr<std::unique_ptr<Daemon>> preset =
      Daemon::Start(dir_ / "checkpoints", {"--max_batch=1", "--init_config=tiny"});
  ASSERT_FALSE(preset.ok());
  EXPECT_THAT(std::string(preset.status().message()),
              HasSubstr("training shape 2 windows x 9 events exceeds the daemon's limits (1 x 4096)"));
}

// A Stream request gRPC could not parse (here a string field that is not UTF-8, which a C++ client sends) read as the
// client's half-close: the call ended OK and the events after it were silently not taken. Now the call ends
// INVALID_ARGUMENT once the events before it are processed and acknowledged, nothing after it is taken, and the
// instrument goes on from there in the next call.
TEST_F(ValidationTest, AStreamRequestThatCannotBeParsedEndsTheCallInvalidArgument) {
  InitTiny();
  const auto request = [&](uint64_t seq, const std::string& instrument) {
    v1::StreamRequest r;
    r.set_ack(true);
    v1::StreamEvent& event = *r.add_events();
    event.set_instrument(instrument);
    event.set_seq(seq);
    event.mutable_features()->mutable_features()->Resize(config_.n_features, 0.25f * static_cast<float>(seq + 1));
    event.mutable_features()->set_dt(0.5f);
    return r.SerializeAsString();
  };
  std::string unparsable = request(1, "B?");
  unparsable[unparsable.find("B?") + 1] = '\xff';
  const char* const kStream = "/perception.v1.Perception/Stream";
  const RawCallResult call = CallRaw(daemon_->target(), kStream, {request(0, "B"), unparsable, request(2, "B")});
  EXPECT_EQ(call.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << call.status.error_message();
  EXPECT_THAT(call.status.error_message(), HasSubstr("a request could not be parsed as perception.v1.StreamRequest"));
  ASSERT_FALSE(call.responses.empty());
  v1::StreamResponse last;
  ASSERT_TRUE(last.ParseFromString(call.responses.back()));
  ASSERT_EQ(last.acks_size(), 1);
  EXPECT_EQ(last.acks(0).last_seq(), 0u);
  EXPECT_EQ(last.processed_events(), 1u);
  const RawCallResult next = CallRaw(daemon_->target(), kStream, {request(1, "B")});
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
}

// A Train request gRPC could not parse ended the stream OK after the steps before it, the batches after it silently
// not trained. Now it ends INVALID_ARGUMENT, as a refused batch does: the steps before it answered, none after it.
TEST_F(ValidationTest, ATrainRequestThatCannotBeParsedEndsTheStreamInvalidArgument) {
  InitTiny();
  const std::string batch = TrainRequest(testing::MakeRandomBatch(config_, 2, 9, 77), config_).SerializeAsString();
  const RawCallResult call =
      CallRaw(daemon_->target(), "/perception.v1.Perception/Train", {batch, "\xff\xff\xff\xff", batch});
  EXPECT_EQ(call.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << call.status.error_message();
  EXPECT_THAT(call.status.error_message(),
              HasSubstr("a request could not be parsed as perception.v1.TrainStepRequest"));
  ASSERT_EQ(call.responses.size(), 1u);
  v1::TrainStepResponse first;
  ASSERT_TRUE(first.ParseFromString(call.responses[0]));
  EXPECT_EQ(first.step(), 1);
  steps_ = 1;
  ExpectNextStepSucceeds();  // step 2: nothing after the request was trained
}

}  // namespace
}  // namespace perception::e2e
