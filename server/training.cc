// The device side of a training step and the Train stream's reactor.
#include "server/training.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <utility>

#include "engine/host_allocation.h"
#include "engine/status_macros.h"
#include "server/proto_convert.h"
#include "server/raw_messages.h"

namespace perception::server {

absl::StatusOr<std::optional<Normalizer>> ValidateBeforeTheJob(const v1::Batch& batch, const Limits& limits,
                                                               const HostStatus& status) {
  const Normalizer* normalizer = status.model.has_value() ? &status.model->normalizer : nullptr;
  if (normalizer != nullptr && batch.n_features() != static_cast<int>(normalizer->mean.size())) normalizer = nullptr;
  RETURN_IF_ERROR(ValidateBatch(batch, limits, normalizer));
  if (normalizer == nullptr) return std::nullopt;
  return *normalizer;
}

absl::StatusOr<v1::TrainStepResponse> TrainOnDevice(ModelHost& host, const v1::Batch& batch, const v1::Batch* next,
                                                    const Stopwatch& queued, const Normalizer* batch_checked_under,
                                                    const Normalizer* next_checked_under) {
  const double queue_seconds = queued.Seconds();
  const std::optional<BatchView<float>> next_view =
      next != nullptr ? std::optional<BatchView<float>>(ViewOf(*next)) : std::nullopt;
  ASSIGN_OR_RETURN(const TrainOutcome outcome, host.TrainStep(ViewOf(batch), next_view ? &*next_view : nullptr,
                                                              batch_checked_under, next_checked_under));
  v1::TrainStepResponse response;
  response.set_loss(outcome.result.loss);
  response.set_grad_norm(outcome.result.grad_norm);
  response.set_step(outcome.result.step);
  response.set_device_seconds(outcome.device_seconds);
  response.set_queue_seconds(queue_seconds);
  return response;
}

template <typename Change>
void TrainReactor::Update(Change change) {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    change();
    finish = AdvanceLocked();
  }
  // Outside the lock: once Finish is called, gRPC may delete the reactor (OnDone) on another thread as soon as no
  // reaction is running. (AcceptReceived goes on after a Finish, within the OnReadDone that runs it: gRPC runs OnDone
  // only once that reaction has returned.)
  if (finish.has_value()) Finish(*std::move(finish));
}

TrainReactor::TrainReactor(DeviceWorker& worker, const Limits& limits, LiveCalls& registry,
                           absl::AnyInvocable<void(const absl::Status&)> on_finish)
    : worker_(worker), limits_(limits), registry_(registry), on_finish_(std::move(on_finish)) {
  registry_.Join(this, [this] { Update([] {}); });
}

void TrainReactor::Drain(const absl::Status& status) {
  Update([&] {
    // A stream whose input ended already finishes as it would have; so does one whose client half-closed, whose
    // batches received are still trained.
    if (input_done_ || reads_ended_) return;
    drained_ = status;
    input_done_ = true;
  });
}

absl::Status ParseKeepingTheBatch(grpc::ByteBuffer& bytes, v1::TrainStepRequest& request) {
  v1::Batch* batch = request.has_batch() ? request.release_batch() : nullptr;
  request.Clear();
  if (batch != nullptr) {
    batch->Clear();
    request.set_allocated_batch(batch);
  }
  return MergeRequest(bytes, request);
}

void TrainReactor::OnReadDone(bool ok) {
  bool parse_here = false;
  Update([&] {
    std::unique_ptr<grpc::ByteBuffer> bytes = std::move(incoming_);
    if (!ok) {
      // The batches received before the half-close are still parsed and trained: the input ends after them.
      reads_ended_ = true;
      input_done_ = input_done_ || received_.empty();
      return;
    }
    if (input_done_ || EndingLocked()) return;  // a batch read after the input ended (a drain) is not trained
    // The next read starts as this Update ends (AdvanceLocked), so that the transport receives the next batch while
    // this one is parsed; the thread that finds no batch ahead of its own parses them all, in order.
    parse_here = received_.empty();
    received_.push_back(std::move(bytes));
  });
  if (parse_here) AcceptReceived();
}

void TrainReactor::AcceptReceived() {
  for (bool more = true; more;) {
    // Parsed and validated outside the lock (a batch may take milliseconds), which the device worker takes at each
    // step's start and end; the batch stays first in `received_` meanwhile, counted among those the stream holds.
    auto [bytes, request] = OldestReceivedAndSpare();
    absl::Status parsed = ParseKeepingTheBatch(*bytes, *request);
    absl::StatusOr<std::optional<Normalizer>> checked = std::nullopt;
    if (parsed.ok()) checked = ValidateBeforeTheJob(request->batch(), limits_, worker_.status());
    Update([&] {
      received_.pop_front();
      // A batch received before the input ended (a drain) or the stream failed is not trained.
      if (!input_done_ && !EndingLocked()) {
        if (parsed.ok()) {
          AcceptLocked(std::move(request), std::move(checked));
        } else {
          // (Refused as a batch is, after the steps before it.)
          steps_.push_back(Step{nullptr, std::move(parsed), std::nullopt});
          input_done_ = true;
        }
      }
      // Nor are those behind a batch refused, or behind the input's end.
      if (input_done_ || EndingLocked()) received_.clear();
      more = !received_.empty();
      if (!more && reads_ended_) input_done_ = true;
    });
  }
}

void TrainReactor::AcceptLocked(std::unique_ptr<v1::TrainStepRequest> request,
                                absl::StatusOr<std::optional<Normalizer>> checked) {
  Step& step = steps_.emplace_back(Step{std::move(request), std::nullopt, std::nullopt});
  absl::Status accepted = checked.status();
  if (accepted.ok()) {
    step.range_checked_under = *std::move(checked);
    // The job refers to `step`, which stays in place (a deque keeps its elements where they are when others
    // are added or removed at the ends) until the stream has answered it.
    accepted = worker_.Enqueue(JobPriority::kTraining, [this, &step, queued = Stopwatch()](ModelHost& host) {
      if (absl::Status dropped = DroppedBecause(step, host.model_generation()); !dropped.ok()) {
        // The step before may have staged this one's batch, whose request is a spare now: a later batch parsed into it
        // has the same address, by which the backend knows what it staged.
        host.ForgetStagedNext();
        OnStepDone(step, std::move(dropped));
        return;
      }
      // As DeviceWorker::Run answers a unary TrainStep: a batch the host cannot hold ends the stream, not the daemon.
      absl::StatusOr<v1::TrainStepResponse> result = RunOrExhausted("what this step needs", [&] {
        const Step* next = NextStep(step);
        return TrainOnDevice(host, step.request->batch(), next != nullptr ? &next->request->batch() : nullptr, queued,
                             CheckedUnder(step.range_checked_under),
                             next != nullptr ? CheckedUnder(next->range_checked_under) : nullptr);
      });
      worker_.PublishStatus(host);
      OnStepDone(step, std::move(result));
    });
  }
  if (accepted.ok()) {
    ++running_;
  } else {
    step.result = std::move(accepted);
    input_done_ = true;  // nothing after a refused batch is read
  }
}

std::pair<grpc::ByteBuffer*, std::unique_ptr<v1::TrainStepRequest>> TrainReactor::OldestReceivedAndSpare() {
  absl::MutexLock lock(&mu_);
  grpc::ByteBuffer* oldest = received_.front().get();
  if (spare_requests_.empty()) return {oldest, std::make_unique<v1::TrainStepRequest>()};
  std::unique_ptr<v1::TrainStepRequest> request = std::move(spare_requests_.back());
  spare_requests_.pop_back();
  return {oldest, std::move(request)};
}

const TrainReactor::Step* TrainReactor::NextStep(const Step& step) {
  absl::MutexLock lock(&mu_);
  const auto at = std::find_if(steps_.begin(), steps_.end(), [&](const Step& s) { return &s == &step; });
  if (at == steps_.end() || std::next(at) == steps_.end()) return nullptr;
  const Step& next = *std::next(at);
  return next.request != nullptr && !next.result.has_value() ? &next : nullptr;
}

absl::Status TrainReactor::DroppedBecause(const Step& step, int64_t model_generation) {
  absl::MutexLock lock(&mu_);
  if (broken_) return absl::CancelledError("not run: the client cancelled the stream");
  for (const Step& before : steps_) {
    if (&before == &step) break;
    if (before.result.has_value() && !before.result->ok()) {
      return absl::AbortedError("not run: a batch before it failed");
    }
  }
  if (!model_generation_.has_value()) model_generation_ = model_generation;
  if (*model_generation_ != model_generation) {
    return absl::AbortedError(
        "not run: the model was replaced (InitModel or LoadCheckpoint) after this stream's first step; its steps "
        "so far trained the previous model");
  }
  return absl::OkStatus();
}

void TrainReactor::OnStepDone(Step& step, absl::StatusOr<v1::TrainStepResponse> result) {
  Update([&] {
    if (!result.ok()) input_done_ = true;  // nothing after a failed batch is read
    step.result = std::move(result);
    if (step.request != nullptr && !input_done_ && spare_requests_.size() < kMaxSpareRequests) {
      spare_requests_.push_back(std::move(step.request));
    }
    step.request.reset();
    --running_;
  });
}

void TrainReactor::OnWriteDone(bool ok) {
  Update([&] {
    writing_ = false;
    broken_ = broken_ || !ok;
  });
}

void TrainReactor::OnCancel() {
  Update([&] { broken_ = true; });
}

void TrainReactor::OnDone() {
  // gRPC runs OnDone once every other reaction has returned, an order its own (uninstrumented) atomics keep; taking
  // the lock the reactions write under shows ThreadSanitizer that order too, before the reactor is freed.
  absl::Status outcome;
  {
    absl::MutexLock lock(&mu_);
    outcome = outcome_;
  }
  on_finish_(outcome);
  registry_.Remove(this);
  delete this;
}

bool TrainReactor::EndingLocked() const {
  const bool failed = !steps_.empty() && steps_.front().result.has_value() && !steps_.front().result->ok();
  return broken_ || failed || (input_done_ && steps_.empty());
}

std::optional<grpc::Status> TrainReactor::AdvanceLocked() {
  if (finished_) return std::nullopt;
  // StartWrite and StartRead are safe under the lock: gRPC never runs a reaction inside them (it hands reactions
  // to its executor), and the reactor outlives them because it is not finished.
  if (!EndingLocked()) {
    if (!writing_ && !steps_.empty() && steps_.front().result.has_value()) {
      SerializeResponse(**steps_.front().result, outgoing_);
      steps_.pop_front();
      writing_ = true;
      StartWrite(&outgoing_);
    }
    const size_t held = steps_.size() + received_.size();
    if (incoming_ == nullptr && !input_done_ && !reads_ended_ && held < kMaxUnansweredSteps) {
      incoming_ = std::make_unique<grpc::ByteBuffer>();
      StartRead(incoming_.get());
    }
    return std::nullopt;
  }
  // Jobs refer to this reactor and `outgoing_` must outlive its write: finish only when both are done. A read
  // still in progress is fine: it completes (not ok) once the stream is finished.
  if (running_ > 0 || writing_) return std::nullopt;
  finished_ = true;
  // A step that failed says more than the cancellation it caused: a data-parallel client cancels every rank's
  // stream when one rank fails, and this rank's own step may then fail on the dead peer's collective.
  absl::Status status;
  const auto failed = std::find_if(steps_.begin(), steps_.end(),
                                   [](const Step& step) { return step.result.has_value() && !step.result->ok(); });
  if (failed != steps_.end()) {
    status = failed->result->status();
  } else if (broken_) {
    status = absl::CancelledError("the client cancelled the stream or stopped reading its responses");
  } else {
    status = drained_;
  }
  outcome_ = status;
  return ToGrpcStatus(status);
}

}  // namespace perception::server
