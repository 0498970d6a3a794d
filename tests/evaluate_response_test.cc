// Evaluate's per-horizon results through the service (proto HorizonAccuracy, EvaluateResponse), against the
// counts and the loss worked out here from the logits the CPU backend gave for the batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "engine/config.h"
#include "tests/batch_message.h"
#include "tests/forwarding_backend.h"
#include "tests/in_process_daemon.h"
#include "tests/test_util.h"

namespace perception {
namespace {

struct RecordedLogits {
  absl::Mutex mu;
  std::vector<float> last ABSL_GUARDED_BY(mu);  // the logits of the latest Evaluate, [B, T, H]
  bool nan_logits ABSL_GUARDED_BY(mu) = false;  // Evaluate's logits come out NaN, as an overflowed model's do
};

// Passes every call through; keeps the logits each evaluation produced.
class LogitRecordingBackend final : public testing::ForwardingBackend {
 public:
  LogitRecordingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<RecordedLogits> recorded)
      : ForwardingBackend(std::move(inner)), recorded_(std::move(recorded)) {}
  absl::StatusOr<double> Evaluate(const BatchView<float>& batch, std::span<float> logits) override {
    absl::StatusOr<double> loss = ForwardingBackend::Evaluate(batch, logits);
    absl::MutexLock lock(&recorded_->mu);
    if (recorded_->nan_logits) std::ranges::fill(logits, std::nanf(""));
    recorded_->last.assign(logits.begin(), logits.end());
    return loss;
  }

 private:
  const std::shared_ptr<RecordedLogits> recorded_;
};

// What EvaluateResponse should say, worked out from the batch and its logits by the proto's definitions.
struct Expected {
  std::vector<int64_t> masked, correct;
  int64_t total_masked = 0;
  double loss = 0;
};

Expected Score(const testing::RandomBatch& batch, const std::vector<float>& logits, int H) {
  Expected e{std::vector<int64_t>(H), std::vector<int64_t>(H)};
  double bce_sum = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (batch.mask[i] != 1.f) continue;  // only labels with mask 1 count
    const double l = logits[i], y = batch.labels[i];
    const double p = 1 / (1 + std::exp(-l));
    const int h = static_cast<int>(i % H);
    ++e.masked[h];
    e.correct[h] += (p > 0.5) == (y == 1);  // "up" when p > 0.5
    bce_sum += std::max(l, 0.0) - l * y + std::log1p(std::exp(-std::abs(l)));
  }
  for (int64_t m : e.masked) e.total_masked += m;
  e.loss = bce_sum / std::max<int64_t>(e.total_masked, 1);
  return e;
}

class EvaluateResponseTest : public ::testing::Test {
 protected:
  EvaluateResponseTest()
      : recorded_(std::make_shared<RecordedLogits>()),
        daemon_(
            [recorded = recorded_](std::unique_ptr<Backend> backend) -> std::unique_ptr<Backend> {
              return std::make_unique<LogitRecordingBackend>(std::move(backend), recorded);
            },
            "evaluate_response") {}

  void SetUp() override { ASSERT_TRUE(daemon_.InitTinyModel(11).ok()); }

  // Evaluates `batch`; its logits come back in `logits`.
  v1::EvaluateResponse Evaluate(const testing::RandomBatch& batch, std::vector<float>& logits) {
    v1::EvaluateRequest request;
    *request.mutable_batch() = testing::BatchMessage(batch, config_);
    request.set_return_probabilities(true);
    grpc::ClientContext context;
    v1::EvaluateResponse response;
    const grpc::Status status = daemon_.stub().Evaluate(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    absl::MutexLock lock(&recorded_->mu);
    logits = recorded_->last;
    EXPECT_EQ(logits.size(), batch.labels.size());
    return response;
  }

  // Every field of `response` against `e` (and its probabilities against σ(logits)).
  void ExpectMatches(const v1::EvaluateResponse& response, const Expected& e, const std::vector<float>& logits) {
    const int H = config_.n_horizons;
    ASSERT_EQ(response.horizons_size(), H);
    for (int h = 0; h < H; ++h) {
      SCOPED_TRACE(h);
      const v1::HorizonAccuracy& got = response.horizons(h);
      EXPECT_EQ(got.horizon_events(), config_.horizons[h]);
      EXPECT_EQ(got.masked_labels(), e.masked[h]);
      EXPECT_EQ(got.correct(), e.correct[h]);
      EXPECT_EQ(got.accuracy(), e.masked[h] > 0 ? static_cast<double>(e.correct[h]) / e.masked[h] : 0.0);
    }
    EXPECT_EQ(response.masked_labels(), e.total_masked);
    EXPECT_NEAR(response.loss(), e.loss, 1e-5 * std::max(e.loss, 1e-3));
    ASSERT_EQ(response.probabilities_size(), static_cast<int>(logits.size()));
    for (size_t i = 0; i < logits.size(); ++i) {
      EXPECT_NEAR(response.probabilities(i), 1 / (1 + std::exp(-static_cast<double>(logits[i]))), 1e-6) << i;
      // Far enough from 0 that float32 p and the logit's sign agree on "p > 0.5".
      EXPECT_GT(std::abs(logits[i]), 1e-6f) << i;
    }
  }

  const ModelConfig config_ = *NamedConfig("tiny");
  std::shared_ptr<RecordedLogits> recorded_;
  testing::InProcessDaemon daemon_;
};

// A batch with mask-0 labels on every horizon and none at all on the last one: only mask-1 labels count, the
// horizon without any answers 0 of 0 with accuracy 0, and the totals are the sums.
TEST_F(EvaluateResponseTest, PerHorizonCountsAndAccuracyFollowTheLogits) {
  const int H = config_.n_horizons;
  testing::RandomBatch batch = testing::MakeRandomBatch(config_, 3, config_.window, 41);
  for (size_t i = H - 1; i < batch.mask.size(); i += H) batch.mask[i] = 0.f;  // horizon 50: nothing masked in
  std::vector<float> logits;
  const v1::EvaluateResponse response = Evaluate(batch, logits);
  const Expected e = Score(batch, logits, H);

  // The batch exercises what it should: masked-out labels on the scored horizons, right and wrong calls on each.
  for (int h = 0; h < H - 1; ++h) {
    ASSERT_LT(e.masked[h], batch.batch * batch.window) << h;
    ASSERT_GT(e.correct[h], 0) << h;
    ASSERT_LT(e.correct[h], e.masked[h]) << h;
  }
  ASSERT_EQ(e.masked[H - 1], 0);
  ExpectMatches(response, e, logits);
  EXPECT_EQ(response.horizons(H - 1).correct(), 0);
  EXPECT_EQ(response.horizons(H - 1).accuracy(), 0.0);

  // A mask-0 label does not count whatever it says: flipping every one of them changes nothing.
  testing::RandomBatch flipped = batch;
  for (size_t i = 0; i < flipped.mask.size(); ++i) {
    if (flipped.mask[i] == 0.f) flipped.labels[i] = 1.f - flipped.labels[i];
  }
  std::vector<float> flipped_logits;
  const v1::EvaluateResponse again = Evaluate(flipped, flipped_logits);
  EXPECT_EQ(flipped_logits, logits);
  ExpectMatches(again, e, flipped_logits);
  EXPECT_EQ(again.loss(), response.loss());
}

// masked_labels lets the losses of several batches be combined exactly: the weighted mean of two batches' losses is
// the loss of the two batches as one (and a batch with no mask-1 label adds nothing).
TEST_F(EvaluateResponseTest, LossesCombineThroughMaskedLabels) {
  const int H = config_.n_horizons, T = config_.window;
  testing::RandomBatch first = testing::MakeRandomBatch(config_, 2, T, 51);
  testing::RandomBatch second = testing::MakeRandomBatch(config_, 3, T, 52);
  for (size_t i = 0; i < second.mask.size(); i += H) second.mask[i] = 0.f;  // the batches weigh differently
  testing::RandomBatch unmasked = testing::MakeRandomBatch(config_, 1, T, 53);
  std::fill(unmasked.mask.begin(), unmasked.mask.end(), 0.f);
  testing::RandomBatch both{first.batch + second.batch + unmasked.batch, T, {}, {}, {}, {}};
  for (const testing::RandomBatch* part : {&first, &second, &unmasked}) {
    both.x.insert(both.x.end(), part->x.begin(), part->x.end());
    both.dt.insert(both.dt.end(), part->dt.begin(), part->dt.end());
    both.labels.insert(both.labels.end(), part->labels.begin(), part->labels.end());
    both.mask.insert(both.mask.end(), part->mask.begin(), part->mask.end());
  }

  std::vector<float> first_logits, second_logits, unmasked_logits, both_logits;
  const v1::EvaluateResponse a = Evaluate(first, first_logits);
  const v1::EvaluateResponse b = Evaluate(second, second_logits);
  const v1::EvaluateResponse c = Evaluate(unmasked, unmasked_logits);
  const v1::EvaluateResponse all = Evaluate(both, both_logits);
  ExpectMatches(a, Score(first, first_logits, H), first_logits);
  ExpectMatches(b, Score(second, second_logits, H), second_logits);
  ExpectMatches(c, Score(unmasked, unmasked_logits, H), unmasked_logits);
  ExpectMatches(all, Score(both, both_logits, H), both_logits);

  // No mask-1 label: loss 0, nothing counted, every accuracy 0.
  EXPECT_EQ(c.loss(), 0.0);
  EXPECT_EQ(c.masked_labels(), 0);
  for (const v1::HorizonAccuracy& h : c.horizons()) EXPECT_EQ(h.accuracy(), 0.0);

  ASSERT_NE(a.masked_labels(), b.masked_labels());
  EXPECT_EQ(all.masked_labels(), a.masked_labels() + b.masked_labels() + c.masked_labels());
  const double combined = (a.loss() * a.masked_labels() + b.loss() * b.masked_labels() + c.loss() * c.masked_labels()) /
                          (a.masked_labels() + b.masked_labels() + c.masked_labels());
  EXPECT_NEAR(combined, all.loss(), 1e-6 * all.loss());
  // The unweighted mean is not it (the test would not tell them apart otherwise).
  EXPECT_GT(std::abs((a.loss() + b.loss()) / 2 - all.loss()), 1e-4 * all.loss());
  for (int h = 0; h < H; ++h) {
    EXPECT_EQ(all.horizons(h).masked_labels(),
              a.horizons(h).masked_labels() + b.horizons(h).masked_labels() + c.horizons(h).masked_labels());
    EXPECT_EQ(all.horizons(h).correct(), a.horizons(h).correct() + b.horizons(h).correct() + c.horizons(h).correct());
  }
}

// A logit that is not a number predicts neither up nor down: before, NaN > 0 being false, it counted as a correct
// "down" on every label 0, so a model whose outputs overflowed scored the share of down labels.
TEST_F(EvaluateResponseTest, ANotANumberPredictionIsNeverCorrect) {
  {
    absl::MutexLock lock(&recorded_->mu);
    recorded_->nan_logits = true;
  }
  const testing::RandomBatch batch = testing::MakeRandomBatch(config_, 2, config_.window, 61);
  std::vector<float> logits;
  const v1::EvaluateResponse response = Evaluate(batch, logits);
  ASSERT_TRUE(std::isnan(logits[0]));
  ASSERT_NE(std::count(batch.labels.begin(), batch.labels.end(), 0.f), 0) << "labels the old count took as right";
  for (const v1::HorizonAccuracy& horizon : response.horizons()) {
    SCOPED_TRACE(horizon.horizon_events());
    EXPECT_GT(horizon.masked_labels(), 0);
    EXPECT_EQ(horizon.correct(), 0);
    EXPECT_EQ(horizon.accuracy(), 0.0);
  }
}

}  // namespace
}  // namespace perception
