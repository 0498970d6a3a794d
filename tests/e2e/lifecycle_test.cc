// The daemon's life as operators see it: flags refused before it serves, health and reflection, draining on
// SIGTERM/SIGINT with exit code 0, and /metrics scraped from the running binary.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "engine/backend.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "tests/batch_message.h"
#include "tests/e2e/e2e_util.h"

namespace perception::e2e {
namespace {

using ::testing::HasSubstr;
using ServingStatus = grpc::health::v1::HealthCheckResponse;

std::vector<std::string> ListServices(const std::string& target) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  stream->Write(request);
  stream->WritesDone();
  std::vector<std::string> names;
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  while (stream->Read(&response)) {
    for (const auto& service : response.list_services_response().service()) names.push_back(service.name());
  }
  EXPECT_TRUE(stream->Finish().ok());
  return names;
}

// Expects perceptiond with `flags` and checkpoints in `checkpoints` to refuse them before it serves: exit code 1, its
// output naming `reason`. One that accepts them serves until `timeout` ends it (exit code 124), so that the test fails
// instead of hanging.
void ExpectRefusedAtStartUp(const std::filesystem::path& checkpoints, const std::string& flags,
                            const std::string& reason) {
  SCOPED_TRACE(flags);
  const CommandResult refused = RunCommand(absl::StrCat("timeout 20 ", PERCEPTIOND_PATH,
                                                        " --listen=127.0.0.1:0 --metrics_listen= --checkpoint_dir=",
                                                        checkpoints.string(), " ", flags));
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_THAT(refused.output, HasSubstr(reason));
}

// gRPC's default SO_REUSEPORT let a second daemon listen on the first one's port: it started, and calls went to
// either daemon at random (an init to one, the train after it to the other). The second now fails its start.
TEST(LifecycleTest, ASecondDaemonOnAPortInUseFailsToStart) {
  const ScopedTempDir first_checkpoints("port_first"), second_checkpoints("port_second");
  absl::StatusOr<std::unique_ptr<Daemon>> first = Daemon::Start(first_checkpoints.path());
  ASSERT_TRUE(first.ok()) << first.status();
  ExpectRefusedAtStartUp(second_checkpoints.path(), absl::StrCat("--listen=", (*first)->target()),
                         absl::StrCat("cannot listen on ", (*first)->target(), " (in use"));
  EXPECT_TRUE((*first)->client().GetStatus().ok()) << "the first daemon stopped serving";
}

// --precision is checked before the daemon serves: an unknown name, or a CUDA precision on --device=cpu, ends it
// with the reason and exit code 1.
TEST(LifecycleTest, TheDaemonRefusesAPrecisionItCannotRun) {
  // perceptiond creates its checkpoint folder before it checks --precision: a temporary one, not ctest's directory.
  const ScopedTempDir checkpoints("precision");
  ExpectRefusedAtStartUp(checkpoints.path(), "--precision=fp16",
                         "unknown precision 'fp16' (auto, fp32, 3xtf32 or tf32)");
  ExpectRefusedAtStartUp(checkpoints.path(), "--device=cpu --precision=3xtf32",
                         "--precision=3xtf32 is the CUDA backend's; --device=cpu computes in fp32");
  // Before, --device=auto served on the CPU and refused every model; where it resolves to CUDA the pair is valid.
  if (!CudaBackendAvailable().ok()) {
    ExpectRefusedAtStartUp(checkpoints.path(), "--device=auto --precision=tf32",
                           "--precision=tf32 is the CUDA backend's, but --device=auto resolves to the CPU here (");
  }
}

// Before, only --device=cpu was looked at: any other name served, and then refused every model.
TEST(LifecycleTest, TheDaemonRefusesAnUnknownDevice) {
  const ScopedTempDir checkpoints("device");
  ExpectRefusedAtStartUp(checkpoints.path(), "--device=gpu", "--device: unknown device 'gpu' (cpu, cuda, auto)");
}

// --device=cuda where no CUDA device can be used (a host without the driver, a container without the GPU) started and
// reported SERVING, then refused every model: a supervisor's probes passed a daemon that could do nothing.
TEST(LifecycleTest, TheDaemonRefusesCudaWhereNoCudaDeviceCanBeUsed) {
  if (CudaBackendAvailable().ok()) GTEST_SKIP() << "a CUDA device can be used here";
  const ScopedTempDir checkpoints("no_cuda");
  ExpectRefusedAtStartUp(checkpoints.path(), "--device=cuda",
                         "FAILED_PRECONDITION: --device=cuda, but no CUDA device can be used here (");
}

// Before, a negative --init_levels silently kept the preset's features, and a large one overflowed 4*levels + 8
// (INT_MAX gave a model of 4 features) or was refused only as a config dimension.
TEST(LifecycleTest, TheDaemonRefusesInitLevelsOutOfRange) {
  const ScopedTempDir checkpoints("init_levels");
  for (const int levels : {-1, kMaxLobsterLevels + 1, std::numeric_limits<int>::max()}) {
    ExpectRefusedAtStartUp(checkpoints.path(), absl::StrCat("--init_config=tiny --init_levels=", levels),
                           absl::StrCat("--init_levels must be in [0, ", kMaxLobsterLevels,
                                        "] (0: the preset's feature count), got ", levels));
  }
  // Without a preset to apply to, it was accepted and did nothing.
  ExpectRefusedAtStartUp(checkpoints.path(), "--init_levels=1",
                         "--init_levels applies to --init_config's preset; without one it would be ignored");
}

// Each refusal names its flag and value: "limits must be positive" left the operator to find which of four, and a
// negative drain wait was taken as none.
TEST(LifecycleTest, TheDaemonNamesTheFlagOutOfRange) {
  const ScopedTempDir checkpoints("flag_ranges");
  ExpectRefusedAtStartUp(checkpoints.path(), "--queue_depth=0", "--queue_depth must be >= 1, got 0");
  ExpectRefusedAtStartUp(checkpoints.path(), "--max_message_bytes=3000000000",
                         "--max_message_bytes must be at most 2147483647, got 3000000000");
  ExpectRefusedAtStartUp(checkpoints.path(), "--stream_slots=0", "--stream_slots must be >= 1, got 0");
  ExpectRefusedAtStartUp(checkpoints.path(), "--stream_read_max=-3", "--stream_read_max must be >= 1, got -3");
  ExpectRefusedAtStartUp(checkpoints.path(), "--stream_slots=8 --stream_log_entries=4",
                         "--stream_log_entries (4) must be at least --stream_slots (8)");
  ExpectRefusedAtStartUp(checkpoints.path(), "--drain_grace=-1s",
                         "--drain_grace must be 0 (none) or positive, got -1s");
  ExpectRefusedAtStartUp(checkpoints.path(), "--drain_for_reads=-2s",
                         "--drain_for_reads must be 0 (none) or positive, got -2s");
}

// A word that is not a flag (one without its dashes, say) was ignored; flag names take dashes as the clients' do.
TEST(LifecycleTest, TheDaemonRefusesArgumentsThatAreNotFlags) {
  const ScopedTempDir checkpoints("not_flags");
  ExpectRefusedAtStartUp(checkpoints.path(), "drain_grace=5s",
                         "INVALID_ARGUMENT: perceptiond takes flags only, not 'drain_grace=5s' (perceptiond --help "
                         "lists them)");
  ExpectRefusedAtStartUp(checkpoints.path(), "--drain-grace=-1s", "--drain_grace must be 0 (none) or positive");
}

// A port past 65535 listened on its low 16 bits (99999: port 34463) and an empty one on any free port, where no
// probe would look; a stall timeout or a preset the daemon refuses was refused only after both listeners opened.
TEST(LifecycleTest, TheDaemonRefusesBadListenPortsAndFlagsBeforeListening) {
  const ScopedTempDir checkpoints("listen_ports");
  const std::pair<std::string, std::string> refusals[] = {
      {"--listen=127.0.0.1:99999",
       "--listen '127.0.0.1:99999': the port must be a number from 0 to 65535 (0: any free one), got '99999'"},
      {"--metrics_listen=127.0.0.1:65536", "--metrics_listen '127.0.0.1:65536': the port must be a number from 0 to "
                                           "65535 (0: any free one), got '65536'"},
      {"--metrics_listen=127.0.0.1:", "--metrics_listen '127.0.0.1:': the port must be a number from 0 to 65535"},
      {"--listen=[::1]:+80", "--listen '[::1]:+80': the port must be a number from 0 to 65535"},
      {"--listen=localhost", "--listen 'localhost' is not host:port"},
      {"--device_stall_timeout=0", "--device_stall_timeout must be positive (inf: no watch), got 0"},
      {"--device_stall_timeout=-1s", "--device_stall_timeout must be positive (inf: no watch), got -1s"},
      {"--keepalive_time=0", "--keepalive_time must be at least 1ms (inf: no pings), got 0"},
      {"--keepalive_time=500us", "--keepalive_time must be at least 1ms (inf: no pings), got 500us"},
      {"--keepalive_timeout=inf", "--keepalive_timeout must be at least 1ms and finite, got inf"},
      {"--keepalive_timeout=500us", "--keepalive_timeout must be at least 1ms and finite, got 500us"},
      {"--init_config=bogus", "--init_config: unknown config 'bogus'"},
  };
  for (const auto& [flags, reason] : refusals) {
    ExpectRefusedAtStartUp(checkpoints.path(), flags, reason);
    const CommandResult refused = RunCommand(absl::StrCat("timeout 20 ", PERCEPTIOND_PATH, " --checkpoint_dir=",
                                                          checkpoints.path().string(), " ", flags));
    EXPECT_THAT(refused.output, ::testing::Not(HasSubstr("serving "))) << flags << ": refused before listening";
  }
}

TEST(LifecycleTest, TheDaemonRefusesANegativeStreamTickTiming) {
  const ScopedTempDir checkpoints("stream_tick_timing");
  ExpectRefusedAtStartUp(checkpoints.path(), "--stream_tick_timing=-1",
                         "--stream_tick_timing must be 0 (none) or positive");
}

// 2^62 entries wrapped the CUDA logs' sizes to nothing (every log and the buffers after it overlapping), and the CPU
// daemon's first stream ended it (std::length_error in the host log's allocation).
TEST(LifecycleTest, TheDaemonRefusesMoreLogEntriesThanAnyDeviceHolds) {
  const ScopedTempDir checkpoints("stream_log_entries");
  ExpectRefusedAtStartUp(checkpoints.path(), "--stream_slots=1 --stream_log_entries=4611686018427387904",
                         "--stream_log_entries must be at most 1073741824, got 4611686018427387904");
}

// A slot count far beyond any feed's instruments took the host's memory before the daemon listened (15 GB and
// growing at 10^8): each slot's queues and bookkeeping are made at the start.
TEST(LifecycleTest, TheDaemonRefusesMoreStreamSlotsThanItCanKeep) {
  const ScopedTempDir checkpoints("stream_slots");
  ExpectRefusedAtStartUp(checkpoints.path(), "--stream_slots=1048577 --stream_log_entries=1048577",
                         "--stream_slots must be at most 1048576, got 1048577 (each slot takes host memory");
}

// Before, --checkpoint_on_exit was resolved only after the drain: a name the save refuses lost the final save.
TEST(LifecycleTest, TheDaemonRefusesACheckpointOnExitItCannotSave) {
  const ScopedTempDir checkpoints("checkpoint_on_exit");
  std::filesystem::create_directory(checkpoints.path() / "runs");
  const std::pair<std::string, std::string> names[] = {
      {"../escape.safetensors", "must not contain '..'"},
      {(checkpoints.path() / "x.safetensors").string(), "is absolute"},
      {"a/", "does not end in a file name"},
      {"runs", "is a folder; a checkpoint is a file"},
  };
  for (const auto& [name, why] : names) {
    ExpectRefusedAtStartUp(checkpoints.path(), "--checkpoint_on_exit=" + name,
                           absl::StrCat("--checkpoint_on_exit: checkpoint name '", name, "' ", why));
  }
  // A name the save cannot write (here below a file, where its folder would be) too, as the CLI's --save is.
  std::ofstream(checkpoints.path() / "plain") << "a file";
  const std::string unwritable = (std::filesystem::canonical(checkpoints.path()) / "plain/x.safetensors").string();
  ExpectRefusedAtStartUp(checkpoints.path(), "--checkpoint_on_exit=plain/x.safetensors",
                         absl::StrCat("cannot write ", unwritable, ": cannot create its temporary file ", unwritable,
                                      ".tmp."));
}

// The exit's save creates the folders its name adds: a name in a folder not there yet is taken at start-up. The
// start-up check tries a file of the name's nearest existing folder, where a folder of the file's name may be
// (runs/exit.safetensors, for runs/day1/exit.safetensors): that is not the name saved, and must not refuse it.
TEST(LifecycleTest, ACheckpointOnExitInAFolderNotThereYetIsSavedThere) {
  for (const bool folder_above : {false, true}) {
    SCOPED_TRACE(folder_above ? "a folder runs/exit.safetensors" : "no folder runs");
    const ScopedTempDir temp("checkpoint_on_exit_new_folder");
    if (folder_above) std::filesystem::create_directories(temp.path() / "checkpoints/runs/exit.safetensors");
    absl::StatusOr<std::unique_ptr<Daemon>> daemon =
        Daemon::Start(temp.path() / "checkpoints", {"--checkpoint_on_exit=runs/day1/exit.safetensors"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    ASSERT_TRUE((*daemon)->client().InitModel(TinyInitRequest(1)).ok());
    (*daemon)->Signal(SIGTERM);
    absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
    ASSERT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
    EXPECT_TRUE(std::filesystem::is_regular_file(temp.path() / "checkpoints/runs/day1/exit.safetensors"));
  }
}

// A refused --load names the flag, not a request's field: a refused name, and a file that is missing or does not load
// (those said only "safetensors file '...': cannot open").
TEST(LifecycleTest, ARefusedLoadNameNamesTheFlag) {
  const ScopedTempDir checkpoints("load_name");
  ExpectRefusedAtStartUp(checkpoints.path(), "--load=../escape.safetensors",
                         "--load: checkpoint name '../escape.safetensors' must not contain '..'");
  ExpectRefusedAtStartUp(checkpoints.path(), "--load=missing.safetensors",
                         "--load: checkpoint 'missing.safetensors' does not load: ");
  std::ofstream(checkpoints.path() / "corrupt.safetensors") << "not a safetensors file";
  ExpectRefusedAtStartUp(checkpoints.path(), "--load=corrupt.safetensors",
                         "--load: checkpoint 'corrupt.safetensors' does not load: ");
}

// --load_if_present falls back only where the file is missing: one that is there but does not load ends the start,
// --init_config or not, since serving a fresh model would lose it (and the exit's save would overwrite it).
TEST(LifecycleTest, ACheckpointThatDoesNotLoadFailsLoadIfPresent) {
  const ScopedTempDir checkpoints("load_if_present_corrupt");
  std::ofstream(checkpoints.path() / "last.safetensors") << "not a safetensors file";
  for (const std::string fallback : {"", " --init_config=tiny"}) {
    ExpectRefusedAtStartUp(checkpoints.path(), "--load_if_present=last.safetensors" + fallback,
                           "--load_if_present: checkpoint 'last.safetensors' exists but does not load: ");
  }
  std::filesystem::create_directory(checkpoints.path() / "runs");
  ExpectRefusedAtStartUp(checkpoints.path(), "--load_if_present=runs --init_config=tiny",
                         "--load_if_present: checkpoint 'runs' exists but does not load: ");
  ExpectRefusedAtStartUp(checkpoints.path(), "--load_if_present=../escape.safetensors",
                         "--load_if_present: checkpoint name '../escape.safetensors' must not contain '..'");
}

// --load requires the file and --load_if_present does not: asked for both, the daemon cannot tell which was meant.
TEST(LifecycleTest, LoadAndLoadIfPresentExcludeEachOther) {
  const ScopedTempDir checkpoints("load_and_load_if_present");
  ExpectRefusedAtStartUp(checkpoints.path(), "--load=a.safetensors --load_if_present=a.safetensors",
                         "--load and --load_if_present exclude each other");
}

// A hang-up (the terminal the daemon was started from closing) drains and saves as SIGTERM does: it killed the daemon
// on the spot, the model and its --checkpoint_on_exit with it.
TEST(LifecycleTest, AHangUpDrainsAndSavesLikeSigterm) {
  const ScopedTempDir temp("hang_up");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--checkpoint_on_exit=exit.safetensors"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_TRUE((*daemon)->client().InitModel(TinyInitRequest(1)).ok());
  (*daemon)->Signal(SIGHUP);
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
  EXPECT_THAT((*daemon)->Log(), HasSubstr("Hangup: draining"));
  EXPECT_TRUE(std::filesystem::is_regular_file(temp.path() / "checkpoints" / "exit.safetensors"));
}

// With no model there is nothing to save: the exit says so, instead of leaving the operator to look for the file.
TEST(LifecycleTest, ACheckpointOnExitWithNoModelSaysNoneWasSaved) {
  const ScopedTempDir temp("checkpoint_on_exit_no_model");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--checkpoint_on_exit=exit.safetensors"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  (*daemon)->Signal(SIGTERM);
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
  EXPECT_THAT((*daemon)->Log(), HasSubstr("--checkpoint_on_exit=exit.safetensors: no checkpoint saved, the daemon "
                                          "holds no model (none was initialized or loaded)"));
  EXPECT_FALSE(std::filesystem::exists(temp.path() / "checkpoints" / "exit.safetensors"));
}

// The exit's save resolves the name again: a folder that took it while the daemon served fails the exit, non-zero.
TEST(LifecycleTest, ACheckpointOnExitThatBecameAFolderFailsTheExit) {
  const ScopedTempDir temp("checkpoint_on_exit_folder");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--checkpoint_on_exit=exit.safetensors"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_TRUE((*daemon)->client().InitModel(TinyInitRequest(1)).ok());
  std::filesystem::create_directory(temp.path() / "checkpoints" / "exit.safetensors");
  (*daemon)->Signal(SIGTERM);
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 1);
  EXPECT_THAT((*daemon)->Log(), HasSubstr("checkpoint name 'exit.safetensors' is a folder; a checkpoint is a file"));
}

// Before, spdlog read an unknown level as `off`: the daemon served with every log line silenced.
TEST(LifecycleTest, TheDaemonRefusesAnUnknownLogLevel) {
  const ScopedTempDir checkpoints("log_level");
  ExpectRefusedAtStartUp(checkpoints.path(), "--log_level=verbose",
                         "unknown --log_level 'verbose' (trace, debug, info, warn, error, critical or off)");
}

TEST(LifecycleTest, HealthServesThenDrainsOnSigtermAnsweringEveryStepTaken) {
  const ScopedTempDir temp("drain");
  const std::filesystem::path& dir = temp.path();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(dir / "checkpoints", {"--drain_grace=2s", "--checkpoint_on_exit=exit.safetensors"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  EXPECT_EQ(*client.Health(), ServingStatus::SERVING);
  EXPECT_EQ(*client.Health("perception.v1.Perception"), ServingStatus::SERVING);
  EXPECT_THAT(ListServices((*daemon)->target()),
              ::testing::IsSupersetOf({"perception.v1.Perception", "grpc.health.v1.Health"}));
  ASSERT_TRUE(client.InitModel(TinyInitRequest(4)).ok());

  // A long training stream is in flight when the signal arrives.
  const ModelConfig config = TinyConfig();
  std::atomic<int> answered = 0;
  std::vector<int64_t> steps;
  std::future<absl::Status> stream = std::async(std::launch::async, [&] {
    return client.Train(
        1'000'000,
        [&](int i, v1::TrainStepRequest& request) {
          request = TrainRequest(testing::MakeRandomBatch(config, 2, 9, i), config);
          return true;
        },
        [&](const v1::TrainStepResponse& response) {
          steps.push_back(response.step());
          ++answered;
        });
  });
  while (answered < 5 && stream.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GE(answered, 5) << stream.get();
  EXPECT_FALSE(client.GetStatus()->draining());
  EXPECT_THAT(HttpGet((*daemon)->metrics_port(), "/metrics").value_or(""), HasSubstr("\nperception_draining 0\n"));
  (*daemon)->Signal(SIGTERM);

  absl::StatusOr<ServingStatus::ServingStatus> health = ServingStatus::SERVING;
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (health.ok() && *health == ServingStatus::SERVING && absl::Now() < deadline) health = client.Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, ServingStatus::NOT_SERVING);
  const absl::Status refused = client.InitModel(TinyInitRequest(5)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("draining"));
  const absl::StatusOr<v1::GetStatusResponse> status = client.GetStatus();
  ASSERT_TRUE(status.ok()) << "a read, answered through the grace: " << status.status();
  EXPECT_TRUE(status->draining());
  EXPECT_THAT(HttpGet((*daemon)->metrics_port(), "/metrics").value_or(""), HasSubstr("\nperception_draining 1\n"));
  const CommandResult ctl_status =
      RunCommand(absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target(), " status"));
  EXPECT_THAT(ctl_status.output, HasSubstr("draining: the daemon is exiting; it refuses new work and answers reads of "
                                           "the convictions until they are read back or its --drain_for_reads ends"));

  const absl::Status ended = stream.get();
  EXPECT_EQ(ended.code(), absl::StatusCode::kUnavailable) << ended;
  for (size_t i = 0; i < steps.size(); ++i) ASSERT_EQ(steps[i], static_cast<int64_t>(i + 1));
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();

  // --checkpoint_on_exit saved the model after the in-flight steps: every step it took was answered.
  absl::StatusOr<Checkpoint> saved = LoadCheckpoint((dir / "checkpoints" / "exit.safetensors").string());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step, static_cast<int64_t>(steps.size()));
}

// An open Stream whose request of events 1..n of instrument "A" (a random series of the tiny model from `seed`) the
// daemon has acknowledged whole.
struct AcknowledgedStream {
  v1::StreamRequest events;
  std::shared_ptr<std::atomic<uint64_t>> acked = std::make_shared<std::atomic<uint64_t>>(0);
  std::unique_ptr<client::EventStream> stream;
};
absl::StatusOr<AcknowledgedStream> StreamUntilAcknowledged(client::PerceptionClient& client, int n, uint64_t seed) {
  const ModelConfig config = TinyConfig();
  const testing::RandomBatch series = testing::MakeRandomBatch(config, 1, n, seed);
  AcknowledgedStream opened;
  for (int t = 0; t < n; ++t) {
    *opened.events.add_events() = testing::FeatureEvent(series, config.n_features, t, "A", t + 1);
  }
  opened.events.set_ack(true);
  opened.stream = client.OpenStream([acked = opened.acked](const v1::StreamResponse& response) {
    for (const v1::InstrumentAck& ack : response.acks()) *acked = ack.last_seq();
  });
  if (!opened.stream->Write(opened.events)) return absl::UnavailableError("the stream ended before its events");
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (*opened.acked < static_cast<uint64_t>(n) && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  if (*opened.acked != static_cast<uint64_t>(n)) {
    return absl::DeadlineExceededError(absl::StrCat("acknowledged ", opened.acked->load(), " of ", n, " events"));
  }
  return opened;
}

// Through --drain_grace the reads keep answering while new work is refused: a client whose Stream the drain ended
// reads back the convictions of every event it streamed, which the device holds only until the daemon exits.
TEST(LifecycleTest, ConvictionsStayReadableThroughTheDrainGrace) {
  const ScopedTempDir temp("drain_read");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints", {"--drain_grace=3s"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  ASSERT_TRUE(client.InitModel(TinyInitRequest(4)).ok());
  constexpr int kEvents = 40;
  absl::StatusOr<AcknowledgedStream> acknowledged = StreamUntilAcknowledged(client, kEvents, 11);
  ASSERT_TRUE(acknowledged.ok()) << acknowledged.status();
  const std::unique_ptr<client::EventStream>& stream = acknowledged->stream;
  v1::ReadConvictionsRequest read;
  read.set_instrument("A");
  read.set_from_seq(1);
  read.set_with_probabilities(true);
  absl::StatusOr<v1::ReadConvictionsResponse> before = client.ReadConvictions(read);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(before->convictions_size(), kEvents);

  (*daemon)->Signal(SIGTERM);
  absl::StatusOr<ServingStatus::ServingStatus> health = ServingStatus::SERVING;
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (health.ok() && *health == ServingStatus::SERVING && absl::Now() < deadline) health = client.Health();
  ASSERT_TRUE(health.ok()) << health.status();
  ASSERT_EQ(*health, ServingStatus::NOT_SERVING);
  const absl::Status ended = stream->Finish();
  EXPECT_EQ(ended.code(), absl::StatusCode::kUnavailable) << ended;
  EXPECT_THAT(std::string(ended.message()), HasSubstr("ReadConvictions"));

  absl::StatusOr<v1::ListStreamsResponse> listed = client.ListStreams();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->streams_size(), 1);
  EXPECT_EQ(listed->streams(0).end_seq(), static_cast<uint64_t>(kEvents + 1));
  absl::StatusOr<v1::ReadConvictionsResponse> during = client.ReadConvictions(read);
  ASSERT_TRUE(during.ok()) << during.status();
  EXPECT_EQ(during->first_seq(), 1u);
  EXPECT_EQ(during->end_seq(), static_cast<uint64_t>(kEvents + 1));
  EXPECT_THAT(during->convictions(), ::testing::ElementsAreArray(before->convictions()));
  EXPECT_THAT(during->probabilities(), ::testing::ElementsAreArray(before->probabilities()));
  absl::StatusOr<v1::GetStatusResponse> status = client.GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->streaming().active_streams(), 1);

  // New work is refused meanwhile: a new stream's events, a seed, a reset.
  const std::unique_ptr<client::EventStream> late = client.OpenStream([](const v1::StreamResponse&) {});
  late->Write(acknowledged->events);
  const absl::Status late_end = late->Finish();
  EXPECT_EQ(late_end.code(), absl::StatusCode::kUnavailable) << late_end;
  v1::ResetStreamRequest reset;
  reset.set_instrument("A");
  const absl::Status reset_refused = client.ResetStream(reset).status();
  EXPECT_EQ(reset_refused.code(), absl::StatusCode::kUnavailable) << reset_refused;
  EXPECT_THAT(std::string(reset_refused.message()), HasSubstr("draining"));

  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(15));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
}

// A Stream that is open but idle when the daemon drains ends at once with UNAVAILABLE naming the drain (its
// events acknowledged first), instead of holding the daemon's exit until the shutdown deadline cancels it.
TEST(LifecycleTest, AnIdleStreamEndsAtOnceOnSigterm) {
  const ScopedTempDir temp("drain_stream");
  // (Its convictions stay unread: no wait for them, which the tests below cover.)
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--drain_for_reads=0s"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  ASSERT_TRUE(client.InitModel(TinyInitRequest(4)).ok());
  absl::StatusOr<AcknowledgedStream> acknowledged = StreamUntilAcknowledged(client, 10, 5);
  ASSERT_TRUE(acknowledged.ok()) << acknowledged.status();
  const std::unique_ptr<client::EventStream>& stream = acknowledged->stream;

  (*daemon)->Signal(SIGTERM);
  const absl::Time signalled = absl::Now();
  while (!stream->ended() && absl::Now() < signalled + absl::Seconds(10)) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(1)) << "the idle stream held up the drain";
  const absl::Status ended = stream->Finish();
  EXPECT_EQ(ended.code(), absl::StatusCode::kUnavailable) << ended;
  EXPECT_THAT(std::string(ended.message()), HasSubstr("draining"));
  // Before the drain reached idle streams, this one kept the daemon until the 60 s shutdown deadline; the connection
  // it leaves open is closed by the exit (IdleConnectionsAndAnOpenHealthWatchDoNotHoldTheExit).
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(5));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
}

// Convictions not yet read back hold the drain (--drain_for_reads, 10 s unless set): reads keep answering, page by
// page, and the listener closes once the last page is read, long before the limit.
TEST(LifecycleTest, TheDrainWaitsForUnreadConvictionsUntilTheyAreReadBack) {
  const ScopedTempDir temp("drain_unread");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--drain_for_reads=60s"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  ASSERT_TRUE(client.InitModel(TinyInitRequest(4)).ok());
  constexpr int kEvents = 40;
  absl::StatusOr<AcknowledgedStream> acknowledged = StreamUntilAcknowledged(client, kEvents, 13);
  ASSERT_TRUE(acknowledged.ok()) << acknowledged.status();

  (*daemon)->Signal(SIGTERM);
  (void)acknowledged->stream->Finish();  // OK or UNAVAILABLE, as its half-close and the drain meet
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ((*daemon)->WaitForExit(absl::ZeroDuration()).status().code(), absl::StatusCode::kDeadlineExceeded)
      << "exited with convictions unread";
  // A read whose output cannot be written is refused before it reads: perceptionctl read every page, which counted
  // as read back, and failed only at the write, so the daemon exited with the convictions lost.
  const std::string unwritable = (temp.path() / "not_a_folder" / "a.csv").string();
  const CommandResult refused = RunCommand(absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target(),
                                                        " convictions --instrument A --out ", unwritable));
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr(absl::StrCat("cannot write ", unwritable, ": cannot create its temporary")));
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ((*daemon)->WaitForExit(absl::ZeroDuration()).status().code(), absl::StatusCode::kDeadlineExceeded)
      << "exited after a read that wrote nothing";
  v1::ReadConvictionsRequest read;
  read.set_instrument("A");
  read.set_from_seq(1);
  read.set_max_count(16);
  std::vector<float> convictions;
  for (int page = 0; page < 3; ++page) {
    absl::StatusOr<v1::ReadConvictionsResponse> got = client.ReadConvictions(read);
    ASSERT_TRUE(got.ok()) << "page " << page << ": " << got.status();
    convictions.insert(convictions.end(), got->convictions().begin(), got->convictions().end());
    read.set_from_seq(got->next_seq());
  }
  ASSERT_EQ(convictions.size(), static_cast<size_t>(kEvents));
  for (const float c : convictions) EXPECT_TRUE(std::isfinite(c) && std::abs(c) < 1.f) << c;
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(5));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
  EXPECT_THAT((*daemon)->Log(), HasSubstr("40 conviction(s) of 1 stream(s) not read back"));
  EXPECT_THAT((*daemon)->Log(), HasSubstr("every stream's log was read to its end"));
}

// 127.0.0.1:`port` (0: any free one), for the relays below.
sockaddr_in Loopback(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

// A socket listening on a free loopback port, for one connection; the port goes to `port`.
int ListenOnLoopback(int& port) {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address = Loopback(0);
  socklen_t size = sizeof(address);
  EXPECT_EQ(::bind(listener, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
  EXPECT_EQ(::listen(listener, 1), 0);
  EXPECT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &size), 0);
  port = ntohs(address.sin_port);
  return listener;
}

// The daemon's gRPC port, which a relay forwards to.
int PortOf(const Daemon& daemon) { return std::stoi(daemon.target().substr(daemon.target().rfind(':') + 1)); }

// A loopback relay to `upstream` for one connection that passes the server's bytes on at `rate` bytes/s (the
// server's side of it taking little into its buffer, so that the server's kernel holds what is still to go) and,
// as a client consuming a large answer does, sends the server an HTTP/2 WINDOW_UPDATE between the client's frames
// every 5 ms once the client has sent its first frames.
class SlowChattyLink {
 public:
  SlowChattyLink(int upstream_port, int rate) : rate_(rate) {
    listener_ = ListenOnLoopback(port_);
    accepter_ = std::thread([this, upstream_port] { Relay(upstream_port); });
  }
  ~SlowChattyLink() {
    stop_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    for (const int fd : {client_.load(), server_.load()}) {
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
    }
    accepter_.join();
    for (std::thread& pump : pumps_) pump.join();
    for (const int fd : {listener_, client_.load(), server_.load()}) {
      if (fd >= 0) ::close(fd);
    }
  }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  void Relay(int upstream_port) {
    const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) return;
    client_ = client;
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int small = 32 * 1024;
    ::setsockopt(server, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    const sockaddr_in address = Loopback(upstream_port);
    if (::connect(server, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) return;
    server_ = server;
    pumps_.emplace_back([this] { Upstream(); });
    pumps_.emplace_back([this] { Downstream(); });
    pumps_.emplace_back([this] { Inject(); });
  }

  bool SendToServer(const std::string& bytes) {
    absl::MutexLock lock(&upstream_mu_);
    return ::send(server_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }

  // The client's bytes, passed on whole frames at a time (after the 24-byte connection preface).
  void Upstream() {
    std::string pending;
    bool preface_sent = false;
    char chunk[65536];
    while (!stop_) {
      const ssize_t n = ::recv(client_, chunk, sizeof(chunk), 0);
      if (n <= 0) break;
      pending.append(chunk, static_cast<size_t>(n));
      std::string whole;
      if (!preface_sent && pending.size() >= 24) {
        whole = pending.substr(0, 24);
        pending.erase(0, 24);
        preface_sent = true;
      }
      while (preface_sent && pending.size() >= 9) {
        const size_t frame = 9 + ((static_cast<uint8_t>(pending[0]) << 16) | (static_cast<uint8_t>(pending[1]) << 8) |
                                  static_cast<uint8_t>(pending[2]));
        if (pending.size() < frame) break;
        whole += pending.substr(0, frame);
        pending.erase(0, frame);
      }
      if (!whole.empty()) {
        if (!SendToServer(whole)) break;
        client_spoke_ = true;
      }
    }
    ::shutdown(server_, SHUT_WR);
  }

  void Downstream() {
    char chunk[16384];
    while (!stop_) {
      const ssize_t n = ::recv(server_, chunk, sizeof(chunk), 0);
      if (n <= 0) break;
      absl::SleepFor(absl::Seconds(static_cast<double>(n) / rate_));
      if (::send(client_, chunk, static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
    }
    ::shutdown(client_, SHUT_WR);
  }

  void Inject() {
    const std::string window_update("\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x01", 13);
    while (!stop_) {
      absl::SleepFor(absl::Milliseconds(5));
      if (client_spoke_ && !SendToServer(window_update)) return;
    }
  }

  const int rate_;
  int listener_ = -1, port_ = 0;
  std::atomic<int> client_ = -1, server_ = -1;
  std::atomic<bool> stop_ = false, client_spoke_ = false;
  absl::Mutex upstream_mu_;
  std::thread accepter_;
  std::vector<std::thread> pumps_;
};

// A loopback relay to `upstream` that passes bytes both ways until Freeze(), then reads and writes nothing more, the
// connections left open: the daemon's side of it is what a feed whose host or network vanished leaves behind (its
// kernel still takes the daemon's bytes; no answer comes).
class FreezableLink {
 public:
  explicit FreezableLink(int upstream_port) {
    listener_ = ListenOnLoopback(port_);
    accepter_ = std::thread([this, upstream_port] { Relay(upstream_port); });
  }
  ~FreezableLink() {
    stop_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    accepter_.join();
    for (std::thread& pump : pumps_) pump.join();
    for (const int fd : {listener_, client_, server_}) {
      if (fd >= 0) ::close(fd);
    }
  }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }
  void Freeze() { frozen_ = true; }

 private:
  // One connection: the client's, and the one it opens to the daemon for it.
  void Relay(int upstream_port) {
    client_ = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client_ < 0) return;
    server_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_in address = Loopback(upstream_port);
    if (::connect(server_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) return;
    pumps_.emplace_back([this] { Pump(client_, server_); });
    pumps_.emplace_back([this] { Pump(server_, client_); });
  }

  // One direction; polls, so that it sees the freeze and the stop without a byte coming.
  void Pump(int from, int to) {
    char chunk[65536];
    while (!stop_) {
      pollfd readable{from, POLLIN, 0};
      if (frozen_ || ::poll(&readable, 1, 20) <= 0) {
        absl::SleepFor(absl::Milliseconds(20));
        continue;
      }
      const ssize_t n = ::recv(from, chunk, sizeof(chunk), 0);
      if (n <= 0 || ::send(to, chunk, static_cast<size_t>(n), MSG_NOSIGNAL) != n) return;
    }
  }

  int listener_ = -1, port_ = 0, client_ = -1, server_ = -1;
  std::atomic<bool> stop_ = false, frozen_ = false;
  std::thread accepter_;
  std::vector<std::thread> pumps_;
};

// The daemon's flags, `extra` among them, under which one ReadConvictions page holds what StreamAPageOfConvictions
// streams.
std::vector<std::string> OnePageFlags(const std::string& extra) {
  return {extra, "--stream_slots=4", "--stream_log_entries=200000", "--stream_read_max=50000"};
}
constexpr int kPageEvents = 40'000;

// Streams kPageEvents events of instrument "A" into a fresh tiny model: a page of ~2.9 MB with probabilities.
void StreamAPageOfConvictions(client::PerceptionClient& client) {
  ASSERT_TRUE(client.InitModel(TinyInitRequest(4)).ok());
  constexpr int kPerRequest = 4'000;
  const ModelConfig config = TinyConfig();
  const testing::RandomBatch series = testing::MakeRandomBatch(config, 1, kPageEvents, 17);
  std::atomic<uint64_t> acked = 0;
  const std::unique_ptr<client::EventStream> stream = client.OpenStream([&](const v1::StreamResponse& response) {
    for (const v1::InstrumentAck& ack : response.acks()) acked = ack.last_seq();
  });
  for (int first = 0; first < kPageEvents; first += kPerRequest) {
    v1::StreamRequest request;
    for (int t = first; t < first + kPerRequest; ++t) {
      *request.add_events() = testing::FeatureEvent(series, config.n_features, t, "A", t + 1);
    }
    request.set_ack(true);
    ASSERT_TRUE(stream->Write(request));
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(120);
  while (acked < kPageEvents && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(acked, kPageEvents);
  ASSERT_TRUE(stream->Finish().ok());
}

// A stub on its own channel to `target`, connected (one call answered).
std::unique_ptr<v1::Perception::Stub> ConnectedReader(const std::string& target) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(64 << 20);
  std::unique_ptr<v1::Perception::Stub> reader =
      v1::Perception::NewStub(grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), arguments));
  grpc::ClientContext context;
  v1::ListStreamsResponse streams;
  EXPECT_TRUE(reader->ListStreams(&context, v1::ListStreamsRequest(), &streams).ok());
  return reader;
}

v1::ReadConvictionsRequest ReadAllOfA() {
  v1::ReadConvictionsRequest read;
  read.set_instrument("A");
  read.set_from_seq(1);
  read.set_with_probabilities(true);
  return read;
}

// gRPC finishes a call once its answer is in the kernel. The exit closed the connections 250 ms after the last call
// ended, and a close with the client's bytes (window updates) coming in resets the connection, which drops what the
// kernel still held: a client reading back a large page over a slow link lost it, and the daemon had counted it read.
TEST(LifecycleTest, AReadBackPageOnASlowLinkIsDeliveredBeforeTheExitClosesTheConnection) {
  const ScopedTempDir temp("drain_slow_link");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", OnePageFlags("--drain_for_reads=60s"));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_NO_FATAL_FAILURE(StreamAPageOfConvictions((*daemon)->client()));
  const SlowChattyLink link(PortOf(**daemon), 300'000);
  const std::unique_ptr<v1::Perception::Stub> reader = ConnectedReader(link.target());
  (*daemon)->Signal(SIGTERM);
  absl::SleepFor(absl::Milliseconds(200));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  v1::ReadConvictionsResponse page;
  const grpc::Status status = reader->ReadConvictions(&context, ReadAllOfA(), &page);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_GT(page.ByteSizeLong(), 500'000u) << "a page the slow link takes seconds to carry";
  EXPECT_EQ(page.convictions_size(), kPageEvents);
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
  EXPECT_THAT((*daemon)->Log(), HasSubstr("every stream's log was read to its end"));
}

// A second signal ends the exit's wait for answers to be delivered, as it ends --drain_for_reads': a client on a link
// too slow for its page held the exit for the whole 60 s with the operator's second signal ignored.
TEST(LifecycleTest, ASecondSignalEndsTheWaitForAnAnswerOnASlowLink) {
  const ScopedTempDir temp("drain_slow_link_second_signal");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", OnePageFlags("--drain_for_reads=60s"));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_NO_FATAL_FAILURE(StreamAPageOfConvictions((*daemon)->client()));
  // ~150 s for the ~2.9 MB page.
  const SlowChattyLink link(PortOf(**daemon), 20'000);
  const std::unique_ptr<v1::Perception::Stub> reader = ConnectedReader(link.target());
  (*daemon)->Signal(SIGTERM);
  absl::SleepFor(absl::Milliseconds(200));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  std::future<grpc::Status> read = std::async(std::launch::async, [&] {
    v1::ReadConvictionsResponse page;
    return reader->ReadConvictions(&context, ReadAllOfA(), &page);
  });
  // The page was answered (so the convictions count as read back), and it is on its slow way.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!absl::StrContains((*daemon)->Log(), "every stream's log was read to its end") && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_THAT((*daemon)->Log(), HasSubstr("every stream's log was read to its end"));
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Time second_signal = absl::Now();
  (*daemon)->Signal(SIGTERM);
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_LT(absl::Now() - second_signal, absl::Seconds(5)) << (*daemon)->Log();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
  EXPECT_THAT((*daemon)->Log(), HasSubstr("a second signal ended the wait for answers to be delivered: after "));
  EXPECT_FALSE(read.get().ok()) << "the page could not have crossed the link yet";
}

// A feed whose host or network vanished leaves its connection half open, and its call held its instrument: ResetStream
// and SeedStream refused ("fed by 1 open Stream call(s)") for gRPC's default 2 h before the daemon pinged the
// connection. The daemon's pings now find it (--keepalive_time, --keepalive_timeout), cancel the call and free the
// instrument; a feed that is alive but quiet answers them and keeps its call.
TEST(LifecycleTest, AFeedWhoseConnectionWentSilentIsCutByTheKeepaliveAndItsInstrumentFreed) {
  const ScopedTempDir temp("keepalive");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--keepalive_time=500ms", "--keepalive_timeout=3s"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  ASSERT_TRUE(client.InitModel(TinyInitRequest(4)).ok());
  FreezableLink link(PortOf(**daemon));
  client::PerceptionClient feed(link.target());
  const ModelConfig config = TinyConfig();
  const testing::RandomBatch series = testing::MakeRandomBatch(config, 1, 1, 23);
  std::atomic<uint64_t> acked = 0;
  const std::unique_ptr<client::EventStream> stream = feed.OpenStream([&](const v1::StreamResponse& response) {
    for (const v1::InstrumentAck& ack : response.acks()) acked = ack.last_seq();
  });
  v1::StreamRequest request;
  request.set_ack(true);
  *request.add_events() = testing::FeatureEvent(series, config.n_features, 0, "K", 1);
  ASSERT_TRUE(stream->Write(request));
  for (const absl::Time give_up = absl::Now() + absl::Seconds(30); acked < 1 && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(acked, 1u);
  v1::ResetStreamRequest reset;
  reset.set_instrument("K");
  // Quiet for 14 pings' time, past a ping's timeout twice over: the feed answers them, and its call and its hold on
  // the instrument stay. The link goes silent with no data since (a client stops pinging after two without data; the
  // daemon goes on).
  absl::SleepFor(absl::Seconds(7));
  EXPECT_EQ(client.ResetStream(reset).status().code(), absl::StatusCode::kFailedPrecondition);

  link.Freeze();
  const absl::Time frozen = absl::Now();
  absl::Status reset_status = client.ResetStream(reset).status();
  while (!reset_status.ok() && absl::Now() - frozen < absl::Seconds(30)) {
    EXPECT_EQ(reset_status.code(), absl::StatusCode::kFailedPrecondition) << reset_status;
    absl::SleepFor(absl::Milliseconds(50));
    reset_status = client.ResetStream(reset).status();
  }
  EXPECT_TRUE(reset_status.ok()) << reset_status;
  // A ping at most 0.5 s after the link went silent, the connection closed 3 s later (a timeout long enough that
  // the quiet phase above survives a sanitizer's stalls).
  EXPECT_LT(absl::Now() - frozen, absl::Seconds(15));
  // The call's end is logged once gRPC is done with it, after its instruments were freed (which the reset saw): under
  // ThreadSanitizer, once, not yet when the reset was taken.
  const std::string ended = "Stream failed: CANCELLED: the call was cancelled (the client cancelled or went away";
  for (const absl::Time give_up = absl::Now() + absl::Seconds(10);
       !absl::StrContains((*daemon)->Log(), ended) && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_THAT((*daemon)->Log(), HasSubstr(ended));
}

// Streamed events still queued when the drain's waits end no longer hold the exit: gRPC's shutdown waits for every
// call, and a Stream call finished only once its events were processed (a cut call's 32k events on `large` on the
// CPU held a drain 85 s, the second signal notwithstanding). They are dropped, a call still open is told where its
// instrument resumes, and the model is saved at once.
TEST(LifecycleTest, ASecondSignalEndsADrainThatQueuedStreamEventsHeld) {
  const absl::StatusOr<ModelConfig> config = NamedConfig("large");
  ASSERT_TRUE(config.ok()) << config.status();
  constexpr int kEvents = 16384;  // the most one call has unprocessed
  const testing::RandomBatch series = testing::MakeRandomBatch(*config, 1, kEvents, 29);
  v1::StreamRequest events;
  for (int t = 0; t < kEvents; ++t) {
    *events.add_events() = testing::FeatureEvent(series, config->n_features, t, "A", t + 1);
  }
  for (const bool cut : {true, false}) {
    SCOPED_TRACE(cut ? "the call cut" : "the call open");
    const ScopedTempDir temp("drain_queued_events");
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(
        temp.path() / "checkpoints", {"--drain_for_reads=600s", "--checkpoint_on_exit=exit.safetensors"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    client::PerceptionClient& client = (*daemon)->client();
    v1::InitModelRequest large;
    large.set_config_name("large");
    ASSERT_TRUE(client.InitModel(large).ok());
    std::unique_ptr<client::EventStream> stream = client.OpenStream([](const v1::StreamResponse&) {});
    ASSERT_TRUE(stream->Write(events));
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    absl::StatusOr<v1::ListStreamsResponse> listed;
    while ((listed = client.ListStreams()).ok() && listed->streams_size() == 0 && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_TRUE(listed.ok() && listed->streams_size() == 1) << "the events were not taken";
    if (cut) stream.reset();  // the client cancels the call
    (*daemon)->Signal(SIGTERM);
    // (Two signals the daemon has not yet taken are one.)
    while (!absl::StrContains((*daemon)->Log(), "Terminated: draining") && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    absl::SleepFor(absl::Milliseconds(200));
    const absl::Time second_signal = absl::Now();
    (*daemon)->Signal(SIGTERM);
    absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(120));
    ASSERT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
    EXPECT_LT(absl::Now() - second_signal, absl::Seconds(10)) << (*daemon)->Log();
    EXPECT_TRUE(std::filesystem::exists(temp.path() / "checkpoints" / "exit.safetensors")) << (*daemon)->Log();
    // The CPU backend's `large` ticks take far longer than the test's second: events were left. (A CUDA device may
    // have processed them all by then.)
    if (DaemonDevice() != "cpu") continue;
    EXPECT_THAT((*daemon)->Log(), HasSubstr("event(s) still to process were dropped unprocessed"));
    if (cut) continue;
    const absl::Status ended = stream->Finish();
    EXPECT_EQ(ended.code(), absl::StatusCode::kUnavailable) << ended;
    EXPECT_THAT(std::string(ended.message()), HasSubstr("the daemon exits: "));
    EXPECT_THAT(std::string(ended.message()), HasSubstr(" events of this call were not processed: 'A' from seq "));
  }
}

// A second signal ends --drain_grace too.
TEST(LifecycleTest, ASecondSignalEndsTheDrainGrace) {
  const ScopedTempDir temp("drain_grace_second_signal");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints", {"--drain_grace=600s"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  (*daemon)->Signal(SIGTERM);
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Time second_signal = absl::Now();
  (*daemon)->Signal(SIGTERM);
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
  EXPECT_LT(absl::Now() - second_signal, absl::Seconds(5));
}

// Convictions nobody reads hold the drain only for --drain_for_reads, or until a second signal; the log says why the
// wait ended and, as the listener closes, what was lost.
TEST(LifecycleTest, UnreadConvictionsHoldTheDrainForDrainForReadsOrUntilASecondSignal) {
  for (const bool second_signal : {false, true}) {
    SCOPED_TRACE(second_signal ? "second signal" : "limit");
    const ScopedTempDir temp("drain_unread_limit");
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(
        temp.path() / "checkpoints", {second_signal ? "--drain_for_reads=600s" : "--drain_for_reads=2s"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    client::PerceptionClient& client = (*daemon)->client();
    ASSERT_TRUE(client.InitModel(TinyInitRequest(4)).ok());
    absl::StatusOr<AcknowledgedStream> acknowledged = StreamUntilAcknowledged(client, 10, 17);
    ASSERT_TRUE(acknowledged.ok()) << acknowledged.status();

    (*daemon)->Signal(SIGTERM);
    const absl::Time signalled = absl::Now();
    (void)acknowledged->stream->Finish();
    if (second_signal) {
      absl::SleepFor(absl::Milliseconds(500));
      (*daemon)->Signal(SIGTERM);
    }
    absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
    ASSERT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
    if (!second_signal) {
      EXPECT_GE(absl::Now() - signalled, absl::Seconds(2));
    }
    const std::string why = second_signal ? "a second signal ended the wait" : "--drain_for_reads (2s) ran out";
    EXPECT_THAT((*daemon)->Log(),
                HasSubstr(absl::StrCat("10 conviction(s) of 1 stream(s) not read back and 0 event(s) still to process: "
                                       "the drain stops waiting for them (", why, "); calls in flight are still "
                                       "answered, their events processed, for up to 1m (a second signal drops the "
                                       "events left)")));
    EXPECT_THAT((*daemon)->Log(), HasSubstr("10 conviction(s) of 1 stream(s) not read back and 0 event(s) still to "
                                            "process: they are lost with the exit\n"));
    if (second_signal) {
      EXPECT_THAT((*daemon)->Log(), HasSubstr("Terminated again: the drain's waits end now"));
    }
  }
}

// A Train stream that is open but idle when the daemon drains (its client between batches) ends at once with
// UNAVAILABLE naming the drain, its step answered first, instead of holding the exit until the shutdown deadline.
TEST(LifecycleTest, AnIdleTrainStreamEndsAtOnceOnSigterm) {
  const ScopedTempDir temp("drain_train");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_TRUE((*daemon)->client().InitModel(TinyInitRequest(4)).ok());
  const std::unique_ptr<v1::Perception::Stub> stub =
      v1::Perception::NewStub(grpc::CreateChannel((*daemon)->target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  const auto stream = stub->Train(&context);
  const ModelConfig config = TinyConfig();
  ASSERT_TRUE(stream->Write(TrainRequest(testing::MakeRandomBatch(config, 2, 9, 1), config)));
  v1::TrainStepResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.step(), 1);

  (*daemon)->Signal(SIGTERM);
  const absl::Time signalled = absl::Now();
  EXPECT_FALSE(stream->Read(&response)) << "a response after the one step sent";
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(1)) << "the idle Train stream held up the drain";
  const grpc::Status ended = stream->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE) << ended.error_message();
  EXPECT_THAT(ended.error_message(), HasSubstr("draining"));
  // This test's connection stays open: the exit closes it rather than wait for the client (the test below).
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(5));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
}

// gRPC's shutdown waits for each client connection to close after its GOAWAY, which a C-core client reads on an idle
// channel only when its backup poller runs (every 5 s): the exit took 5 to 10 s while a client merely kept its
// channel, and the whole 60 s shutdown deadline while one watched the health. The exit waits for the calls it owes
// an answer, then closes the connections.
TEST(LifecycleTest, IdleConnectionsAndAnOpenHealthWatchDoNotHoldTheExit) {
  const ScopedTempDir temp("drain_idle");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_TRUE((*daemon)->client().InitModel(TinyInitRequest(4)).ok());  // its channel stays open, idle
  const std::unique_ptr<grpc::health::v1::Health::Stub> health =
      grpc::health::v1::Health::NewStub(grpc::CreateChannel((*daemon)->target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  const auto watch = health->Watch(&context, grpc::health::v1::HealthCheckRequest());
  grpc::health::v1::HealthCheckResponse seen;
  ASSERT_TRUE(watch->Read(&seen));
  EXPECT_EQ(seen.status(), ServingStatus::SERVING);

  (*daemon)->Signal(SIGTERM);
  const absl::Time signalled = absl::Now();
  ASSERT_TRUE(watch->Read(&seen));
  EXPECT_EQ(seen.status(), ServingStatus::NOT_SERVING);
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(90));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0) << (*daemon)->Log();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(3)) << "the idle connections or the watch held up the exit";
  while (watch->Read(&seen)) {
  }
  EXPECT_FALSE(watch->Finish().ok()) << "a watch the exit cut off";
}

// The value of the sample `series` (name and labels exactly as exposed); NaN when absent.
double Sample(const std::string& exposition, const std::string& series) {
  const std::string prefix = series + " ";
  for (const absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    double value = NAN;
    return absl::SimpleAtod(line.substr(prefix.size()), &value) ? value : NAN;
  }
  return NAN;
}

void ExpectPromtoolAccepts(const std::string& exposition, const std::filesystem::path& dir) {
  ASSERT_STRNE(PERCEPTION_PROMTOOL, "") << "promtool not found: install the Debian package `prometheus` (./dev deps)";
  const std::filesystem::path file = dir / "metrics.txt";
  std::ofstream(file) << exposition;
  const CommandResult result = RunCommand(absl::StrCat(PERCEPTION_PROMTOOL, " check metrics < ", file.string()));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output, "") << "promtool lint findings";
}

TEST(LifecycleTest, MetricsPassPromtoolAndCountTheWorkDone) {
  const ScopedTempDir temp("metrics");
  const std::filesystem::path& dir = temp.path();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(dir / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  absl::StatusOr<v1::InitModelResponse> model = client.InitModel(TinyInitRequest(8));
  ASSERT_TRUE(model.ok());

  absl::StatusOr<std::string> idle = HttpGet((*daemon)->metrics_port(), "/metrics");
  ASSERT_TRUE(idle.ok()) << idle.status();
  ExpectPromtoolAccepts(*idle, dir);
  EXPECT_EQ(Sample(*idle, "perception_train_steps_total"), 0);
  EXPECT_TRUE(std::isnan(Sample(*idle, "perception_train_loss")));  // no training yet: not a loss of 0
  // Every refusal series exists at 0 before its first refusal, so that rate() and increase() see that one.
  for (const std::string reason :
       {"invalid_argument", "failed_precondition", "not_found", "resource_exhausted", "unavailable"}) {
    EXPECT_EQ(Sample(*idle, absl::StrCat("perception_requests_rejected_total{reason=\"", reason, "\"}")), 0) << reason;
  }
  for (const std::string reason : {"instrument", "sequence", "features", "book", "exchange_time", "capacity",
                                    "model_change", "stopped", "no_model", "empty", "seeding", "payload",
                                    "call_ended"}) {
    EXPECT_EQ(Sample(*idle, absl::StrCat("perception_stream_events_rejected_total{reason=\"", reason, "\"}")), 0)
        << reason;
  }
  for (const std::string reason : {"failed_tick", "nonfinite_output"}) {
    EXPECT_EQ(Sample(*idle, absl::StrCat("perception_stream_events_dropped_total{reason=\"", reason, "\"}")), 0)
        << reason;
  }
  EXPECT_EQ(Sample(*idle, "perception_convictions_lost_reads_total"), 0);
  // The worker clears a job's start once the job has answered, so a scrape right after InitModel may still see it.
  EXPECT_LT(Sample(*idle, "perception_device_job_seconds"), 1.0) << "no job has run long on an idle device";

  const ModelConfig config = TinyConfig();
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(client.TrainStep(TrainRequest(testing::MakeRandomBatch(config, 2, 9, i), config)).ok());
  double last_loss = NAN;
  ASSERT_TRUE(client
                  .Train(
                      7,
                      [&](int i, v1::TrainStepRequest& request) {
                        request = TrainRequest(testing::MakeRandomBatch(config, 2, 9, 10 + i), config);
                        return true;
                      },
                      [&](const v1::TrainStepResponse& response) { last_loss = response.loss(); })
                  .ok());
  const testing::RandomBatch series = testing::MakeRandomBatch(config, 1, 3, 20);
  v1::StreamRequest events;
  for (int t = 0; t < 3; ++t) *events.add_events() = testing::FeatureEvent(series, config.n_features, t, "A", t + 1);
  const std::unique_ptr<client::EventStream> stream = client.OpenStream([](const v1::StreamResponse&) {});
  ASSERT_TRUE(stream->Write(events));
  ASSERT_TRUE(stream->Finish().ok());
  v1::TrainStepRequest bad = TrainRequest(testing::MakeRandomBatch(config, 2, 9, 30), config);
  bad.mutable_batch()->set_x(0, NAN);
  ASSERT_FALSE(client.TrainStep(bad).ok());
  v1::SaveCheckpointRequest save;
  save.set_name("m.safetensors");
  ASSERT_TRUE(client.SaveCheckpoint(save).ok());

  // A Train or Stream call is recorded once gRPC is done with it, which may be just after its client's Finish.
  const std::string train_session = R"(perception_rpc_session_seconds_count{code="OK",method="Train"})";
  const std::string stream_session = R"(perception_rpc_session_seconds_count{code="OK",method="Stream"})";
  absl::StatusOr<std::string> busy;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(30); absl::Now() < give_up;) {
    busy = HttpGet((*daemon)->metrics_port(), "/metrics");
    ASSERT_TRUE(busy.ok()) << busy.status();
    if (Sample(*busy, train_session) == 1 && Sample(*busy, stream_session) == 1) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ExpectPromtoolAccepts(*busy, dir);
  EXPECT_EQ(Sample(*busy, "perception_train_steps_total"), 12);
  EXPECT_EQ(Sample(*busy, "perception_train_step_seconds_count"), 12);
  EXPECT_GT(Sample(*busy, "perception_train_step_seconds_sum"), 0);
  EXPECT_NEAR(Sample(*busy, "perception_train_loss"), last_loss, 1e-9);
  EXPECT_EQ(Sample(*busy, R"(perception_rpc_duration_seconds_count{code="OK",method="TrainStep"})"), 5);
  // A bidirectional call lasts as long as its client keeps it open: its length is not an RPC latency.
  EXPECT_EQ(Sample(*busy, train_session), 1);
  EXPECT_EQ(Sample(*busy, stream_session), 1);
  EXPECT_TRUE(std::isnan(Sample(*busy, R"(perception_rpc_duration_seconds_count{code="OK",method="Train"})")));
  EXPECT_TRUE(std::isnan(Sample(*busy, R"(perception_rpc_duration_seconds_count{code="OK",method="Stream"})")));
  EXPECT_EQ(Sample(*busy, R"(perception_rpc_duration_seconds_count{code="INVALID_ARGUMENT",method="TrainStep"})"), 1);
  EXPECT_EQ(Sample(*busy, R"(perception_requests_rejected_total{reason="invalid_argument"})"), 1);
  EXPECT_EQ(Sample(*busy, R"(perception_checkpoint_duration_seconds_count{operation="save"})"), 1);
  EXPECT_EQ(Sample(*busy, "perception_model_parameters"), model->model().trained_parameters());
  EXPECT_EQ(Sample(*busy, "perception_queued_jobs"), 0);
  EXPECT_GT(Sample(*busy, "process_cpu_seconds_total"), 0);
  EXPECT_GT(Sample(*busy, "process_resident_memory_bytes"), 1e6);
  EXPECT_GE(Sample(*busy, "process_virtual_memory_bytes"), Sample(*busy, "process_resident_memory_bytes"));
  EXPECT_GT(Sample(*busy, "process_open_fds"), 3);
  EXPECT_GE(Sample(*busy, "process_max_fds"), Sample(*busy, "process_open_fds"));
  EXPECT_NEAR(Sample(*busy, "process_start_time_seconds"), absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()), 600);
  EXPECT_FALSE(HttpGet((*daemon)->metrics_port(), "/other").ok());

  // A loaded model has not trained yet: the loss of the model it replaced is not its own.
  v1::CloseStreamRequest close;
  close.set_instrument("A");
  ASSERT_TRUE(client.CloseStream(close).ok());
  v1::LoadCheckpointRequest load;
  load.set_name("m.safetensors");
  ASSERT_TRUE(client.LoadCheckpoint(load).ok());
  absl::StatusOr<std::string> loaded = HttpGet((*daemon)->metrics_port(), "/metrics");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(std::isnan(Sample(*loaded, "perception_train_loss")));
  EXPECT_EQ(Sample(*loaded, "perception_train_steps_total"), 12);

  (*daemon)->Signal(SIGINT);
  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

}  // namespace
}  // namespace perception::e2e
