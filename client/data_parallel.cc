// Data-parallel training from the client: rank checks, per-rank slices of each global batch, and the ranks' streams
// run together.
#include "client/data_parallel.h"

#include <algorithm>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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

namespace {

// What of the normalizer, optimizer, precision and replica checks `rank` holds otherwise than `first`, "" if nothing.
std::string RankDifference(const v1::GetStatusResponse& first, const v1::GetStatusResponse& rank) {
  std::vector<std::string> differences;
  if (rank.model().normalizer_fitted() != first.model().normalizer_fitted()) {
    differences.push_back(absl::StrCat("normalizer (", rank.model().normalizer_fitted() ? "fitted" : "not fitted",
                                       " vs ", first.model().normalizer_fitted() ? "fitted" : "not fitted", ")"));
  } else if (rank.model().normalizer().SerializeAsString() != first.model().normalizer().SerializeAsString()) {
    differences.push_back("normalizer (its values)");
  }
  if (rank.model().optimizer().SerializeAsString() != first.model().optimizer().SerializeAsString()) {
    differences.push_back("optimizer settings");
  }
  if (rank.device().precision() != first.device().precision()) {
    differences.push_back(absl::StrCat("precision (", rank.device().precision(), " vs ", first.device().precision(),
                                       ")"));
  }
  if (rank.data_parallel().replica_check_every() != first.data_parallel().replica_check_every()) {
    differences.push_back(absl::StrCat("--replica_check_every (", rank.data_parallel().replica_check_every(), " vs ",
                                       first.data_parallel().replica_check_every(), ")"));
  }
  return absl::StrJoin(differences, ", ");
}

}  // namespace

absl::Status CheckRanks(std::span<const v1::GetStatusResponse> statuses, std::span<const std::string> targets) {
  const int n = static_cast<int>(statuses.size());
  for (int r = 0; r < n; ++r) {
    const v1::GetStatusResponse& s = statuses[r];
    const std::string who = absl::StrCat("target ", r, " (", targets[r], ")");
    if (!s.has_data_parallel() || s.data_parallel().rank() != r || s.data_parallel().world_size() != n) {
      const v1::DataParallelStatus& p = s.data_parallel();
      return absl::FailedPreconditionError(absl::StrCat(
          who, " is ",
          s.has_data_parallel() ? absl::StrCat("rank ", p.rank(), " of ", p.world_size())
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
    // Beside the model's shape and step, what every rank must share for their updates to stay identical: a rank
    // without the normalizer trains on unstandardized inputs (a run stopped after fitting rank 0's), another optimizer
    // or precision diverges from the first step, and another --replica_check_every pairs one rank's checksum
    // all-gather with its peers' next step's sums (NCCL: undefined). Another normalizer's values would also show in
    // the replica check's checksum, but only after a step, and a rank whose normalizer refuses its slice of a batch
    // (the standardized bound) leaves its peers in the step's all-reduce.
    const std::string differs = RankDifference(statuses[0], s);
    if (!differs.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          who, " differs from rank 0 in its ", differs, ": the ranks' updates would not stay identical (save on rank "
          "0 and load the checkpoint on every rank, or init every rank, with the same perceptiond flags)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTargets(std::span<const v1::GetStatusResponse> statuses, std::span<const std::string> targets) {
  const bool any_rank = std::any_of(statuses.begin(), statuses.end(),
                                    [](const v1::GetStatusResponse& s) { return s.has_data_parallel(); });
  if (statuses.size() == 1 && !any_rank) return absl::OkStatus();  // one daemon of its own
  // One rank of a job alone would take steps its peers never join (their collectives wait on it).
  if (statuses.size() == 1 && statuses[0].data_parallel().world_size() != 1) {
    const v1::DataParallelStatus& p = statuses[0].data_parallel();
    return absl::FailedPreconditionError(absl::StrCat(
        "the daemon at ", targets[0], " is rank ", p.rank(), " of ", p.world_size(), " of a data-parallel job: "
        "give --targets the job's ", p.world_size(), " ranks in rank order"));
  }
  return CheckRanks(statuses, targets);
}

ShardedBatches::ShardedBatches(absl::AnyInvocable<void(Batch&)> sample, int world_size, int per_rank,
                               absl::AnyInvocable<bool()> stop)
    : world_size_(world_size), per_rank_(per_rank), sample_(std::move(sample)), stop_(std::move(stop)) {}

bool ShardedBatches::Shard(int step, int rank, v1::Batch& out) {
  absl::MutexLock lock(&mu_);
  // Decided under the lock the sampling takes: a rank behind the others still gets every batch they got, and none
  // gets one more, so that a data-parallel job's ranks stop at one step (else one would wait in a collective its
  // peers never join, until the job aborts).
  stopped_ = stopped_ || (stop_ != nullptr && stop_());
  if (stopped_ && step >= sampled_) return false;
  while (sampled_ <= step) {
    Pending& next = pending_[sampled_++];
    if (!spare_.empty()) {
      next.batch = std::move(spare_.back());
      spare_.pop_back();
    }
    sample_(next.batch);
    next.untaken = world_size_;
  }
  const auto it = pending_.find(step);
  CopyWindows(it->second.batch, rank * per_rank_, per_rank_, out);
  if (--it->second.untaken == 0) {
    spare_.push_back(std::move(it->second.batch));
    pending_.erase(it);
  }
  return true;
}

absl::Status TrainRanks(std::span<PerceptionClient* const> ranks, int steps, ShardedBatches& batches,
                        absl::FunctionRef<void(const v1::TrainStepResponse&)> on_rank0_response,
                        CallCancellation* cancellation_from_caller) {
  CallCancellation own_cancellation;
  CallCancellation& cancellation = cancellation_from_caller != nullptr ? *cancellation_from_caller : own_cancellation;
  absl::Mutex mu;
  std::optional<size_t> first_failure;  // guarded by mu
  bool cancelled_by_caller = false;     // guarded by mu: the first failure came of the caller's Cancel
  std::vector<absl::Status> results(ranks.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      results[r] = ranks[r]->Train(
          steps,
          [&](int step, v1::TrainStepRequest& request) { return batches.Shard(step, r, *request.mutable_batch()); },
          [&](const v1::TrainStepResponse& response) {
            if (r == 0) on_rank0_response(response);
          },
          &cancellation);
      if (results[r].ok()) return;
      absl::MutexLock lock(&mu);
      if (!first_failure) {
        first_failure = r;
        cancelled_by_caller = cancellation.cancelled();
        cancellation.Cancel();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  if (!first_failure) return absl::OkStatus();
  // Cancelled by the caller, every rank's call ended alike, whichever came first: rank 0's answers are the run's.
  const size_t reported = cancelled_by_caller && !results[0].ok() ? 0 : *first_failure;
  const absl::Status& failed = results[reported];
  if (ranks.size() == 1) return failed;
  return absl::Status(failed.code(), absl::StrCat("rank ", reported, " (", ranks[reported]->target(), "): ",
                                                  failed.message(),
                                                  cancelled_by_caller ? " (every rank's call was cancelled)"
                                                                      : " (the other ranks' streams were stopped)"));
}

}  // namespace perception::client
