// Device time of a streaming tick as the probes measure it (launch_probe, resident_probe): every enqueue queued behind
// a stream held by a spinning kernel, CUDA events between them, so the host's queueing does not count.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/percentile.h"
#include "engine/cuda_check.h"
#include "engine/status_macros.h"

namespace perception {

__global__ void HoldKernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Median µs between the events around each of `ticks` calls of `enqueue`, after 20 untimed ones.
inline absl::StatusOr<double> MedianHeldTick(cudaStream_t stream, int ticks,
                                             const std::function<absl::Status()>& enqueue) {
  std::vector<cudaEvent_t> events(ticks + 1);
  for (auto& e : events) CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  for (int warm = 0; warm < 20; ++warm) RETURN_IF_ERROR(enqueue());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  HoldKernel<<<1, 1, 0, stream>>>(6'000'000);  // ~3 ms at 1.98 GHz
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  CUDA_RETURN_IF_ERROR(cudaEventRecord(events[0], stream));
  for (int t = 0; t < ticks; ++t) {
    RETURN_IF_ERROR(enqueue());
    CUDA_RETURN_IF_ERROR(cudaEventRecord(events[t + 1], stream));
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  std::vector<double> us;
  for (int t = 0; t < ticks; ++t) {
    float ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events[t], events[t + 1]));
    us.push_back(1e3 * ms);
  }
  for (auto& e : events) CUDA_RETURN_IF_ERROR(cudaEventDestroy(e));
  return Median(std::move(us));
}

}  // namespace perception
