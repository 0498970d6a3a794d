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

}  // namespace perception::kernels
