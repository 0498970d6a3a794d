// Data-parallel training across daemons: one NCCL communicator per daemon (one rank per GPU), the sums the training
// step enqueues inside its captured graph, a watchdog wait that never hangs on a dead or stalled peer, and the
// cross-rank parameter checksum.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/backend.h"

namespace perception {

// The opaque ncclUniqueId rank 0 creates and the other ranks receive (over the daemons' gRPC API).
inline constexpr size_t kNcclUniqueIdBytes = sizeof(ncclUniqueId);

// A new unique id (NCCL_UNIQUE_ID_BYTES raw bytes). NCCL starts its bootstrap listener in this process, so rank 0
// must create it itself.
absl::StatusOr<std::string> NewNcclUniqueId();

class NcclCommunicator {
 public:
  // Joins the communicator named by `unique_id` as options.rank of options.world_size on the current CUDA device.
  // Non-blocking underneath: if the other ranks have not all joined within options.timeout, the attempt is aborted
  // and DEADLINE_EXCEEDED returned, never a hang.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(std::string_view unique_id,
                                                                  const DataParallelOptions& options);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  int64_t check_every() const { return options_.check_every; }

  // OK until the communicator was aborted; then FAILED_PRECONDITION with the reason. A captured step must not be
  // replayed after that: its collectives refer to the aborted communicator.
  absl::Status Usable() const;

  // Enqueue on `stream` the in-place sum over all ranks of `count` values. Capturable: no host synchronization, so
  // a training graph records them. Every rank must issue the same sums in the same order. NCCL's ring reduces each
  // element once and broadcasts it, so every rank receives the same bits.
  absl::Status SumInPlace(float* data, size_t count, cudaStream_t stream);
  absl::Status SumInPlace(double* data, size_t count, cudaStream_t stream);

  // Waits for `stream` while watching the communicator: a peer's failure that NCCL reports (ABORTED) or no
  // completion within the timeout (DEADLINE_EXCEEDED) aborts the communicator, which releases the stream, and
  // returns the reason. After that every call answers FAILED_PRECONDITION with the original reason.
  absl::Status Synchronize(cudaStream_t stream);

  // Compares a checksum of `params` (this rank's parameters after optimizer step `step`) across the ranks, through
  // an all-gather on `stream` (not capturable: it waits). DATA_LOSS naming the ranks that differ from rank 0.
  absl::Status CheckReplicas(std::span<const float> params, int64_t step, cudaStream_t stream);

 private:
  explicit NcclCommunicator(const DataParallelOptions& options) : options_(options) {}
  // After a non-blocking call: polls until NCCL no longer reports it in progress, or aborts at `deadline`.
  absl::Status Await(ncclResult_t result, const char* what, absl::Time deadline);
  // Aborts the communicator and remembers `reason` for every later call. Once the job has formed, the abort finishes
  // on a detached thread (see the definition).
  absl::Status Abort(absl::Status reason);

  const DataParallelOptions options_;
  ncclComm_t comm_ = nullptr;
  bool joined_ = false;  // every rank joined: an abort may then wait on peers, a failed join's abort does not
  absl::Status broken_;
  uint64_t* device_checksums_ = nullptr;  // [world_size] gathered, then this rank's own
};

// The checksum CheckReplicas compares: FNV-1a over the bytes of `params`.
uint64_t ParamChecksum(std::span<const float> params);

}  // namespace perception
