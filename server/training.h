// Training over gRPC: the device side of one step, and the Train stream that pipelines steps through the worker.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "perception/v1/perception.pb.h"
#include "server/device_worker.h"
#include "server/live_calls.h"
#include "server/model_host.h"
#include "server/request_validation.h"
#include "server/stopwatch.h"

namespace perception::server {

// ValidateBatch before a batch's job is queued, under the normalizer of `status` (the device worker's last published
// one), so that the range check shares the pass over x with the finiteness check on a gRPC thread instead of taking
// one of its own on the worker between two steps. The normalizer it was checked under (for ModelHost's
// `checked_under`); nullopt where the range could not be checked (no model, or features the model does not take: the
// host's own checks refuse such a batch).
absl::StatusOr<std::optional<Normalizer>> ValidateBeforeTheJob(const v1::Batch& batch, const Limits& limits,
                                                               const HostStatus& status);

// The normalizer ValidateBeforeTheJob checked under, as ModelHost takes it (null: not checked).
inline const Normalizer* CheckedUnder(const std::optional<Normalizer>& normalizer) {
  return normalizer.has_value() ? &*normalizer : nullptr;
}

// Parses a Train stream's read `bytes` (consumed) into `request`, as ParseRequest does, but keeps the batch `request`
// holds (cleared) and so the capacity of its arrays: ParseRequest's clear deletes the batch, and a batch of megabytes,
// which the transport delivers in slices, then grew each of its arrays from nothing, copying and faulting in new
// pages (bench/train_feed_probe --parse, a `small` batch at 10 book levels in 16 KiB slices: 373 µs against 121 into
// a kept batch on the development machine, 621 against 316 on the H100 host's CPU).
absl::Status ParseKeepingTheBatch(grpc::ByteBuffer& bytes, v1::TrainStepRequest& request);

// One TrainStep on the worker thread; `queued` started when the job was queued (for queue_seconds). `next`, where
// given, is the batch of the step queued right behind this one (ModelHost::TrainStep stages it meanwhile). Each batch
// was range-checked under its `..._checked_under` where not null (ValidateBeforeTheJob).
absl::StatusOr<v1::TrainStepResponse> TrainOnDevice(ModelHost& host, const v1::Batch& batch, const v1::Batch* next,
                                                    const Stopwatch& queued,
                                                    const Normalizer* batch_checked_under = nullptr,
                                                    const Normalizer* next_checked_under = nullptr);

// One Train stream. Each batch read is validated and queued on the device worker; responses go out in batch
// order. At most kMaxUnansweredSteps batches are held (received and waiting for their parse, queued, running or
// waiting to be answered), plus the one being received, so a client that writes ahead keeps the device busy without
// the daemon buffering its stream.
// Three, so that the batch after a step is mostly in when the step starts (it is read as the step before that
// one runs) and is staged while the step runs; with two it was read only once the step had started.
// A stream trains one model: a step that finds another installed (InitModel or LoadCheckpoint from another call) fails
// with ABORTED and trains nothing on it. The first failure, whether refused on arrival (a request that cannot be parsed
// included: requests are read as bytes, raw_messages.h) or on the device, ends the stream with its status once the
// steps queued before it are done; the steps queued behind it, like those still queued when the client cancels, do not
// run, so a client that resends from the failed batch trains on nothing twice. A cancellation cannot stop a step the
// device is running, nor recall the responses it had no time to send: those steps stay applied, so the model can be up
// to kMaxUnansweredSteps steps past the last response sent (and further past the last one the client read). A drain
// (LiveCalls) ends the input, idle streams' included: the steps queued are run and answered, then the stream finishes
// UNAVAILABLE. The reactor deletes itself when gRPC is done with it.
class TrainReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                           public DrainableCall {
 public:
  static constexpr size_t kMaxUnansweredSteps = 3;

  // `registry` holds the stream while it lives; `on_finish` sees the status the stream finished with, once gRPC is
  // done with it (OnDone: whether the client went away before that status reached it is known only then).
  TrainReactor(DeviceWorker& worker, const Limits& limits, LiveCalls& registry,
               absl::AnyInvocable<void(const absl::Status&)> on_finish);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;
  // The daemon drains: no further batch is read (one received but not yet queued is not trained, unless the client
  // has half-closed: then the stream goes on to the end of its input); the steps queued are run and answered, then
  // the stream finishes with `status` unless a step failed.
  void Drain(const absl::Status& status) override;

 private:
  struct Step {
    std::unique_ptr<v1::TrainStepRequest> request;  // a spare once the device is done with it
    std::optional<absl::StatusOr<v1::TrainStepResponse>> result;
    std::optional<Normalizer> range_checked_under;  // ValidateBeforeTheJob's
  };

  // Parses, validates and accepts the batches received, oldest first, until none is left: run by the read that found
  // none ahead of its own, so that one thread at a time takes them, in order; only within OnReadDone (Update says
  // why).
  void AcceptReceived();
  // The oldest batch received (it stays in `received_` until accepted), and a spare request to parse it into (else a
  // new one).
  std::pair<grpc::ByteBuffer*, std::unique_ptr<v1::TrainStepRequest>> OldestReceivedAndSpare();
  // The device worker's thread delivers a step's result.
  void OnStepDone(Step& step, absl::StatusOr<v1::TrainStepResponse> result);
  // Why the device worker must not run `step` (a batch before it failed, the client cancelled, or the model, of
  // `model_generation` now, is not the one the stream's first step trained); OK to run it.
  absl::Status DroppedBecause(const Step& step, int64_t model_generation);
  // The step after `step`, if its batch has been accepted (its job is queued behind `step`'s, so it stays in place
  // until that job is done); else null.
  const Step* NextStep(const Step& step);
  // Queues the batch just read as the next step, or records why it was refused: `checked`, its ValidateBeforeTheJob,
  // run before the lock was taken.
  void AcceptLocked(std::unique_ptr<v1::TrainStepRequest> request,
                    absl::StatusOr<std::optional<Normalizer>> checked) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies `change` to the stream's state under the lock, then moves the stream forward.
  template <typename Change>
  void Update(Change change);
  // Starts the next read and write the state allows; the status to finish with once the stream has ended.
  std::optional<grpc::Status> AdvanceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool EndingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  DeviceWorker& worker_;
  const Limits& limits_;
  LiveCalls& registry_;
  absl::AnyInvocable<void(const absl::Status&)> on_finish_;

  absl::Mutex mu_;
  std::unique_ptr<grpc::ByteBuffer> incoming_ ABSL_GUARDED_BY(mu_);  // the read in progress, if any
  // Batches read but not yet accepted (the oldest may be being parsed), in order: the next read starts once one is
  // here, so that the transport receives a batch while the one before it is parsed and validated (+9% steps/s on the
  // 2-core development machine; on the H100 host's 16 cores no difference beyond the rounds' spread, AAPL's 10 levels
  // 639.2 against 648.9 steps/s, medians of 6 rotated rounds: bench/RESULTS.md, sixty-eighth session).
  std::deque<std::unique_ptr<grpc::ByteBuffer>> received_ ABSL_GUARDED_BY(mu_);
  // A read came back empty: the client half-closed or went away, or the stream finished.
  bool reads_ended_ ABSL_GUARDED_BY(mu_) = false;
  // Requests whose step is done, parsed into again (ParseKeepingTheBatch): their arrays keep their capacity, where a
  // fresh request grew each array of a batch of megabytes from nothing, copying and faulting in new pages, and freed
  // it on the device worker's thread between two steps. At most kMaxSpareRequests, none once the input has ended: an
  // idle stream holds no more than that beyond its unanswered steps.
  static constexpr size_t kMaxSpareRequests = 2;
  std::vector<std::unique_ptr<v1::TrainStepRequest>> spare_requests_ ABSL_GUARDED_BY(mu_);
  // Every batch received is accepted and the client half-closed, or a batch was refused or failed, or a drain began.
  bool input_done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status drained_ ABSL_GUARDED_BY(mu_);      // the drain that ended the input, if one did
  std::deque<Step> steps_ ABSL_GUARDED_BY(mu_);   // in batch order, until answered
  int running_ ABSL_GUARDED_BY(mu_) = 0;          // steps whose device job has not finished
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer outgoing_ ABSL_GUARDED_BY(mu_);  // the write in progress
  bool broken_ ABSL_GUARDED_BY(mu_) = false;  // cancelled, or the client stopped taking responses
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status outcome_ ABSL_GUARDED_BY(mu_);  // the status the stream finished with
  // ModelHost::model_generation() at the stream's first step: every later step must train that same model.
  std::optional<int64_t> model_generation_ ABSL_GUARDED_BY(mu_);
};

}  // namespace perception::server
