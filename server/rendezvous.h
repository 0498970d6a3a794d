// The data-parallel bootstrap over the daemons' own gRPC API: rank 0 serves NCCL's unique id (the Rendezvous
// service), the other ranks fetch it from rank 0's daemon, retrying until it is there or their timeout passes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"

namespace perception::server {

class RendezvousService final : public v1::Rendezvous::Service {
 public:
  // `world_size` 0: this daemon is not part of a data-parallel job, and refuses every call.
  RendezvousService(int rank, int world_size) : rank_(rank), world_size_(world_size) {}

  // Rank 0: from now on, GetUniqueId hands out `unique_id` to each other rank of the job, to one process each.
  void Publish(std::string unique_id);

  grpc::Status GetUniqueId(grpc::ServerContext* context, const v1::GetUniqueIdRequest* request,
                           v1::GetUniqueIdResponse* response) override;

 private:
  const int rank_, world_size_;
  absl::Mutex mu_;
  std::optional<std::string> unique_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, uint64_t> handed_to_ ABSL_GUARDED_BY(mu_);  // rank → the process (asker) given the id
};

// Rank `rank` of `world_size` asks rank 0's daemon at `target` for the unique id until it answers or `timeout`
// passes (DEADLINE_EXCEEDED naming the last answer); a refusal other than "not yet" ends the wait at once.
absl::StatusOr<std::string> FetchUniqueId(const std::string& target, int rank, int world_size,
                                          absl::Duration timeout);

}  // namespace perception::server
