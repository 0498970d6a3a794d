// A device check of kernels/common.cuh's branch-free sigmoid division against IEEE division, for kernel_test.cc.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace perception::testing {

// For every float e in [0, 1] (each value e^−|v| can take), counts where SigmoidFromExp(e, ·) differs in any bit from
// IEEE's 1/(1 + e) and e/(1 + e), into *mismatches.
cudaError_t CountSigmoidMismatches(uint64_t* mismatches);

}  // namespace perception::testing
