// glibc's allocator kept from handing freed megabytes back to the kernel.
#include "engine/host_allocation.h"

#include <cstdlib>  // (defines __GLIBC__ where the C library is glibc)

// Whether malloc is glibc's: ASan, TSan and MSan replace it with their own.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define PERCEPTION_SANITIZER_MALLOC 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define PERCEPTION_SANITIZER_MALLOC 1
#endif
#if defined(__GLIBC__) && !defined(PERCEPTION_SANITIZER_MALLOC)
#include <malloc.h>
#define PERCEPTION_GLIBC_MALLOC 1
#endif

namespace perception {

bool KeepFreedHostMemoryForReuse() {
#if defined(PERCEPTION_GLIBC_MALLOC)
  constexpr int kLargestHeapBlock = 32 << 20;  // glibc's ceiling for M_MMAP_THRESHOLD on 64-bit hosts
  constexpr int kKeptFreeHeap = 256 << 20;
  return mallopt(M_MMAP_THRESHOLD, kLargestHeapBlock) == 1 && mallopt(M_TRIM_THRESHOLD, kKeptFreeHeap) == 1;
#else
  return false;
#endif
}

}  // namespace perception
