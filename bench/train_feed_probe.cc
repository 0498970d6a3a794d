// train_feed_probe: the host side of feeding training batches to the daemon, on the CPU. `--parse`: a Train stream's
// parse of one batch as the transport delivers it (in slices), through gRPC's default path (ParseRequest, into a fresh
// request) and into a spare whose batch is kept (ParseKeepingTheBatch), under glibc's default allocator or with
// --keep_freed_memory (KeepFreedHostMemoryForReuse). `--unary HOST:PORT`: unary TrainStep calls one after another
// against a daemon holding a model of the --levels' features at `small`'s training shape. µs are medians over rounds.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/percentile.h"
#include "client/perception_client.h"
#include "engine/config.h"
#include "engine/host_allocation.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/raw_messages.h"
#include "server/training.h"
#include "tests/batch_message.h"

ABSL_FLAG(bool, parse, false, "time the parse of a Train request in slices");
ABSL_FLAG(bool, keep_freed_memory, false, "with --parse: KeepFreedHostMemoryForReuse first");
ABSL_FLAG(std::string, unary, "", "time unary TrainStep calls against the daemon at this address");
ABSL_FLAG(int, levels, 10, "LOBSTER book levels of the batches (features 4·levels + 8)");
ABSL_FLAG(int, rounds, 5, "rounds (the median is printed)");
ABSL_FLAG(int, per_round, 100, "parses or calls a round");

namespace perception {
namespace {

using Clock = std::chrono::steady_clock;

// Random TrainStep requests of `small`'s training shape with the --levels' features.
std::vector<v1::TrainStepRequest> Requests(int count) {
  ModelConfig config = *NamedConfig("small");
  config.n_features = 4 * absl::GetFlag(FLAGS_levels) + 8;
  std::vector<v1::TrainStepRequest> requests(count);
  for (int i = 0; i < count; ++i) {
    *requests[i].mutable_batch() =
        testing::BatchMessage(testing::MakeRandomBatch(config, config.batch, config.window, 100 + i), config);
  }
  return requests;
}

absl::Status TimeParses() {
  if (absl::GetFlag(FLAGS_keep_freed_memory) && !KeepFreedHostMemoryForReuse()) {
    return absl::FailedPreconditionError("the allocator refused the settings");
  }
  const std::string bytes = Requests(1)[0].SerializeAsString();
  std::printf("a request of %zu bytes; allocator %s\n", bytes.size(),
              absl::GetFlag(FLAGS_keep_freed_memory) ? "keeping freed memory" : "glibc's default");
  for (const size_t slice : {size_t{16} << 10, size_t{64} << 10, bytes.size()}) {
    const std::vector<grpc::Slice> slices = testing::Slices(bytes, slice);
    v1::TrainStepRequest spare;
    std::vector<double> fresh_us, kept_us;
    for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
      // Each way in a run of its own, as a daemon parses every batch one way: their allocations interleaved, the heap
      // that one leaves would serve the other.
      double fresh = 0, kept = 0;
      for (int i = 0; i < absl::GetFlag(FLAGS_per_round); ++i) {
        grpc::ByteBuffer buffer(slices.data(), slices.size());
        const Clock::time_point start = Clock::now();
        auto request = std::make_unique<v1::TrainStepRequest>();
        if (!server::ParseRequest(buffer, *request).ok()) return absl::InternalError("ParseRequest failed");
        request.reset();
        fresh += std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      }
      for (int i = 0; i < absl::GetFlag(FLAGS_per_round); ++i) {
        grpc::ByteBuffer buffer(slices.data(), slices.size());
        const Clock::time_point start = Clock::now();
        if (!server::ParseKeepingTheBatch(buffer, spare).ok()) return absl::InternalError("ParseKeepingTheBatch");
        kept += std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      }
      fresh_us.push_back(fresh / absl::GetFlag(FLAGS_per_round));
      kept_us.push_back(kept / absl::GetFlag(FLAGS_per_round));
    }
    std::printf("slices of %8zu bytes: ParseRequest into a fresh request %8.1f us (freeing it included), "
                "ParseKeepingTheBatch into a spare %8.1f us\n", slice, Median(fresh_us), Median(kept_us));
  }
  return absl::OkStatus();
}

absl::Status TimeUnarySteps(const std::string& target) {
  const std::vector<v1::TrainStepRequest> requests = Requests(4);
  client::PerceptionClient client(target);
  std::vector<double> step_us, device_us;
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    double device_s = 0;
    const Clock::time_point start = Clock::now();
    for (int i = 0; i < absl::GetFlag(FLAGS_per_round); ++i) {
      const absl::StatusOr<v1::TrainStepResponse> response = client.TrainStep(requests[i % requests.size()]);
      if (!response.ok()) return response.status();
      device_s += response->device_seconds();
    }
    step_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count() /
                      absl::GetFlag(FLAGS_per_round));
    device_us.push_back(device_s * 1e6 / absl::GetFlag(FLAGS_per_round));
  }
  std::printf("unary TrainStep: %.1f us a call (%.1f steps/s), the device's step %.1f us\n", Median(step_us),
              1e6 / Median(step_us), Median(device_us));
  return absl::OkStatus();
}

}  // namespace
}  // namespace perception

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::Status status = absl::InvalidArgumentError("give --parse or --unary HOST:PORT");
  // On a thread of its own, as the daemon parses on gRPC's threads: their allocations come from glibc's per-thread
  // arenas, which hand memory back to the kernel otherwise than the main one.
  if (absl::GetFlag(FLAGS_parse)) std::thread([&] { status = perception::TimeParses(); }).join();
  if (!absl::GetFlag(FLAGS_unary).empty()) status = perception::TimeUnarySteps(absl::GetFlag(FLAGS_unary));
  if (!status.ok()) std::fprintf(stderr, "train_feed_probe: %s\n", status.ToString().c_str());
  return status.ok() ? 0 : 1;
}
