// cuBLAS for the CUDA backend: one handle on one stream, its workspace set once, deterministic (no atomics), float32
// or, opted in, TF32 tensor cores; and the three products of a linear layer in the model's row-major layout.
#pragma once

#include <memory>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"

namespace perception {

// Matrices are row-major with a leading dimension (row stride, in floats): activations [rows, features],
// weights [out, in]. A product's beta scales what its output held (beta = 1 accumulates, e.g. onto a broadcast
// bias or a residual stream).
class Blas {
 public:
  static absl::StatusOr<std::unique_ptr<Blas>> Create(cudaStream_t stream, void* workspace, size_t workspace_bytes,
                                                      bool tf32);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // y[rows, out] = x[rows, in] · w[out, in]ᵀ + beta·y
  absl::Status Forward(int rows, int in, int out, const float* x, int ldx, const float* w, int ldw, float beta,
                       float* y, int ldy);
  // dx[rows, in] = dy[rows, out] · w[out, in] + beta·dx
  absl::Status BackwardData(int rows, int in, int out, const float* dy, int lddy, const float* w, int ldw, float beta,
                            float* dx, int lddx);
  // dw[out, in] = dy[rows, out]ᵀ · x[rows, in]
  absl::Status BackwardWeight(int rows, int in, int out, const float* dy, int lddy, const float* x, int ldx, float* dw,
                              int lddw);

  // 2·m·n·k summed over every product issued so far.
  double flops() const { return flops_; }

 private:
  explicit Blas(cublasHandle_t handle) : handle_(handle) {}
  absl::Status Gemm(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, const float* a, int lda,
                    const float* b, int ldb, float beta, float* c, int ldc);

  cublasHandle_t handle_;
  double flops_ = 0;
};

}  // namespace perception
