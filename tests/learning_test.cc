// Learning on real data: `small` trained on the first 70% of the AMZN day beats the class prior on the last 30%.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "engine/backend.h"
#include "engine/dataset.h"
#include "engine/lobster.h"
#include "tests/lobster_samples.h"
#include "tests/test_util.h"

namespace perception {
namespace {

BatchView<float> View(const Batch& b) { return {b.batch, b.window, b.x, b.dt, b.labels, b.mask}; }

TEST(LearningTest, SmallBeatsTheClassPriorOnTheLastThirtyPercentOfAmzn) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<LobsterData> data = ReadLobster(testing::ShippedLobsterPath("AMZN", "orderbook", 1),
                                                 testing::ShippedLobsterPath("AMZN", "message", 1));
  ASSERT_TRUE(data.ok()) << data.status();
  ModelConfig config = *NamedConfig("small");
  config.n_features = LobsterFeatureCount(data->levels);
  config.batch = 16;
  absl::StatusOr<EventSeries> series = BuildSeries(*data, config.horizons);
  ASSERT_TRUE(series.ok()) << series.status();
  absl::StatusOr<SplitSeries> split = SplitByTime(*series, 0.7);
  ASSERT_TRUE(split.ok()) << split.status();

  ParamLayout layout(config);
  std::vector<float> params = testing::InitialParams(config, 1);
  const Normalizer normalizer = FitNormalizer(split->train);
  std::copy(normalizer.mean.begin(), normalizer.mean.end(), params.begin() + layout.tensor(layout.norm_mean).offset);
  std::copy(normalizer.inv_std.begin(), normalizer.inv_std.end(),
            params.begin() + layout.tensor(layout.norm_inv_std).offset);
  OptimizerConfig optimizer;
  optimizer.schedule = LrSchedule::kWarmupCosine;
  optimizer.warmup_steps = 10;
  optimizer.total_steps = 80;
  optimizer.min_lr = 1e-4;
  std::unique_ptr<Backend> backend = MakeCpuBackend(config, optimizer, std::move(params));

  absl::StatusOr<WindowSampler> sampler = WindowSampler::Create(split->train, config.window, config.warmup, 1);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  const Batch validation = SequentialWindows(split->validation, config.window, config.warmup);
  ASSERT_GT(validation.batch, 200);
  const double initial_loss = *backend->Evaluate(View(validation), {});
  Batch batch;
  for (int step = 0; step < optimizer.total_steps; ++step) {
    sampler->Sample(config.batch, batch);
    absl::StatusOr<TrainStepResult> result = backend->TrainStep(View(batch));
    ASSERT_TRUE(result.ok() && std::isfinite(result->loss));
  }
  const double val_loss = *backend->Evaluate(View(validation), {});

  // The constant predictor: the training part's label frequency per horizon, scored on the same windows and mask.
  const double prior_loss = PriorBaselineLoss(ClassPrior(split->train), validation.labels, validation.mask);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("AMZN validation (%d windows of %d): initial %.5f, after %lld steps of %d windows %.5f, class prior %.5f;"
              " %.1f s\n",
              validation.batch, config.window, initial_loss, static_cast<long long>(optimizer.total_steps), config.batch, val_loss, prior_loss,
              seconds);
  RecordProperty("validation_loss", std::to_string(val_loss));
  RecordProperty("class_prior_loss", std::to_string(prior_loss));
  EXPECT_LT(val_loss, prior_loss);
  EXPECT_LT(seconds, 120.0);
}

}  // namespace
}  // namespace perception
