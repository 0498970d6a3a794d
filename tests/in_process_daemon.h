// perceptiond's service as Serve() assembles it, on the CPU and in process, for tests that decorate its backends.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "perception/v1/perception.grpc.pb.h"
#include "server/checkpoint_directory.h"
#include "server/device_worker.h"
#include "server/metrics.h"
#include "server/model_host.h"
#include "server/perception_service.h"
#include "server/request_validation.h"
#include "server/stream_batcher.h"

namespace perception::testing {

// What a Stream call came back with.
struct StreamOutcome {
  grpc::Status status;
  std::map<std::string, uint64_t> acked;  // last sequence number acknowledged, by instrument
};

// The device worker, stream batcher and service around a model host whose backends pass through `decorate`;
// served on an in-process channel and on a loopback port (for PerceptionClient). Checkpoints go to the test's
// temporary folder, under `checkpoint_folder`.
class InProcessDaemon {
 public:
  InProcessDaemon(server::ModelHost::BackendDecorator decorate, const std::string& checkpoint_folder,
                  const server::StreamOptions& stream_options = {})
      : stream_options_(stream_options),
        worker_(std::make_unique<server::ModelHost>("cpu", metrics_, stream_options_.device, /*use_graphs=*/true,
                                                    Precision::kFloat32, std::move(decorate)),
                limits_.queue_depth, stream_options_.resident_idle_period),
        streams_(worker_, stream_options_, metrics_),
        checkpoints_(server::CheckpointDirectory::Open(::testing::TempDir() + "/" + checkpoint_folder).value()),
        service_(worker_, streams_, stream_options_, checkpoints_, limits_, metrics_) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    stub_ = v1::Perception::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  ~InProcessDaemon() {
    server_->Shutdown();
    worker_.Stop();
  }

  v1::Perception::Stub& stub() { return *stub_; }
  // The unary call `method` of the stub with `request`, given `timeout`; its status (the response is dropped).
  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (v1::Perception::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                    const Request& request, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    Response response;
    return (stub_.get()->*method)(&context, request, &response);
  }
  // InitModel of the `tiny` preset from `seed` (replacing the model there when `replace`); the model goes to `model`
  // where given.
  grpc::Status InitTinyModel(uint64_t seed, bool replace = false, v1::Model* model = nullptr) {
    v1::InitModelRequest request;
    request.set_config_name("tiny");
    request.set_seed(seed);
    request.set_replace(replace);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::InitModelResponse response;
    const grpc::Status status = stub_->InitModel(&context, request, &response);
    if (model != nullptr) *model = response.model();
    return status;
  }
  // One Stream call: every request written, the writes closed, every acknowledgement read.
  StreamOutcome Stream(const std::vector<std::vector<v1::StreamEvent>>& requests) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    const auto call = stub_->Stream(&context);
    for (const std::vector<v1::StreamEvent>& events : requests) {
      v1::StreamRequest request;
      for (const v1::StreamEvent& event : events) *request.add_events() = event;
      if (!call->Write(request)) break;
    }
    call->WritesDone();
    StreamOutcome outcome;
    for (v1::StreamResponse response; call->Read(&response);) {
      for (const v1::InstrumentAck& ack : response.acks()) outcome.acked[ack.instrument()] = ack.last_seq();
    }
    outcome.status = call->Finish();
    return outcome;
  }
  // ListStreams' answer, by instrument.
  std::map<std::string, v1::StreamInfo> Streams() {
    grpc::ClientContext context;
    v1::ListStreamsResponse response;
    EXPECT_TRUE(stub_->ListStreams(&context, v1::ListStreamsRequest(), &response).ok());
    std::map<std::string, v1::StreamInfo> by_instrument;
    for (const v1::StreamInfo& info : response.streams()) by_instrument[info.instrument()] = info;
    return by_instrument;
  }
  grpc::Status ResetStream(const std::string& instrument) {
    grpc::ClientContext context;
    v1::ResetStreamRequest request;
    request.set_instrument(instrument);
    v1::ResetStreamResponse response;
    return stub_->ResetStream(&context, request, &response);
  }
  grpc::Status SeedStream(const std::string& instrument, const std::vector<v1::StreamEvent>& window) {
    grpc::ClientContext context;
    v1::SeedStreamRequest request;
    request.set_instrument(instrument);
    for (const v1::StreamEvent& event : window) *request.add_events() = event;
    v1::SeedStreamResponse response;
    return stub_->SeedStream(&context, request, &response);
  }
  // The instrument's first page of convictions (expected to be answered).
  v1::ReadConvictionsResponse ReadConvictions(const std::string& instrument) {
    grpc::ClientContext context;
    v1::ReadConvictionsRequest request;
    request.set_instrument(instrument);
    v1::ReadConvictionsResponse response;
    EXPECT_TRUE(stub_->ReadConvictions(&context, request, &response).ok());
    return response;
  }
  // The service's drain, as perceptiond begins it on SIGTERM or a lost device.
  void BeginDrain() { service_.BeginDrain(); }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  server::DeviceWorker& worker() { return worker_; }
  const server::StreamBatcher& streams() const { return streams_; }
  const server::ServerMetrics& metrics() const { return metrics_; }
  // The value of a metric in the daemon's exposition: a name, with its labels where it has them
  // (`name{label="value"}`); -1 where there is none.
  double Metric(const std::string& name) const {
    const std::string text = metrics_.Render(), prefix = absl::StrCat("\n", name, " ");
    const size_t at = text.find(prefix);
    if (at == std::string::npos) return -1;
    const size_t from = at + prefix.size();
    double value = -1;
    EXPECT_TRUE(absl::SimpleAtod(text.substr(from, text.find('\n', from) - from), &value));
    return value;
  }

 private:
  server::ServerMetrics metrics_;
  const server::StreamOptions stream_options_;
  const server::Limits limits_{.max_message_bytes = 64 << 20, .max_batch = 1024, .max_window = 4096, .queue_depth = 8};
  server::DeviceWorker worker_;
  server::StreamBatcher streams_;
  const server::CheckpointDirectory checkpoints_;
  server::PerceptionService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Perception::Stub> stub_;
};

// Occupies a device worker with a job of the test's, as a long evaluation would, so that what is queued meanwhile
// waits behind it until Open. A fixture declares it before its daemon, so that it outlives the worker running its
// job, and opens it on destruction in case a test failed while holding it. Holds once.
class WorkerGate {
 public:
  // Returns once the job runs.
  void Hold(server::DeviceWorker& worker, server::JobPriority priority = server::JobPriority::kTraining) {
    ASSERT_TRUE(worker
                    .Enqueue(priority,
                             [this](server::ModelHost&) {
                               running_.Notify();
                               open_.WaitForNotification();
                             })
                    .ok());
    running_.WaitForNotification();
  }
  void Open() {
    if (!open_.HasBeenNotified()) open_.Notify();
  }

 private:
  absl::Notification running_, open_;
};

}  // namespace perception::testing
