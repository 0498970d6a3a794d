// Rank 0's Rendezvous service and the other ranks' fetch of NCCL's unique id.
#include "server/rendezvous.h"

#include <algorithm>
#include <cstdint>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace perception::server {
namespace {

// Between two asks of a rank 0 that is not up yet, and how long one ask may take.
constexpr absl::Duration kRetryInterval = absl::Milliseconds(200);
constexpr absl::Duration kAskTimeout = absl::Seconds(2);

}  // namespace

void RendezvousService::Publish(std::string unique_id) {
  absl::MutexLock lock(&mu_);
  unique_id_ = std::move(unique_id);
}

grpc::Status RendezvousService::GetUniqueId(grpc::ServerContext*, const v1::GetUniqueIdRequest* request,
                                            v1::GetUniqueIdResponse* response) {
  if (world_size_ == 0 || rank_ != 0) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            world_size_ == 0 ? "this daemon is not part of a data-parallel job (no --world_size)"
                             : absl::StrCat("this daemon is rank ", rank_, ", not rank 0: ask the first of --peers")};
  }
  if (request->world_size() != world_size_ || request->rank() < 1 || request->rank() >= world_size_) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("rank 0 leads a job of world size ", world_size_, "; rank ", request->rank(), " of ",
                         request->world_size(), " does not belong to it")};
  }
  absl::MutexLock lock(&mu_);
  if (!unique_id_.has_value()) return {grpc::StatusCode::UNAVAILABLE, "rank 0 has not created the NCCL unique id yet"};
  // Another process asking as a rank already handed the id has restarted (or runs as the same rank): the id names a
  // job that formed, or is forming, with the first, whose bootstrap it cannot join again. It waited out
  // --collective_timeout blaming a peer, and crash-looped under a supervisor. The same process asking again (a retry
  // whose answer was lost) is answered again.
  const auto [handed, first_ask] = handed_to_.try_emplace(request->rank(), request->asker());
  if (!first_ask && handed->second != request->asker()) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("rank ", request->rank(), " was handed this job's NCCL unique id already, by another "
                         "process: a rank that restarted cannot rejoin the job it formed; restart every rank")};
  }
  response->set_unique_id(*unique_id_);
  return grpc::Status::OK;
}

absl::StatusOr<std::string> FetchUniqueId(const std::string& target, int rank, int world_size,
                                          absl::Duration timeout) {
  const std::unique_ptr<v1::Rendezvous::Stub> stub =
      v1::Rendezvous::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  v1::GetUniqueIdRequest request;
  request.set_rank(rank);
  request.set_world_size(world_size);
  request.set_asker((uint64_t{std::random_device{}()} << 32) | std::random_device{}());
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + kAskTimeout)));
    v1::GetUniqueIdResponse response;
    const grpc::Status status = stub->GetUniqueId(&context, request, &response);
    if (status.ok()) return response.unique_id();
    const bool not_yet = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!not_yet) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat("rank 0 at ", target, " refused rank ", rank, ": ", status.error_message()));
    }
    if (absl::Now() + kRetryInterval >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("rank ", rank, " of ", world_size, ": rank 0 at ", target,
                                                      " did not hand out the NCCL unique id within ",
                                                      absl::FormatDuration(timeout), " (last answer: ",
                                                      status.error_message(), ")"));
    }
    absl::SleepFor(kRetryInterval);
  }
}

}  // namespace perception::server
