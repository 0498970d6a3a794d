// Device time of a few launches for the product benchmarks (bench_gemm, gemm_sweep): the launches captured into one
// CUDA graph, so launch gaps do not count, one untimed replay, then timed replays between CUDA events.
#pragma once

#include <functional>
#include <vector>

#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "bench/percentile.h"
#include "engine/cuda_check.h"
#include "engine/status_macros.h"

namespace perception {

// µs per call of `enqueue` on `stream`: `launches` calls captured into one graph, replayed `repeats` times after one
// untimed replay; the median replay divided by `launches`.
inline absl::StatusOr<double> MedianGraphMicroseconds(cudaStream_t stream, int launches, int repeats,
                                                      const std::function<absl::Status()>& enqueue) {
  cudaGraph_t graph = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  absl::Status status;
  for (int i = 0; i < launches && status.ok(); ++i) status = enqueue();
  CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  RETURN_IF_ERROR(status);
  cudaGraphExec_t exec = nullptr;
  CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream));
  std::vector<double> us;
  for (int r = 0; r < repeats; ++r) {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(1e3 * ms / launches);
  }
  CUDA_RETURN_IF_ERROR(cudaEventDestroy(start));
  CUDA_RETURN_IF_ERROR(cudaEventDestroy(stop));
  CUDA_RETURN_IF_ERROR(cudaGraphExecDestroy(exec));
  CUDA_RETURN_IF_ERROR(cudaGraphDestroy(graph));
  return Median(std::move(us));
}

}  // namespace perception
