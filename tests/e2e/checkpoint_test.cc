// Checkpoints across daemon restarts: save, restart, load gives identical Evaluate outputs; --load_if_present
// resumes the exit's checkpoint; a SIGKILL in the middle of a save leaves the previous checkpoint loadable.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "engine/backend.h"
#include "engine/checkpoint.h"
#include "tests/e2e/e2e_util.h"

namespace perception::e2e {
namespace {

using ::testing::HasSubstr;

v1::EvaluateResponse Evaluate(client::PerceptionClient& client, const v1::EvaluateRequest& request) {
  absl::StatusOr<v1::EvaluateResponse> response = client.Evaluate(request);
  EXPECT_TRUE(response.ok()) << response.status();
  return response.ok() ? *response : v1::EvaluateResponse();
}

absl::Status Save(client::PerceptionClient& client, const std::string& name) {
  v1::SaveCheckpointRequest request;
  request.set_name(name);
  return client.SaveCheckpoint(request).status();
}

absl::StatusOr<v1::LoadCheckpointResponse> Load(client::PerceptionClient& client, const std::string& name) {
  v1::LoadCheckpointRequest request;
  request.set_name(name);
  return client.LoadCheckpoint(request);
}

TEST(CheckpointTest, SaveRestartLoadGivesIdenticalEvaluateOutputs) {
  const ModelConfig config = TinyConfig();
  const v1::EvaluateRequest probe = EvaluateRequest(testing::MakeRandomBatch(config, 3, 20, 42), config, true);
  const ScopedTempDir temp("restart");
  const std::filesystem::path& dir = temp.path();
  v1::EvaluateResponse before;
  {
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(dir / "checkpoints");
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    client::PerceptionClient& client = (*daemon)->client();
    ASSERT_TRUE(client.InitModel(TinyInitRequest(3)).ok());
    for (int i = 0; i < 5; ++i) {
      ASSERT_TRUE(client.TrainStep(TrainRequest(testing::MakeRandomBatch(config, 2, 9, 7 + i), config)).ok());
    }
    before = Evaluate(client, probe);
    ASSERT_TRUE(Save(client, "runs/five.safetensors").ok());
    (*daemon)->Signal(SIGTERM);
    absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(20));
    ASSERT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(*exit_code, 0);
  }
  ASSERT_EQ(before.step(), 5);
  ASSERT_EQ(before.probabilities_size(), 3 * 20 * config.n_horizons);

  absl::StatusOr<std::unique_ptr<Daemon>> restarted = Daemon::Start(dir / "checkpoints");
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  client::PerceptionClient& client = (*restarted)->client();
  absl::StatusOr<v1::GetStatusResponse> status = client.GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_FALSE(status->has_model()) << "a daemon starts without a model unless told to load one";
  EXPECT_EQ(status->device().precision(), "auto") << "before any model, the daemon's --precision (its default)";
  absl::StatusOr<v1::LoadCheckpointResponse> loaded = Load(client, "runs/five.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->model().step(), 5);
  EXPECT_EQ(client.GetStatus()->device().precision(), DaemonDevice() == "cpu" ? "fp32" : "3xtf32")
      << "auto resolves to fp32 on the CPU and to 3xtf32 on CUDA";
  EXPECT_EQ(EvaluationBits(Evaluate(client, probe)), EvaluationBits(before))
      << "loss, accuracies and probabilities, bit for bit";

  // --load at startup restores the same model, and training continues from its step.
  absl::StatusOr<std::unique_ptr<Daemon>> preloaded =
      Daemon::Start(dir / "checkpoints", {"--load=runs/five.safetensors"});
  ASSERT_TRUE(preloaded.ok()) << preloaded.status();
  EXPECT_EQ(EvaluationBits(Evaluate((*preloaded)->client(), probe)), EvaluationBits(before));
  absl::StatusOr<v1::TrainStepResponse> next =
      (*preloaded)->client().TrainStep(TrainRequest(testing::MakeRandomBatch(config, 2, 9, 12), config));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->step(), 6);
}

// deploy/'s flags: the first start finds no checkpoint and serves --init_config's preset; SIGTERM saves it; the
// restart with the same flags loads it instead of a fresh preset, at the same step with the same outputs.
TEST(CheckpointTest, LoadIfPresentResumesTheExitCheckpointAfterARestart) {
  const ModelConfig config = TinyConfig();
  const v1::EvaluateRequest probe = EvaluateRequest(testing::MakeRandomBatch(config, 3, 20, 42), config, true);
  const ScopedTempDir temp("load_if_present");
  const std::filesystem::path checkpoints = temp.path() / "checkpoints";
  const std::vector<std::string> flags = {"--load_if_present=last.safetensors", "--init_config=tiny",
                                          "--checkpoint_on_exit=last.safetensors"};
  v1::EvaluateResponse before;
  {
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(checkpoints, flags);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    client::PerceptionClient& client = (*daemon)->client();
    const absl::StatusOr<v1::GetStatusResponse> status = client.GetStatus();
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_TRUE(status->has_model()) << "no checkpoint yet: --init_config's preset";
    EXPECT_EQ(status->model().step(), 0);
    EXPECT_EQ(status->model().config().d_model(), config.d_model);
    EXPECT_THAT((*daemon)->Log(),
                HasSubstr("--load_if_present: no checkpoint 'last.safetensors' yet; creating a model from "
                          "--init_config=tiny"));
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(client.TrainStep(TrainRequest(testing::MakeRandomBatch(config, 2, 9, 50 + i), config)).ok());
    }
    before = Evaluate(client, probe);
    (*daemon)->Signal(SIGTERM);
    const absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(20));
    ASSERT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(*exit_code, 0);
  }
  ASSERT_EQ(before.step(), 3);
  ASSERT_TRUE(std::filesystem::is_regular_file(checkpoints / "last.safetensors")) << "the exit's save";

  absl::StatusOr<std::unique_ptr<Daemon>> restarted = Daemon::Start(checkpoints, flags);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  client::PerceptionClient& client = (*restarted)->client();
  const absl::StatusOr<v1::GetStatusResponse> status = client.GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_TRUE(status->has_model());
  EXPECT_EQ(status->model().step(), 3) << "the saved model, not a fresh preset at step 0";
  EXPECT_EQ(EvaluationBits(Evaluate(client, probe)), EvaluationBits(before)) << "bit for bit";
  EXPECT_THAT((*restarted)->Log(), HasSubstr("--load_if_present: loaded checkpoint 'last.safetensors' at step 3"));
  const absl::StatusOr<v1::TrainStepResponse> next =
      client.TrainStep(TrainRequest(testing::MakeRandomBatch(config, 2, 9, 60), config));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->step(), 4) << "training continues from the saved step";
}

// Without --init_config a missing checkpoint leaves the daemon serving with no model, as a plain start does.
TEST(CheckpointTest, LoadIfPresentWithoutAFileOrInitConfigServesWithNoModel) {
  const ScopedTempDir temp("load_if_present_none");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--load_if_present=runs/last.safetensors"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const absl::StatusOr<v1::GetStatusResponse> status = (*daemon)->client().GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_FALSE(status->has_model());
  EXPECT_THAT((*daemon)->Log(),
              HasSubstr("--load_if_present: no checkpoint 'runs/last.safetensors' yet; serving with no model"));
}

// The daemon's next TrainStep on `batch` against the offline engine's from the checkpoint `from` under `optimizer`:
// parameters, moments and step after it, bit for bit. What the daemon reports of its optimizer is a record of its
// own; this is what it trains with.
void ExpectNextStepTrainsWith(client::PerceptionClient& client, const std::filesystem::path& checkpoints,
                              const std::string& from, const OptimizerConfig& optimizer,
                              const testing::RandomBatch& batch) {
  SCOPED_TRACE(from);
  absl::StatusOr<Checkpoint> start = LoadCheckpoint((checkpoints / from).string());
  ASSERT_TRUE(start.ok()) << start.status();
  std::unique_ptr<Backend> offline = MakeCpuBackend(start->config, optimizer, start->params);
  ASSERT_TRUE(offline->ImportState(*start).ok());
  ASSERT_TRUE(offline->TrainStep(batch.view()).ok());
  absl::StatusOr<Checkpoint> expected = offline->ExportState();
  ASSERT_TRUE(expected.ok()) << expected.status();

  const absl::StatusOr<v1::TrainStepResponse> step = client.TrainStep(TrainRequest(batch, start->config));
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_TRUE(Save(client, "next_" + from).ok());
  absl::StatusOr<Checkpoint> trained = LoadCheckpoint((checkpoints / ("next_" + from)).string());
  ASSERT_TRUE(trained.ok()) << trained.status();
  EXPECT_EQ(trained->step, expected->step);
  EXPECT_TRUE(testing::BitIdentical(trained->params, expected->params)) << "parameters";
  EXPECT_TRUE(testing::BitIdentical(trained->exp_avg, expected->exp_avg)) << "first moments";
  EXPECT_TRUE(testing::BitIdentical(trained->exp_avg_sq, expected->exp_avg_sq)) << "second moments";
}

// A checkpoint carries its optimizer settings: a run loaded without naming them continues on the same schedule, and
// one loaded with settings (or given them by SetOptimizer) trains under those.
TEST(CheckpointTest, LoadKeepsTheSavedOptimizerUnlessTheRequestNamesOne) {
  if (DaemonDevice() != "cpu") GTEST_SKIP() << "compares the daemon's step with the offline CPU engine's, bit for bit";
  const ModelConfig config = TinyConfig();
  const ScopedTempDir temp("optimizer");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  v1::InitModelRequest init = TinyInitRequest(3);
  v1::OptimizerSettings& cosine = *init.mutable_optimizer();
  cosine.set_lr(3e-3);
  cosine.set_weight_decay(0.05);
  cosine.set_schedule(v1::LR_SCHEDULE_WARMUP_COSINE);
  cosine.set_warmup_steps(2);
  cosine.set_total_steps(50);
  cosine.set_min_lr(1e-4);
  const absl::StatusOr<v1::InitModelResponse> created = client.InitModel(init);
  ASSERT_TRUE(created.ok()) << created.status();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(client.TrainStep(TrainRequest(testing::MakeRandomBatch(config, 2, 9, 30 + i), config)).ok());
  }
  ASSERT_TRUE(Save(client, "cosine.safetensors").ok());

  v1::LoadCheckpointRequest named;
  named.set_name("cosine.safetensors");
  named.mutable_optimizer()->set_lr(5e-4);
  const absl::StatusOr<v1::LoadCheckpointResponse> renamed = client.LoadCheckpoint(named);
  ASSERT_TRUE(renamed.ok()) << renamed.status();
  EXPECT_EQ(renamed->model().optimizer().lr(), 5e-4);
  EXPECT_EQ(renamed->model().optimizer().schedule(), v1::LR_SCHEDULE_CONSTANT) << "the request's settings, whole";

  const absl::StatusOr<v1::LoadCheckpointResponse> resumed = Load(client, "cosine.safetensors");
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->model().step(), 2);
  EXPECT_EQ(resumed->model().optimizer().SerializeAsString(), created->model().optimizer().SerializeAsString())
      << "loaded: " << resumed->model().optimizer().DebugString()
      << "saved: " << created->model().optimizer().DebugString();

  // What each trains with: the cosine schedule resumed at step 3, the named constant 5e-4, and SetOptimizer's.
  const std::filesystem::path checkpoints = temp.path() / "checkpoints";
  OptimizerConfig saved;
  saved.lr = 3e-3;
  saved.weight_decay = 0.05;
  saved.schedule = LrSchedule::kWarmupCosine;
  saved.warmup_steps = 2;
  saved.total_steps = 50;
  saved.min_lr = 1e-4;
  const testing::RandomBatch batch = testing::MakeRandomBatch(config, 2, 9, 40);
  ExpectNextStepTrainsWith(client, checkpoints, "cosine.safetensors", saved, batch);
  ASSERT_TRUE(client.LoadCheckpoint(named).ok());
  OptimizerConfig constant;
  constant.lr = 5e-4;
  ExpectNextStepTrainsWith(client, checkpoints, "cosine.safetensors", constant, batch);

  v1::SetOptimizerRequest set;
  set.mutable_optimizer()->set_lr(2e-3);
  set.mutable_optimizer()->set_weight_decay(0.3);
  set.mutable_optimizer()->set_max_grad_norm(0.05);
  ASSERT_TRUE(client.SetOptimizer(set).ok());
  ASSERT_TRUE(Save(client, "set.safetensors").ok());
  OptimizerConfig changed;
  changed.lr = 2e-3;
  changed.weight_decay = 0.3;
  changed.max_grad_norm = 0.05;
  ExpectNextStepTrainsWith(client, checkpoints, "set.safetensors", changed, batch);
}

// Saves a large model over `name` in the background and SIGKILLs the daemon as soon as the save's temporary file
// appears. True when the kill landed in the middle of the write.
bool KillDuringSave(Daemon& daemon, const std::filesystem::path& checkpoints, const std::string& name) {
  v1::InitModelRequest large;
  large.set_config_name("large");
  large.set_replace(true);
  if (!daemon.client().InitModel(large).ok()) return false;
  std::future<absl::Status> save = std::async(std::launch::async, [&] { return Save(daemon.client(), name); });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  bool caught = false;
  while (!caught && absl::Now() < deadline && save.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    for (const auto& entry : std::filesystem::directory_iterator(checkpoints)) {
      caught = caught || entry.path().filename().string().starts_with(name + ".tmp.");
    }
  }
  daemon.Signal(SIGKILL);
  (void)daemon.WaitForExit(absl::Seconds(10));
  (void)save.get();  // the call fails (UNAVAILABLE) when the kill came first
  return caught;
}

TEST(CheckpointTest, SigkillDuringSaveLeavesThePreviousCheckpointLoadable) {
  const ModelConfig config = TinyConfig();
  const v1::EvaluateRequest probe = EvaluateRequest(testing::MakeRandomBatch(config, 2, 9, 5), config, true);
  const ScopedTempDir temp("sigkill");
  const std::filesystem::path& dir = temp.path();
  const std::filesystem::path checkpoints = dir / "checkpoints";
  v1::EvaluateResponse before;
  bool caught = false;
  // The write of a `large` checkpoint (about 80 MB, then fsync) takes long enough to be caught in the middle;
  // an attempt that misses it (the save finished first) is repeated from scratch.
  for (int attempt = 0; attempt < 5 && !caught; ++attempt) {
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(checkpoints);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    ASSERT_TRUE((*daemon)->client().InitModel(TinyInitRequest(21)).ok());
    ASSERT_TRUE((*daemon)->client().TrainStep(TrainRequest(testing::MakeRandomBatch(config, 2, 9, 1), config)).ok());
    before = Evaluate((*daemon)->client(), probe);
    ASSERT_TRUE(Save((*daemon)->client(), "model.safetensors").ok());
    caught = KillDuringSave(**daemon, checkpoints, "model.safetensors");
  }
  ASSERT_TRUE(caught) << "never caught a save in the middle of its write";

  absl::StatusOr<std::unique_ptr<Daemon>> restarted = Daemon::Start(checkpoints);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  absl::StatusOr<v1::LoadCheckpointResponse> loaded = Load((*restarted)->client(), "model.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->model().config().d_model(), config.d_model) << "the tiny checkpoint, not a half-written large one";
  EXPECT_EQ(loaded->model().step(), 1);
  EXPECT_EQ(EvaluationBits(Evaluate((*restarted)->client(), probe)), EvaluationBits(before));
}

}  // namespace
}  // namespace perception::e2e
