// A kernel that traps, for the daemon's lost-device test hook (--inject_device_loss_at_tick): a real sticky error.
#pragma once

#include <cuda_runtime.h>

namespace perception::kernels {

// Launches one thread that executes a trap instruction: the launch succeeds, and the stream's next synchronization
// returns cudaErrorLaunchFailure, after which the context is unusable (as after any sticky error).
cudaError_t LaunchTrap(cudaStream_t stream);

}  // namespace perception::kernels
