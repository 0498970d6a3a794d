// Counted CUDA allocations and the arena that carves the backend's buffers out of one of them.
#include "engine/cuda_memory.h"

#include <atomic>
#include <cstring>
#include <utility>

#include <cuda_runtime.h>

#include "engine/cuda_check.h"

namespace perception {
namespace {

std::atomic<int64_t> allocation_count{0};

}  // namespace

int64_t CudaAllocationCount() { return allocation_count.load(); }

CudaAllocation::CudaAllocation(CudaAllocation&& other) noexcept
    : kind_(other.kind_), ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

CudaAllocation& CudaAllocation::operator=(CudaAllocation&& other) noexcept {
  if (this != &other) {
    Release();
    kind_ = other.kind_;
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

CudaAllocation::~CudaAllocation() { Release(); }

void CudaAllocation::Release() {
  if (!ptr_) return;
  // A failure to free cannot be reported from a destructor; the pointer is dropped either way.
  if (kind_ == MemoryKind::kDevice) {
    cudaFree(ptr_);
  } else {
    cudaFreeHost(ptr_);
  }
  ptr_ = nullptr;
}

absl::StatusOr<CudaAllocation> AllocateCuda(MemoryKind kind, size_t bytes) {
  CudaAllocation allocation;
  allocation.kind_ = kind;
  allocation.bytes_ = bytes;
  if (kind == MemoryKind::kDevice) {
    CUDA_RETURN_IF_ERROR(cudaMalloc(&allocation.ptr_, bytes));
    allocation_count.fetch_add(1);
    // The zeros must be in place before any stream reads the memory. cudaMemset runs on the legacy default stream
    // and returns before it has, and the backends' streams are non-blocking: nothing else orders them after it.
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(allocation.ptr_, 0, bytes, cudaStreamLegacy));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
  } else {
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&allocation.ptr_, bytes));
    allocation_count.fetch_add(1);
    std::memset(allocation.ptr_, 0, bytes);
  }
  return allocation;
}

absl::Status CudaArena::Allocate() {
  if (overflowed_) return absl::ResourceExhaustedError("the buffers reserved together exceed any allocation's size");
  auto allocation = AllocateCuda(kind_, size_);
  if (!allocation.ok()) return allocation.status();
  allocation_ = *std::move(allocation);
  auto* base = static_cast<std::byte*>(allocation_.get());
  for (const auto& assign : assign_) assign(base);
  assign_.clear();
  return absl::OkStatus();
}

}  // namespace perception
