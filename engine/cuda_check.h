// absl::Status checks for CUDA runtime and cuBLAS calls (kernel launchers included): a failure names the call, the
// error, the file and the line.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace perception::cuda_internal {

inline absl::Status CudaFailure(cudaError_t error, const char* call, const char* file, int line) {
  const std::string message = absl::StrCat(call, " failed with ", cudaGetErrorName(error), " (",
                                           cudaGetErrorString(error), ") at ", file, ":", line);
  return error == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message) : absl::InternalError(message);
}

inline absl::Status CublasFailure(cublasStatus_t status, const char* call, const char* file, int line) {
  return absl::InternalError(absl::StrCat(call, " failed with ", cublasGetStatusName(status), " (",
                                          cublasGetStatusString(status), ") at ", file, ":", line));
}

}  // namespace perception::cuda_internal

#define CUDA_RETURN_IF_ERROR(call)                                                            \
  do {                                                                                        \
    const cudaError_t _cuda_error = (call);                                                   \
    if (_cuda_error != cudaSuccess) {                                                         \
      return ::perception::cuda_internal::CudaFailure(_cuda_error, #call, __FILE__, __LINE__); \
    }                                                                                         \
  } while (0)

#define CUBLAS_RETURN_IF_ERROR(call)                                                                \
  do {                                                                                              \
    const cublasStatus_t _cublas_status = (call);                                                   \
    if (_cublas_status != CUBLAS_STATUS_SUCCESS) {                                                  \
      return ::perception::cuda_internal::CublasFailure(_cublas_status, #call, __FILE__, __LINE__); \
    }                                                                                               \
  } while (0)
