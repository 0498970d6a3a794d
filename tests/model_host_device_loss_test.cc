// ModelHost once the device is lost: every call that needs the device is refused, naming the failure and the remedy;
// the metrics count those answers as failures, not refusals.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/device_loss.h"
#include "server/metrics.h"
#include "server/model_host.h"
#include "tests/test_util.h"

namespace perception::server {
namespace {

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "%s was not refused as a lost device: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

bool RefusedAsLost(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         std::string(status.message()).find("injected cudaErrorIllegalAddress") != std::string::npos &&
         std::string(status.message()).find("restart perceptiond") != std::string::npos;
}

// 0 when a host with a model refuses training, evaluation, streaming, a save and a new model after the loss.
int ChecksAfterTheLoss() {
  ServerMetrics metrics;
  ModelHost host("cpu", metrics, StreamingConfig{}, /*use_graphs=*/true, Precision::kFloat32);
  const ModelConfig config = *NamedConfig("tiny");
  if (!host.Init(config, OptimizerConfig{}, 3, std::nullopt, /*replace=*/false).ok()) return 2;
  const testing::RandomBatch batch = testing::MakeRandomBatch(config, config.batch, config.window, 4);
  if (!host.TrainStep(batch.view()).ok()) return 3;

  NoteDeviceLost(absl::InternalError("injected cudaErrorIllegalAddress"));
  if (const auto step = host.TrainStep(batch.view()); !RefusedAsLost(step.status())) {
    return Fail("TrainStep", step.status());
  }
  if (const auto evaluation = host.Evaluate(batch.view(), false); !RefusedAsLost(evaluation.status())) {
    return Fail("Evaluate", evaluation.status());
  }
  if (const auto streaming = host.StreamingBackend(); !RefusedAsLost(streaming.status())) {
    return Fail("streaming", streaming.status());
  }
  if (const auto saved = host.Save("/nonexistent/x.safetensors"); !RefusedAsLost(saved.status())) {
    return Fail("Save", saved.status());
  }
  if (const absl::Status init = host.Init(config, OptimizerConfig{}, 5, std::nullopt, /*replace=*/true);
      !RefusedAsLost(init)) {
    return Fail("InitModel", init);
  }
  return 0;
}

// In a fresh process (the threadsafe death-test style re-executes the binary): the loss is for the whole process.
TEST(ModelHostDeviceLossDeathTest, EveryDeviceCallIsRefusedOnceTheDeviceIsLost) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(ChecksAfterTheLoss()), ::testing::ExitedWithCode(0), "");
}

// 0 when UNAVAILABLE is a refusal (draining) before the loss and a failure after it: not in
// perception_requests_rejected_total, whose help promised refusals only and counted every call the loss failed.
int UnavailableIsAFailureOnceTheDeviceIsLost() {
  ServerMetrics metrics;
  if (!IsRefusal(absl::StatusCode::kUnavailable)) return 2;
  metrics.ObserveRpc("TrainStep", ServerMetrics::RpcKind::kUnary, absl::StatusCode::kUnavailable, 0.01);
  NoteDeviceLost(absl::InternalError("injected cudaErrorIllegalAddress"));
  if (IsRefusal(absl::StatusCode::kUnavailable)) return 3;
  metrics.ObserveRpc("Stream", ServerMetrics::RpcKind::kBidirectional, absl::StatusCode::kUnavailable, 0.01);
  metrics.ObserveRpc("Evaluate", ServerMetrics::RpcKind::kUnary, absl::StatusCode::kUnavailable, 0.01);
  const std::string text = metrics.Render();
  if (text.find("perception_requests_rejected_total{reason=\"unavailable\"} 1\n") == std::string::npos) {
    std::fprintf(stderr, "the refusals counted are not the one before the loss:\n%s\n", text.c_str());
    return 4;
  }
  if (text.find("perception_rpc_session_seconds_count{code=\"UNAVAILABLE\",method=\"Stream\"} 1\n") ==
      std::string::npos) {
    std::fprintf(stderr, "the failed Stream call is not in its histogram:\n%s\n", text.c_str());
    return 5;
  }
  return IsRefusal(absl::StatusCode::kInvalidArgument) ? 0 : 6;
}

TEST(ModelHostDeviceLossDeathTest, UnavailableIsAFailureNotARefusalOnceTheDeviceIsLost) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(UnavailableIsAFailureOnceTheDeviceIsLost()), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace perception::server
