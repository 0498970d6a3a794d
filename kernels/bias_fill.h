// Broadcasts biases into GEMM outputs before the GEMMs accumulate onto them (beta = 1), all in one launch.
#pragma once

#include <cuda_runtime.h>

namespace perception::kernels {

// dst[r·ld + c] = bias[c] for r < rows, c < cols.
struct BiasFillJob {
  float* dst = nullptr;
  int ld = 0;
  const float* bias = nullptr;
  int cols = 0;
};

// Runs `count` jobs from the device table `jobs`, each over `rows` rows.
cudaError_t LaunchBiasFill(const BiasFillJob* jobs, int count, int rows, cudaStream_t stream);

}  // namespace perception::kernels
