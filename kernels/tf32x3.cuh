// Float32-accurate products on the TF32 tensor cores (the "3×TF32" split of CUTLASS's OpMultiplyAddFastF32): each
// float32 operand becomes a TF32 "big" part and a TF32 remainder, and a·b ≈ big_a·big_b + big_a·small_b +
// small_a·big_b with float32 accumulation; the dropped small_a·small_b term is about 2⁻²² of a·b, below what float32
// accumulation over a long sum already loses.
#pragma once

#include <cstdint>

namespace perception::kernels {

struct Tf32Split {
  uint32_t big, small;
};

// Round to nearest (ties away) into TF32's 10 mantissa bits; the tensor core would otherwise truncate.
__device__ __forceinline__ uint32_t ToTf32(float x) {
  uint32_t bits;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
  return bits;
}

// x − big is exact in float32, so big + small carries 21 of x's 24 mantissa bits.
__device__ __forceinline__ Tf32Split SplitTf32(float x) {
  const uint32_t big = ToTf32(x);
  return {big, ToTf32(x - __uint_as_float(big))};
}

// d += a·b over one m16n8k8 tile. With g = lane / 4 and t = lane % 4, the fragments are (PTX ISA, mma.m16n8k8 .tf32):
// a (row-major 16×8): a[0] = (g, t), a[1] = (g+8, t), a[2] = (g, t+4), a[3] = (g+8, t+4);
// b (8×8, k by n):    b[0] = (k t, n g), b[1] = (k t+4, n g);
// d (16×8):           d[0], d[1] = (g, 2t), (g, 2t+1); d[2], d[3] = (g+8, 2t), (g+8, 2t+1).
__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d[j] += a·b[j] for the N tiles of one mma row at float32 accuracy from split fragments. The two correction terms go
// in before the big one, so they are summed while the accumulators are still small; each pass runs over all N tiles
// before the next, so consecutive mma are independent instead of each waiting out the previous one's latency.
template <int N>
__device__ __forceinline__ void Mma3xTf32(float (&d)[N][4], const uint32_t (&a_big)[4], const uint32_t (&a_small)[4],
                                          const uint32_t (&b_big)[N][2], const uint32_t (&b_small)[N][2]) {
#pragma unroll
  for (int j = 0; j < N; ++j) MmaTf32(d[j], a_small, b_big[j]);
#pragma unroll
  for (int j = 0; j < N; ++j) MmaTf32(d[j], a_big, b_small[j]);
#pragma unroll
  for (int j = 0; j < N; ++j) MmaTf32(d[j], a_big, b_big[j]);
}

}  // namespace perception::kernels
