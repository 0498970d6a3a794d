// Data-parallel training over NCCL (engine/nccl_communicator.h): world size 1 through the NCCL path ≡ the plain path
// bit for bit (graphs on, so the collectives are captured); a rank whose peer never joins fails within the timeout;
// the CPU backend refuses a communicator; and, on a host with two GPUs, two ranks on halves of a global batch ≡ one
// rank on the whole within MODEL.md §8, with the ranks' parameters bit-identical after 100 steps.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "absl/time/clock.h"
#include "engine/backend.h"
#include "engine/cuda_backend.h"
#include "engine/cuda_model.h"
#include "engine/nccl_communicator.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using testing::Contains;
using testing::BitIdentical;
using testing::ExpectSameState;
using testing::InitialParams;
using testing::Step;
using testing::WarmupCosine;
using testing::kGradientTolerance;
using testing::kLogitsTolerance;
using testing::kParamsTolerance;
using testing::MakeRandomBatch;

// Windows [first, first + count) of a batch.
BatchView<float> Windows(const BatchView<float>& batch, const ModelConfig& c, int first, int count) {
  const size_t events = static_cast<size_t>(batch.window) * count, begin = static_cast<size_t>(batch.window) * first;
  return {count,
          batch.window,
          batch.x.subspan(begin * c.n_features, events * c.n_features),
          batch.dt.subspan(begin, events),
          batch.labels.subspan(begin * c.n_horizons, events * c.n_horizons),
          batch.mask.subspan(begin * c.n_horizons, events * c.n_horizons)};
}

absl::StatusOr<std::shared_ptr<NcclCommunicator>> SoloCommunicator(int64_t check_every) {
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  if (!id.ok()) return id.status();
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> communicator =
      NcclCommunicator::Create(*id, {.rank = 0, .world_size = 1, .check_every = check_every});
  if (!communicator.ok()) return communicator.status();
  return std::shared_ptr<NcclCommunicator>(*std::move(communicator));
}

TEST(DataParallel, CreateRefusesABadRankOrId) {
  const std::string id(kNcclUniqueIdBytes, '\0');
  const auto bad_rank = NcclCommunicator::Create(id, {.rank = 2, .world_size = 2});
  EXPECT_EQ(bad_rank.status().code(), absl::StatusCode::kInvalidArgument) << bad_rank.status();
  const auto bad_id = NcclCommunicator::Create("short", {.rank = 0, .world_size = 1});
  EXPECT_EQ(bad_id.status().code(), absl::StatusCode::kInvalidArgument) << bad_id.status();
  EXPECT_TRUE(Contains(bad_id.status(), "128 bytes")) << bad_id.status();
}

TEST(DataParallel, ParamChecksumSeesEveryBit) {
  std::vector<float> params = InitialParams(*NamedConfig("tiny"), 3);
  const uint64_t before = ParamChecksum(params);
  EXPECT_EQ(ParamChecksum(params), before);
  uint32_t bits;
  std::memcpy(&bits, &params[params.size() / 2], sizeof(bits));
  bits ^= 1u;  // one ulp somewhere in the middle
  std::memcpy(&params[params.size() / 2], &bits, sizeof(bits));
  EXPECT_NE(ParamChecksum(params), before);
}

// The bit-for-bit test one GPU allows: 20 steps (1 eager, 1 capture, 18 replays) of a warmup + cosine schedule with
// and without a world-size-1 communicator. The loss partials and the gradients go through ncclAllReduce inside the
// captured graph; a sum over one rank is the identity, so nothing may differ by a bit.
TEST(DataParallel, WorldSizeOneThroughNcclIsBitIdenticalToThePlainPath) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  const OptimizerConfig optimizer = WarmupCosine(20);
  auto communicator = SoloCommunicator(/*check_every=*/5);
  ASSERT_TRUE(communicator.ok()) << communicator.status();
  auto plain = CudaModel::Create(config, optimizer, InitialParams(config, 11));
  auto nccl = CudaModel::Create(config, optimizer, InitialParams(config, 11), {.communicator = *communicator});
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  for (int step = 1; step <= 20; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const auto batch = MakeRandomBatch(config, config.batch, config.window, 500 + step);
    const auto a = Step(**plain, batch.view()), b = Step(**nccl, batch.view());
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(std::memcmp(&a->loss, &b->loss, sizeof(double)), 0) << a->loss << " vs " << b->loss;
    EXPECT_EQ(std::memcmp(&a->grad_norm, &b->grad_norm, sizeof(double)), 0) << a->grad_norm << " vs " << b->grad_norm;
    EXPECT_EQ(a->mask_count, b->mask_count);
  }
  ExpectSameState(**plain, **nccl);
  EXPECT_TRUE(BitIdentical(*(*plain)->DownloadGrads(), *(*nccl)->DownloadGrads())) << "gradients";
  const TrainingCounters counters = (*nccl)->training_counters();
  EXPECT_EQ(counters.graph_captures, 1);
  EXPECT_EQ(counters.graph_replays, 19);
  std::printf("[data parallel] small, replayed step: %.1f us plain, %.1f us through NCCL at world size 1\n",
              (*plain)->training_counters().last_step_seconds * 1e6, counters.last_step_seconds * 1e6);
}

// The same through the Backend interface, which also compares the parameter checksum every 5 steps.
TEST(DataParallel, BackendChecksReplicasEveryNSteps) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  auto communicator = SoloCommunicator(/*check_every=*/5);
  ASSERT_TRUE(communicator.ok()) << communicator.status();
  auto backend = MakeBackend("cuda", config, OptimizerConfig{}, InitialParams(config, 12), *communicator);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const auto batch = MakeRandomBatch(config, config.batch, config.window, 13);
  for (int step = 1; step <= 12; ++step) ASSERT_TRUE((*backend)->TrainStep(batch.view()).ok());
  EXPECT_EQ((*backend)->training_counters().replica_checks, 2);

  const auto cpu = MakeBackend("cpu", config, OptimizerConfig{}, InitialParams(config, 12), *communicator);
  EXPECT_EQ(cpu.status().code(), absl::StatusCode::kFailedPrecondition) << cpu.status();
  EXPECT_TRUE(Contains(cpu.status(), "NCCL")) << cpu.status();
}

// Rank 0 of a world of two whose peer never joins: joining is aborted at the timeout with a clear error, no hang.
TEST(DataParallel, RankZeroFailsWithinTheTimeoutWhenItsPeerNeverJoins) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const auto id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  const absl::Time start = absl::Now();
  const auto communicator = NcclCommunicator::Create(*id, {.rank = 0, .world_size = 2, .timeout = absl::Seconds(3)});
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(communicator.status().code(), absl::StatusCode::kDeadlineExceeded) << communicator.status();
  EXPECT_TRUE(Contains(communicator.status(), "did not complete within 3s")) << communicator.status();
  EXPECT_GE(took, absl::Seconds(3));
  EXPECT_LT(took, absl::Seconds(10)) << "the abort itself must not hang";
  std::printf("[data parallel] lone rank 0 of 2 gave up after %.2f s: %s\n", absl::ToDoubleSeconds(took),
              std::string(communicator.status().message()).c_str());
}

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

// Needs two GPUs (two ranks on one GPU are refused by NCCL): rank r on device r trains on windows [rB, (r+1)B) of
// every global batch of 2B windows; a plain model on device 0 trains on the whole. Loss and gradients of the first
// step within §8, parameters after 10 steps within §8, the two ranks' parameters bit-identical after 100 steps, and a
// stalled rank 1 failing rank 0's next step within the timeout.
TEST(DataParallel, TwoRanksOnHalvesMatchOneRankOnTheWholeBatch) {
  SKIP_WITHOUT_CUDA_DEVICE();
  if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices (NCCL refuses two ranks on one GPU); found " << DeviceCount();
  ModelConfig whole_config = *NamedConfig("small");
  ModelConfig half_config = whole_config;
  half_config.batch = whole_config.batch / 2;
  whole_config.batch = 2 * half_config.batch;
  const OptimizerConfig optimizer = WarmupCosine(100);
  const auto id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();

  std::vector<std::unique_ptr<CudaModel>> ranks(2);
  std::vector<absl::Status> created(2);
  {
    std::vector<std::thread> threads;  // joining blocks until both ranks are in
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        if (cudaSetDevice(r) != cudaSuccess) {
          created[r] = absl::InternalError("cudaSetDevice");
          return;
        }
        auto communicator = NcclCommunicator::Create(
            *id, {.rank = r, .world_size = 2, .timeout = absl::Seconds(10), .check_every = 10});
        if (!communicator.ok()) {
          created[r] = communicator.status();
          return;
        }
        auto model = CudaModel::Create(half_config, optimizer, InitialParams(half_config, 21),
                                       {.communicator = std::shared_ptr<NcclCommunicator>(*std::move(communicator))});
        if (model.ok()) ranks[r] = *std::move(model);
        created[r] = model.status();
      });
    }
    for (std::thread& t : threads) t.join();
  }
  ASSERT_TRUE(created[0].ok() && created[1].ok()) << created[0] << " / " << created[1];
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto whole = CudaModel::Create(whole_config, optimizer, InitialParams(whole_config, 21));
  ASSERT_TRUE(whole.ok()) << whole.status();

  // Every rank enqueues its step (the collectives wait for each other on the devices), then waits.
  auto step_ranks = [&](const BatchView<float>& global, bool gradients_only) {
    std::vector<absl::StatusOr<kernels::StepReport>> reports(2, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        cudaSetDevice(r);
        CudaModel& model = *ranks[r];
        absl::Status status = model.StageBatch(Windows(global, half_config, r * half_config.batch, half_config.batch));
        if (status.ok()) status = gradients_only ? model.EnqueueGradients() : model.EnqueueTrainStep();
        reports[r] = status.ok() ? model.Wait() : absl::StatusOr<kernels::StepReport>(status);
      });
    }
    for (std::thread& t : threads) t.join();
    return reports;
  };

  const auto first = MakeRandomBatch(whole_config, whole_config.batch, whole_config.window, 700);
  const auto halves = step_ranks(first.view(), /*gradients_only=*/true);
  ASSERT_TRUE((*whole)->StageBatch(first.view()).ok());
  ASSERT_TRUE((*whole)->EnqueueGradients().ok());
  const auto expected = (*whole)->Wait();
  ASSERT_TRUE(halves[0].ok() && halves[1].ok() && expected.ok()) << halves[0].status() << halves[1].status();
  EXPECT_LE(std::abs(halves[0]->loss - expected->loss) / std::abs(expected->loss), kLogitsTolerance);
  EXPECT_EQ(halves[0]->mask_count, expected->mask_count) << "each rank sees the global mask count";
  EXPECT_EQ(std::memcmp(&halves[0]->loss, &halves[1]->loss, sizeof(double)), 0);
  EXPECT_LE(testing::RelativeError(*ranks[0]->DownloadGrads(), *(*whole)->DownloadGrads()), kGradientTolerance);
  EXPECT_TRUE(BitIdentical(*ranks[0]->DownloadGrads(), *ranks[1]->DownloadGrads()));

  for (int step = 1; step <= 100; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const auto global = MakeRandomBatch(whole_config, whole_config.batch, whole_config.window, 800 + step);
    const auto reports = step_ranks(global.view(), /*gradients_only=*/false);
    ASSERT_TRUE(reports[0].ok() && reports[1].ok()) << reports[0].status() << " / " << reports[1].status();
    if (step <= 10) {
      const auto reference = Step(**whole, global.view());
      ASSERT_TRUE(reference.ok()) << reference.status();
      EXPECT_LE(std::abs(reports[0]->loss - reference->loss) / std::abs(reference->loss), kLogitsTolerance);
    }
    if (step == 10) {
      EXPECT_LE(testing::RelativeError(*ranks[0]->DownloadParams(), *(*whole)->DownloadParams()), kParamsTolerance);
    }
  }
  EXPECT_TRUE(BitIdentical(*ranks[0]->DownloadParams(), *ranks[1]->DownloadParams())) << "after 100 steps";

  // Rank 1 stalls (never enqueues its step): rank 0's step fails within the timeout instead of hanging, and its
  // communicator stays aborted.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const auto last = MakeRandomBatch(whole_config, whole_config.batch, whole_config.window, 999);
  const absl::Time start = absl::Now();
  const auto stalled = Step(*ranks[0], Windows(last.view(), half_config, 0, half_config.batch));
  EXPECT_EQ(stalled.status().code(), absl::StatusCode::kDeadlineExceeded) << stalled.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  const auto after = Step(*ranks[0], Windows(last.view(), half_config, 0, half_config.batch));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition) << after.status();
}

}  // namespace
}  // namespace perception
