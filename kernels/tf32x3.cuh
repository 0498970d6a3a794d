// Float32-accurate products on the TF32 tensor cores (the "3×TF32" split of CUTLASS's OpMultiplyAddFastF32): each
// float32 operand becomes a TF32 "big" part and a remainder that the tensor cores take as TF32, and a·b ≈ big_a·big_b
// + big_a·small_b + small_a·big_b with float32 accumulation; the dropped small_a·small_b term is about 2⁻²² of a·b,
// below what float32 accumulation over a long sum already loses.
#pragma once

#include <cstdint>

namespace perception::kernels {

struct Tf32Split {
  uint32_t big, small;
};

// big: x rounded to nearest (ties away) into TF32 with two integer operations instead of a conversion (the split is
// the producer's bottleneck); the carry of a finite x rounds its magnitude up, into infinity past TF32's largest. A NaN
// whose mantissa carries out may become ±0 or ±infinity as big, but then small = x − big is NaN, so NaN still reaches
// the product. x − big is exact in float32, so big + small carries 21 of x's 24 mantissa bits.
__device__ __forceinline__ uint32_t Tf32Big(float x) { return (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u; }

// The split for operands that go straight into mma or wgmma: small stays float32 and the tensor core truncates it,
// which costs ≤ 2⁻¹⁰ of small, ≤ 2⁻²¹ of x, and saves a rounding conversion (several instructions on sm_90).
__device__ __forceinline__ Tf32Split SplitTf32ForMma(float x) {
  const uint32_t big = Tf32Big(x);
  return {big, __float_as_uint(x - __uint_as_float(big))};
}

// d += a·b for one m16n8k8 tile on the TF32 tensor cores (sm_80 on), fragments as PTX's mma.m16n8k8 lays them out:
// with g = lane/4 and t = lane%4, a = A(g, t), A(g+8, t), A(g, t+4), A(g+8, t+4); b = B(t, g), B(t+4, g);
// d = D(g, 2t), D(g, 2t+1), D(g+8, 2t), D(g+8, 2t+1).
__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a·b in 3×TF32 from split operands: the small cross terms first, so that they are not lost under the big
// product.
__device__ __forceinline__ void MmaTf32x3(float (&d)[4], const Tf32Split (&a)[4], const Tf32Split (&b)[2]) {
  const uint32_t a_big[4] = {a[0].big, a[1].big, a[2].big, a[3].big};
  const uint32_t a_small[4] = {a[0].small, a[1].small, a[2].small, a[3].small};
  const uint32_t b_big[2] = {b[0].big, b[1].big}, b_small[2] = {b[0].small, b[1].small};
  MmaTf32(d, a_small, b_big);
  MmaTf32(d, a_big, b_small);
  MmaTf32(d, a_big, b_big);
}

}  // namespace perception::kernels
