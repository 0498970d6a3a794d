// launch_probe: what a streaming tick's launch costs before any work, measured the way bench_stream measures a tick
// (each launch between two CUDA events, the stream held by a spinning kernel while the host queues them all, median
// of the event gaps). Variants: nothing between the events, empty kernels of one block and of one cluster of 8
// blocks (the small one-instrument tick's shape), with and without ~200 KB of dynamic shared memory, with a cluster
// barrier, captured in a graph or launched plainly. `launch_probe` prints one line per variant.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/held_ticks.cuh"
#include "bench/probe_main.h"
#include "engine/cuda_check.h"
#include "engine/status_macros.h"

namespace {

constexpr int kTicks = 400;

__global__ void EmptyKernel() {}

__global__ void ClusterBarrierKernel() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Touches its dynamic shared memory the way a tick's first stage would: one store and a block barrier.
__global__ void SharedTouchKernel() {
  extern __shared__ float smem[];
  smem[threadIdx.x] = 1.f;
  __syncthreads();
}

struct Shape {
  const char* name;
  void (*kernel)();
  int blocks, threads, cluster;
  size_t shared;
};

cudaError_t LaunchShape(const Shape& s, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(s.blocks);
  config.blockDim = dim3(s.threads);
  config.dynamicSmemBytes = s.shared;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = s.cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = s.cluster > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&config, s.kernel);
}

// MedianHeldTick of kTicks calls of a CUDA launch.
absl::StatusOr<double> MedianTick(cudaStream_t stream, const std::function<cudaError_t()>& enqueue) {
  return perception::MedianHeldTick(stream, kTicks, [&]() -> absl::Status {
    CUDA_RETURN_IF_ERROR(enqueue());
    return absl::OkStatus();
  });
}

// The same tick captured into a graph of one launch, replayed as bench_stream replays a tick.
absl::StatusOr<double> MedianGraphTick(const Shape& s, cudaStream_t stream) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  CUDA_RETURN_IF_ERROR(LaunchShape(s, stream));
  CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
  const absl::StatusOr<double> us = MedianTick(stream, [&] { return cudaGraphLaunch(exec, stream); });
  CUDA_RETURN_IF_ERROR(cudaGraphExecDestroy(exec));
  CUDA_RETURN_IF_ERROR(cudaGraphDestroy(graph));
  return us;
}

absl::Status Probe() {
  cudaStream_t stream;
  int lowest = 0, highest = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, highest));
  constexpr size_t kBig = 200 * 1024;
  for (auto kernel : {SharedTouchKernel, ClusterBarrierKernel}) {
    CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kBig)));
    CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  const Shape shapes[] = {
      {"empty, 1 block of 32", EmptyKernel, 1, 32, 1, 0},
      {"empty, 8 blocks of 256", EmptyKernel, 8, 256, 1, 0},
      {"empty, cluster of 8 x 256", EmptyKernel, 8, 256, 8, 0},
      {"cluster barrier, cluster of 8 x 256", ClusterBarrierKernel, 8, 256, 8, 0},
      {"shared 200 KB, 1 block of 256", SharedTouchKernel, 1, 256, 1, kBig},
      {"shared 200 KB, 8 blocks of 256", SharedTouchKernel, 8, 256, 1, kBig},
      {"shared 200 KB, cluster of 8 x 256", SharedTouchKernel, 8, 256, 8, kBig},
      {"cluster barrier + 200 KB, cluster of 8 x 256", ClusterBarrierKernel, 8, 256, 8, kBig},
      {"shared 200 KB, cluster of 16 x 256", SharedTouchKernel, 16, 256, 16, kBig},
  };
  std::printf("%-48s %12s %12s\n", "variant", "plain us", "graph us");
  ASSIGN_OR_RETURN(const double nothing, MedianTick(stream, [] { return cudaSuccess; }));
  std::printf("%-48s %12.2f %12s\n", "nothing between the events", nothing, "-");
  for (const Shape& s : shapes) {
    ASSIGN_OR_RETURN(const double plain, MedianTick(stream, [&] { return LaunchShape(s, stream); }));
    ASSIGN_OR_RETURN(const double graphed, MedianGraphTick(s, stream));
    std::printf("%-48s %12.2f %12.2f\n", s.name, plain, graphed);
  }
  // The same 200 KB cluster tick with the shared-memory carveout preferred at its maximum.
  CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(SharedTouchKernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  const Shape carve{"shared 200 KB, cluster of 8, carveout 100%", SharedTouchKernel, 8, 256, 8, kBig};
  ASSIGN_OR_RETURN(const double carved, MedianTick(stream, [&] { return LaunchShape(carve, stream); }));
  std::printf("%-48s %12.2f %12s\n", carve.name, carved, "-");
  CUDA_RETURN_IF_ERROR(cudaStreamDestroy(stream));
  return absl::OkStatus();
}

}  // namespace

int main() { return RunProbe("launch_probe", Probe); }
