// A kernel that writes through an invalid address, for the tests of a lost device.
#pragma once

#include <cuda_runtime.h>

namespace perception::testing {

// Launches one thread that stores to an unmapped address on `stream`: the stream's next synchronization reports
// cudaErrorIllegalAddress, a sticky error. Returns the launch's own error.
cudaError_t LaunchIllegalAddressWrite(cudaStream_t stream);

}  // namespace perception::testing
