// Every float e in [0, 1] through kernels/common.cuh's SigmoidFromExp, against IEEE division (__fdiv_rn).
#include "tests/cuda/sigmoid_exhaustive.h"

#include "kernels/common.cuh"

namespace perception::testing {
namespace {

constexpr uint32_t kOneBits = 0x3f800000u;  // 1.0f: the floats in [0, 1] are the bit patterns 0 .. kOneBits

__global__ void CountSigmoidMismatchesKernel(unsigned long long* mismatches) {
  unsigned long long found = 0;
  for (uint32_t bits = blockIdx.x * blockDim.x + threadIdx.x; bits <= kOneBits; bits += gridDim.x * blockDim.x) {
    const float e = __uint_as_float(bits), d = __fadd_rn(1.f, e);
    found += __float_as_uint(kernels::SigmoidFromExp(e, true)) != __float_as_uint(__fdiv_rn(1.f, d));
    found += __float_as_uint(kernels::SigmoidFromExp(e, false)) != __float_as_uint(__fdiv_rn(e, d));
  }
  atomicAdd(mismatches, found);
}

}  // namespace

cudaError_t CountSigmoidMismatches(uint64_t* mismatches) {
  unsigned long long* device = nullptr;
  cudaError_t e = cudaMalloc(&device, sizeof(*device));
  if (e == cudaSuccess) e = cudaMemset(device, 0, sizeof(*device));
  if (e == cudaSuccess) CountSigmoidMismatchesKernel<<<1024, 256>>>(device);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaMemcpy(mismatches, device, sizeof(*device), cudaMemcpyDeviceToHost);
  cudaFree(device);
  return e;
}

}  // namespace perception::testing
