// The training step as a replayed CUDA graph (warmup → capture → replay, ARCHITECTURE.md): replay ≡ eager bit for bit
// under a warmup + cosine schedule (float32 and 3×TF32 products), other shapes and other buffers refused, an overfit
// on one fixed batch that follows the eager trajectory, no allocation over a thousand replays, and the counters the
// daemon reads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/cuda_backend.h"
#include "engine/cuda_memory.h"
#include "engine/cuda_model.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/test_util.h"

namespace perception {

namespace {

using testing::MakeRandomBatch;

using testing::Contains;
using testing::ExpectSameState;
using testing::InitialParams;
using testing::MakeModel;
using testing::Step;
using testing::WarmupCosine;

// Twenty steps over a different batch each (so the staging is exercised under replay) with the learning rate moving
// every step (warmup then cosine, read from the device step counter): 1 eager step, 1 capture, 18 more replays.
void ExpectReplayBitIdenticalToEager(Precision precision) {
  const ModelConfig config = *NamedConfig("small");
  const OptimizerConfig optimizer = WarmupCosine(20);
  auto eager = MakeModel(config, optimizer, /*graphs=*/false, 4, precision);
  auto replayed = MakeModel(config, optimizer, /*graphs=*/true, 4, precision);
  ASSERT_TRUE(eager && replayed);
  for (int step = 1; step <= 20; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const auto batch = MakeRandomBatch(config, config.batch, config.window, 300 + step);
    const auto a = Step(*eager, batch.view()), b = Step(*replayed, batch.view());
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(std::memcmp(&a->loss, &b->loss, sizeof(double)), 0) << a->loss << " vs " << b->loss;
    EXPECT_EQ(std::memcmp(&a->grad_norm, &b->grad_norm, sizeof(double)), 0) << a->grad_norm << " vs " << b->grad_norm;
    EXPECT_EQ(b->step, step);
  }
  ExpectSameState(*eager, *replayed);
  EXPECT_EQ(*replayed->DownloadStep(), 20);

  const TrainingCounters e = eager->training_counters(), r = replayed->training_counters();
  EXPECT_EQ(e.eager_steps, 20);
  EXPECT_EQ(e.graph_captures, 0);
  EXPECT_EQ(e.graph_replays, 0);
  EXPECT_EQ(r.eager_steps, 1);
  EXPECT_EQ(r.graph_captures, 1);
  EXPECT_EQ(r.graph_replays, 19);
  EXPECT_EQ(r.timed_steps, 20);
  EXPECT_GT(r.last_step_seconds, 0);
  EXPECT_GE(r.total_step_seconds, r.last_step_seconds);
  std::printf("[graph] small %s: last step %.1f us eager, %.1f us replayed (device time, CUDA events)\n",
              PrecisionName(precision), e.last_step_seconds * 1e6, r.last_step_seconds * 1e6);
}

TEST(CudaGraphTrainStep, ReplayIsBitIdenticalToEagerOverTwentyStepsOfAWarmupCosineSchedule) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectReplayBitIdenticalToEager(Precision::kFloat32);
}

// The 3×TF32 products read the weights' TF32 parts, split inside the captured step: each replay splits that step's
// weights.
TEST(CudaGraphTrainStep, ReplayIsBitIdenticalToEagerIn3xTf32) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectReplayBitIdenticalToEager(Precision::kFloat32Tf32x3);
}

// Under tf32 the products, the scan, the CfC and the GRN head run in plain TF32, and the graph keeps its streams'
// priorities (the main stream a level above the weight gradients'; CudaModel::Initialize): replay still equals eager
// to the bit.
TEST(CudaGraphTrainStep, ReplayIsBitIdenticalToEagerInTf32) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectReplayBitIdenticalToEager(Precision::kTf32);
}

// The model's buffers are sized for the config's (batch, window): any other training shape is refused, naming both,
// and leaves the cached graph to replay the next step of the right shape.
TEST(CudaGraphTrainStep, AnotherShapeIsRefusedAndTheGraphKeepsReplaying) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");  // (batch, window) = (2, 9)
  auto model = MakeModel(config, OptimizerConfig{}, /*graphs=*/true, 5);
  ASSERT_TRUE(model);
  const auto batch = MakeRandomBatch(config, config.batch, config.window, 6);
  for (int step = 0; step < 3; ++step) ASSERT_TRUE(Step(*model, batch.view()).ok());
  const TrainingCounters before = model->training_counters();
  ASSERT_EQ(before.graph_captures, 1);
  ASSERT_EQ(before.graph_replays, 2);

  for (const auto& [b, t] : {std::pair{1, 9}, std::pair{2, 5}, std::pair{1, 4}}) {
    const auto other = MakeRandomBatch(config, b, t, 7);
    const auto refused = Step(*model, other.view());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    const std::string shape = absl::StrCat("(", b, ", ", t, ")");
    EXPECT_TRUE(Contains(refused.status(), shape) && Contains(refused.status(), "(2, 9)")) << refused.status();
  }
  const auto next = Step(*model, batch.view());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->step, 4);
  const TrainingCounters after = model->training_counters();
  EXPECT_EQ(after.graph_captures, 1);
  EXPECT_EQ(after.graph_replays, before.graph_replays + 1);
  EXPECT_EQ(after.eager_steps, before.eager_steps);
}

// A graph replays only over the buffers it was captured with: with the input staging moved, the step is refused
// (nothing is launched), and once it is back the graph replays again.
TEST(CudaGraphTrainStep, AReplayOverOtherBuffersIsRefused) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  auto model = MakeModel(config, OptimizerConfig{}, /*graphs=*/true, 8);
  ASSERT_TRUE(model);
  const auto batch = MakeRandomBatch(config, config.batch, config.window, 9);
  for (int step = 0; step < 2; ++step) ASSERT_TRUE(Step(*model, batch.view()).ok());
  ASSERT_EQ(model->training_counters().graph_captures, 1);

  auto elsewhere = AllocateCuda(MemoryKind::kPinnedHost, batch.x.size() * sizeof(float));
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  float* const captured = CudaModelTestPeer::x_staging(*model, 0);
  CudaModelTestPeer::x_staging(*model, 0) = static_cast<float*>(elsewhere->get());
  const auto refused = Step(*model, batch.view());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal) << refused.status();
  EXPECT_TRUE(Contains(refused.status(), "captured over other buffers")) << refused.status();
  EXPECT_EQ(model->training_counters().graph_replays, 1);
  EXPECT_EQ(*model->DownloadStep(), 2) << "nothing ran";

  CudaModelTestPeer::x_staging(*model, 0) = captured;
  const auto replayed = Step(*model, batch.view());
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_EQ(replayed->step, 3);
  EXPECT_EQ(model->training_counters().graph_replays, 2);
}

// One fixed `small` batch (B = 256, T = 64) whose labels follow the sign of feature 0 (kept at least 0.5 from zero),
// 80% of the labels masked in: 1 eager step, then 250 graph launches (the capture step's included) drive the masked
// loss from about ln 2 to below 0.01, on the same trajectory as 251 eager steps.
TEST(CudaGraphTrainStep, OverfitsOneFixedBatchOnTheEagerTrajectory) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  auto batch = MakeRandomBatch(config, config.batch, config.window, 10);
  Rng rng(11);
  const size_t F = config.n_features, H = config.n_horizons;
  for (size_t i = 0; i < static_cast<size_t>(config.batch) * config.window; ++i) {
    const bool up = rng.Uniform() < 0.5;
    const float magnitude = static_cast<float>(rng.Uniform(0.5, 2.0));
    batch.x[i * F] = up ? magnitude : -magnitude;
    for (size_t h = 0; h < H; ++h) batch.labels[i * H + h] = up ? 1.f : 0.f;
  }
  constexpr int kSteps = 251;
  auto eager = MakeModel(config, OptimizerConfig{}, /*graphs=*/false, 3);
  auto replayed = MakeModel(config, OptimizerConfig{}, /*graphs=*/true, 3);
  ASSERT_TRUE(eager && replayed);
  std::vector<double> eager_losses, replayed_losses;
  for (auto [model, losses] : {std::pair{eager.get(), &eager_losses}, std::pair{replayed.get(), &replayed_losses}}) {
    ASSERT_TRUE(model->StageBatch(batch.view()).ok());  // staged once: every step trains on the same pinned batch
    for (int step = 0; step < kSteps; ++step) {
      ASSERT_TRUE(model->EnqueueTrainStep().ok());
      const auto report = model->Wait();
      ASSERT_TRUE(report.ok()) << report.status();
      losses->push_back(report->loss);
    }
  }
  const TrainingCounters r = replayed->training_counters();
  EXPECT_EQ(r.eager_steps, 1);
  EXPECT_EQ(r.graph_captures, 1);
  EXPECT_EQ(r.graph_replays, kSteps - 1);

  double worst = 0;
  int identical = 0;
  for (int i = 0; i < kSteps; ++i) {
    const double difference = std::abs(replayed_losses[i] - eager_losses[i]);
    worst = std::max(worst, difference / std::max(std::abs(eager_losses[i]), 1e-12));
    identical += std::memcmp(&replayed_losses[i], &eager_losses[i], sizeof(double)) == 0;
  }
  std::printf("[graph] overfit small B=%d: loss %.4f -> %.4f (step 50 %.4f, 100 %.4f, 200 %.4f); replayed vs eager: "
              "%d/%d steps bit-identical, worst relative difference %.2e\n",
              config.batch, replayed_losses.front(), replayed_losses.back(), replayed_losses[50], replayed_losses[100],
              replayed_losses[200], identical, kSteps, worst);
  EXPECT_NEAR(replayed_losses.front(), std::log(2.0), 0.1);
  EXPECT_LT(replayed_losses.back(), 0.01);
  EXPECT_LE(worst, 1e-6) << "the replayed trajectory left the eager one";
}

// After the eager step and the capture, a thousand replays allocate nothing: not through the backend's allocator,
// and not on the device at all (cuBLAS and the graph runtime included).
TEST(CudaGraphTrainStep, AllocatesNothingOverAThousandReplayedSteps) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  auto model = MakeModel(config, OptimizerConfig{}, /*graphs=*/true, 12);
  ASSERT_TRUE(model);
  const auto batch = MakeRandomBatch(config, config.batch, config.window, 13);
  for (int step = 0; step < 3; ++step) ASSERT_TRUE(Step(*model, batch.view()).ok());
  const int64_t allocations = CudaAllocationCount();
  size_t free_before = 0, free_after = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  for (int step = 0; step < 1000; ++step) ASSERT_TRUE(Step(*model, batch.view()).ok());
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_EQ(CudaAllocationCount(), allocations) << "allocations through the backend's allocator";
  EXPECT_EQ(free_after, free_before) << "device memory taken by anything";
  const TrainingCounters counters = model->training_counters();
  EXPECT_EQ(counters.graph_captures, 1);
  EXPECT_EQ(counters.graph_replays, 1002);
  EXPECT_EQ(counters.timed_steps, 1003);
  std::printf("[graph] small: %.1f us mean device time over 1003 steps\n",
              counters.total_step_seconds / counters.timed_steps * 1e6);
}

// The Backend face: MakeCudaBackend(graphs = false) trains eagerly, set_use_graphs(true) captures on the next step,
// and the counters come through Backend::training_counters; the CPU backend reports zeros.
TEST(CudaGraphTrainStep, TheBackendSwitchAndCounters) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  CudaModelOptions options;
  options.graphs = false;
  auto backend = MakeCudaBackend(config, OptimizerConfig{}, InitialParams(config, 14), options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const auto batch = MakeRandomBatch(config, config.batch, config.window, 15);
  for (int step = 0; step < 3; ++step) ASSERT_TRUE((*backend)->TrainStep(batch.view()).ok());
  TrainingCounters c = (*backend)->training_counters();
  EXPECT_EQ(c.eager_steps, 3);
  EXPECT_EQ(c.graph_captures, 0);
  (*backend)->set_use_graphs(true);
  for (int step = 0; step < 2; ++step) ASSERT_TRUE((*backend)->TrainStep(batch.view()).ok());
  c = (*backend)->training_counters();
  EXPECT_EQ(c.eager_steps, 3);
  EXPECT_EQ(c.graph_captures, 1);
  EXPECT_EQ(c.graph_replays, 2);
  EXPECT_EQ(c.timed_steps, 5);

  auto cpu = MakeCpuBackend(config, OptimizerConfig{}, InitialParams(config, 14), 1);
  ASSERT_TRUE(cpu->TrainStep(batch.view()).ok());
  cpu->set_use_graphs(false);
  EXPECT_EQ(cpu->training_counters().eager_steps, 0);
  EXPECT_EQ(cpu->training_counters().timed_steps, 0);
}

}  // namespace
}  // namespace perception
