// Row-major linear-layer products on column-major cuBLAS: a row-major [r, c] matrix is a column-major [c, r] one,
// so each product is issued transposed (Yᵀ = W·Xᵀ and so on).
#include "engine/cuda_blas.h"

#include "engine/cuda_check.h"

namespace perception {

absl::StatusOr<std::unique_ptr<Blas>> Blas::Create(cudaStream_t stream, void* workspace, size_t workspace_bytes,
                                                   bool tf32) {
  cublasHandle_t handle = nullptr;
  CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  std::unique_ptr<Blas> blas(new Blas(handle));
  CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, stream));
  CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(handle, workspace, workspace_bytes));
  CUBLAS_RETURN_IF_ERROR(cublasSetAtomicsMode(handle, CUBLAS_ATOMICS_NOT_ALLOWED));
  CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(handle, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  return blas;
}

Blas::~Blas() { cublasDestroy(handle_); }

absl::Status Blas::Gemm(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, const float* a, int lda,
                        const float* b, int ldb, float beta, float* c, int ldc) {
  const float one = 1.f;
  CUBLAS_RETURN_IF_ERROR(cublasSgemm(handle_, op_a, op_b, m, n, k, &one, a, lda, b, ldb, &beta, c, ldc));
  flops_ += 2.0 * m * n * k;
  return absl::OkStatus();
}

absl::Status Blas::Forward(int rows, int in, int out, const float* x, int ldx, const float* w, int ldw, float beta,
                           float* y, int ldy) {
  return Gemm(CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, w, ldw, x, ldx, beta, y, ldy);
}

absl::Status Blas::BackwardData(int rows, int in, int out, const float* dy, int lddy, const float* w, int ldw,
                                float beta, float* dx, int lddx) {
  return Gemm(CUBLAS_OP_N, CUBLAS_OP_N, in, rows, out, w, ldw, dy, lddy, beta, dx, lddx);
}

absl::Status Blas::BackwardWeight(int rows, int in, int out, const float* dy, int lddy, const float* x, int ldx,
                                  float* dw, int lddw) {
  return Gemm(CUBLAS_OP_N, CUBLAS_OP_T, in, out, rows, x, ldx, dy, lddy, 0.f, dw, lddw);
}

}  // namespace perception
