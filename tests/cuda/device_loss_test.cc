// A failed CUDA call leaves nothing behind for the next one; a sticky error loses the device, once, for the process.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/cuda_check.h"
#include "engine/device_loss.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/cuda/device_fault.h"

namespace perception::testing {
namespace {

// Death tests run in a fresh process (the threadsafe style re-executes the binary), so that a device lost there is
// not lost for the tests after them. Their checks report on stderr and in the exit code.
class DeviceLossDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

int Fail(const std::string& why) {
  std::fprintf(stderr, "check failed: %s\n", why.c_str());
  return 1;
}

absl::Status FailedCall(cudaError_t error) {
  CUDA_RETURN_IF_ERROR(error);
  return absl::OkStatus();
}

// 0 when the checks of a sticky error's status, and of the one handler run, all pass.
int ChecksOfAStickyError() {
  int handled = 0;
  OnDeviceLost([&] { ++handled; });
  const absl::Status allocation = FailedCall(cudaErrorMemoryAllocation);
  if (allocation.code() != absl::StatusCode::kResourceExhausted) return Fail(allocation.ToString());
  if (!DeviceLostStatus().ok() || handled != 0) return Fail("an allocation failure lost the device");
  const absl::Status sticky = FailedCall(cudaErrorIllegalAddress);
  if (sticky.code() != absl::StatusCode::kUnavailable || !Contains(sticky, "cudaErrorIllegalAddress") ||
      !Contains(sticky, "restart perceptiond")) {
    return Fail(sticky.ToString());
  }
  (void)FailedCall(cudaErrorLaunchFailure);
  const absl::Status lost = DeviceLostStatus();
  if (lost.code() != absl::StatusCode::kUnavailable || !Contains(lost, "cudaErrorIllegalAddress")) {
    return Fail(absl::StrCat("the loss must name its first failure: ", lost.ToString()));
  }
  if (handled != 1) return Fail(absl::StrCat("the handler ran ", handled, " times"));
  return 0;
}

TEST_F(DeviceLossDeathTest, AStickyErrorLosesTheDeviceOnceAndNamesItsFirstFailure) {
  EXPECT_EXIT(std::exit(ChecksOfAStickyError()), ::testing::ExitedWithCode(0), "");
}

// 0 when a real illegal address is reported as a lost device, and a backend refuses its next call.
int ChecksOfAnIllegalAddress() {
  const ModelConfig config = *NamedConfig("tiny");
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      MakeCudaBackend(config, OptimizerConfig{}, InitialParams(config, 2));
  if (!backend.ok()) return Fail(backend.status().ToString());
  if (LaunchIllegalAddressWrite(cudaStreamLegacy) != cudaSuccess) return Fail("the faulting kernel did not launch");
  const absl::Status synchronized = FailedCall(cudaStreamSynchronize(cudaStreamLegacy));
  if (synchronized.code() != absl::StatusCode::kUnavailable) return Fail(synchronized.ToString());
  if (DeviceLostStatus().ok()) return Fail("the illegal address did not lose the device");
  const RandomBatch batch = MakeRandomBatch(config, config.batch, config.window, 3);
  if ((*backend)->TrainStep(batch.view()).ok()) return Fail("a training step succeeded on a lost device");
  return 0;
}

TEST_F(DeviceLossDeathTest, AnIllegalAddressLosesTheDevice) {
  SKIP_WITHOUT_CUDA_DEVICE();
  EXPECT_EXIT(std::exit(ChecksOfAnIllegalAddress()), ::testing::ExitedWithCode(0), "");
}

// 0 when the daemon's test hook (--inject_device_loss_at_tick) loses the device for real after a lone event, by a
// trap inside the running resident step (reported by the wait's stream query) or in a kernel of its own after a
// launched tick: the trap's sticky error, the handler run, the next tick refused rather than hung, and a training
// step refused.
int ChecksOfAnInjectedLoss(bool resident) {
  int handled = 0;
  OnDeviceLost([&] { ++handled; });
  const ModelConfig config = *NamedConfig("small");
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      MakeCudaBackend(config, OptimizerConfig{}, InitialParams(config, 6));
  if (!backend.ok()) return Fail(backend.status().ToString());
  (*backend)->set_stream_resident(resident);
  if (const absl::Status configured = (*backend)->ConfigureStreaming(1, 16); !configured.ok()) {
    return Fail(configured.ToString());
  }
  const RandomBatch events = MakeRandomBatch(config, 1, 1, 7);
  const std::vector<int32_t> slots = {0};
  const std::vector<int64_t> log_indices = {0};
  const StreamTick tick{events.x, events.dt, slots, log_indices};
  if (const absl::Status stepped = (*backend)->ForwardStepInto(tick); !stepped.ok()) return Fail(stepped.ToString());
  const absl::Status lost = (*backend)->InjectDeviceLoss();
  if (lost.code() != absl::StatusCode::kUnavailable || !Contains(lost, "cudaErrorLaunchFailure") ||
      !Contains(lost, "restart perceptiond") ||
      !Contains(lost, resident ? "cudaStreamQuery" : "cudaStreamSynchronize")) {
    return Fail(lost.ToString());
  }
  if (handled != 1) return Fail(absl::StrCat("the handler ran ", handled, " times"));
  if ((*backend)->ForwardStepInto(tick).ok()) return Fail("a tick succeeded on a lost device");
  const RandomBatch batch = MakeRandomBatch(config, 2, config.window, 8);
  if ((*backend)->TrainStep(batch.view()).ok()) return Fail("a training step succeeded on a lost device");
  return 0;
}

TEST_F(DeviceLossDeathTest, TheInjectedLossTrapsUnderTheResidentStep) {
  SKIP_WITHOUT_CUDA_DEVICE();
  EXPECT_EXIT(std::exit(ChecksOfAnInjectedLoss(/*resident=*/true)), ::testing::ExitedWithCode(0), "");
}

TEST_F(DeviceLossDeathTest, TheInjectedLossTrapsAfterALaunchedTick) {
  SKIP_WITHOUT_CUDA_DEVICE();
  EXPECT_EXIT(std::exit(ChecksOfAnInjectedLoss(/*resident=*/false)), ::testing::ExitedWithCode(0), "");
}

// The runtime keeps a failed call's error for the next kernel launcher to read back; the checks clear it.
TEST(CudaFailure, AFailedAllocationDoesNotFailTheNextCall) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      MakeCudaBackend(config, OptimizerConfig{}, InitialParams(config, 4));
  ASSERT_TRUE(backend.ok()) << backend.status();
  const absl::StatusOr<CudaAllocation> huge = AllocateCuda(MemoryKind::kDevice, size_t{1} << 52);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  const RandomBatch batch = MakeRandomBatch(config, config.batch, config.window, 5);
  std::vector<float> logits(batch.labels.size());
  const absl::StatusOr<double> loss = (*backend)->Evaluate(batch.view(), logits);
  EXPECT_TRUE(loss.ok()) << loss.status();
  EXPECT_TRUE((*backend)->TrainStep(batch.view()).ok());
  EXPECT_TRUE(DeviceLostStatus().ok());
}

}  // namespace
}  // namespace perception::testing
