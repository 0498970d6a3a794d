// The next batch staged ahead of a training step (CudaModel::StageBatch's two input slots): a step that finds it copies
// it to the device beside its compute. The same batches give the same bits with and without that, graphed or eager,
// through the model and through the Backend; a staged batch is trained once and in order, also with steps in flight;
// a replay over a moved slot is refused.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/cuda_memory.h"
#include "engine/cuda_model.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using testing::BitIdentical;
using testing::Contains;
using testing::ExpectSameState;
using testing::InitialParams;
using testing::MakeModel;
using testing::MakeRandomBatch;
using testing::RandomBatch;
using testing::Step;
using testing::WarmupCosine;

constexpr uint64_t kSeed = 21;  // every model here starts from the same parameters

std::vector<RandomBatch> Batches(const ModelConfig& config, int count) {
  std::vector<RandomBatch> batches;
  for (int i = 0; i < count; ++i) batches.push_back(MakeRandomBatch(config, config.batch, config.window, 500 + i));
  return batches;
}

bool SameReport(const kernels::StepReport& a, const kernels::StepReport& b) {
  return std::memcmp(&a.loss, &b.loss, sizeof(a.loss)) == 0 &&
         std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(a.grad_norm)) == 0 && a.step == b.step;
}

// Each batch trained by today's Stage → Enqueue → Wait (graphed; every step copies its own batch in) against the
// loader's steady state (batch n + 1 staged before step n is enqueued, so every step after the first finds its batch
// on the device and copies the next one in beside its compute), under a learning rate that moves every step.
void ExpectPrefetchBitIdentical(const char* config_name, Precision precision, bool graphs) {
  const ModelConfig config = *NamedConfig(config_name);
  constexpr int kSteps = 10;
  const OptimizerConfig optimizer = WarmupCosine(kSteps);
  auto plain = MakeModel(config, optimizer, /*graphs=*/true, kSeed, precision);
  auto prefetching = MakeModel(config, optimizer, graphs, kSeed, precision);
  ASSERT_TRUE(plain && prefetching);
  const std::vector<RandomBatch> batches = Batches(config, kSteps);
  ASSERT_TRUE(prefetching->StageBatch(batches[0].view()).ok());
  for (int i = 0; i < kSteps; ++i) {
    SCOPED_TRACE(::testing::Message() << "step " << i + 1);
    const auto expected = Step(*plain, batches[i].view());
    ASSERT_TRUE(expected.ok()) << expected.status();
    if (i + 1 < kSteps) {
      ASSERT_TRUE(prefetching->StageBatch(batches[i + 1].view()).ok());
    }
    ASSERT_TRUE(prefetching->EnqueueTrainStep().ok());
    const auto got = prefetching->Wait();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameReport(*expected, *got)) << expected->loss << " vs " << got->loss;
  }
  ExpectSameState(*plain, *prefetching);
  const TrainingCounters c = prefetching->training_counters();
  if (graphs) {
    // The first step eager (its own copy and the next's); then one graph per slot training on a prefetched batch and
    // prefetching the next, and one for the last step, which has no next.
    EXPECT_EQ(c.eager_steps, 1);
    EXPECT_EQ(c.graph_captures, 3);
    EXPECT_EQ(c.graph_replays, kSteps - 1);
  } else {
    EXPECT_EQ(c.eager_steps, kSteps);
    EXPECT_EQ(c.graph_captures, 0);
  }
  EXPECT_EQ(c.timed_steps, kSteps);
}

TEST(CudaPrefetch, TinyCheckpointIsBitIdenticalWithAndWithoutPrefetch) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectPrefetchBitIdentical("tiny", Precision::kFloat32, /*graphs=*/true);
}

TEST(CudaPrefetch, TinyCheckpointIsBitIdenticalWithPrefetchEager) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectPrefetchBitIdentical("tiny", Precision::kFloat32, /*graphs=*/false);
}

TEST(CudaPrefetch, SmallCheckpointIsBitIdenticalWithAndWithoutPrefetchIn3xTf32) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectPrefetchBitIdentical("small", Precision::kFloat32Tf32x3, /*graphs=*/true);
}

// Two batches staged, a third refused; each step takes the oldest, a step with none staged since trains the last one
// again (as with one slot); then steps left in flight while the next batches are staged, which must wait for a step
// still copying from the slot they overwrite and only for that. The reference trains the same sequence one staged
// batch at a time.
TEST(CudaPrefetch, TinyStagedBatchesAreTrainedOnceAndInOrder) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  const OptimizerConfig optimizer = WarmupCosine(8);
  auto reference = MakeModel(config, optimizer, /*graphs=*/true, kSeed);
  auto model = MakeModel(config, optimizer, /*graphs=*/true, kSeed);
  ASSERT_TRUE(reference && model);
  const std::vector<RandomBatch> b = Batches(config, 6);
  std::vector<kernels::StepReport> expected;
  for (const int i : {0, 1, 1, 2, 3, 4, 5}) {
    const auto report = Step(*reference, b[i].view());
    ASSERT_TRUE(report.ok()) << report.status();
    expected.push_back(*report);
  }

  ASSERT_TRUE(model->StageBatch(b[0].view()).ok());
  ASSERT_TRUE(model->StageBatch(b[1].view()).ok());
  const absl::Status third = model->StageBatch(b[2].view());
  EXPECT_EQ(third.code(), absl::StatusCode::kFailedPrecondition) << third;
  for (int i = 0; i < 3; ++i) {  // b0, then b1 (copied in beside b0's step), then b1 again
    SCOPED_TRACE(::testing::Message() << "step " << i + 1);
    ASSERT_TRUE(model->EnqueueTrainStep().ok());
    const auto report = model->Wait();
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(SameReport(expected[i], *report)) << expected[i].loss << " vs " << report->loss;
  }
  // b2 and b3 staged; b2's step (copying b2 and b3 in) left in flight while b4 is staged over b2's slot, b3's step
  // (copying b4 in) in flight while b5 is staged over b3's slot, which nothing in flight copies from any more.
  ASSERT_TRUE(model->StageBatch(b[2].view()).ok());
  ASSERT_TRUE(model->StageBatch(b[3].view()).ok());
  ASSERT_TRUE(model->EnqueueTrainStep().ok());
  ASSERT_TRUE(model->StageBatch(b[4].view()).ok());
  ASSERT_TRUE(model->EnqueueTrainStep().ok());
  ASSERT_TRUE(model->StageBatch(b[5].view()).ok());
  ASSERT_TRUE(model->EnqueueTrainStep().ok());
  const auto b4_step = model->Wait();  // the last enqueued step's report
  ASSERT_TRUE(b4_step.ok()) << b4_step.status();
  EXPECT_TRUE(SameReport(expected[5], *b4_step)) << expected[5].loss << " vs " << b4_step->loss;
  ASSERT_TRUE(model->EnqueueTrainStep().ok());
  const auto last = model->Wait();
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(SameReport(expected[6], *last)) << expected[6].loss << " vs " << last->loss;
  ExpectSameState(*reference, *model);
}

// The prefetching graphs replay only over the slots they were captured with: with the next batch's staging moved, the
// step is refused before anything runs; it took its batch, so the next step trains the one staged behind it.
TEST(CudaPrefetch, TinyReplayOverAMovedNextSlotIsRefused) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("tiny");
  auto model = MakeModel(config, OptimizerConfig{}, /*graphs=*/true, kSeed);
  ASSERT_TRUE(model);
  const std::vector<RandomBatch> b = Batches(config, 4);
  ASSERT_TRUE(model->StageBatch(b[0].view()).ok());
  for (int i = 1; i <= 3; ++i) {  // eager, then the two slots' prefetching graphs captured
    ASSERT_TRUE(model->StageBatch(b[i].view()).ok());
    ASSERT_TRUE(model->EnqueueTrainStep().ok());
    ASSERT_TRUE(model->Wait().ok());
  }
  ASSERT_EQ(model->training_counters().graph_captures, 2);
  // b3 is on the device in slot 1; staging another batch now puts it in slot 0, which b3's step would copy in.
  const RandomBatch next = MakeRandomBatch(config, config.batch, config.window, 600);
  ASSERT_TRUE(model->StageBatch(next.view()).ok());
  auto elsewhere = AllocateCuda(MemoryKind::kPinnedHost, next.x.size() * sizeof(float));
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  float* const captured = CudaModelTestPeer::x_staging(*model, 0);
  CudaModelTestPeer::x_staging(*model, 0) = static_cast<float*>(elsewhere->get());
  const absl::Status refused = model->EnqueueTrainStep();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInternal) << refused;
  EXPECT_TRUE(Contains(refused, "captured over other buffers")) << refused;
  EXPECT_EQ(*model->DownloadStep(), 3) << "nothing ran";

  CudaModelTestPeer::x_staging(*model, 0) = captured;
  ASSERT_TRUE(model->EnqueueTrainStep().ok());
  const auto report = model->Wait();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->step, 4);
}

// Two CUDA backends of `tiny` from the same initial parameters (`seed`) under a schedule of kSteps steps: one trained
// by TrainStep alone, one with a next batch staged; where either cannot be made, the failure is recorded.
struct PlainAndAhead {
  static constexpr int kSteps = 8;
  explicit PlainAndAhead(uint64_t seed)
      : plain(MakeCudaBackend(config, WarmupCosine(kSteps), InitialParams(config, seed))),
        ahead(MakeCudaBackend(config, WarmupCosine(kSteps), InitialParams(config, seed))) {
    EXPECT_TRUE(plain.ok()) << plain.status();
    EXPECT_TRUE(ahead.ok()) << ahead.status();
  }
  bool ok() const { return plain.ok() && ahead.ok(); }

  const ModelConfig config = *NamedConfig("tiny");
  absl::StatusOr<std::unique_ptr<Backend>> plain, ahead;
};

// The Backend face (Backend::TrainStepWithNext, as perception train calls it, and TrainStepStagingNext, as the
// daemon's Train stream does): the same results and checkpoint as TrainStep alone, also where an Evaluate comes
// between two steps or the next call's batch is a copy at another address (both drop the head start, not the batch).
void ExpectTrainingWithNextMatchesTrainStep(bool staging_during_step) {
  constexpr int kSteps = PlainAndAhead::kSteps;
  PlainAndAhead backends(22);
  ASSERT_TRUE(backends.ok());
  auto& [config, plain, ahead] = backends;
  const std::vector<RandomBatch> batches = Batches(config, kSteps);
  const RandomBatch moved = batches[6];  // step 7's batch at another address
  for (int i = 0; i < kSteps; ++i) {
    SCOPED_TRACE(::testing::Message() << "step " << i + 1);
    const auto expected = (*plain)->TrainStep(batches[i].view());
    ASSERT_TRUE(expected.ok()) << expected.status();
    const BatchView<float> batch = i == 6 ? moved.view() : batches[i].view();
    const auto got = i + 1 == kSteps    ? (*ahead)->TrainStep(batch)
                     : staging_during_step ? (*ahead)->TrainStepStagingNext(batch, batches[i + 1].view())
                                         : (*ahead)->TrainStepWithNext(batch, batches[i + 1].view());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(std::memcmp(&expected->loss, &got->loss, sizeof(double)), 0) << expected->loss << " vs " << got->loss;
    EXPECT_EQ(std::memcmp(&expected->grad_norm, &got->grad_norm, sizeof(double)), 0);
    EXPECT_EQ(expected->step, got->step);
    if (i == 3) {  // between steps 4 and 5: the model's slots hold step 5's batch, which evaluating must not take
      const auto a = (*plain)->Evaluate(batches[0].view(), {}), b = (*ahead)->Evaluate(batches[0].view(), {});
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(std::memcmp(&*a, &*b, sizeof(double)), 0) << *a << " vs " << *b;
    }
  }
  const auto a = (*plain)->ExportState(), b = (*ahead)->ExportState();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(BitIdentical(a->params, b->params)) << "parameters";
  EXPECT_TRUE(BitIdentical(a->exp_avg, b->exp_avg)) << "first moments";
  EXPECT_TRUE(BitIdentical(a->exp_avg_sq, b->exp_avg_sq)) << "second moments";
  EXPECT_EQ(a->step, b->step);
}

TEST(CudaPrefetch, TinyBackendTrainStepWithNextMatchesTrainStep) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectTrainingWithNextMatchesTrainStep(/*staging_during_step=*/false);
}

TEST(CudaPrefetch, TinyBackendTrainStepStagingNextMatchesTrainStep) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectTrainingWithNextMatchesTrainStep(/*staging_during_step=*/true);
}

// A batch staged for a step that then fails before training on it is forgotten at the backend's next call: a later
// batch at the same address (as a freed request's memory may come back) is trained on as it is then, not as staged.
TEST(CudaPrefetch, TinyBatchStagedForAFailedStepIsNotTakenForALaterOneAtItsAddress) {
  SKIP_WITHOUT_CUDA_DEVICE();
  PlainAndAhead backends(23);
  ASSERT_TRUE(backends.ok());
  auto& [config, plain, ahead] = backends;
  const std::vector<RandomBatch> batches = Batches(config, 3);
  RandomBatch reused = batches[1];  // staged as the next step's batch, then rewritten in place with another batch
  ASSERT_TRUE((*plain)->TrainStep(batches[0].view()).ok());
  ASSERT_TRUE((*ahead)->TrainStepStagingNext(batches[0].view(), reused.view()).ok());
  // The step meant for `reused` fails before it trains (a wrong window), then `reused` holds batch 3.
  BatchView<float> wrong = reused.view();
  wrong.window -= 1;
  EXPECT_FALSE((*ahead)->TrainStep(wrong).ok());
  const float* const address = reused.x.data();
  reused = batches[2];
  ASSERT_EQ(reused.x.data(), address);
  const auto expected = (*plain)->TrainStep(batches[2].view());
  const auto got = (*ahead)->TrainStep(reused.view());
  ASSERT_TRUE(expected.ok() && got.ok());
  EXPECT_EQ(std::memcmp(&expected->loss, &got->loss, sizeof(double)), 0) << expected->loss << " vs " << got->loss;
}

// A next batch whose arrays do not match its (batch, window) was refused after the step was enqueued, before it was
// waited for: the step ran and was applied while step() stayed behind, so the daemon took it for not applied. Now the
// refusal comes after the wait, with step() advanced; the step equals TrainStep's.
TEST(CudaPrefetch, TinyNextBatchRefusedDuringTheStepLeavesTheStepCounted) {
  SKIP_WITHOUT_CUDA_DEVICE();
  PlainAndAhead backends(24);
  ASSERT_TRUE(backends.ok());
  auto& [config, plain, ahead] = backends;
  const std::vector<RandomBatch> batches = Batches(config, 2);
  BatchView<float> short_next = batches[1].view();
  short_next.mask = short_next.mask.first(short_next.mask.size() - 1);
  const auto refused = (*ahead)->TrainStepStagingNext(batches[0].view(), short_next);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_EQ((*ahead)->step(), 1);
  ASSERT_TRUE((*plain)->TrainStep(batches[0].view()).ok());
  const auto a = (*plain)->ExportState(), b = (*ahead)->ExportState();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(BitIdentical(a->params, b->params)) << "the step was applied as TrainStep applies it";
  EXPECT_EQ(a->step, b->step);
  // The refused batch is not staged: the next call trains on what it is given.
  const auto expected = (*plain)->TrainStep(batches[1].view());
  const auto got = (*ahead)->TrainStep(batches[1].view());
  ASSERT_TRUE(expected.ok() && got.ok());
  EXPECT_EQ(std::memcmp(&expected->loss, &got->loss, sizeof(double)), 0) << expected->loss << " vs " << got->loss;
}

}  // namespace
}  // namespace perception
