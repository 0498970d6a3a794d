// End-to-end test support: starting and stopping perceptiond, scraping /metrics, building requests.
#include "tests/e2e/e2e_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/batch_message.h"

extern char** environ;

namespace perception::e2e {
namespace {

constexpr int kStartAttempts = 3;
constexpr absl::Duration kStartTimeout = absl::Seconds(20);

// A shell starts its background jobs (`e2e_tests &`, as the CUDA host's sharded runs do) with SIGINT ignored, and
// every command the tests start would inherit that: perceptionctl leaves an ignored signal alone, as it should, so
// the tests that interrupt it need SIGINT at its default in this process, before any command starts.
const bool kInterruptAtItsDefault = [] {
  struct sigaction action = {};
  if (sigaction(SIGINT, nullptr, &action) == 0 && action.sa_handler == SIG_IGN) std::signal(SIGINT, SIG_DFL);
  return true;
}();

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& arguments, const std::filesystem::path& log_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> argv;
  for (const std::string& argument : arguments) argv.push_back(const_cast<char*>(argument.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int error = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": ", std::strerror(error)));
  return pid;
}

void CopyFloats(const std::vector<float>& from, google::protobuf::RepeatedField<float>* to) {
  to->Assign(from.begin(), from.end());
}

}  // namespace

int FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(address);
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), size);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size);
  ::close(fd);
  return ntohs(address.sin_port);
}

std::string DaemonDevice() {
  const char* device = std::getenv("PERCEPTION_E2E_DEVICE");
  return device != nullptr && *device != '\0' ? device : "cpu";
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const std::filesystem::path& checkpoint_dir,
                                                      const std::vector<std::string>& flags) {
  absl::Status exited;
  for (int attempt = 0; attempt < kStartAttempts; ++attempt) {
    const int port = FreeLoopbackPort(), metrics_port = FreeLoopbackPort();
    const std::string target = absl::StrCat("127.0.0.1:", port);
    const std::filesystem::path log_path = checkpoint_dir.parent_path() / absl::StrCat("perceptiond.", port, ".log");
    std::vector<std::string> arguments = {PERCEPTIOND_PATH, absl::StrCat("--device=", DaemonDevice()),
                                          "--listen=" + target,
                                          absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port),
                                          "--checkpoint_dir=" + checkpoint_dir.string()};
    arguments.insert(arguments.end(), flags.begin(), flags.end());
    absl::StatusOr<pid_t> pid = Spawn(arguments, log_path);
    if (!pid.ok()) return pid.status();
    std::unique_ptr<Daemon> daemon(new Daemon(*pid, target, metrics_port, log_path));
    const absl::Time deadline = absl::Now() + kStartTimeout;
    while (absl::Now() < deadline) {
      if (daemon->client().WaitUntilServing(absl::Milliseconds(250)).ok()) return daemon;
      absl::StatusOr<int> code = daemon->WaitForExit(absl::ZeroDuration());
      if (code.ok() || code.status().code() != absl::StatusCode::kDeadlineExceeded) {
        exited = absl::UnavailableError(absl::StrCat("perceptiond exited at startup:\n", daemon->Log()));
        break;  // e.g. a port taken between FreeLoopbackPort and its bind: try others
      }
    }
    if (exited.ok()) {
      return absl::DeadlineExceededError(
          absl::StrCat("perceptiond is not serving after ", absl::FormatDuration(kStartTimeout), ":\n", daemon->Log()));
    }
  }
  return exited;
}

Daemon::Daemon(pid_t pid, std::string target, int metrics_port, std::filesystem::path log_path)
    : pid_(pid),
      target_(std::move(target)),
      metrics_port_(metrics_port),
      log_path_(std::move(log_path)),
      client_(
          std::make_unique<client::PerceptionClient>(target_, client::ClientOptions{.timeout = absl::Seconds(60)})) {}

Daemon::~Daemon() {
  if (!running_) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
}

void Daemon::Signal(int signal) const { ::kill(pid_, signal); }

absl::StatusOr<int> Daemon::WaitForExit(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int wait_status = 0;
    const pid_t done = ::waitpid(pid_, &wait_status, WNOHANG);
    if (done == pid_) {
      running_ = false;
      if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
      return absl::AbortedError(absl::StrCat("perceptiond was killed by signal ", WTERMSIG(wait_status)));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("perceptiond still runs after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string Daemon::Log() const {
  std::ifstream file(log_path_);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

std::vector<float> ReadNpy(const std::filesystem::path& path, std::string* header) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (bytes.size() < 10) return {};
  const size_t header_size = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
  if (bytes.size() < 10 + header_size) return {};
  if (header != nullptr) *header = bytes.substr(10, header_size);
  std::vector<float> data((bytes.size() - 10 - header_size) / sizeof(float));
  std::memcpy(data.data(), bytes.data() + 10 + header_size, data.size() * sizeof(float));
  return data;
}

RawCallResult CallRaw(const std::string& target, const std::string& method, const std::vector<std::string>& requests) {
  const std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  // (What a generated stub does for a bidirectional method, with messages of bytes: gRPC's own ByteBuffer traits.
  // grpc::internal is not a stable interface; a gRPC upgrade may move it.)
  const grpc::internal::RpcMethod rpc(method.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> call(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(), rpc,
                                                                                            &context));
  for (const std::string& request : requests) {
    grpc::Slice slice(request);
    if (!call->Write(grpc::ByteBuffer(&slice, 1))) break;
  }
  call->WritesDone();
  RawCallResult result;
  for (grpc::ByteBuffer response; call->Read(&response);) {
    std::vector<grpc::Slice> slices;
    if (!response.Dump(&slices).ok()) continue;
    std::string& bytes = result.responses.emplace_back();
    for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  result.status = call->Finish();
  return result;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to port ", port, ": ", std::strerror(errno)));
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  std::array<char, 4096> chunk;
  for (ssize_t n; (n = ::recv(fd, chunk.data(), chunk.size(), 0)) > 0;) response.append(chunk.data(), n);
  ::close(fd);
  const size_t head_end = response.find("\r\n\r\n");
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (head_end == std::string::npos || status_line.find(" 200 ") == std::string::npos) {
    return absl::NotFoundError(absl::StrCat("GET ", path, ": ", status_line));
  }
  return response.substr(head_end + 4);
}

CommandResult RunCommand(const std::string& command) {
  CommandResult result;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> chunk;
  for (size_t n; (n = std::fread(chunk.data(), 1, chunk.size(), pipe)) > 0;) result.output.append(chunk.data(), n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.ended_by_signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  return result;
}

v1::InitModelRequest TinyInitRequest(uint64_t seed) {
  v1::InitModelRequest request;
  request.set_config_name("tiny");
  request.set_seed(seed);
  return request;
}

ModelConfig TinyConfig() { return *NamedConfig("tiny"); }

v1::Batch ToProto(const testing::RandomBatch& batch, const ModelConfig& config) {
  return testing::BatchMessage(batch, config);
}

v1::Batch ToProto(const Batch& batch) {
  return testing::BatchMessage(batch.batch, batch.window, batch.n_features, batch.n_horizons, batch.x, batch.dt,
                               batch.labels, batch.mask);
}

v1::TrainStepRequest TrainRequest(const testing::RandomBatch& batch, const ModelConfig& config) {
  v1::TrainStepRequest request;
  *request.mutable_batch() = ToProto(batch, config);
  return request;
}

v1::EvaluateRequest EvaluateRequest(const testing::RandomBatch& batch, const ModelConfig& config,
                                    bool with_probabilities) {
  v1::EvaluateRequest request;
  *request.mutable_batch() = ToProto(batch, config);
  request.set_return_probabilities(with_probabilities);
  return request;
}

v1::Normalizer ToProto(const Normalizer& normalizer) {
  v1::Normalizer message;
  CopyFloats(normalizer.mean, message.mutable_mean());
  CopyFloats(normalizer.inv_std, message.mutable_inv_std());
  return message;
}

std::string EvaluationBits(v1::EvaluateResponse response) {
  response.clear_device_seconds();
  return response.SerializeAsString();
}

}  // namespace perception::e2e
