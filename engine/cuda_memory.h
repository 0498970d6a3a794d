// Device and pinned host memory of the CUDA backend. Every allocation goes through AllocateCuda, which counts it,
// so that "nothing is allocated per step" is checked by a test (CudaAllocationCount) rather than claimed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace perception {

enum class MemoryKind { kDevice, kPinnedHost };

// Allocations made through AllocateCuda in this process so far, both kinds (frees do not lower it).
int64_t CudaAllocationCount();

// One allocation, freed on destruction.
class CudaAllocation {
 public:
  CudaAllocation() = default;
  CudaAllocation(CudaAllocation&& other) noexcept;
  CudaAllocation& operator=(CudaAllocation&& other) noexcept;
  CudaAllocation(const CudaAllocation&) = delete;
  CudaAllocation& operator=(const CudaAllocation&) = delete;
  ~CudaAllocation();

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  friend absl::StatusOr<CudaAllocation> AllocateCuda(MemoryKind kind, size_t bytes);
  void Release();

  MemoryKind kind_ = MemoryKind::kDevice;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// cudaMalloc or cudaMallocHost of `bytes`, zero-filled, counted.
absl::StatusOr<CudaAllocation> AllocateCuda(MemoryKind kind, size_t bytes);

// Many buffers carved from one allocation: Reserve() records each buffer, Allocate() makes the single counted
// allocation (256-byte aligned pieces, zero-filled) and points every reserved slot into it.
class CudaArena {
 public:
  explicit CudaArena(MemoryKind kind) : kind_(kind) {}

  // A count whose bytes overflow size_t (an absurd --stream_log_entries) wrapped to a small size, and the buffers
  // reserved after it overlapped it: such a count makes Allocate fail instead.
  template <typename T>
  void Reserve(T** slot, size_t count) {
    const size_t offset = size_;
    size_t bytes = 0, end = 0;
    if (__builtin_mul_overflow(count, sizeof(T), &bytes) || bytes > SIZE_MAX - (kAlignment - 1) ||
        __builtin_add_overflow(size_, (bytes + kAlignment - 1) / kAlignment * kAlignment, &end)) {
      overflowed_ = true;
      return;
    }
    size_ = end;
    assign_.push_back([slot, offset](std::byte* base) { *slot = reinterpret_cast<T*>(base + offset); });
  }

  // RESOURCE_EXHAUSTED where the reservations' sum overflowed size_t, or the allocation's error.
  absl::Status Allocate();
  size_t bytes() const { return size_; }

 private:
  static constexpr size_t kAlignment = 256;
  MemoryKind kind_;
  size_t size_ = 0;
  bool overflowed_ = false;
  std::vector<std::function<void(std::byte*)>> assign_;
  CudaAllocation allocation_;
};

}  // namespace perception
