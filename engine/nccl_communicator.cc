// The NCCL communicator of one data-parallel rank: non-blocking init, the in-graph sums, a watchdog wait that aborts
// the communicator instead of hanging, and the parameter checksum across ranks.
#include "engine/nccl_communicator.h"

#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/cuda_check.h"
#include "engine/status_macros.h"

namespace perception {
namespace {

// How often a wait looks at the stream and the communicator: short next to a training step, long next to a query.
constexpr absl::Duration kPollInterval = absl::Microseconds(20);

std::string NcclError(ncclResult_t result, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return absl::StrCat(ncclGetErrorString(result), last != nullptr && *last != '\0' ? absl::StrCat(": ", last) : "");
}

}  // namespace

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  if (const ncclResult_t result = ncclGetUniqueId(&id); result != ncclSuccess) {
    return absl::UnavailableError(absl::StrCat("ncclGetUniqueId failed: ", NcclError(result, nullptr)));
  }
  return std::string(id.internal, sizeof(id.internal));
}

uint64_t ParamChecksum(std::span<const float> params) {
  uint64_t hash = 14695981039346656037ull;
  const auto* bytes = reinterpret_cast<const unsigned char*>(params.data());
  for (size_t i = 0; i < params.size_bytes(); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(std::string_view unique_id,
                                                                           const DataParallelOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL: rank ", options.rank, " does not fit a world of size ",
                                                   options.world_size));
  }
  if (unique_id.size() != kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL: a unique id has ", kNcclUniqueIdBytes, " bytes, got ", unique_id.size()));
  }
  if (options.timeout <= absl::ZeroDuration() || options.check_every < 0) {
    return absl::InvalidArgumentError("NCCL: the timeout must be positive and check_every at least 0");
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  std::unique_ptr<NcclCommunicator> communicator(new NcclCommunicator(options));
  CUDA_RETURN_IF_ERROR(
      cudaMalloc(&communicator->device_checksums_, (options.world_size + 1) * sizeof(*communicator->device_checksums_)));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; Await bounds how long the job may take
  const absl::Time deadline = absl::Now() + options.timeout;
  const ncclResult_t started =
      ncclCommInitRankConfig(&communicator->comm_, options.world_size, id, options.rank, &config);
  RETURN_IF_ERROR(communicator->Await(started, "joining the communicator", deadline));
  communicator->joined_ = true;
  return communicator;
}

NcclCommunicator::~NcclCommunicator() {
  // Destruction cannot report errors: flush and free the communicator when it is healthy, abort it otherwise.
  if (comm_ != nullptr) {
    ncclResult_t result = ncclCommFinalize(comm_);
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (result == ncclInProgress && absl::Now() < deadline) {
      absl::SleepFor(kPollInterval);
      ncclCommGetAsyncError(comm_, &result);
    }
    if (result == ncclSuccess) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
  }
  if (device_checksums_ != nullptr) cudaFree(device_checksums_);
}

absl::Status NcclCommunicator::Await(ncclResult_t result, const char* what, absl::Time deadline) {
  while (result == ncclInProgress) {
    if (absl::Now() > deadline) {
      return Abort(absl::DeadlineExceededError(absl::StrCat(
          "NCCL rank ", rank(), " of ", world_size(), ": ", what, " did not complete within ",
          absl::FormatDuration(options_.timeout), " (a peer rank died, stalled or never joined); communicator aborted")));
    }
    absl::SleepFor(kPollInterval);
    if (const ncclResult_t polled = ncclCommGetAsyncError(comm_, &result); polled != ncclSuccess) result = polled;
  }
  if (result != ncclSuccess) {
    return Abort(absl::AbortedError(absl::StrCat("NCCL rank ", rank(), " of ", world_size(), ": ", what,
                                                 " failed: ", NcclError(result, comm_), "; communicator aborted")));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Usable() const {
  if (broken_.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("the data-parallel communicator was aborted (",
                                                    broken_.message(), "); restart every rank of the job"));
}

absl::Status NcclCommunicator::Abort(absl::Status reason) {
  if (comm_ != nullptr && joined_) {
    // ncclCommAbort stops this rank's collectives first, then reclaims the communicator, which within a node can wait
    // on a peer that was killed (NVIDIA/nccl#863; seen on two H200s: the daemon's worker blocked there after a kill -9
    // of rank 1). A detached thread finishes the abort, so the error reaches the caller now.
    std::thread([comm = comm_] { ncclCommAbort(comm); }).detach();
  } else if (comm_ != nullptr) {
    ncclCommAbort(comm_);  // a join that timed out: measured to return at once (the lone-rank tests)
  }
  comm_ = nullptr;
  broken_ = reason;
  return reason;
}

absl::Status NcclCommunicator::SumInPlace(float* data, size_t count, cudaStream_t stream) {
  RETURN_IF_ERROR(Usable());
  return Await(ncclAllReduce(data, data, count, ncclFloat32, ncclSum, comm_, stream), "an all-reduce",
               absl::Now() + options_.timeout);
}

absl::Status NcclCommunicator::SumInPlace(double* data, size_t count, cudaStream_t stream) {
  RETURN_IF_ERROR(Usable());
  return Await(ncclAllReduce(data, data, count, ncclFloat64, ncclSum, comm_, stream), "an all-reduce",
               absl::Now() + options_.timeout);
}

absl::Status NcclCommunicator::Synchronize(cudaStream_t stream) {
  RETURN_IF_ERROR(Usable());
  const absl::Time deadline = absl::Now() + options_.timeout;
  for (;;) {
    const cudaError_t queried = cudaStreamQuery(stream);
    if (queried == cudaSuccess) return absl::OkStatus();
    if (queried != cudaErrorNotReady) CUDA_RETURN_IF_ERROR_OF(queried, "cudaStreamQuery(stream)");
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t polled = ncclCommGetAsyncError(comm_, &state); polled != ncclSuccess) state = polled;
    if (state != ncclSuccess && state != ncclInProgress) {
      return Abort(absl::AbortedError(absl::StrCat("NCCL rank ", rank(), " of ", world_size(),
                                                   ": a peer rank failed during the step: ", NcclError(state, comm_),
                                                   "; communicator aborted")));
    }
    if (absl::Now() > deadline) {
      return Abort(absl::DeadlineExceededError(absl::StrCat(
          "NCCL rank ", rank(), " of ", world_size(), ": the step did not complete within ",
          absl::FormatDuration(options_.timeout), " (a peer rank died or stalled); communicator aborted")));
    }
    absl::SleepFor(kPollInterval);
  }
}

absl::Status NcclCommunicator::CheckReplicas(std::span<const float> params, int64_t step, cudaStream_t stream) {
  RETURN_IF_ERROR(Usable());
  const int n = world_size();
  const uint64_t mine = ParamChecksum(params);
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(device_checksums_ + n, &mine, sizeof(mine), cudaMemcpyHostToDevice, stream));
  RETURN_IF_ERROR(Await(ncclAllGather(device_checksums_ + n, device_checksums_, 1, ncclUint64, comm_, stream),
                        "the parameter checksum all-gather", absl::Now() + options_.timeout));
  RETURN_IF_ERROR(Synchronize(stream));
  std::vector<uint64_t> all(n);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(all.data(), device_checksums_, n * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  std::vector<std::string> differing;
  for (int r = 1; r < n; ++r) {
    if (all[r] != all[0]) differing.push_back(absl::StrCat("rank ", r, " has 0x", absl::Hex(all[r])));
  }
  if (differing.empty()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("data-parallel parameters diverged after step ", step, ": rank 0 has 0x",
                                          absl::Hex(all[0]), ", ", absl::StrJoin(differing, ", ")));
}

}  // namespace perception
