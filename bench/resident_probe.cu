// resident_probe: what an event costs a resident (persistent) kernel of the small tick's shape (a cluster of 8 blocks
// of 256 threads, 184,800 bytes of dynamic shared memory each) that waits for events instead of being launched per
// event, against the graph-launched empty kernel of launch_probe. The kernel's body is empty: one warp takes the
// event, the cluster synchronizes, rank 0 answers. Ways an event reaches it: (a) the host writes it into mapped
// pinned memory and spins on the answer (host-timed round trip, and back-to-back events through a ring); (b) stream
// ordered: stream memory operations write a doorbell in device memory and wait for the answer, captured in a graph
// per tick (or queued plainly), timed with CUDA events as launch_probe times a tick. `resident_probe` prints one line
// per variant.
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/held_ticks.cuh"
#include "bench/percentile.h"
#include "bench/probe_main.h"
#include "engine/cuda_check.h"
#include "engine/status_macros.h"

#define CU_RETURN_IF_ERROR(call)                                                                            \
  do {                                                                                                      \
    const CUresult _cu_result = (call);                                                                     \
    if (_cu_result != CUDA_SUCCESS) {                                                                       \
      const char* _name = nullptr;                                                                          \
      cuGetErrorName(_cu_result, &_name);                                                                   \
      return absl::InternalError(absl::StrCat(#call, " failed with ", _name ? _name : "?", " at ", __LINE__)); \
    }                                                                                                       \
  } while (0)

namespace {

constexpr int kThreads = 256;
constexpr int kCluster = 8;
constexpr size_t kShared = 184800;  // the fixed plan's launch
constexpr int kTicks = 400;
constexpr int kRoundTrips = 5000;
constexpr int kBackToBack = 20000;

// An event as the host writes it: three 64-byte lines (the small tick's 40 features, Δt, slot and log position fit),
// word 0 of each its sequence number, written after the line's data.
constexpr int kLines = 3, kLineWords = 16, kEventWords = kLines * kLineWords;
struct alignas(64) HostEvent {
  uint32_t w[kEventWords];
};
constexpr int kRing = 64;
struct alignas(64) Reply {
  uint32_t done;      // the last answered event's sequence number
  uint32_t sum;       // the sum of its data words (as the blocks read them)
  uint32_t timed_out;
};
struct alignas(64) Control {
  uint32_t stop;
};

enum Mode : int {
  kPollSeqThenRead,  // host memory: one lane polls line 0's sequence number, then the warp reads the event
  kPollWholeEvent,   // host memory: the warp reads the whole event until every line carries the sequence number
  kDeviceDoorbell,   // device memory: a flag set by the stream (1: an event, cleared by the kernel), answer flag 1
};

struct Args {
  const HostEvent* ring;   // kPollSeq*, mapped pinned memory; kDeviceDoorbell: one event in device memory
  uint32_t* doorbell;      // kDeviceDoorbell
  uint32_t* device_done;   // kDeviceDoorbell
  Reply* reply;            // mapped pinned memory
  const Control* control;  // mapped pinned memory
  int all_poll;            // every block's warp 0 polls (else rank 0's, and the others read the event from it)
};

__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t LoadRelaxed(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void LoadRelaxed2(const uint32_t* p, uint32_t& a, uint32_t& b) {
  asm volatile("ld.relaxed.sys.global.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ void StoreRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void StoreRelaxed(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t GlobalNanoseconds() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

constexpr uint32_t kEvent = 1, kStop = 2;
constexpr uint64_t kIdleNanoseconds = 2'000'000'000;  // without events or a stop this long, the kernel leaves

// Warp 0's wait for event k (sequence number k + 1): the event's words into `event`, kEvent, or kStop when the host
// asks or nothing came for kIdleNanoseconds. The stop flag and the clock are read every 256 polls.
template <int kMode>
__device__ uint32_t Poll(const Args& a, uint32_t k, uint32_t* event) {
  const int lane = threadIdx.x;
  const uint64_t start = GlobalNanoseconds();
  const HostEvent* e = kMode == kDeviceDoorbell ? a.ring : a.ring + k % kRing;
  for (uint32_t polls = 1;; ++polls) {
    bool ready = false;
    if constexpr (kMode == kPollWholeEvent) {
      uint32_t w0 = 0, w1 = 0;
      if (lane < kEventWords / 2) LoadRelaxed2(e->w + 2 * lane, w0, w1);
      const bool seq_ok = lane >= kEventWords / 2 || (2 * lane) % kLineWords != 0 || w0 == k + 1;
      ready = __all_sync(0xffffffffu, seq_ok);
      if (ready && lane < kEventWords / 2) {
        event[2 * lane] = w0;
        event[2 * lane + 1] = w1;
      }
    } else {
      uint32_t seen = 0;
      if (lane == 0) {
        seen = kMode == kDeviceDoorbell ? LoadAcquire(a.doorbell) : LoadAcquire(e->w);
      }
      seen = __shfl_sync(0xffffffffu, seen, 0);
      ready = kMode == kDeviceDoorbell ? seen == 1 : seen == k + 1;
      if (ready) {
        if (kMode == kDeviceDoorbell && lane == 0) StoreRelaxed(a.doorbell, 0);
        __syncwarp();
        for (int i = lane; i < kEventWords; i += 32) event[i] = LoadRelaxed(e->w + i);
      }
    }
    if (ready) return kEvent;
    if (polls % 256 == 0) {
      uint32_t stop = 0;
      if (lane == 0) stop = LoadRelaxed(&a.control->stop) != 0 || GlobalNanoseconds() - start > kIdleNanoseconds;
      if (__shfl_sync(0xffffffffu, stop, 0)) return kStop;
    }
  }
}

// Shared memory: the event's words, then the block's decision (kEvent or kStop).
template <int kMode>
__global__ void __launch_bounds__(kThreads, 1) ResidentKernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(16) uint32_t smem[];
  uint32_t* decision = smem + kEventWords;
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  auto rank0 = [&](const uint32_t* p) {  // p in rank 0's shared memory
    uint32_t mapped;
    asm volatile("mapa.shared::cluster.u32 %0, %1, 0;"
                 : "=r"(mapped)
                 : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
    return mapped;
  };
  auto load_cluster = [](uint32_t address) {
    uint32_t v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(address) : "memory");
    return v;
  };
  const bool polls = a.all_poll || rank == 0;
  for (uint32_t k = 0;; ++k) {
    if (polls && threadIdx.x < 32) {
      const uint32_t d = Poll<kMode>(a, k, smem);
      if (threadIdx.x == 0) *decision = d;
    }
    ClusterSync();  // rank 0's decision (every block follows it) and event are readable by every block
    if (load_cluster(rank0(decision)) != kEvent) break;
    if (!a.all_poll && rank != 0 && threadIdx.x < kEventWords) {
      smem[threadIdx.x] = load_cluster(rank0(smem + threadIdx.x));
    }
    ClusterSync();  // every block is done with the event (rank 0's words and decision are free for the next)
    if (rank == 0 && threadIdx.x < 32) {
      uint32_t sum = 0;
      for (int i = threadIdx.x; i < kEventWords; i += 32) sum += smem[i];
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (threadIdx.x == 0) {
        a.reply->sum = sum;
        if (kMode == kDeviceDoorbell) {
          StoreRelease(a.device_done, 1);
        } else {
          StoreRelease(&a.reply->done, k + 1);
        }
      }
    }
  }
  if (rank == 0 && threadIdx.x == 0 && LoadRelaxed(&a.control->stop) == 0) a.reply->timed_out = 1;
  ClusterSync();  // no block leaves while another may read its shared memory
}

__global__ void EmptyKernel() {}

cudaLaunchConfig_t ClusterConfig(cudaStream_t stream, cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kCluster);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kShared;
  config.stream = stream;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = kCluster;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

absl::StatusOr<double> MedianTick(cudaStream_t stream, const std::function<absl::Status()>& enqueue) {
  return perception::MedianHeldTick(stream, kTicks, enqueue);
}

// A graph of whatever `capture` enqueues, replayed per tick.
absl::StatusOr<double> MedianGraphTick(cudaStream_t stream, const std::function<absl::Status()>& capture) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status captured = capture();
  CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  RETURN_IF_ERROR(captured);
  CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
  const absl::StatusOr<double> us = MedianTick(stream, [&]() -> absl::Status {
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream));
    return absl::OkStatus();
  });
  CUDA_RETURN_IF_ERROR(cudaGraphExecDestroy(exec));
  CUDA_RETURN_IF_ERROR(cudaGraphDestroy(graph));
  return us;
}

template <typename T>
std::atomic_ref<T> Ref(T& v) {
  return std::atomic_ref<T>(v);
}

// Host writes event k into its ring entry: each line's data, then its sequence number, line 0 last (so that line 0's
// sequence number means the whole event is written).
void WriteEvent(HostEvent* ring, uint32_t k) {
  HostEvent& e = ring[k % kRing];
  for (int l = kLines - 1; l >= 0; --l) {
    for (int i = 1; i < kLineWords; ++i) {
      Ref(e.w[l * kLineWords + i]).store(k * 64 + l * kLineWords + i, std::memory_order_relaxed);
    }
    Ref(e.w[l * kLineWords]).store(k + 1, std::memory_order_release);
  }
}
uint32_t ExpectedSum(uint32_t k) {
  uint32_t sum = 0;
  for (int l = 0; l < kLines; ++l) {
    sum += k + 1;
    for (int i = 1; i < kLineWords; ++i) sum += k * 64 + l * kLineWords + i;
  }
  return sum;
}

struct Host {
  HostEvent* ring;
  Reply* reply;
  Control* control;
};

// Launches the resident kernel on `resident`, waits for nothing (its first poll finds no event), then returns.
template <int kMode>
absl::Status StartResident(const Host& h, Args args, cudaStream_t resident) {
  Ref(h.control->stop).store(0);
  Ref(h.reply->done).store(0);
  Ref(h.reply->timed_out).store(0);
  for (int i = 0; i < kRing; ++i) {
    for (int l = 0; l < kLines; ++l) Ref(h.ring[i].w[l * kLineWords]).store(0);
  }
  CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(ResidentKernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kShared)));
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = ClusterConfig(resident, &attribute);
  CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, ResidentKernel<kMode>, args));
  return absl::OkStatus();
}

absl::Status StopResident(const Host& h, cudaStream_t resident, const char* name) {
  Ref(h.control->stop).store(1, std::memory_order_release);
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(resident));
  if (Ref(h.reply->timed_out).load()) std::printf("  (%s: the kernel timed out)\n", name);
  return absl::OkStatus();
}

// (a): host-timed round trip of one event at a time, then back-to-back events through the ring.
template <int kMode>
absl::Status HostVariant(const Host& h, Args args, cudaStream_t resident, const char* name) {
  RETURN_IF_ERROR(StartResident<kMode>(h, args, resident));
  using Clock = std::chrono::steady_clock;
  uint32_t k = 0, wrong = 0;
  auto wait_done = [&](uint32_t seq) -> bool {
    const auto give_up = Clock::now() + std::chrono::seconds(1);
    while (Ref(h.reply->done).load(std::memory_order_acquire) < seq) {
      if (Clock::now() > give_up) return false;
    }
    return true;
  };
  std::vector<double> us;
  for (int i = 0; i < kRoundTrips + 100; ++i, ++k) {
    const auto t0 = Clock::now();
    WriteEvent(h.ring, k);
    if (!wait_done(k + 1)) return absl::DeadlineExceededError(absl::StrCat(name, ": no answer to event ", k));
    const auto t1 = Clock::now();
    if (Ref(h.reply->sum).load() != ExpectedSum(k)) ++wrong;
    if (i >= 100) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  // Back to back: up to kRing − 1 events outstanding.
  const auto t0 = Clock::now();
  const uint32_t first = k;
  for (int i = 0; i < kBackToBack; ++i, ++k) {
    while (k + 1 - Ref(h.reply->done).load(std::memory_order_acquire) >= kRing) {
    }
    WriteEvent(h.ring, k);
  }
  if (!wait_done(k)) return absl::DeadlineExceededError(absl::StrCat(name, ": back-to-back events unanswered"));
  const double per_event = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / (k - first);
  RETURN_IF_ERROR(StopResident(h, resident, name));
  std::printf("%-58s %9.2f %9.2f %9.2f %10.2f %6u\n", name, perception::Median(us), perception::Percentile(us, 0.1),
              perception::Percentile(us, 0.99), per_event, wrong);
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status Probe() {
  int lowest = 0, highest = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
  cudaStream_t stream, resident;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, highest));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&resident, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(EmptyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kShared)));

  // (c) the launched tick's floor.
  ASSIGN_OR_RETURN(const double empty_graph, MedianGraphTick(stream, [&]() -> absl::Status {
                     cudaLaunchAttribute attribute;
                     const cudaLaunchConfig_t config = ClusterConfig(stream, &attribute);
                     CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, EmptyKernel));
                     return absl::OkStatus();
                   }));
  ASSIGN_OR_RETURN(const double nothing, MedianTick(stream, [] { return absl::OkStatus(); }));

  Host h{};
  CUDA_RETURN_IF_ERROR(cudaHostAlloc(&h.ring, kRing * sizeof(HostEvent), cudaHostAllocMapped));
  CUDA_RETURN_IF_ERROR(cudaHostAlloc(&h.reply, sizeof(Reply), cudaHostAllocMapped));
  CUDA_RETURN_IF_ERROR(cudaHostAlloc(&h.control, sizeof(Control), cudaHostAllocMapped));
  Args args{};
  CUDA_RETURN_IF_ERROR(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(const_cast<HostEvent**>(&args.ring)), h.ring, 0));
  CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(reinterpret_cast<void**>(&args.reply), h.reply, 0));
  CUDA_RETURN_IF_ERROR(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(const_cast<Control**>(&args.control)), h.control, 0));

  std::printf("(a) host writes the event into mapped pinned memory, spins on the answer (us; %d round trips)\n",
              kRoundTrips);
  std::printf("%-58s %9s %9s %9s %10s %6s\n", "variant", "median", "p10", "p99", "b2b us/ev", "wrong");
  for (int all = 0; all < 2; ++all) {
    args.all_poll = all;
    RETURN_IF_ERROR(HostVariant<kPollSeqThenRead>(
        h, args, resident,
        all ? "poll seq, then read event; every block polls" : "poll seq, then read event; rank 0 polls"));
    RETURN_IF_ERROR(HostVariant<kPollWholeEvent>(
        h, args, resident, all ? "poll whole event; every block polls" : "poll whole event; rank 0 polls"));
  }

  // (b) stream ordered: the doorbell and the answer in device memory, one event's data in device memory.
  uint32_t* device = nullptr;  // [0] doorbell, [32] answer, [64..) the event
  CUDA_RETURN_IF_ERROR(cudaMalloc(&device, 64 * sizeof(uint32_t) + sizeof(HostEvent)));
  CUDA_RETURN_IF_ERROR(cudaMemset(device, 0, 64 * sizeof(uint32_t) + sizeof(HostEvent)));
  const CUdeviceptr doorbell = reinterpret_cast<CUdeviceptr>(device), done = reinterpret_cast<CUdeviceptr>(device + 32);
  HostEvent* staged = nullptr;
  CUDA_RETURN_IF_ERROR(cudaHostAlloc(&staged, sizeof(HostEvent), cudaHostAllocDefault));
  Args dargs = args;
  dargs.all_poll = 0;
  dargs.doorbell = device;
  dargs.device_done = device + 32;
  dargs.ring = reinterpret_cast<const HostEvent*>(device + 64);
  const CUstream s = reinterpret_cast<CUstream>(stream);
  // One tick: the answer cleared, (the event copied in,) the doorbell rung, the answer awaited.
  auto tick = [&](bool copy) -> absl::Status {
    CU_RETURN_IF_ERROR(cuStreamWriteValue32(s, done, 0, CU_STREAM_WRITE_VALUE_DEFAULT));
    if (copy) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device + 64, staged, sizeof(HostEvent), cudaMemcpyHostToDevice, stream));
    }
    CU_RETURN_IF_ERROR(cuStreamWriteValue32(s, doorbell, 1, CU_STREAM_WRITE_VALUE_DEFAULT));
    CU_RETURN_IF_ERROR(cuStreamWaitValue32(s, done, 1, CU_STREAM_WAIT_VALUE_EQ));
    return absl::OkStatus();
  };
  // The memory operations alone: an answer written by the stream itself.
  auto self_answered = [&]() -> absl::Status {
    CU_RETURN_IF_ERROR(cuStreamWriteValue32(s, done, 1, CU_STREAM_WRITE_VALUE_DEFAULT));
    CU_RETURN_IF_ERROR(cuStreamWaitValue32(s, done, 1, CU_STREAM_WAIT_VALUE_EQ));
    return absl::OkStatus();
  };
  std::printf("(b) stream ordered, CUDA events around each of %d queued ticks (median us)\n", kTicks);
  std::printf("%-58s %9s %9s\n", "variant", "plain", "graph");
  std::printf("%-58s %9.2f %9s\n", "nothing between the events", nothing, "-");
  // A variant that fails prints its error and the probe goes on.
  auto row = [&](const char* name, const std::function<absl::Status()>& enqueue) {
    const absl::StatusOr<double> plain = MedianTick(stream, enqueue);
    const absl::StatusOr<double> graphed = MedianGraphTick(stream, enqueue);
    std::printf("%-58s %9.2f %9.2f\n", name, plain.ok() ? *plain : -1.0, graphed.ok() ? *graphed : -1.0);
    if (!plain.ok()) std::printf("  plain: %s\n", plain.status().ToString().c_str());
    if (!graphed.ok()) std::printf("  graph: %s\n", graphed.status().ToString().c_str());
    std::fflush(stdout);
  };
  row("write answer + wait on it (no kernel)", self_answered);
  RETURN_IF_ERROR(StartResident<kDeviceDoorbell>(h, dargs, resident));
  row("clear answer, ring doorbell, wait answer (resident)", [&] { return tick(false); });
  row("same + 192-byte event copied from pinned memory", [&] { return tick(true); });
  RETURN_IF_ERROR(StopResident(h, resident, "device doorbell"));
  std::printf("(c) %-54s %9s %9.2f\n", "empty kernel, cluster of 8 x 256, 184,800 B shared", "-", empty_graph);

  CUDA_RETURN_IF_ERROR(cudaFree(device));
  CUDA_RETURN_IF_ERROR(cudaFreeHost(staged));
  CUDA_RETURN_IF_ERROR(cudaFreeHost(h.ring));
  CUDA_RETURN_IF_ERROR(cudaFreeHost(h.reply));
  CUDA_RETURN_IF_ERROR(cudaFreeHost(h.control));
  CUDA_RETURN_IF_ERROR(cudaStreamDestroy(stream));
  CUDA_RETURN_IF_ERROR(cudaStreamDestroy(resident));
  return absl::OkStatus();
}

}  // namespace

int main() { return RunProbe("resident_probe", Probe); }
