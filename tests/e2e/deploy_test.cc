// The daemon command lines that deploy/ ships (the systemd unit, the image's entrypoint, the Kubernetes args) take
// flags this perceptiond has, with values it accepts, and agree with the ports and the volume the files declare.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_util.h"

namespace perception::e2e {
namespace {

using ::testing::ElementsAre;

const std::filesystem::path kDeploy = PERCEPTION_DEPLOY_DIR;

// The file with each backslash-newline continuation joined into one line, as systemd and Docker read it.
std::string ReadJoined(const std::filesystem::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream text;
  text << in.rdbuf();
  return absl::StrReplaceAll(text.str(), {{"\\\n", " "}});
}

// The rest of the first line that starts with `key` (after leading spaces), or "" with a test failure.
std::string ValueOf(const std::string& text, absl::string_view key, const std::filesystem::path& path) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripLeadingAsciiWhitespace(line);
    if (absl::ConsumePrefix(&line, key)) return std::string(absl::StripAsciiWhitespace(line));
  }
  ADD_FAILURE() << path << " has no line starting with " << key;
  return "";
}

// A JSON array of strings (Docker's exec form, a YAML flow sequence of quoted strings).
std::vector<std::string> JsonWords(const std::string& array) {
  const nlohmann::json parsed = nlohmann::json::parse(array, nullptr, /*allow_exceptions=*/false);
  EXPECT_TRUE(parsed.is_array()) << array;
  return parsed.is_array() ? parsed.get<std::vector<std::string>>() : std::vector<std::string>{};
}

// The value of --name=VALUE among `words`, or "" with a test failure.
std::string FlagValue(const std::vector<std::string>& words, const std::string& name) {
  for (const std::string& word : words) {
    if (absl::StartsWith(word, absl::StrCat("--", name, "="))) return word.substr(name.size() + 3);
  }
  ADD_FAILURE() << "no --" << name << "= among " << absl::StrJoin(words, " ");
  return "";
}

// The flags `words` pass to the program, less those Daemon::Start sets itself (loopback ports, a temporary
// checkpoint folder, the CPU), whose values the other checks here compare across the files.
std::vector<std::string> FlagsBesidesTheTestsOwn(const std::vector<std::string>& words) {
  std::vector<std::string> flags;
  for (const std::string& word : words) {
    const bool tests_own = absl::StartsWith(word, "--listen=") || absl::StartsWith(word, "--metrics_listen=") ||
                           absl::StartsWith(word, "--checkpoint_dir=") || absl::StartsWith(word, "--device=");
    if (!tests_own) flags.push_back(word);
  }
  return flags;
}

// perceptiond with `flags` starts and serves; a model initialized on it can be evaluated.
void ExpectServesWith(const std::vector<std::string>& flags, const std::string& where) {
  SCOPED_TRACE(absl::StrCat(where, ": ", absl::StrJoin(flags, " ")));
  const ScopedTempDir temp("deploy_flags");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints", flags);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const absl::StatusOr<v1::InitModelResponse> init = (*daemon)->client().InitModel(TinyInitRequest(3));
  EXPECT_TRUE(init.ok()) << init.status();
}

// ExecStart's words: the bundle's env wrapper, the program, then its flags.
std::vector<std::string> SystemdCommand() {
  const std::filesystem::path unit = kDeploy / "systemd" / "perceptiond.service";
  return absl::StrSplit(ValueOf(ReadJoined(unit), "ExecStart=", unit), ' ', absl::SkipWhitespace());
}

struct ImageCommand {
  std::vector<std::string> entrypoint, cmd;
};
ImageCommand DockerfileCommand() {
  const std::filesystem::path dockerfile = kDeploy / "Dockerfile";
  const std::string text = ReadJoined(dockerfile);
  return {JsonWords(ValueOf(text, "ENTRYPOINT ", dockerfile)), JsonWords(ValueOf(text, "CMD ", dockerfile))};
}

TEST(DeployTest, TheSystemdUnitsCommandLineStartsTheDaemon) {
  const std::vector<std::string> command = SystemdCommand();
  ASSERT_GE(command.size(), 2u);
  EXPECT_EQ(command[0], "/opt/perceptiond/env");
  EXPECT_EQ(command[1], "perceptiond");
  const std::vector<std::string> flags(command.begin() + 2, command.end());
  EXPECT_EQ(FlagValue(flags, "device"), "cuda");
  // StateDirectory=perceptiond is /var/lib/perceptiond, the only place DynamicUser= with ProtectSystem=strict writes.
  EXPECT_TRUE(absl::StartsWith(FlagValue(flags, "checkpoint_dir"), "/var/lib/perceptiond/"));
  ExpectServesWith(FlagsBesidesTheTestsOwn(flags), "deploy/systemd/perceptiond.service");
}

TEST(DeployTest, TheImagesEntrypointStartsTheDaemonWithItsCmdAndWithTheKubernetesArgs) {
  const ImageCommand image = DockerfileCommand();
  ASSERT_GE(image.entrypoint.size(), 2u);
  EXPECT_EQ(image.entrypoint[0], "/opt/perceptiond/env");
  EXPECT_EQ(image.entrypoint[1], "perceptiond");
  const std::vector<std::string> entrypoint_flags(image.entrypoint.begin() + 2, image.entrypoint.end());
  EXPECT_THAT(image.cmd, ElementsAre("--device=cuda"));

  std::vector<std::string> with_cmd = FlagsBesidesTheTestsOwn(entrypoint_flags);
  for (const std::string& flag : FlagsBesidesTheTestsOwn(image.cmd)) with_cmd.push_back(flag);
  ExpectServesWith(with_cmd, "deploy/Dockerfile ENTRYPOINT + CMD");

  // Kubernetes' args replace the image's CMD and keep its ENTRYPOINT.
  const std::filesystem::path manifest = kDeploy / "kubernetes" / "perceptiond.yaml";
  const std::vector<std::string> args = JsonWords(ValueOf(ReadJoined(manifest), "args:", manifest));
  EXPECT_EQ(FlagValue(args, "device"), "cuda");
  std::vector<std::string> with_args = FlagsBesidesTheTestsOwn(entrypoint_flags);
  for (const std::string& flag : FlagsBesidesTheTestsOwn(args)) with_args.push_back(flag);
  ExpectServesWith(with_args, "deploy/Dockerfile ENTRYPOINT + deploy/kubernetes args");
}

// The ports the image exposes and the pod declares (and Prometheus is told to scrape) are the ones the entrypoint
// listens on, and the checkpoint volume is mounted where the entrypoint keeps its checkpoints.
TEST(DeployTest, TheImageAndThePodAgreeOnPortsAndTheCheckpointFolder) {
  const ImageCommand image = DockerfileCommand();
  const std::string grpc_port = std::string(absl::StripPrefix(FlagValue(image.entrypoint, "listen"), "0.0.0.0:"));
  const std::string metrics_port =
      std::string(absl::StripPrefix(FlagValue(image.entrypoint, "metrics_listen"), "0.0.0.0:"));
  const std::string checkpoint_dir = FlagValue(image.entrypoint, "checkpoint_dir");

  const std::filesystem::path dockerfile = kDeploy / "Dockerfile";
  EXPECT_EQ(ValueOf(ReadJoined(dockerfile), "EXPOSE ", dockerfile), absl::StrCat(grpc_port, " ", metrics_port));

  const std::filesystem::path manifest = kDeploy / "kubernetes" / "perceptiond.yaml";
  const std::string pod = ReadJoined(manifest);
  EXPECT_EQ(ValueOf(pod, "prometheus.io/port:", manifest), absl::StrCat("\"", metrics_port, "\""));
  EXPECT_TRUE(std::regex_search(pod, std::regex(absl::StrCat(R"(\{name: grpc, containerPort: )", grpc_port, R"(\})"))))
      << "no grpc containerPort " << grpc_port;
  EXPECT_TRUE(
      std::regex_search(pod, std::regex(absl::StrCat(R"(\{name: metrics, containerPort: )", metrics_port, R"(\})"))))
      << "no metrics containerPort " << metrics_port;
  EXPECT_TRUE(absl::StrContains(pod, absl::StrCat("mountPath: ", checkpoint_dir, "}")))
      << "no volume mounted at " << checkpoint_dir;
  EXPECT_TRUE(std::regex_search(pod, std::regex(absl::StrCat(R"(grpc: \{port: )", grpc_port, R"(\})"))))
      << "the health probes do not ask port " << grpc_port;
}

}  // namespace
}  // namespace perception::e2e
