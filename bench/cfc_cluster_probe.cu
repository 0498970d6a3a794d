// cfc_cluster_probe: the costs a CfC recurrence split over a thread-block cluster would pay every step, measured in
// SM cycles on the device it runs on: a block barrier, a cluster barrier after a store into the next block's shared
// memory (clusters of 2, 4 and 8), an exchange with every other block through st.async and mbarriers, and the TF32
// tensor-core product (mma.sync m16n8k8) as a dependent chain and as independent products from every warp. Each
// kernel runs one 256-thread block an SM (as the CfC's tile kernels do), loops kIterations times and records its
// cycles per iteration; `cfc_cluster_probe` prints the median over blocks.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "absl/status/status.h"
#include "bench/probe_main.h"
#include "engine/cuda_check.h"
#include "engine/status_macros.h"

namespace {

constexpr int kThreads = 256, kIterations = 4096;
// Enough dynamic shared memory that no two blocks share an SM.
constexpr size_t kSharedBytes = 120 * 1024;

// Iteration: every thread stores a float, the block waits, every thread reads its neighbour's.
__global__ void BlockBarrierKernel(long long* cycles, float* sink) {
  extern __shared__ float smem[];
  float v = threadIdx.x;
  const long long start = clock64();
  for (int i = 0; i < kIterations; ++i) {
    smem[threadIdx.x] = v;
    __syncthreads();
    v += smem[(threadIdx.x + 1) % kThreads];
    __syncthreads();
  }
  const long long end = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = (end - start) / kIterations;
  if (v == -1.f) *sink = v;
}

// Iteration: every thread stores a float into the next block of its cluster, the cluster waits, every thread reads
// the float its neighbour of the previous block stored.
__global__ void ClusterBarrierKernel(long long* cycles, float* sink) {
  extern __shared__ float smem[];
  unsigned rank, size;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(&smem[threadIdx.x]));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"((rank + 1) % size));
  float v = threadIdx.x;
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  const long long start = clock64();
  for (int i = 0; i < kIterations; ++i) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    v += smem[(threadIdx.x + 1) % kThreads];
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  }
  const long long end = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = (end - start) / kIterations;
  if (v == -1.f) *sink = v;
}

// Iteration: every thread sends a float to every other block of its cluster by st.async, which completes bytes on
// that block's mbarrier (one a buffer, two buffers in turn), and waits on its own block's mbarrier for all of the
// others' floats, then reads one: an all-to-all exchange of a step's activations without a cluster barrier. A block
// writes buffer b again only after every other block has sent it the step after, i.e. has read buffer b.
__global__ void ClusterMbarrierKernel(long long* cycles, float* sink) {
  constexpr int kMaxCluster = 8;
  __shared__ __align__(8) uint64_t bars[2];
  __shared__ float inbox[2][kMaxCluster][kThreads];
  unsigned rank, size;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(&bars[0]));
  if (threadIdx.x < 2) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * threadIdx.x) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  float v = threadIdx.x;
  const long long start = clock64();
  for (int i = 0; i < kIterations; ++i) {
    const int b = i & 1;
    const uint32_t bar = bar0 + 8 * b;
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                   "r"((size - 1) * kThreads * 4u)
                   : "memory");
    }
    const uint32_t slot = static_cast<uint32_t>(__cvta_generic_to_shared(&inbox[b][rank][threadIdx.x]));
    for (unsigned q = 1; q < size; ++q) {
      const unsigned to = (rank + q) % size;
      uint32_t remote_slot, remote_bar;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_slot) : "r"(slot), "r"(to));
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(bar), "r"(to));
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote_slot),
                   "r"(__float_as_uint(v)), "r"(remote_bar)
                   : "memory");
    }
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}" ::"r"(bar),
        "r"((i >> 1) & 1)
        : "memory");
    v += inbox[b][(rank + 1) % size][(threadIdx.x + 1) % kThreads];
  }
  const long long end = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = (end - start) / kIterations;
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (v == -1.f) *sink = v;
}

// kChains independent accumulators a warp, each kIterations mma.sync m16n8k8 TF32 products deep.
template <int kChains>
__global__ void MmaKernel(long long* cycles, float* sink) {
  uint32_t a[4], b[2];
  for (int j = 0; j < 4; ++j) a[j] = __float_as_uint(1e-3f * (threadIdx.x + j));
  for (int j = 0; j < 2; ++j) b[j] = __float_as_uint(1e-3f * (threadIdx.x - j));
  float acc[kChains][4] = {};
  __syncthreads();
  const long long start = clock64();
  for (int i = 0; i < kIterations; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      asm volatile(
          "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};"
          : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  __syncthreads();
  const long long end = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = (end - start) / kIterations;
  float total = 0.f;
  for (int c = 0; c < kChains; ++c) total += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  if (total == -1.f) *sink = total;
}

// Runs `kernel` on 128 blocks in clusters of `cluster` and returns the median cycles an iteration over the blocks.
absl::StatusOr<long long> MedianCycles(void (*kernel)(long long*, float*), int cluster, long long* cycles,
                                       float* sink) {
  CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
  constexpr int kBlocks = 128;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kBlocks);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSharedBytes;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = cluster > 1 ? 1 : 0;
  for (int warm = 0; warm < 2; ++warm) CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, kernel, cycles, sink));
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  std::vector<long long> host(kBlocks);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(host.data(), cycles, kBlocks * sizeof(long long), cudaMemcpyDeviceToHost));
  std::nth_element(host.begin(), host.begin() + kBlocks / 2, host.end());
  return host[kBlocks / 2];
}

absl::Status Run() {
  long long* cycles = nullptr;
  float* sink = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&cycles, 128 * sizeof(long long)));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&sink, sizeof(float)));
  int clock_khz = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  auto report = [&](const char* what, long long c) {
    std::printf("%-58s %6lld cycles (%7.1f ns at %.2f GHz)\n", what, c, 1e6 * c / clock_khz, clock_khz / 1e6);
  };
  ASSIGN_OR_RETURN(const long long block, MedianCycles(BlockBarrierKernel, 1, cycles, sink));
  report("block: store, barrier, load, barrier", block);
  for (const int cluster : {2, 4, 8}) {
    ASSIGN_OR_RETURN(const long long c, MedianCycles(ClusterBarrierKernel, cluster, cycles, sink));
    char what[96];
    std::snprintf(what, sizeof(what), "cluster of %d: remote store, cluster barrier, load, barrier", cluster);
    report(what, c);
  }
  for (const int cluster : {2, 4, 8}) {
    ASSIGN_OR_RETURN(const long long c, MedianCycles(ClusterMbarrierKernel, cluster, cycles, sink));
    char what[96];
    std::snprintf(what, sizeof(what), "cluster of %d: st.async to every other block, mbarrier wait", cluster);
    report(what, c);
  }
  ASSIGN_OR_RETURN(const long long chain, MedianCycles(MmaKernel<1>, 1, cycles, sink));
  report("mma m16n8k8 tf32, one dependent chain a warp (latency)", chain);
  ASSIGN_OR_RETURN(const long long eight, MedianCycles(MmaKernel<8>, 1, cycles, sink));
  report("mma m16n8k8 tf32, 8 chains a warp, 8 warps: 8 products", eight);
  std::printf("mma m16n8k8 tf32 throughput: %.2f products a cycle an SM (8 warps)\n", 64.0 / eight);
  CUDA_RETURN_IF_ERROR(cudaFree(cycles));
  CUDA_RETURN_IF_ERROR(cudaFree(sink));
  return absl::OkStatus();
}

}  // namespace

int main() { return RunProbe("cfc_cluster_probe", Run); }
