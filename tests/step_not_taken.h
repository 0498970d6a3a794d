// The check, shared by the CPU and the CUDA backend's tests, that a training step whose gradient norm is not finite is
// refused and changes nothing.
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

}  // namespace perception::testing
