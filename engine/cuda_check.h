// absl::Status checks for CUDA runtime and cuBLAS calls (kernel launchers included): a failure names the call, the
// error, the file and the line.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/device_loss.h"

namespace perception::cuda_internal {

// The errors after which the CUDA context cannot be used again ("sticky": every later call of the process fails):
// each that CUDA 13's driver_types.h says needs the process "terminated and relaunched", and the uncorrectable ECC
// and NVLink errors.
inline bool IsStickyCudaError(cudaError_t error) {
  switch (error) {
    case cudaErrorContained:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
      return true;
    default:
      return false;
  }
}

inline absl::Status CudaFailure(cudaError_t error, const char* call, const char* file, int line) {
  // The runtime keeps a failed call's error as its "last error", which every later kernel launcher reads back: a
  // failed allocation would fail the next, unrelated launch. Clearing it leaves a sticky error in place.
  cudaGetLastError();
  const std::string message = absl::StrCat(call, " failed with ", cudaGetErrorName(error), " (",
                                           cudaGetErrorString(error), ") at ", file, ":", line);
  if (IsStickyCudaError(error)) {
    NoteDeviceLost(absl::InternalError(message));
    return DeviceLostStatus();
  }
  return error == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message) : absl::InternalError(message);
}

inline absl::Status CublasFailure(cublasStatus_t status, const char* call, const char* file, int line) {
  return absl::InternalError(absl::StrCat(call, " failed with ", cublasGetStatusName(status), " (",
                                          cublasGetStatusString(status), ") at ", file, ":", line));
}

}  // namespace perception::cuda_internal

#define CUDA_RETURN_IF_ERROR(call) CUDA_RETURN_IF_ERROR_OF(call, #call)

// For an error kept from a call made before (a poll's query, a capture's end), reported as that call's: the variable's
// name would tell a reader of the log nothing.
#define CUDA_RETURN_IF_ERROR_OF(error, call_text)                                                 \
  do {                                                                                            \
    const cudaError_t _cuda_error = (error);                                                      \
    if (_cuda_error != cudaSuccess) {                                                             \
      return ::perception::cuda_internal::CudaFailure(_cuda_error, call_text, __FILE__, __LINE__); \
    }                                                                                             \
  } while (0)

#define CUBLAS_RETURN_IF_ERROR(call)                                                                \
  do {                                                                                              \
    const cublasStatus_t _cublas_status = (call);                                                   \
    if (_cublas_status != CUBLAS_STATUS_SUCCESS) {                                                  \
      return ::perception::cuda_internal::CublasFailure(_cublas_status, #call, __FILE__, __LINE__); \
    }                                                                                               \
  } while (0)
