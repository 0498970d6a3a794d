// perceptionctl's side of data-parallel training (perceptionctl train --targets): the ranks checked against the
// targets, every global batch sampled once and cut into per-rank slices, and the ranks' streams run together.
#pragma once

#include <map>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "client/perception_client.h"
#include "engine/dataset.h"
#include "perception/v1/perception.pb.h"

namespace perception::client {

// Windows [first, first + count) of `from` as a Batch message.
void CopyWindows(const Batch& from, int first, int count, v1::Batch& to);

// OK when statuses[i] (target i's GetStatus) is rank i of a data-parallel job of statuses.size() ranks, every
// rank with a model of the same config at the same step; otherwise FAILED_PRECONDITION naming the target.
absl::Status CheckRanks(std::span<const v1::GetStatusResponse> statuses, std::span<const std::string> targets);

// The targets of `train`: OK for one daemon outside any data-parallel job; otherwise CheckRanks, so that one target
// that reports a rank of a job of several (which alone would train without its peers) is refused too.
absl::Status CheckTargets(std::span<const v1::GetStatusResponse> statuses, std::span<const std::string> targets);

// The global batches of a data-parallel run, each sampled once: rank r of N gets windows [r·B, (r+1)·B) of every
// global batch of N·B windows, so N ranks see exactly the windows that one daemon would on N·B-window batches (and
// with N = 1, exactly what a plain run samples). Thread-safe: each rank's stream takes its slices from its own
// thread; a global batch is dropped once every rank has taken its slice.
class ShardedBatches {
 public:
  // `sample` fills the next global batch of world_size · per_rank windows, overwriting whatever the batch it is given
  // holds (one every rank has taken, whose storage is used again). Once `stop` (if given) answers true, no global
  // batch is sampled past those sampled already, which every rank still gets: the ranks stop at the same step.
  ShardedBatches(absl::AnyInvocable<void(Batch&)> sample, int world_size, int per_rank,
                 absl::AnyInvocable<bool()> stop = nullptr);

  // Rank `rank`'s slice of global batch `step` (0-based), false where the run stops before that step; each rank asks
  // for each step once, in order.
  bool Shard(int step, int rank, v1::Batch& out);

 private:
  struct Pending {
    Batch batch;
    int untaken = 0;  // ranks that have not taken their slice yet
  };
  const int world_size_, per_rank_;
  absl::Mutex mu_;
  absl::AnyInvocable<void(Batch&)> sample_ ABSL_GUARDED_BY(mu_);
  absl::AnyInvocable<bool()> stop_ ABSL_GUARDED_BY(mu_);
  int sampled_ ABSL_GUARDED_BY(mu_) = 0;  // global batches sampled so far
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;  // `stop` answered true: sampled_ is the run's last step count
  std::map<int, Pending> pending_ ABSL_GUARDED_BY(mu_);
  // Global batches every rank has taken, sampled into again: a fresh one faulted in megabytes of new pages each step.
  std::vector<Batch> spare_ ABSL_GUARDED_BY(mu_);
};

// Streams `steps` steps to every rank at once (rank r trains on its slices of `batches`, fewer steps where they stop),
// one Train stream per rank on its own thread; `on_rank0_response` sees rank 0's responses (every rank reports the
// global batch's loss). The first rank to fail cancels the other ranks' streams, so a dead or failing rank ends the
// run at once instead of leaving the others waiting on it; so does `cancellation` (if given) when it is cancelled, and
// a failing rank cancels it too (it stays cancelled). The status is the first failure (rank 0's where the caller
// cancelled), prefixed "rank R (target): " when there are several ranks.
absl::Status TrainRanks(std::span<PerceptionClient* const> ranks, int steps, ShardedBatches& batches,
                        absl::FunctionRef<void(const v1::TrainStepResponse&)> on_rank0_response,
                        CallCancellation* cancellation = nullptr);

}  // namespace perception::client
