// End-to-end test support: the real perceptiond on free loopback ports, HTTP scrapes, batches as messages.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/perception_client.h"
#include "engine/config.h"
#include "engine/dataset.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.pb.h"
#include "tests/file_util.h"
#include "tests/test_util.h"

namespace perception::e2e {

using testing::ScopedTempDir;

// A loopback port nothing was bound to a moment ago: a daemon binds it right after (a clash gets a retry).
int FreeLoopbackPort();

// The daemons' --device: cpu, or PERCEPTION_E2E_DEVICE where set (cuda: the tests that hold for either backend, run
// against the CUDA daemon on a CUDA host).
std::string DaemonDevice();

// A perceptiond process. The destructor kills it (SIGKILL) if it still runs.
class Daemon {
 public:
  // Starts perceptiond (--device=DaemonDevice(), free loopback ports for gRPC and metrics, checkpoints in
  // `checkpoint_dir`, then `flags`) and waits until its health is SERVING; a port taken in the meantime gets another
  // try.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const std::filesystem::path& checkpoint_dir,
                                                       const std::vector<std::string>& flags = {});
  ~Daemon();

  const std::string& target() const { return target_; }
  int metrics_port() const { return metrics_port_; }
  client::PerceptionClient& client() { return *client_; }
  pid_t pid() const { return pid_; }

  void Signal(int signal) const;
  // The exit code once the process ends within `timeout`; an error when it was killed by a signal or is still
  // running.
  absl::StatusOr<int> WaitForExit(absl::Duration timeout);
  // Everything the daemon logged so far.
  std::string Log() const;

 private:
  Daemon(pid_t pid, std::string target, int metrics_port, std::filesystem::path log_path);

  pid_t pid_;
  bool running_ = true;
  const std::string target_;
  const int metrics_port_;
  const std::filesystem::path log_path_;
  std::unique_ptr<client::PerceptionClient> client_;
};

// One bidirectional call of `method` ("/perception.v1.Perception/Stream") that writes each of `requests` as it is (a
// serialized message, or any bytes), half-closes, and reads to the end: the responses' bytes and the final status.
struct RawCallResult {
  std::vector<std::string> responses;
  grpc::Status status;
};
RawCallResult CallRaw(const std::string& target, const std::string& method, const std::vector<std::string>& requests);

// The float32 data of a .npy file written by perception eval (version 1.0 header); its header's dictionary (with the
// shape) into `header` where given. Empty where the file is shorter than a header.
std::vector<float> ReadNpy(const std::filesystem::path& path, std::string* header = nullptr);

// GET http://127.0.0.1:port/path: the body of a 200 answer, an error naming the status line otherwise.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// Runs a shell command; its exit code and everything it printed (stdout and stderr).
struct CommandResult {
  int exit_code = -1;       // -1 where it did not exit (a signal ended it, or it could not start)
  int ended_by_signal = 0;  // the signal that ended it, if one did
  std::string output;
};
CommandResult RunCommand(const std::string& command);

// The `tiny` config as InitModel's request with `seed`, and the same model's config for local comparisons.
v1::InitModelRequest TinyInitRequest(uint64_t seed);
ModelConfig TinyConfig();

v1::Batch ToProto(const testing::RandomBatch& batch, const ModelConfig& config);
v1::Batch ToProto(const Batch& batch);
v1::TrainStepRequest TrainRequest(const testing::RandomBatch& batch, const ModelConfig& config);
v1::EvaluateRequest EvaluateRequest(const testing::RandomBatch& batch, const ModelConfig& config,
                                    bool with_probabilities);
v1::Normalizer ToProto(const Normalizer& normalizer);

// An Evaluate answer without its timing: the bytes that equal weights and inputs must reproduce exactly.
std::string EvaluationBits(v1::EvaluateResponse response);

}  // namespace perception::e2e
