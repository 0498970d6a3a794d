// A kernel that writes through an invalid address, for the tests of a lost device.
#include "tests/cuda/device_fault.h"

#include <cstdint>

namespace perception::testing {
namespace {

__global__ void WriteThroughAddressKernel(uintptr_t address) { *reinterpret_cast<volatile float*>(address) = 1.f; }

}  // namespace

cudaError_t LaunchIllegalAddressWrite(cudaStream_t stream) {
  WriteThroughAddressKernel<<<1, 1, 0, stream>>>(uintptr_t{8});  // page 0 is never mapped
  return cudaGetLastError();
}

}  // namespace perception::testing
