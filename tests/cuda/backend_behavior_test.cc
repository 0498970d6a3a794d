// How the CUDA backend behaves beyond its numbers: a clear error without a device, no allocation per step, bit-identical
// runs, refused shapes, NaNs that surface instead of passing, checkpoints that move between backends, arenas too large
// to allocate and the errors that lose the device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "engine/backend.h"
#include "engine/cuda_backend.h"
#include "engine/cuda_check.h"
#include "engine/cuda_memory.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/step_not_taken.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using testing::MakeRandomBatch;
using testing::RandomParams;
using testing::RelativeError;

using testing::Contains;
using testing::BitIdentical;
using testing::InitialParams;

// Reservations whose bytes overflow size_t wrapped the arena's size to a few bytes, the buffers after them overlapping
// (an absurd --stream_log_entries): refused before any allocation, on any machine.
TEST(CudaArenaTest, ReservationsBeyondAnyAllocationAreRefusedBeforeAllocating) {
  for (const std::vector<size_t>& counts : std::vector<std::vector<size_t>>{
           {1000, size_t{1} << 62, 1000},          // count × 4 bytes overflows
           {SIZE_MAX / sizeof(float)},             // the bytes fit, rounded up to 256 they do not
           {size_t{1} << 61, size_t{1} << 61}}) {  // each fits, their sum does not
    CudaArena arena(MemoryKind::kDevice);
    std::vector<float*> slots(counts.size(), nullptr);
    for (size_t i = 0; i < counts.size(); ++i) arena.Reserve(&slots[i], counts[i]);
    const int64_t allocations = CudaAllocationCount();
    const absl::Status allocated = arena.Allocate();
    EXPECT_EQ(allocated.code(), absl::StatusCode::kResourceExhausted) << allocated;
    EXPECT_EQ(CudaAllocationCount(), allocations);
  }
}

// Every error that CUDA 13's driver_types.h says needs the process relaunched is a lost device (the daemon drains and
// exits to be restarted); an MPS client the server terminated kept answering INTERNAL to every call.
TEST(CudaCheckTest, TheErrorsThatNeedARelaunchAreSticky) {
  for (const cudaError_t error :
       {cudaErrorContained, cudaErrorIllegalAddress, cudaErrorLaunchTimeout, cudaErrorAssert,
        cudaErrorHardwareStackError, cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
        cudaErrorInvalidAddressSpace, cudaErrorInvalidPc, cudaErrorLaunchFailure, cudaErrorTensorMemoryLeak,
        cudaErrorMpsClientTerminated, cudaErrorExternalDevice, cudaErrorECCUncorrectable,
        cudaErrorNvlinkUncorrectable}) {
    EXPECT_TRUE(cuda_internal::IsStickyCudaError(error)) << cudaGetErrorName(error);
  }
  for (const cudaError_t error : {cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorNotReady}) {
    EXPECT_FALSE(cuda_internal::IsStickyCudaError(error)) << cudaGetErrorName(error);
  }
}

// The one test here that runs on machines without a GPU only.
TEST(CudaBackendWithoutDevice, MakeBackendNamesTheMissingDevice) {
  if (CudaDeviceAvailable().ok()) GTEST_SKIP() << "a CUDA device is present; this checks machines without one";
  const ModelConfig config = *NamedConfig("tiny");
  const auto cuda = MakeBackend("cuda", config, OptimizerConfig{}, InitialParams(config, 1));
  ASSERT_FALSE(cuda.ok());
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(cuda.status(), "no CUDA device: cudaGetDeviceCount returned")) << cuda.status();
  const auto fallback = MakeBackend("auto", config, OptimizerConfig{}, InitialParams(config, 1), nullptr, std::nullopt);
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_EQ((*fallback)->device_name(), "cpu");
  EXPECT_EQ((*fallback)->precision(), Precision::kFloat32);  // auto's precision follows the device it resolved to
}

// The programs' --precision=auto: float32 accuracy at the device's best speed, 3xtf32 on CUDA; a precision named
// is kept.
TEST(CudaBackend, AutoPrecisionIsThreeTf32OnTheDevice) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  for (const std::string device : {"cuda", "auto"}) {
    const auto automatic =
        MakeBackend(device, config, OptimizerConfig{}, InitialParams(config, 1), nullptr, std::nullopt);
    ASSERT_TRUE(automatic.ok()) << automatic.status();
    EXPECT_EQ((*automatic)->precision(), Precision::kFloat32Tf32x3) << device;
  }
  for (const Precision p : {Precision::kFloat32, Precision::kFloat32Tf32x3, Precision::kTf32}) {
    const auto named = MakeBackend("cuda", config, OptimizerConfig{}, InitialParams(config, 1), nullptr, p);
    ASSERT_TRUE(named.ok()) << named.status();
    EXPECT_EQ((*named)->precision(), p);
  }
}

// The first step runs eagerly and the second captures the training graph (instantiating it may take device memory
// once); from then on nothing is allocated.
TEST(CudaBackend, AllocatesNothingAcrossAHundredStepsAfterTheCapture) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  auto backend = MakeCudaBackend(config, OptimizerConfig{}, InitialParams(config, 2));
  ASSERT_TRUE(backend.ok()) << backend.status();
  const auto batch = MakeRandomBatch(config, config.batch, config.window, 3);
  for (int step = 0; step < 2; ++step) ASSERT_TRUE((*backend)->TrainStep(batch.view()).ok());
  const int64_t allocations = CudaAllocationCount();
  size_t free_before = 0, free_after = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  for (int step = 0; step < 100; ++step) ASSERT_TRUE((*backend)->TrainStep(batch.view()).ok());
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_EQ(CudaAllocationCount(), allocations) << "allocations through the backend's allocator";
  EXPECT_EQ(free_after, free_before) << "device memory taken by anything, cuBLAS included";
}

TEST(CudaBackend, TwoRunsFromOneSeedAreBitIdenticalAfterTwentySteps) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  std::vector<Checkpoint> finals;
  for (int run = 0; run < 2; ++run) {
    auto backend = MakeCudaBackend(config, OptimizerConfig{}, InitialParams(config, 4));
    ASSERT_TRUE(backend.ok()) << backend.status();
    for (int step = 0; step < 20; ++step) {
      const auto batch = MakeRandomBatch(config, config.batch, config.window, 50 + step);
      ASSERT_TRUE((*backend)->TrainStep(batch.view()).ok());
    }
    auto state = (*backend)->ExportState();
    ASSERT_TRUE(state.ok()) << state.status();
    finals.push_back(*std::move(state));
  }
  const size_t bytes = finals[0].params.size() * sizeof(float);
  EXPECT_EQ(std::memcmp(finals[0].params.data(), finals[1].params.data(), bytes), 0) << "parameters";
  EXPECT_EQ(std::memcmp(finals[0].exp_avg.data(), finals[1].exp_avg.data(), bytes), 0) << "first moments";
  EXPECT_EQ(std::memcmp(finals[0].exp_avg_sq.data(), finals[1].exp_avg_sq.data(), bytes), 0) << "second moments";
}

TEST(CudaBackend, RefusesShapesItWasNotBuiltFor) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  auto backend = MakeCudaBackend(config, OptimizerConfig{}, InitialParams(config, 5));
  ASSERT_TRUE(backend.ok()) << backend.status();
  const auto smaller = MakeRandomBatch(config, config.batch - 1, config.window, 6);
  const auto step = (*backend)->TrainStep(smaller.view());
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(step.status(), "(1, 9)") && Contains(step.status(), "(2, 9)"))
      << step.status();
  const auto other = MakeCudaBackend(config, OptimizerConfig{}, std::vector<float>(3));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
}

// A kernel that swallowed a NaN (fmax, a clamp, a masked sum) would let a broken model pass the parity tests.
TEST(CudaBackend, ANanParameterSurfacesInLogitsAndLoss) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  const ParamLayout layout(config);
  std::vector<float> params = RandomParams(layout, 6);
  const std::vector<float> clean = params;
  params[layout.tensor(layout.layers[0].d).offset] = NAN;
  auto backend = MakeCudaBackend(config, OptimizerConfig{}, params);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const auto batch = MakeRandomBatch(config, config.batch, config.window, 7);
  std::vector<float> logits(batch.labels.size());
  const auto loss = (*backend)->Evaluate(batch.view(), logits);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_TRUE(std::isnan(*loss));
  std::vector<double> expected(logits.size());
  CpuReference<double>(layout).Forward(testing::ToDouble(clean), batch.As<double>().view(config.batch, config.window),
                                       expected);
  EXPECT_EQ(RelativeError(logits, expected), INFINITY);
  // Its gradient norm is NaN too, so the step is refused (and not taken: the parameters keep their NaN).
  const auto step = (*backend)->TrainStep(batch.view());
  EXPECT_EQ(step.status().code(), absl::StatusCode::kFailedPrecondition) << step.status();
  EXPECT_TRUE(Contains(step.status(), "gradient norm is nan (loss nan)")) << step.status();
}

TEST(CudaBackend, AStepWithANonFiniteGradientIsRefusedAndChangesNothing) {
  SKIP_WITHOUT_CUDA_DEVICE();
  testing::ExpectAStepWithANonFiniteGradientChangesNothing("cuda");
}

TEST(CudaBackend, AStepWhoseGradientSquaresOverflowIsRefusedAndChangesNothing) {
  SKIP_WITHOUT_CUDA_DEVICE();
  testing::ExpectAStepWhoseGradientSquaresOverflowChangesNothing("cuda");
}

TEST(CudaBackend, CheckpointsMoveBetweenBackends) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  auto trained = MakeCudaBackend(config, OptimizerConfig{}, InitialParams(config, 8));
  ASSERT_TRUE(trained.ok()) << trained.status();
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE((*trained)->TrainStep(MakeRandomBatch(config, config.batch, config.window, 60 + step).view()).ok());
  }
  const auto state = (*trained)->ExportState();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->step, 3);

  auto resumed = MakeCudaBackend(config, OptimizerConfig{}, InitialParams(config, 9));
  auto cpu = MakeCpuBackend(config, OptimizerConfig{}, InitialParams(config, 9));
  ASSERT_TRUE(resumed.ok());
  ASSERT_TRUE((*resumed)->ImportState(*state).ok());
  ASSERT_TRUE(cpu->ImportState(*state).ok());
  const auto batch = MakeRandomBatch(config, config.batch, config.window, 70);
  std::vector<float> a(batch.labels.size()), b(a.size()), c(a.size());
  ASSERT_TRUE((*trained)->Evaluate(batch.view(), a).ok());
  ASSERT_TRUE((*resumed)->Evaluate(batch.view(), b).ok());
  ASSERT_TRUE(cpu->Evaluate(batch.view(), c).ok());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_LE(RelativeError(a, c), 1e-5);
  const auto next_a = (*trained)->TrainStep(batch.view()), next_b = (*resumed)->TrainStep(batch.view());
  ASSERT_TRUE(next_a.ok() && next_b.ok());
  EXPECT_EQ(next_a->step, 4);
  EXPECT_EQ(next_b->step, 4);
  EXPECT_EQ(next_a->loss, next_b->loss);
  // The loss comes before the update: the update (moments and step included) shows in the state after it.
  const auto after_a = (*trained)->ExportState(), after_b = (*resumed)->ExportState();
  ASSERT_TRUE(after_a.ok() && after_b.ok());
  EXPECT_TRUE(BitIdentical(after_a->params, after_b->params)) << "parameters";
  EXPECT_TRUE(BitIdentical(after_a->exp_avg, after_b->exp_avg)) << "first moments";
  EXPECT_TRUE(BitIdentical(after_a->exp_avg_sq, after_b->exp_avg_sq)) << "second moments";
  EXPECT_EQ(after_b->step, 4);
}

}  // namespace
}  // namespace perception
