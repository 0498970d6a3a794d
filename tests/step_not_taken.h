// The checks, shared by the CPU and the CUDA backend's tests, that a training step whose gradient norm is not finite,
// or too large for float32 once clipped, is refused and changes nothing.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "tests/test_util.h"

namespace perception::testing {

// A step on a batch holding a NaN (which the daemon's validation refuses before a backend sees it; here it stands for
// any cause: weights that diverged, a learning rate too high) is refused FAILED_PRECONDITION, leaves the parameters,
// moments and step bit for bit, and the next step then follows the trajectory of a run that never saw it (so the
// optimizer's step counter, on the device for CUDA, stayed too). Its first step runs eagerly and the refused one is
// the CUDA backend's captured graph.
inline void ExpectAStepWithANonFiniteGradientChangesNothing(const std::string& device) {
  const ModelConfig config = *NamedConfig("tiny");
  const auto make = [&] {
    absl::StatusOr<std::unique_ptr<Backend>> backend =
        MakeBackend(device, config, OptimizerConfig{}, RandomParams(ParamLayout(config), 11));
    EXPECT_TRUE(backend.ok()) << backend.status();
    return *std::move(backend);
  };
  const RandomBatch first = MakeRandomBatch(config, config.batch, config.window, 12);
  const RandomBatch second = MakeRandomBatch(config, config.batch, config.window, 13);
  RandomBatch poisoned = MakeRandomBatch(config, config.batch, config.window, 14);
  poisoned.x[3] = NAN;

  const std::unique_ptr<Backend> control = make();
  ASSERT_TRUE(control->TrainStep(first.view()).ok());
  ASSERT_TRUE(control->TrainStep(second.view()).ok());
  const absl::StatusOr<Checkpoint> expected = control->ExportState();
  ASSERT_TRUE(expected.ok()) << expected.status();

  const std::unique_ptr<Backend> backend = make();
  ASSERT_TRUE(backend->TrainStep(first.view()).ok());
  const absl::StatusOr<Checkpoint> before = backend->ExportState();
  ASSERT_TRUE(before.ok()) << before.status();
  const absl::StatusOr<TrainStepResult> refused = backend->TrainStep(poisoned.view());
  ASSERT_FALSE(refused.ok()) << "loss " << refused->loss << ", gradient norm " << refused->grad_norm;
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("gradient norm is nan"), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("not applied, and the model stays at step 1"), std::string::npos)
      << refused.status();
  EXPECT_EQ(backend->step(), 1);
  const absl::StatusOr<Checkpoint> after = backend->ExportState();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->step, 1);
  EXPECT_TRUE(BitIdentical(after->params, before->params));
  EXPECT_TRUE(BitIdentical(after->exp_avg, before->exp_avg));
  EXPECT_TRUE(BitIdentical(after->exp_avg_sq, before->exp_avg_sq));

  const absl::StatusOr<TrainStepResult> next = backend->TrainStep(second.view());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->step, 2);
  const absl::StatusOr<Checkpoint> final_state = backend->ExportState();
  ASSERT_TRUE(final_state.ok()) << final_state.status();
  EXPECT_TRUE(BitIdentical(final_state->params, expected->params));
  EXPECT_TRUE(BitIdentical(final_state->exp_avg, expected->exp_avg));
  EXPECT_TRUE(BitIdentical(final_state->exp_avg_sq, expected->exp_avg_sq));
}

// A finite gradient norm too large for float32's second moment once clipped: with clipping off, a head scaled by 1e30
// gives gradients near 1e30 (their norm, summed in double, is finite), whose squares would make every second moment
// infinite. Before, the step answered OK and the model then held a value no checkpoint may (SaveCheckpoint refused
// it). Now it is refused as a non-finite norm is, changing nothing, in the eager first step and the captured one.
inline void ExpectAStepWhoseGradientSquaresOverflowChangesNothing(const std::string& device) {
  const ModelConfig config = *NamedConfig("tiny");
  const ParamLayout layout(config);
  std::vector<float> params = RandomParams(layout, 11);
  for (const int tensor : {layout.head_out.weight, layout.head_out.bias}) {
    const TensorSpec& spec = layout.tensor(tensor);
    for (size_t i = spec.offset; i < spec.offset + spec.size; ++i) params[i] *= 1e30f;
  }
  OptimizerConfig unclipped;
  unclipped.max_grad_norm = 0;
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(device, config, unclipped, params);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const absl::StatusOr<Checkpoint> before = (*backend)->ExportState();
  ASSERT_TRUE(before.ok()) << before.status();
  for (const uint64_t seed : {21, 22, 23}) {
    const absl::StatusOr<TrainStepResult> refused =
        (*backend)->TrainStep(MakeRandomBatch(config, config.batch, config.window, seed).view());
    ASSERT_FALSE(refused.ok()) << "loss " << refused->loss << ", gradient norm " << refused->grad_norm;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_NE(refused.status().message().find("too large once clipped for float32's second moment"),
              std::string::npos) << refused.status();
    EXPECT_NE(refused.status().message().find("the model stays at step 0"), std::string::npos) << refused.status();
  }
  EXPECT_EQ((*backend)->step(), 0);
  const absl::StatusOr<Checkpoint> after = (*backend)->ExportState();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(BitIdentical(after->params, before->params));
  EXPECT_TRUE(BitIdentical(after->exp_avg, before->exp_avg));
  EXPECT_TRUE(BitIdentical(after->exp_avg_sq, before->exp_avg_sq));
  // Clipped, the same model takes its steps: the bound is on the norm applied, not the norm found.
  OptimizerConfig clipped;
  absl::StatusOr<std::unique_ptr<Backend>> clipping = MakeBackend(device, config, clipped, params);
  ASSERT_TRUE(clipping.ok()) << clipping.status();
  const absl::StatusOr<TrainStepResult> taken =
      (*clipping)->TrainStep(MakeRandomBatch(config, config.batch, config.window, 21).view());
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_GT(taken->grad_norm, 1e20);
}

}  // namespace perception::testing
