// Data-parallel training from the client: rank checks and per-rank slices of each global batch.
#include "client/data_parallel.h"

#include "absl/strings/str_cat.h"

namespace perception::client {

void CopyWindows(const Batch& from, int first, int count, v1::Batch& to) {
  to.set_batch(count);
  to.set_window(from.window);
  to.set_n_features(from.n_features);
  to.set_n_horizons(from.n_horizons);
  const auto copy = [&](const std::vector<float>& source, size_t per_window,
                        google::protobuf::RepeatedField<float>* out) {
    out->Assign(source.begin() + first * per_window, source.begin() + (first + count) * per_window);
  };
  const size_t T = from.window;
  copy(from.x, T * from.n_features, to.mutable_x());
  copy(from.dt, T, to.mutable_dt());
  copy(from.labels, T * from.n_horizons, to.mutable_labels());
  copy(from.mask, T * from.n_horizons, to.mutable_mask());
}

absl::Status CheckRanks(std::span<const v1::GetStatusResponse> statuses, std::span<const std::string> targets) {
  const int n = static_cast<int>(statuses.size());
  for (int r = 0; r < n; ++r) {
    const v1::GetStatusResponse& s = statuses[r];
    const std::string who = absl::StrCat("target ", r, " (", targets[r], ")");
    if (!s.has_data_parallel() || s.data_parallel().rank() != r || s.data_parallel().world_size() != n) {
      return absl::FailedPreconditionError(absl::StrCat(
          who, " is ",
          s.has_data_parallel() ? absl::StrCat("rank ", s.data_parallel().rank(), " of ", s.data_parallel().world_size())
                                : "not part of a data-parallel job",
          "; --targets must list the ", n, " ranks of one job in rank order"));
    }
    if (!s.has_model()) {
      return absl::FailedPreconditionError(absl::StrCat(who, " has no model; run `perceptionctl init --targets ...`"));
    }
    if (s.model().config().SerializeAsString() != statuses[0].model().config().SerializeAsString() ||
        s.model().step() != statuses[0].model().step()) {
      return absl::FailedPreconditionError(absl::StrCat(who, " holds another model than rank 0 (config or step ",
                                                        s.model().step(), " vs ", statuses[0].model().step(),
                                                        "): init or load the same model on every rank"));
    }
  }
  return absl::OkStatus();
}

ShardedBatches::ShardedBatches(absl::AnyInvocable<void(Batch&)> sample, int world_size, int per_rank)
    : world_size_(world_size), per_rank_(per_rank), sample_(std::move(sample)) {}

void ShardedBatches::Shard(int step, int rank, v1::Batch& out) {
  absl::MutexLock lock(&mu_);
  while (sampled_ <= step) {
    Pending& next = pending_[sampled_++];
    sample_(next.batch);
    next.untaken = world_size_;
  }
  const auto it = pending_.find(step);
  CopyWindows(it->second.batch, rank * per_rank_, per_rank_, out);
  if (--it->second.untaken == 0) pending_.erase(it);
}

}  // namespace perception::client
