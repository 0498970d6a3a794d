// Remote training against the real daemon: Train lowers the loss on held-out data, and TrainStep is bit-identical
// to the offline engine on the CPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/checkpoint.h"
#include "engine/dataset.h"
#include "tests/e2e/e2e_util.h"

namespace perception::e2e {
namespace {

uint64_t Bits(double value) { return std::bit_cast<uint64_t>(value); }

std::vector<uint32_t> Bits(const std::vector<float>& values) {
  std::vector<uint32_t> bits;
  for (const float v : values) bits.push_back(std::bit_cast<uint32_t>(v));
  return bits;
}

double EvaluateLoss(client::PerceptionClient& client, const Batch& windows) {
  v1::EvaluateRequest request;
  *request.mutable_batch() = ToProto(windows);
  absl::StatusOr<v1::EvaluateResponse> response = client.Evaluate(request);
  EXPECT_TRUE(response.ok()) << response.status();
  return response.ok() ? response->loss() : NAN;
}

// A stream the model can learn from: horizon h goes up exactly when feature h of the event is positive.
EventSeries LearnableSeries(const ModelConfig& config, size_t events, uint64_t seed) {
  Rng rng(seed);
  EventSeries series{config.n_features, config.n_horizons, config.horizons, {}, {}, {}, {}, {}};
  for (size_t i = 0; i < events; ++i) {
    for (int f = 0; f < config.n_features; ++f) series.features.push_back(static_cast<float>(rng.Uniform(-1, 1)));
    series.dt.push_back(static_cast<float>(rng.Uniform(0, 2)));
    for (int h = 0; h < config.n_horizons; ++h) {
      series.labels.push_back(series.features[i * config.n_features + h] > 0 ? 1.f : 0.f);
      series.mask.push_back(1.f);
    }
  }
  return series;
}

TEST(TrainingTest, TrainStreamLowersTheValidationLoss) {
  const ModelConfig tiny = TinyConfig();
  const EventSeries training = LearnableSeries(tiny, 4000, 1), held_out = LearnableSeries(tiny, 1000, 2);

  const ScopedTempDir temp("train");
  const std::filesystem::path& dir = temp.path();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(dir / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  v1::InitModelRequest init = TinyInitRequest(5);
  init.set_batch(16);
  init.set_window(32);
  init.mutable_optimizer()->set_lr(1e-2);
  *init.mutable_normalizer() = ToProto(FitNormalizer(training));
  absl::StatusOr<v1::InitModelResponse> model = client.InitModel(init);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE(model->model().normalizer_fitted());

  const Batch validation = SequentialWindows(held_out, 32, tiny.warmup);
  const double initial_loss = EvaluateLoss(client, validation);

  absl::StatusOr<WindowSampler> sampler = WindowSampler::Create(training, 32, tiny.warmup, 11);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  constexpr int kSteps = 60;
  Batch batch;
  std::vector<v1::TrainStepResponse> responses;
  const absl::Status trained = client.Train(
      kSteps,
      [&](int, v1::TrainStepRequest& request) {
        sampler->Sample(16, batch);
        *request.mutable_batch() = ToProto(batch);
        return true;
      },
      [&](const v1::TrainStepResponse& response) { responses.push_back(response); });
  ASSERT_TRUE(trained.ok()) << trained;

  ASSERT_EQ(responses.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_EQ(responses[i].step(), i + 1) << "responses arrive one per batch, in order";
    EXPECT_TRUE(std::isfinite(responses[i].loss()) && responses[i].loss() > 0);
    EXPECT_GT(responses[i].device_seconds(), 0);
  }
  const double final_loss = EvaluateLoss(client, validation);
  EXPECT_LT(final_loss, initial_loss - 0.1) << "initial " << initial_loss << ", after training " << final_loss;
}

TEST(TrainingTest, TrainStepIsBitIdenticalToTheOfflineEngine) {
  if (DaemonDevice() != "cpu") GTEST_SKIP() << "compares the daemon's step with the offline CPU engine's, bit for bit";
  const ModelConfig config = TinyConfig();
  const ParamLayout layout(config);
  constexpr uint64_t kSeed = 7;
  // A random normalizer and non-default optimizer settings, so that every part of the request matters.
  Normalizer normalizer;
  Rng rng(99);
  for (int f = 0; f < config.n_features; ++f) {
    normalizer.mean.push_back(static_cast<float>(rng.Uniform(-1, 1)));
    normalizer.inv_std.push_back(static_cast<float>(rng.Uniform(0.5, 2)));
  }
  OptimizerConfig optimizer;
  optimizer.lr = 3e-3;
  optimizer.weight_decay = 0.02;
  optimizer.max_grad_norm = 0.5;
  optimizer.schedule = LrSchedule::kWarmupCosine;
  optimizer.warmup_steps = 2;
  optimizer.total_steps = 10;
  optimizer.min_lr = 1e-4;

  std::vector<float> params = testing::InitialParams(config, kSeed);
  std::copy(normalizer.mean.begin(), normalizer.mean.end(), params.begin() + layout.tensor(layout.norm_mean).offset);
  std::copy(normalizer.inv_std.begin(), normalizer.inv_std.end(),
            params.begin() + layout.tensor(layout.norm_inv_std).offset);
  std::unique_ptr<Backend> offline = MakeCpuBackend(config, optimizer, params);

  const ScopedTempDir temp("bits");
  const std::filesystem::path& dir = temp.path();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(dir / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  v1::InitModelRequest init = TinyInitRequest(kSeed);
  *init.mutable_normalizer() = ToProto(normalizer);
  v1::OptimizerSettings& settings = *init.mutable_optimizer();
  settings.set_lr(optimizer.lr);
  settings.set_weight_decay(optimizer.weight_decay);
  settings.set_max_grad_norm(optimizer.max_grad_norm);
  settings.set_schedule(v1::LR_SCHEDULE_WARMUP_COSINE);
  settings.set_warmup_steps(optimizer.warmup_steps);
  settings.set_total_steps(optimizer.total_steps);
  settings.set_min_lr(optimizer.min_lr);
  ASSERT_TRUE(client.InitModel(init).ok());

  // Six steps through TrainStep, four through the Train stream.
  std::vector<testing::RandomBatch> batches;
  for (int i = 0; i < 10; ++i)
    batches.push_back(testing::MakeRandomBatch(config, config.batch, config.window, 100 + i));
  std::vector<v1::TrainStepResponse> remote;
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<v1::TrainStepResponse> response = client.TrainStep(TrainRequest(batches[i], config));
    ASSERT_TRUE(response.ok()) << response.status();
    remote.push_back(*response);
  }
  const absl::Status streamed = client.Train(
      4,
      [&](int i, v1::TrainStepRequest& request) {
        request = TrainRequest(batches[6 + i], config);
        return true;
      },
      [&](const v1::TrainStepResponse& response) { remote.push_back(response); });
  ASSERT_TRUE(streamed.ok()) << streamed;
  ASSERT_EQ(remote.size(), batches.size());

  for (size_t i = 0; i < batches.size(); ++i) {
    absl::StatusOr<TrainStepResult> local = offline->TrainStep(batches[i].view());
    ASSERT_TRUE(local.ok()) << local.status();
    EXPECT_EQ(Bits(remote[i].loss()), Bits(local->loss)) << "step " << i + 1;
    EXPECT_EQ(Bits(remote[i].grad_norm()), Bits(local->grad_norm)) << "step " << i + 1;
    EXPECT_EQ(remote[i].step(), local->step);
  }

  v1::SaveCheckpointRequest save;
  save.set_name("after10.safetensors");
  ASSERT_TRUE(client.SaveCheckpoint(save).ok());
  absl::StatusOr<Checkpoint> saved = LoadCheckpoint((dir / "checkpoints" / "after10.safetensors").string());
  ASSERT_TRUE(saved.ok()) << saved.status();
  absl::StatusOr<Checkpoint> expected = offline->ExportState();
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(saved->step, 10);
  EXPECT_EQ(Bits(saved->params), Bits(expected->params));
  EXPECT_EQ(Bits(saved->exp_avg), Bits(expected->exp_avg));
  EXPECT_EQ(Bits(saved->exp_avg_sq), Bits(expected->exp_avg_sq));
}

// A learning rate far too high: the weights grow until a batch's gradient norm is no longer finite. That step is
// refused FAILED_PRECONDITION, which ends the Train stream, and not taken: the model keeps the finite weights of the
// step before, which GetStatus reports and a checkpoint can hold (an update would have written NaN into them all).
TEST(TrainingTest, ADivergingJobIsStoppedBeforeItsModelHoldsANaN) {
  const ModelConfig config = TinyConfig();
  const ScopedTempDir temp("diverge");
  const std::filesystem::path& dir = temp.path();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(dir / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  v1::InitModelRequest init = TinyInitRequest(3);
  init.mutable_optimizer()->set_lr(1e30);
  ASSERT_TRUE(client.InitModel(init).ok());

  constexpr int kSteps = 20;
  std::vector<testing::RandomBatch> batches;
  for (int i = 0; i < kSteps; ++i) {
    batches.push_back(testing::MakeRandomBatch(config, config.batch, config.window, 200 + i));
  }
  std::vector<v1::TrainStepResponse> responses;
  const absl::Status trained = client.Train(
      kSteps,
      [&](int i, v1::TrainStepRequest& request) {
        request = TrainRequest(batches[i], config);
        return true;
      },
      [&](const v1::TrainStepResponse& response) { responses.push_back(response); });
  ASSERT_EQ(trained.code(), absl::StatusCode::kFailedPrecondition) << trained;
  ASSERT_GE(responses.size(), 1u);
  ASSERT_LT(responses.size(), static_cast<size_t>(kSteps));
  const int64_t last_step = responses.back().step();
  EXPECT_EQ(last_step, static_cast<int64_t>(responses.size()));
  EXPECT_THAT(std::string(trained.message()), ::testing::HasSubstr("gradient norm is"));
  EXPECT_THAT(std::string(trained.message()),
              ::testing::HasSubstr(absl::StrCat("not applied, and the model stays at step ", last_step)));
  for (const v1::TrainStepResponse& response : responses) {
    EXPECT_TRUE(std::isfinite(response.loss()) && std::isfinite(response.grad_norm())) << response.step();
  }

  absl::StatusOr<v1::GetStatusResponse> status = client.GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->model().step(), last_step);
  v1::SaveCheckpointRequest save;
  save.set_name("diverged.safetensors");
  ASSERT_TRUE(client.SaveCheckpoint(save).ok()) << "the weights hold a value SaveCheckpoint refuses";
  absl::StatusOr<Checkpoint> saved = LoadCheckpoint((dir / "checkpoints" / "diverged.safetensors").string());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step, last_step);
  EXPECT_TRUE(std::all_of(saved->params.begin(), saved->params.end(), [](float v) { return std::isfinite(v); }));
}

// A Train stream stopped before its first step (perceptionctl train's Ctrl-C at a chunk's start) waited on a call
// that never reached the daemon, its start corked until a first write, until the client's timeout cut it and the run
// failed DEADLINE_EXCEEDED. No call opens now, and the stream ends at once, OK, with the model untouched.
TEST(TrainingTest, ATrainStreamStoppedBeforeItsFirstStepEndsAtOnce) {
  const ScopedTempDir temp("stopped_before_first");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_TRUE((*daemon)->client().InitModel(TinyInitRequest(5)).ok());
  client::PerceptionClient client((*daemon)->target(), {.timeout = absl::Seconds(3)});
  int asked = 0, answered = 0;
  const absl::Time start = absl::Now();
  const absl::Status trained = client.Train(
      5,
      [&](int, v1::TrainStepRequest&) {
        ++asked;
        return false;
      },
      [&](const v1::TrainStepResponse&) { ++answered; });
  EXPECT_TRUE(trained.ok()) << trained;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(asked, 1);
  EXPECT_EQ(answered, 0);
  EXPECT_EQ((*daemon)->client().GetStatus()->model().step(), 0);
}

}  // namespace
}  // namespace perception::e2e
