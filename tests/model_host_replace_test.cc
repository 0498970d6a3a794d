// ModelHost's log when InitModel (replace set) or a load replaces a model: the step of the model discarded is named,
// so that an operator reading the log after a mistaken `perceptionctl init --replace` sees what was lost.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <optional>
#include <string>

#include "engine/config.h"
#include "server/metrics.h"
#include "server/model_host.h"
#include "server/request_validation.h"
#include "tests/captured_log.h"
#include "tests/test_util.h"

namespace perception::server {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(ModelHostReplaceTest, AnInitOrLoadThatReplacesAModelNamesTheStepItDiscards) {
  const testing::CapturedLog log;
  ServerMetrics metrics;
  ModelHost host("cpu", metrics, StreamingConfig{}, /*use_graphs=*/true, Precision::kFloat32);
  const ModelConfig config = *NamedConfig("tiny");
  ASSERT_TRUE(host.Init(config, OptimizerConfig{}, 3, std::nullopt, /*replace=*/false).ok());
  EXPECT_THAT(log.lines(), Contains(AllOf(HasSubstr("model initialized"), Not(HasSubstr("replaces")))));
  for (uint64_t seed : {21, 22, 23}) {
    ASSERT_TRUE(host.TrainStep(testing::MakeRandomBatch(config, config.batch, config.window, seed).view()).ok());
  }
  const std::filesystem::path saved = std::filesystem::path(::testing::TempDir()) / "replace_test.safetensors";
  const absl::StatusOr<SaveOutcome> save = host.Save(saved.string());
  ASSERT_TRUE(save.ok()) << save.status();

  ASSERT_TRUE(host.Init(config, OptimizerConfig{}, 4, std::nullopt, /*replace=*/true).ok());
  EXPECT_THAT(log.lines(), Contains(AllOf(HasSubstr("model initialized"), HasSubstr("seed 4"),
                                          HasSubstr("the model it replaces, at step 3, is discarded"))));
  const Limits limits{.max_message_bytes = 1 << 20, .max_batch = 64, .max_window = 64};
  const absl::StatusOr<double> load = host.Load(saved.string(), std::nullopt, limits);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_THAT(log.lines(), Contains(AllOf(HasSubstr("loaded checkpoint"), HasSubstr("(step 3)"),
                                          HasSubstr("the model it replaces, at step 0, is discarded"))));
  std::filesystem::remove(saved);
}

}  // namespace
}  // namespace perception::server
