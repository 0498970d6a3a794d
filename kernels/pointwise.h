// Elementwise kernels of PerceptionNet: input standardization (MODEL.md §2.0) and the GRN's ELU (§2.5).
#pragma once

#include <cuda_runtime.h>

namespace perception::kernels {

// xn[r,f] = (x[r,f] − mean[f]) · inv_std[f] over `rows` rows of `features`.
cudaError_t LaunchStandardize(const float* x, const float* mean, const float* inv_std, int rows, int features,
                              float* xn, cudaStream_t stream);

// out = elu(pre) over n values. `programmatic`: launched as the programmatic dependent of the kernel ahead on the
// stream (kernels/common.cuh, LaunchKernel).
cudaError_t LaunchEluForward(const float* pre, int n, float* out, cudaStream_t stream, bool programmatic = false);

// d_pre = d_out ⊙ elu'(pre) over `rows` rows of `cols` values, each matrix with its leading dimension (e.g. d_out a
// column range of a wider matrix); d_pre may be d_out (in place, the same leading dimension).
cudaError_t LaunchEluBackwardRows(const float* pre, int ldpre, const float* d_out, int ldd_out, int rows, int cols,
                                  float* d_pre, int ldd_pre, cudaStream_t stream);

}  // namespace perception::kernels
