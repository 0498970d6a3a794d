// Data-parallel flags and the client's --targets against the real programs on this machine's CPU: the daemon
// refuses a world size it cannot join (CPU device, bad rank, missing peers) and gives up cleanly when rank 0 never
// hands out the NCCL id or is not rank 0 of a job; perceptionctl --targets checks that its targets are one job's
// ranks in order, and saves checkpoints on rank 0 only; a rank that dies stops the client's other streams at once.
// Training across ranks needs GPUs (tests/cuda).
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/data_parallel.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "engine/param_layout.h"
#include "engine/status_macros.h"
#include "tests/e2e/e2e_util.h"
#include "tests/lobster_samples.h"

namespace perception::e2e {
namespace {

using ::testing::HasSubstr;

const std::string kOrderbook = testing::ShippedLobsterPath("AAPL", "orderbook", 10);
const std::string kMessages = testing::ShippedLobsterPath("AAPL", "message", 10);

// perceptiond creates its checkpoint folder before it checks the rest of its flags: a temporary one, so that no
// checkpoints/ appears in ctest's working directory.
CommandResult RunDaemon(const std::string& flags) {
  const ScopedTempDir checkpoints("dp-flags");
  return RunCommand(absl::StrCat(PERCEPTIOND_PATH, " --listen=127.0.0.1:0 --metrics_listen= --checkpoint_dir=",
                                 checkpoints.path().string(), " ", flags));
}

TEST(DataParallelTest, TheDaemonRefusesWorldSizesItCannotJoin) {
  const CommandResult cpu = RunDaemon("--device=cpu --world_size=2 --rank=0 --peers=127.0.0.1:1,127.0.0.1:2");
  EXPECT_EQ(cpu.exit_code, 1);
  EXPECT_THAT(cpu.output, HasSubstr("INVALID_ARGUMENT: --world_size needs the CUDA backend"));
  const CommandResult rank = RunDaemon("--device=cuda --world_size=2 --rank=2 --peers=127.0.0.1:1,127.0.0.1:2");
  EXPECT_EQ(rank.exit_code, 1);
  EXPECT_THAT(rank.output, HasSubstr("--rank 2 must be in [0, --world_size)"));
  const CommandResult peers = RunDaemon("--device=cuda --world_size=2 --rank=1 --peers=127.0.0.1:1");
  EXPECT_EQ(peers.exit_code, 1);
  EXPECT_THAT(peers.output, HasSubstr("--peers must list the 2 ranks' gRPC addresses in rank order; it lists 1"));
  // A step may wait on a peer for --collective_timeout: longer than the stall watch allows, a healthy rank would turn
  // NOT_SERVING and be restarted by a liveness probe, ending the job.
  const CommandResult outlasts = RunDaemon(
      "--device=cuda --world_size=2 --rank=1 --peers=127.0.0.1:1,127.0.0.1:2 --collective_timeout=120s");
  EXPECT_EQ(outlasts.exit_code, 1);
  EXPECT_THAT(outlasts.output, HasSubstr("--collective_timeout (2m) must not exceed --device_stall_timeout (1m)"));
  // Each refusal names its flag and value (one message covered both), and without a job both were ignored.
  const CommandResult checks = RunDaemon(
      "--device=cuda --world_size=2 --rank=1 --peers=127.0.0.1:1,127.0.0.1:2 --replica_check_every=-1");
  EXPECT_EQ(checks.exit_code, 1);
  EXPECT_THAT(checks.output, HasSubstr("--replica_check_every must be >= 0 (0: none), got -1"));
  const CommandResult zero = RunDaemon(
      "--device=cuda --world_size=2 --rank=1 --peers=127.0.0.1:1,127.0.0.1:2 --collective_timeout=0s");
  EXPECT_EQ(zero.exit_code, 1);
  EXPECT_THAT(zero.output, HasSubstr("--collective_timeout must be positive, got 0"));
  for (const std::string flag : {"--replica_check_every=5", "--collective_timeout=10s"}) {
    const CommandResult alone = RunDaemon(absl::StrCat("--device=cpu ", flag));
    EXPECT_EQ(alone.exit_code, 1) << flag;
    EXPECT_THAT(alone.output, HasSubstr("--collective_timeout and --replica_check_every apply to --world_size; "
                                        "without it they would be ignored"));
  }
  const CommandResult alone = RunDaemon("--rank=1");
  EXPECT_EQ(alone.exit_code, 1);
  EXPECT_THAT(alone.output, HasSubstr("--rank and --peers need --world_size"));
}

// Rank 1 asks rank 0's daemon for the NCCL id over gRPC before it touches a device, so on any machine: a rank 0
// that is not there times out, and a daemon that is not rank 0 of a job refuses at once.
TEST(DataParallelTest, RankOneGivesUpCleanlyWithoutARankZero) {
  const absl::Time start = absl::Now();
  const CommandResult nobody =
      RunDaemon("--device=cuda --world_size=2 --rank=1 --peers=127.0.0.1:1,127.0.0.1:2 --collective_timeout=2s");
  EXPECT_EQ(nobody.exit_code, 1);
  EXPECT_THAT(nobody.output, HasSubstr("DEADLINE_EXCEEDED: rank 1 of 2: rank 0 at 127.0.0.1:1 did not hand out the "
                                       "NCCL unique id within 2s"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));

  const ScopedTempDir temp("dp-plain");
  absl::StatusOr<std::unique_ptr<Daemon>> plain = Daemon::Start(temp.path());
  ASSERT_TRUE(plain.ok()) << plain.status();
  const CommandResult refused = RunDaemon(absl::StrCat("--device=cuda --world_size=2 --rank=1 --peers=",
                                                       (*plain)->target(), ",127.0.0.1:2 --collective_timeout=30s"));
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_THAT(refused.output, HasSubstr("FAILED_PRECONDITION: rank 0 at " + (*plain)->target() +
                                        " refused rank 1: this daemon is not part of a data-parallel job"));
}

// A start-up that fails after the listener opened (rank 1's join, which no rank 0 answers) stops listening: the
// server's own destructor would wait on every client, and a Health/Watch, which a supervisor may hold open from the
// first moment, stays open until its client ends it.
TEST(DataParallelTest, AStartUpThatFailsAfterListeningExitsWithAHealthWatchOpen) {
  const int port = FreeLoopbackPort();
  std::future<CommandResult> daemon = std::async(std::launch::async, [port] {
    return RunDaemon(absl::StrCat("--device=cuda --world_size=2 --rank=1 --peers=127.0.0.1:1,127.0.0.1:2 ",
                                  "--collective_timeout=3s --listen=127.0.0.1:", port));
  });
  const std::unique_ptr<grpc::health::v1::Health::Stub> health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_wait_for_ready(true);  // through the daemon's start
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  const auto watch = health->Watch(&context, grpc::health::v1::HealthCheckRequest());
  grpc::health::v1::HealthCheckResponse seen;
  ASSERT_TRUE(watch->Read(&seen));
  EXPECT_EQ(seen.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING) << "joining";
  const absl::Time watching = absl::Now();
  ASSERT_EQ(daemon.wait_for(std::chrono::seconds(30)), std::future_status::ready) << "the open watch held the exit";
  EXPECT_LT(absl::Now() - watching, absl::Seconds(10));
  const CommandResult failed = daemon.get();
  EXPECT_EQ(failed.exit_code, 1);
  EXPECT_THAT(failed.output, HasSubstr("did not hand out the NCCL unique id within 3s"));
  context.TryCancel();
}

TEST(DataParallelTest, TargetsMustBeOneJobsRanksToTrainOrSave) {
  const ScopedTempDir temp0("dp-a"), temp1("dp-b");
  absl::StatusOr<std::unique_ptr<Daemon>> a = Daemon::Start(temp0.path()), b = Daemon::Start(temp1.path());
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string ctl =
      absl::StrCat(PERCEPTIONCTL_PATH, " --targets=", (*a)->target(), ",", (*b)->target());
  const CommandResult init = RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10 --batch 4 --window 32"));
  ASSERT_EQ(init.exit_code, 0) << init.output;
  EXPECT_EQ((*a)->client().GetStatus()->model().config().batch(), 4);
  EXPECT_EQ((*b)->client().GetStatus()->model().config().batch(), 4) << "init goes to every target";

  const CommandResult train =
      RunCommand(absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --steps 2"));
  EXPECT_EQ(train.exit_code, 1);
  EXPECT_THAT(train.output, HasSubstr(absl::StrCat("FAILED_PRECONDITION: target 0 (", (*a)->target(),
                                                   ") is not part of a data-parallel job; --targets must list the 2 "
                                                   "ranks of one job in rank order")));

  // A job's rank 0 saves for the whole job; daemons of their own are refused, where the first alone saved.
  const CommandResult save = RunCommand(absl::StrCat(ctl, " checkpoint save ck.safetensors"));
  EXPECT_EQ(save.exit_code, 1) << save.output;
  EXPECT_THAT(save.output, HasSubstr(absl::StrCat("FAILED_PRECONDITION: target 0 (", (*a)->target(),
                                                  ") is not part of a data-parallel job; --targets must list the 2 "
                                                  "ranks of one job in rank order (checkpoint save acts for the job "
                                                  "through rank 0; give each daemon of its own a --target)")));
  EXPECT_FALSE(std::filesystem::exists(temp0.path() / "ck.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(temp1.path() / "ck.safetensors"));

  const CommandResult other = RunCommand(absl::StrCat(ctl, " streams"));
  EXPECT_EQ(other.exit_code, 1);
  EXPECT_THAT(other.output, HasSubstr("--targets applies to status, init, train and checkpoint save|load"));
}

// Random global batches of `ranks` times the model's batch, for ShardedBatches to cut.
absl::AnyInvocable<void(Batch&)> RandomGlobalBatches(const v1::ModelConfig& config, int ranks, Rng& rng) {
  return [&rng, n = ranks * config.batch(), T = config.window(), F = config.n_features(),
          H = config.horizons_size()](Batch& global) {
    global = Batch{n, T, F, H, {}, {}, {}, {}};
    for (int i = 0; i < n * T * F; ++i) global.x.push_back(static_cast<float>(rng.Uniform(-1, 1)));
    for (int i = 0; i < n * T; ++i) global.dt.push_back(static_cast<float>(rng.Uniform(0, 1)));
    for (int i = 0; i < n * T * H; ++i) {
      global.labels.push_back(rng.Uniform() < 0.5 ? 1.f : 0.f);
      global.mask.push_back(1.f);
    }
  };
}

// Two plain daemons, each with the same tiny model (batch 2, window 8), for the client's TrainRanks to drive as two
// ranks: on the CPU there is no NCCL job, so each trains on its own slices alone, which is all the client's side needs.
struct PlainRanks {
  std::unique_ptr<Daemon> rank0, rank1;
  v1::ModelConfig config;
  std::vector<client::PerceptionClient*> clients() const { return {&rank0->client(), &rank1->client()}; }
};

absl::StatusOr<PlainRanks> StartTwoPlainRanks(const ScopedTempDir& dir0, const ScopedTempDir& dir1) {
  ASSIGN_OR_RETURN(std::unique_ptr<Daemon> rank0, Daemon::Start(dir0.path()));
  ASSIGN_OR_RETURN(std::unique_ptr<Daemon> rank1, Daemon::Start(dir1.path()));
  const CommandResult init = RunCommand(absl::StrCat(PERCEPTIONCTL_PATH, " --targets=", rank0->target(), ",",
                                                     rank1->target(), " init --config tiny --batch 2 --window 8"));
  if (init.exit_code != 0) return absl::InternalError(absl::StrCat("init failed: ", init.output));
  ASSIGN_OR_RETURN(const v1::GetStatusResponse status, rank0->client().GetStatus());
  return PlainRanks{std::move(rank0), std::move(rank1), status.model().config()};
}

// Two plain daemons driven as two ranks by the client's TrainRanks: killing rank 1 mid-run ends the run within seconds
// with rank 1's error and rank 0's stream cancelled, instead of rank 0 training on until its million steps are done
// (or, in a real job, waiting on its dead peer).
TEST(DataParallelTest, ARankThatDiesStopsTheOtherRanksStreams) {
  const ScopedTempDir temp0("dp-kill-a"), temp1("dp-kill-b");
  const absl::StatusOr<PlainRanks> job = StartTwoPlainRanks(temp0, temp1);
  ASSERT_TRUE(job.ok()) << job.status();
  Daemon &a = *job->rank0, &b = *job->rank1;
  Rng rng(7);
  client::ShardedBatches batches(RandomGlobalBatches(job->config, 2, rng), 2, job->config.batch());

  const std::vector<client::PerceptionClient*> ranks = job->clients();
  absl::Mutex mu;
  int answered = 0;  // guarded by mu
  absl::Status result;
  absl::Time ended;
  std::thread trainer([&] {
    result = client::TrainRanks(ranks, 1000000, batches, [&](const v1::TrainStepResponse&) {
      absl::MutexLock lock(&mu);
      ++answered;
    });
    ended = absl::Now();
  });
  bool warmed_up = false;
  {
    absl::MutexLock lock(&mu);
    const auto trained = [&] { return answered >= 20; };
    warmed_up = mu.AwaitWithTimeout(absl::Condition(&trained), absl::Seconds(60));
  }
  // The trainer is joined before any assertion can return: a joinable std::thread's destructor terminates the test
  // binary, orphaning both daemons. Without a warm-up rank 0 may be stuck too, so it is killed as well.
  b.Signal(SIGKILL);
  if (!warmed_up) a.Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  trainer.join();
  ASSERT_TRUE(warmed_up) << "rank 0 never trained";
  EXPECT_LT(ended - killed, absl::Seconds(10));
  EXPECT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.message()), HasSubstr(absl::StrCat("rank 1 (", b.target(), "): ")));
  EXPECT_THAT(std::string(result.message()), HasSubstr("the other ranks' streams were stopped"));
  EXPECT_TRUE(a.client().GetStatus().ok()) << "rank 0's daemon keeps serving after its stream was cancelled";
}

// perceptionctl train's Ctrl-C stops a run through ShardedBatches' stop: rank 1 (its daemon stopped by SIGSTOP a
// moment after its step was read) is some 50 steps behind rank 0 when the stop comes, and still trains every step
// rank 0 trained, no more: the two models end at one step, where ranks stopped each at its own step would part (in a
// real job, one of them waiting in a collective its peers never join until the job aborts).
TEST(DataParallelTest, AStopTakesEveryRankToTheSameStep) {
  const ScopedTempDir temp0("dp-stop-a"), temp1("dp-stop-b");
  const absl::StatusOr<PlainRanks> job = StartTwoPlainRanks(temp0, temp1);
  ASSERT_TRUE(job.ok()) << job.status();
  Daemon &a = *job->rank0, &b = *job->rank1;
  Rng rng(11);
  std::atomic<bool> stop = false;
  client::ShardedBatches batches(RandomGlobalBatches(job->config, 2, rng), 2, job->config.batch(),
                                 [&] { return stop.load(); });
  const std::vector<client::PerceptionClient*> ranks = job->clients();
  absl::Mutex mu;
  int64_t rank0_step = 0;  // guarded by mu
  absl::Status result;
  std::thread trainer([&] {
    result = client::TrainRanks(ranks, 1000000, batches, [&](const v1::TrainStepResponse& response) {
      absl::MutexLock lock(&mu);
      rank0_step = response.step();
    });
  });
  const auto rank0_at = [&](int64_t step) {
    absl::MutexLock lock(&mu);
    const auto reached = [&] { return rank0_step >= step; };
    return mu.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(60));
  };
  bool behind = rank0_at(20);
  const absl::StatusOr<v1::GetStatusResponse> rank1_before = b.client().GetStatus();
  b.Signal(SIGSTOP);
  // Rank 1 takes at most the Train stream's window of steps more before the stop lands.
  behind = behind && rank1_before.ok() &&
           rank0_at(rank1_before->model().step() + client::PerceptionClient::kTrainAhead + 50);
  stop = true;
  b.Signal(SIGCONT);
  trainer.join();  // before any assertion can return (a joinable thread's destructor ends the test binary)
  ASSERT_TRUE(behind) << "rank 0 never got ahead";
  ASSERT_TRUE(result.ok()) << result;
  const int64_t step0 = a.client().GetStatus()->model().step(), step1 = b.client().GetStatus()->model().step();
  EXPECT_EQ(step0, rank0_step);
  EXPECT_EQ(step1, step0) << "rank 1 was at step " << rank1_before->model().step() << " when its daemon stopped";
}

}  // namespace
}  // namespace perception::e2e
