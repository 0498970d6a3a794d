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

// big: x rounded to nearest (ties away) into TF32 with two integer operations instead of a conversion (the split is
// the producer's bottleneck); the carry of a finite x rounds its magnitude up, into infinity past TF32's largest. A NaN
// whose mantissa carries out may become ±0 or ±infinity as big, but then small = x − big is NaN, so NaN still reaches
// the product. x − big is exact in float32, so big + small carries 21 of x's 24 mantissa bits.
__device__ __forceinline__ Tf32Split SplitTf32(float x) {
  const uint32_t big = (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u;
  return {big, ToTf32(x - __uint_as_float(big))};
}

}  // namespace perception::kernels
