// l2_read_probe: how fast the L2 delivers data to the SMs when every block reads the same rows, the way the wide
// streaming path's per-tile kernels read a tick's weights (each tile of events reads every row of a product), against
// blocks reading rows of their own. Each block of 512 threads loads float4s of its region (L2-resident) in order, one
// pass per repetition, and folds them into one value so that no load is dropped; one launch covers every repetition,
// timed between CUDA events, median of kLaunches. `l2_read_probe` prints one line per variant: blocks, region, the
// bytes delivered to the SMs a second (TB/s).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/status/status.h"
#include "bench/probe_main.h"
#include "engine/cuda_check.h"
#include "engine/status_macros.h"

namespace {

constexpr int kThreads = 512, kLaunches = 21, kRepetitions = 16;

// Reads `floats` floats at base + blockIdx.x·block_stride, kRepetitions times; `l1` chooses plain loads (which
// allocate in L1, as the wide kernels' do) over ld.global.cg (L2 only).
template <bool kL1>
__global__ void __launch_bounds__(kThreads) ReadKernel(const float4* base, size_t block_stride, int float4s,
                                                       float* sink) {
  const float4* region = base + blockIdx.x * block_stride;
  float acc = 0.f;
  for (int r = 0; r < kRepetitions; ++r) {
#pragma unroll 4
    for (int i = threadIdx.x; i < float4s; i += kThreads) {
      float4 v;
      if constexpr (kL1) {
        v = region[i];
      } else {
        v = __ldcg(region + i);
      }
      acc += v.x + v.y + v.z + v.w;
    }
  }
  if (acc == 1234.5f) sink[blockIdx.x] = acc;  // never true for the data below; keeps the loads
}

struct Variant {
  const char* name;
  int blocks_per_sm;
  size_t region_bytes;
  bool shared_region;  // every block reads the same region (the weights' pattern)
  bool l1;
};

absl::Status Probe() {
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s: %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  const std::vector<Variant> variants = {
      {"same 128 KB, every block, plain loads", 1, 128 << 10, true, true},
      {"same 128 KB, every block, ld.cg", 1, 128 << 10, true, false},
      {"same 512 KB, every block, plain loads", 1, 512 << 10, true, true},
      {"same 512 KB, every block, ld.cg", 1, 512 << 10, true, false},
      {"same 32 KB, 4 blocks an SM, plain loads", 4, 32 << 10, true, true},
      {"own 128 KB each (L2-resident), plain loads", 1, 128 << 10, false, true},
      {"own 128 KB each (L2-resident), ld.cg", 1, 128 << 10, false, false},
      {"own 32 KB each, 4 blocks an SM, plain loads", 4, 32 << 10, false, true},
  };
  size_t most = 0;
  for (const Variant& v : variants) {
    most = std::max(most, v.region_bytes * (v.shared_region ? 1 : sms * v.blocks_per_sm));
  }
  float* data = nullptr;
  float* sink = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&data, most));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&sink, 4096 * sizeof(float)));
  std::vector<float> host(most / sizeof(float));
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i % 1000) * 1e-3f;
  CUDA_RETURN_IF_ERROR(cudaMemcpy(data, host.data(), most, cudaMemcpyHostToDevice));
  cudaEvent_t start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  for (const Variant& v : variants) {
    const int blocks = sms * v.blocks_per_sm, float4s = static_cast<int>(v.region_bytes / sizeof(float4));
    const size_t stride = v.shared_region ? 0 : v.region_bytes / sizeof(float4);
    std::vector<float> ms;
    for (int launch = 0; launch < kLaunches + 1; ++launch) {
      CUDA_RETURN_IF_ERROR(cudaEventRecord(start));
      if (v.l1) {
        ReadKernel<true><<<blocks, kThreads>>>(reinterpret_cast<const float4*>(data), stride, float4s, sink);
      } else {
        ReadKernel<false><<<blocks, kThreads>>>(reinterpret_cast<const float4*>(data), stride, float4s, sink);
      }
      CUDA_RETURN_IF_ERROR(cudaGetLastError());
      CUDA_RETURN_IF_ERROR(cudaEventRecord(stop));
      CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
      float elapsed = 0.f;
      CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&elapsed, start, stop));
      if (launch > 0) ms.push_back(elapsed);  // the first launch warms the L2
    }
    std::sort(ms.begin(), ms.end());
    const double median_s = ms[ms.size() / 2] * 1e-3;
    const double bytes = static_cast<double>(blocks) * v.region_bytes * kRepetitions;
    std::printf("%-48s %4d blocks  %7.1f us  %5.2f TB/s\n", v.name, blocks, median_s * 1e6, bytes / median_s * 1e-12);
  }
  CUDA_RETURN_IF_ERROR(cudaFree(data));
  CUDA_RETURN_IF_ERROR(cudaFree(sink));
  return absl::OkStatus();
}

}  // namespace

int main() { return RunProbe("l2_read_probe", Probe); }
