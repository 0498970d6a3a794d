// The mbarrier primitives (PTX) of the kernels that hand shared memory between warps or from asynchronous copies:
// barriers by their 32-bit shared-memory address.
#pragma once

#include <cstdint>

namespace perception::kernels {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarrierArrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}" ::"r"(bar) : "memory");
}
// Arrives and expects `bytes` more of asynchronous copies before the phase completes.
__device__ __forceinline__ void MbarrierArriveExpect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Until the phase of `parity` has completed.
__device__ __forceinline__ void MbarrierWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}" ::"r"(
          bar),
      "r"(parity)
      : "memory");
}

// Makes this thread's barrier initializations visible to the cluster's asynchronous copies (before a cluster barrier).
__device__ __forceinline__ void MbarrierInitFence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// `bytes` (a multiple of 16) from global `src` to shared `dst` in every block of the cluster that `blocks` names (bit r:
// rank r), each block's barrier at `bar` (the same shared offset in all of them) counting the bytes that land there.
__device__ __forceinline__ void BulkCopyMulticast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                                  uint16_t blocks) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(blocks)
      : "memory");
}
// The cluster barrier in halves (every thread of every block of the cluster arrives): a relaxed arrive (ordering only
// what a fence before it orders, e.g. MbarrierInitFence's initializations), and the wait, which acquires.
__device__ __forceinline__ void ClusterBarrierArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterBarrierWait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

}  // namespace perception::kernels
