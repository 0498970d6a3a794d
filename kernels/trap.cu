// The trapping kernel of kernels/trap.h.
#include "kernels/trap.h"

namespace perception::kernels {
namespace {

__global__ void TrapKernel() { __trap(); }

}  // namespace

cudaError_t LaunchTrap(cudaStream_t stream) {
  TrapKernel<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

}  // namespace perception::kernels
