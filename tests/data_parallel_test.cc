// Data-parallel training's CPU-side pieces: the NCCL unique id handed from rank 0 to the other ranks over the
// Rendezvous gRPC service (loopback, an opaque 128-byte id), and perceptionctl's rank checks and per-rank slices of
// each global batch.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "client/data_parallel.h"
#include "grpcpp/grpcpp.h"
#include "server/rendezvous.h"

namespace perception {
namespace {

using client::CheckRanks;
using client::CheckTargets;
using client::ShardedBatches;
using server::FetchUniqueId;
using server::RendezvousService;

// A Rendezvous service alone on a free loopback port.
class RendezvousServer {
 public:
  RendezvousServer(int rank, int world_size) : service_(rank, world_size) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~RendezvousServer() { server_->Shutdown(); }
  RendezvousService& service() { return service_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  RendezvousService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

std::string OpaqueId() {
  std::string id(128, '\0');
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>(i * 37 + 5);  // zero bytes included
  return id;
}

TEST(Rendezvous, RankOneGetsRankZerosIdOnceItIsPublished) {
  RendezvousServer rank0(0, 3);
  ASSERT_NE(rank0.target(), "127.0.0.1:0");
  // The id appears after the ranks started asking: they retry through UNAVAILABLE.
  std::thread publisher([&] {
    absl::SleepFor(absl::Milliseconds(500));
    rank0.service().Publish(OpaqueId());
  });
  std::vector<absl::StatusOr<std::string>> got(2, absl::UnknownError("not run"));
  std::vector<std::thread> ranks;
  for (int r = 1; r <= 2; ++r) {
    ranks.emplace_back([&, r] { got[r - 1] = FetchUniqueId(rank0.target(), r, 3, absl::Seconds(10)); });
  }
  publisher.join();
  for (std::thread& t : ranks) t.join();
  for (const auto& id : got) {
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(*id, OpaqueId());
  }
}

TEST(Rendezvous, AStrangerIsRefusedAtOnce) {
  RendezvousServer rank0(0, 2);
  rank0.service().Publish(OpaqueId());
  const absl::Time start = absl::Now();
  const auto wrong_world = FetchUniqueId(rank0.target(), 1, 3, absl::Seconds(10));
  EXPECT_EQ(wrong_world.status().code(), absl::StatusCode::kFailedPrecondition) << wrong_world.status();
  const auto wrong_rank = FetchUniqueId(rank0.target(), 0, 2, absl::Seconds(10));
  EXPECT_EQ(wrong_rank.status().code(), absl::StatusCode::kFailedPrecondition) << wrong_rank.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "a refusal is not retried";

  RendezvousServer not_rank0(1, 2), not_parallel(0, 0);
  const auto asked_rank1 = FetchUniqueId(not_rank0.target(), 1, 2, absl::Seconds(10));
  EXPECT_EQ(asked_rank1.status().code(), absl::StatusCode::kFailedPrecondition) << asked_rank1.status();
  const auto asked_plain = FetchUniqueId(not_parallel.target(), 1, 2, absl::Seconds(10));
  EXPECT_EQ(asked_plain.status().code(), absl::StatusCode::kFailedPrecondition) << asked_plain.status();
  EXPECT_NE(std::string(asked_plain.status().message()).find("not part of a data-parallel job"), std::string::npos);
}

// A rank that restarted got the formed job's id again, then waited out its join timeout blaming a peer (rank 0's
// bootstrap had closed). Each rank is handed the id by one process; another is refused at once, saying what to do.
TEST(Rendezvous, EachRankIsHandedTheIdOnce) {
  RendezvousServer rank0(0, 3);
  rank0.service().Publish(OpaqueId());
  ASSERT_TRUE(FetchUniqueId(rank0.target(), 1, 3, absl::Seconds(10)).ok());
  const absl::Time start = absl::Now();
  const auto again = FetchUniqueId(rank0.target(), 1, 3, absl::Seconds(10));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_NE(std::string(again.status().message())
                .find("rank 1 was handed this job's NCCL unique id already, by another process: a rank that "
                      "restarted cannot rejoin the job it formed; restart every rank"),
            std::string::npos)
      << again.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "a refusal is not retried";
  // The same process asking again, as a retry whose answer was lost does, gets it again.
  const std::unique_ptr<v1::Rendezvous::Stub> stub =
      v1::Rendezvous::NewStub(grpc::CreateChannel(rank0.target(), grpc::InsecureChannelCredentials()));
  v1::GetUniqueIdRequest request;
  request.set_rank(2);
  request.set_world_size(3);
  request.set_asker(0x5eed);
  for (int ask = 0; ask < 2; ++ask) {
    grpc::ClientContext context;
    v1::GetUniqueIdResponse response;
    const grpc::Status status = stub->GetUniqueId(&context, request, &response);
    ASSERT_TRUE(status.ok()) << "ask " << ask << ": " << status.error_message();
    EXPECT_EQ(response.unique_id(), OpaqueId());
  }
}

TEST(Rendezvous, ARankZeroThatNeverPublishesTimesOut) {
  RendezvousServer rank0(0, 2);
  const absl::Time start = absl::Now();
  const auto id = FetchUniqueId(rank0.target(), 1, 2, absl::Seconds(1));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDeadlineExceeded) << id.status();
  EXPECT_NE(std::string(id.status().message()).find("within 1s"), std::string::npos) << id.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
}

TEST(Rendezvous, NobodyListeningTimesOut) {
  const auto id = FetchUniqueId("127.0.0.1:1", 1, 2, absl::Seconds(1));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDeadlineExceeded) << id.status();
}

// Window w of every global batch carries g·1000 + w in every value, so a slice shows where it came from.
Batch NumberedBatch(int global, int windows) {
  Batch b{windows, 2, 3, 1, {}, {}, {}, {}};
  for (int w = 0; w < windows; ++w) {
    const float v = static_cast<float>(global * 1000 + w);
    b.x.insert(b.x.end(), 2 * 3, v);
    b.dt.insert(b.dt.end(), 2, v);
    b.labels.insert(b.labels.end(), 2, v);
    b.mask.insert(b.mask.end(), 2, v);
  }
  return b;
}

TEST(ShardedBatches, RankRGetsWindowsRBToRPlusOneBOfEveryGlobalBatch) {
  constexpr int kRanks = 3, kPerRank = 4, kSteps = 50;
  int sampled = 0;
  ShardedBatches batches([&](Batch& global) { global = NumberedBatch(sampled++, kRanks * kPerRank); }, kRanks,
                         kPerRank);
  std::vector<std::thread> ranks;
  std::vector<int> wrong(kRanks, 0);
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      v1::Batch shard;
      for (int step = 0; step < kSteps; ++step) {
        batches.Shard(step, r, shard);
        bool ok = shard.batch() == kPerRank && shard.window() == 2 && shard.x_size() == kPerRank * 2 * 3 &&
                  shard.dt_size() == kPerRank * 2 && shard.mask_size() == kPerRank * 2;
        for (int w = 0; ok && w < kPerRank; ++w) {
          const float expected = static_cast<float>(step * 1000 + r * kPerRank + w);
          ok = shard.x(w * 6) == expected && shard.x(w * 6 + 5) == expected && shard.dt(w * 2 + 1) == expected &&
               shard.labels(w * 2) == expected && shard.mask(w * 2 + 1) == expected;
        }
        wrong[r] += !ok;
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(sampled, kSteps) << "each global batch is sampled once, whatever the ranks' interleaving";
  EXPECT_EQ(std::accumulate(wrong.begin(), wrong.end(), 0), 0);
}

TEST(ShardedBatches, OneRankGetsTheWholeBatch) {
  ShardedBatches batches([](Batch& global) { global = NumberedBatch(7, 5); }, 1, 5);
  v1::Batch shard;
  batches.Shard(0, 0, shard);
  EXPECT_EQ(shard.batch(), 5);
  EXPECT_EQ(shard.dt(9), 7004.f);
}

// Once every rank has taken its slice of a global batch, the next one is sampled into its storage: a fresh batch each
// step faulted in megabytes of new pages (AAPL's 10 levels at `small`'s shape: 3.1 MB of features).
TEST(ShardedBatches, AGlobalBatchEveryRankTookIsSampledIntoAgain) {
  std::vector<const float*> storage;
  ShardedBatches batches(
      [&](Batch& global) {
        global.x.resize(1000);
        storage.push_back(global.x.data());
      },
      2, 5);
  v1::Batch shard;
  batches.Shard(0, 0, shard);
  batches.Shard(0, 1, shard);  // global batch 0 taken by both ranks
  batches.Shard(1, 0, shard);
  batches.Shard(2, 0, shard);  // batch 1 still waits for rank 1: a batch of its own
  ASSERT_EQ(storage.size(), 3u);
  EXPECT_EQ(storage[1], storage[0]);
  EXPECT_NE(storage[2], storage[1]);
}

// A stop (perceptionctl train's Ctrl-C) takes every rank to the same step: the ranks ahead get nothing past the
// global batches sampled when it came, the ranks behind still get every one of those. Had each rank stopped where it
// stood, a data-parallel job's ranks would part at different steps, one of them waiting in a collective its peers
// never join until the job aborts.
TEST(ShardedBatches, AStopTakesEveryRankToTheSameStep) {
  int sampled = 0;
  bool stop = false;
  ShardedBatches batches([&](Batch& global) { global = NumberedBatch(sampled++, 2 * 2); }, 2, 2, [&] { return stop; });
  v1::Batch shard;
  for (int step = 0; step < 5; ++step) ASSERT_TRUE(batches.Shard(step, 0, shard));
  for (int step = 0; step < 2; ++step) ASSERT_TRUE(batches.Shard(step, 1, shard));
  stop = true;
  // The rank behind asks first: it is not stopped where it stands.
  for (int step = 2; step < 5; ++step) {
    ASSERT_TRUE(batches.Shard(step, 1, shard)) << step;
    EXPECT_EQ(shard.dt(0), static_cast<float>(step * 1000 + 2)) << "rank 1's windows of global batch " << step;
  }
  EXPECT_FALSE(batches.Shard(5, 1, shard));
  EXPECT_FALSE(batches.Shard(5, 0, shard));
  stop = false;  // a stop holds once decided: the steps already left out stay out
  EXPECT_FALSE(batches.Shard(5, 0, shard));
  EXPECT_EQ(sampled, 5);
}

v1::GetStatusResponse RankStatus(int rank, int world_size, int64_t step) {
  v1::GetStatusResponse status;
  status.mutable_data_parallel()->set_rank(rank);
  status.mutable_data_parallel()->set_world_size(world_size);
  status.mutable_model()->set_step(step);
  status.mutable_model()->mutable_config()->set_batch(8);
  return status;
}

TEST(CheckRanks, TargetsMustBeOneJobsRanksInOrderWithOneModel) {
  const std::vector<std::string> targets = {"a:1", "b:2"};
  EXPECT_TRUE(CheckRanks(std::vector{RankStatus(0, 2, 5), RankStatus(1, 2, 5)}, targets).ok());
  const absl::Status swapped = CheckRanks(std::vector{RankStatus(1, 2, 5), RankStatus(0, 2, 5)}, targets);
  EXPECT_EQ(swapped.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(swapped.message()).find("target 0 (a:1) is rank 1 of 2"), std::string::npos) << swapped;
  EXPECT_FALSE(CheckRanks(std::vector{RankStatus(0, 3, 5), RankStatus(1, 3, 5)}, targets).ok()) << "world size";
  EXPECT_FALSE(CheckRanks(std::vector{RankStatus(0, 2, 5), RankStatus(1, 2, 6)}, targets).ok()) << "step";
  v1::GetStatusResponse plain = RankStatus(0, 2, 5);
  plain.clear_data_parallel();
  const absl::Status not_parallel = CheckRanks(std::vector{plain, RankStatus(1, 2, 5)}, targets);
  EXPECT_NE(std::string(not_parallel.message()).find("not part of a data-parallel job"), std::string::npos);
}

// Ranks with the same model config and step but another normalizer (fitted or not, or its values), optimizer, precision
// or replica-check interval passed: a rank without the normalizer (a run stopped after fitting rank 0's) trained on
// unstandardized inputs, and differing check intervals paired one rank's checksum all-gather with its peers' next sums.
TEST(CheckRanks, RanksMustShareNormalizerOptimizerPrecisionAndReplicaChecks) {
  const std::vector<std::string> targets = {"a:1", "b:2"};
  const auto with = [](const std::function<void(v1::GetStatusResponse&)>& change) {
    v1::GetStatusResponse status = RankStatus(1, 2, 5);
    change(status);
    return status;
  };
  const std::vector<std::pair<v1::GetStatusResponse, std::string>> cases = {
      {with([](auto& s) { s.mutable_model()->set_normalizer_fitted(true); }),
       "target 1 (b:2) differs from rank 0 in its normalizer (fitted vs not fitted)"},
      {with([](auto& s) { s.mutable_model()->mutable_normalizer()->add_inv_std(2.f); }),
       "target 1 (b:2) differs from rank 0 in its normalizer (its values)"},
      {with([](auto& s) { s.mutable_model()->mutable_optimizer()->set_lr(3e-3); }), "in its optimizer settings"},
      {with([](auto& s) { s.mutable_device()->set_precision("tf32"); }), "in its precision (tf32 vs )"},
      {with([](auto& s) { s.mutable_data_parallel()->set_replica_check_every(50); }),
       "in its --replica_check_every (50 vs 0)"},
  };
  for (const auto& [rank1, reason] : cases) {
    const absl::Status refused = CheckRanks(std::vector{RankStatus(0, 2, 5), rank1}, targets);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << reason;
    EXPECT_NE(std::string(refused.message()).find(reason), std::string::npos) << refused;
  }
}

// One --target that reports rank 0 of 2 was trained alone (the rank check ran only for several targets); README:
// target i must report rank i of N.
TEST(CheckTargets, OneTargetMustNotBeOneRankOfSeveral) {
  const std::vector<std::string> one = {"a:1"};
  v1::GetStatusResponse plain = RankStatus(0, 2, 5);
  plain.clear_data_parallel();
  EXPECT_TRUE(CheckTargets(std::vector{plain}, one).ok());
  EXPECT_TRUE(CheckTargets(std::vector{RankStatus(0, 1, 5)}, one).ok()) << "a job of one rank";
  const absl::Status alone = CheckTargets(std::vector{RankStatus(0, 2, 5)}, one);
  EXPECT_EQ(alone.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(alone.message()).find("the daemon at a:1 is rank 0 of 2 of a data-parallel job: give "
                                              "--targets the job's 2 ranks in rank order"),
            std::string::npos)
      << alone;
  const std::vector<std::string> two = {"a:1", "b:2"};
  EXPECT_TRUE(CheckTargets(std::vector{RankStatus(0, 2, 5), RankStatus(1, 2, 5)}, two).ok());
  EXPECT_FALSE(CheckTargets(std::vector{RankStatus(1, 2, 5), RankStatus(0, 2, 5)}, two).ok()) << "order";
  EXPECT_FALSE(CheckTargets(std::vector{plain, plain}, two).ok()) << "two daemons outside any job";
}

}  // namespace
}  // namespace perception
