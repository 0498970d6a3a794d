// state_traffic_probe: the floor a streaming tick of n instruments pays to read and write its SSM states alone
// (`small`: 2 layers × 4 heads × 64 × 32 floats, 64 KB a slot), measured as bench_stream measures a tick: a graph of
// one state pass a layer, each pass reading and rewriting every tick slot's 32 KB of that layer as plainly as the
// hardware allows (16-byte accesses, four or eight in flight a thread), with default or evict-first L2 policies, or
// with the first slots' states in a persisting L2 window as large as the device allows (the most of the states that
// could stay in L2 from tick to tick), a read-only pass for comparison, and the read-write pass over states held in
// bfloat16 (half the bytes; the update in float32), the floor of a narrower-state mode; and both read-write passes
// with every other tick walking each layer's slots backwards, so that a tick first meets the states the tick before
// touched last, the ones most likely still in L2. `state_traffic_probe` prints one line per tick size.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/held_ticks.cuh"
#include "bench/probe_main.h"
#include "engine/cuda_check.h"
#include "engine/status_macros.h"
#include "kernels/common.cuh"

namespace {

constexpr int kLayers = 2;
constexpr int kLayerFloats = 4 * 64 * 32;  // small: heads × headdim × d_state
constexpr int kSlotFloats = kLayers * kLayerFloats;
constexpr int kThreads = 256;
constexpr int kTicks = 300;

enum class Pass { kReadWrite, kReadWriteEvictFirst, kReadOnly, kReadWriteBf16 };

__device__ __forceinline__ float4 Load(const float4* p, uint64_t policy, bool marked) {
  float4 v;
  if (marked) {
    asm volatile("ld.global.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p), "l"(policy));
  } else {
    v = *p;
  }
  return v;
}
__device__ __forceinline__ void Store(float4* p, float4 v, uint64_t policy, bool marked) {
  if (marked) {
    perception::kernels::Store16(reinterpret_cast<float*>(p), v, policy);
  } else {
    *p = v;
  }
}

// The bfloat16 pass's update of a 16-byte piece (eight states), in float32 between the loads and the stores.
__device__ __forceinline__ uint4 DecayBf16(uint4 piece) {
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&piece);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 s = __bfloat1622float2(pairs[i]);
    pairs[i] = __floats2bfloat162_rn(0.999f * s.x + 1e-3f, 0.999f * s.y + 1e-3f);
  }
  return piece;
}

// Piece `piece` (of the tick's pieces, in event order) of layer l's states of the tick's n slots, a slot's states of
// type State read in pieces of type Piece; null past the tick's end.
template <typename Piece, typename State>
__device__ __forceinline__ Piece* StatePiece(State* states, const int* slots, int n, int l, int64_t piece) {
  constexpr int kPieces = kLayerFloats * sizeof(State) / sizeof(Piece);
  const int event = static_cast<int>(piece / kPieces), within = static_cast<int>(piece % kPieces);
  return event < n ? reinterpret_cast<Piece*>(states + static_cast<int64_t>(slots[event]) * kSlotFloats +
                                              l * kLayerFloats) + within
                   : nullptr;
}

// Layer l's states of the tick's n slots: the state decays and takes an input, as the SSM update does (so every byte
// is read and written), or, read-only, each block's sum lands in `sink`. kReadWriteBf16 reads `states` as bfloat16
// states (a slot's kSlotFloats of them in half the bytes) and moves eight of them a 16-byte piece.
// `backwards`: block b takes the pieces of block gridDim.x − 1 − b, so the pass meets the slots last to first.
template <Pass kPass, int kPerThread>
__global__ void __launch_bounds__(kThreads) StatePassKernel(float* states, const int* slots, int n, int l,
                                                            float* sink, bool backwards) {
  const int block = backwards ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int64_t first = (static_cast<int64_t>(block) * kThreads * kPerThread) + threadIdx.x;
  if constexpr (kPass == Pass::kReadWriteBf16) {
    __nv_bfloat16* const base = reinterpret_cast<__nv_bfloat16*>(states);
    uint4 v[kPerThread];
    uint4* at[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      at[k] = StatePiece<uint4>(base, slots, n, l, first + k * kThreads);
      if (at[k]) v[k] = *at[k];
    }
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      if (at[k]) *at[k] = DecayBf16(v[k]);
    }
    return;
  }
  constexpr bool kMarked = kPass == Pass::kReadWriteEvictFirst;
  const uint64_t policy = kMarked ? perception::kernels::EvictFirstPolicy() : 0;
  float4 v[kPerThread];
  float4* at[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    at[k] = StatePiece<float4>(states, slots, n, l, first + k * kThreads);
    if (at[k]) v[k] = Load(at[k], policy, kMarked);
  }
  if constexpr (kPass == Pass::kReadOnly) {
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      if (at[k]) sum += v[k].x + v[k].y + v[k].z + v[k].w;
    }
    if (sum == 1.2345f) sink[blockIdx.x] = sum;  // never true for the data below; keeps the loads
  } else {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      if (!at[k]) continue;
      const float4 s = v[k];
      Store(at[k], make_float4(0.999f * s.x + 1e-3f, 0.999f * s.y + 1e-3f, 0.999f * s.z + 1e-3f, 0.999f * s.w + 1e-3f),
            policy, kMarked);
    }
  }
}

// Puts a persisting window over [base, base + bytes) on every kernel node of the graph.
absl::Status SetWindow(cudaGraph_t graph, float* base, size_t bytes) {
  size_t count = 0;
  CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nodes.data(), &count));
  cudaKernelNodeAttrValue value = {};
  value.accessPolicyWindow.base_ptr = base;
  value.accessPolicyWindow.num_bytes = bytes;
  value.accessPolicyWindow.hitRatio = 1.f;
  value.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
  value.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
  for (cudaGraphNode_t node : nodes) {
    CUDA_RETURN_IF_ERROR(cudaGraphKernelNodeSetAttribute(node, cudaKernelNodeAttributeAccessPolicyWindow, &value));
  }
  return absl::OkStatus();
}

// A graph of one pass a layer; window_bytes > 0: its kernels carry a persisting access-policy window over the states'
// first window_bytes.
template <Pass kPass, int kPerThread>
absl::StatusOr<cudaGraphExec_t> CaptureTick(cudaStream_t stream, float* states, const int* slots, int n, float* sink,
                                            size_t window_bytes, bool backwards) {
  const int64_t pieces = static_cast<int64_t>(n) * (kLayerFloats / (kPass == Pass::kReadWriteBf16 ? 8 : 4));
  const int blocks = static_cast<int>((pieces + kThreads * kPerThread - 1) / (kThreads * kPerThread));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < kLayers; ++l) {
    StatePassKernel<kPass, kPerThread><<<blocks, kThreads, 0, stream>>>(states, slots, n, l, sink, backwards);
  }
  CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  if (window_bytes > 0) RETURN_IF_ERROR(SetWindow(graph, states, window_bytes));
  CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_RETURN_IF_ERROR(cudaGraphDestroy(graph));
  return exec;
}

// Median µs a tick; `alternating`: every other tick walks the slots backwards.
template <Pass kPass, int kPerThread = 4>
absl::StatusOr<double> MedianTick(cudaStream_t stream, float* states, const int* slots, int n, float* sink,
                                  size_t window_bytes = 0, bool alternating = false) {
  cudaGraphExec_t forwards, backwards;
  ASSIGN_OR_RETURN(forwards,
                   (CaptureTick<kPass, kPerThread>(stream, states, slots, n, sink, window_bytes, false)));
  ASSIGN_OR_RETURN(backwards,
                   (CaptureTick<kPass, kPerThread>(stream, states, slots, n, sink, window_bytes, true)));
  int tick = 0;
  const absl::StatusOr<double> us = perception::MedianHeldTick(stream, kTicks, [&]() -> absl::Status {
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(alternating && tick++ % 2 == 1 ? backwards : forwards, stream));
    return absl::OkStatus();
  });
  CUDA_RETURN_IF_ERROR(cudaGraphExecDestroy(forwards));
  CUDA_RETURN_IF_ERROR(cudaGraphExecDestroy(backwards));
  return us;
}

absl::Status Probe() {
  cudaStream_t stream;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int device = 0, l2 = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  constexpr int kMaxSlots = 10000;
  float *states = nullptr, *sink = nullptr;
  int* slots = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&states, sizeof(float) * kSlotFloats * kMaxSlots));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&sink, sizeof(float) * 65536));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&slots, sizeof(int) * kMaxSlots));
  std::vector<int> identity(kMaxSlots);
  for (int i = 0; i < kMaxSlots; ++i) identity[i] = i;
  CUDA_RETURN_IF_ERROR(cudaMemcpy(slots, identity.data(), sizeof(int) * kMaxSlots, cudaMemcpyHostToDevice));
  CUDA_RETURN_IF_ERROR(cudaMemset(states, 0, sizeof(float) * kSlotFloats * kMaxSlots));
  int max_persisting = 0, max_window = 0;
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&max_persisting, cudaDevAttrMaxPersistingL2CacheSize, device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&max_window, cudaDevAttrMaxAccessPolicyWindowSize, device));
  std::printf("L2 %d bytes (persisting at most %d, window at most %d); SSM states %d bytes a slot (%d layers)\n", l2,
              max_persisting, max_window, kSlotFloats * 4, kLayers);
  std::printf("%-12s %9s %20s %12s %12s %12s %22s %20s %14s %14s\n", "instruments", "state MB",
              "read+write us (GB/s)", "8 in flight", "evict-first", "read-only", "persisting window us",
              "bf16 read+write us", "alternating", "bf16 alt.");
  for (int n : {256, 512, 768, 1024, 1536, 2048, 4096, 10000}) {
    const double mb = 1e-6 * n * kSlotFloats * 4.0;
    ASSIGN_OR_RETURN(const double rw, MedianTick<Pass::kReadWrite>(stream, states, slots, n, sink));
    ASSIGN_OR_RETURN(const double rw_first, MedianTick<Pass::kReadWriteEvictFirst>(stream, states, slots, n, sink));
    ASSIGN_OR_RETURN(const double rw8, (MedianTick<Pass::kReadWrite, 8>(stream, states, slots, n, sink)));
    ASSIGN_OR_RETURN(const double ro, MedianTick<Pass::kReadOnly>(stream, states, slots, n, sink));
    ASSIGN_OR_RETURN(const double bf16, MedianTick<Pass::kReadWriteBf16>(stream, states, slots, n, sink));
    ASSIGN_OR_RETURN(const double alternating, MedianTick<Pass::kReadWrite>(stream, states, slots, n, sink, 0, true));
    ASSIGN_OR_RETURN(const double bf16_alternating,
                     MedianTick<Pass::kReadWriteBf16>(stream, states, slots, n, sink, 0, true));
    // The window over as much of the states as may persist; the rest streams.
    const size_t window = std::min<size_t>({static_cast<size_t>(max_persisting), static_cast<size_t>(max_window),
                                            static_cast<size_t>(n) * kSlotFloats * 4});
    CUDA_RETURN_IF_ERROR(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, static_cast<size_t>(max_persisting)));
    ASSIGN_OR_RETURN(const double persisting, MedianTick<Pass::kReadWrite>(stream, states, slots, n, sink, window));
    CUDA_RETURN_IF_ERROR(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0));
    CUDA_RETURN_IF_ERROR(cudaCtxResetPersistingL2Cache());
    std::printf("%-12d %9.1f %11.2f (%6.0f) %12.2f %12.2f %12.2f %12.2f (%.1f MB) %20.2f %14.2f %14.2f\n", n, mb,
                rw, 2e-3 * mb / (rw * 1e-6), rw8, rw_first, ro, persisting, 1e-6 * window, bf16, alternating,
                bf16_alternating);
  }
  CUDA_RETURN_IF_ERROR(cudaFree(states));
  CUDA_RETURN_IF_ERROR(cudaFree(sink));
  CUDA_RETURN_IF_ERROR(cudaFree(slots));
  CUDA_RETURN_IF_ERROR(cudaStreamDestroy(stream));
  return absl::OkStatus();
}

}  // namespace

int main() { return RunProbe("state_traffic_probe", Probe); }
