// The allocator kept from handing freed megabytes back to the kernel: an array of megabytes comes from the heap and
// its memory stays there once freed, for the next request's.
#include "engine/host_allocation.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace perception {
namespace {

TEST(KeepFreedHostMemoryForReuse, MegabytesComeFromTheHeapAndStayThereOnceFreed) {
#if defined(__GLIBC__)
  if (!KeepFreedHostMemoryForReuse()) GTEST_SKIP() << "malloc is not glibc's (a sanitizer's)";
  constexpr size_t kBytes = 8 << 20;
  const struct mallinfo2 before = mallinfo2();
  auto block = std::make_unique<std::vector<char>>(kBytes, 1);
  const struct mallinfo2 held = mallinfo2();
  EXPECT_EQ(held.hblks, before.hblks) << "the array was mapped afresh, to be unmapped at free";
  block.reset();
  const struct mallinfo2 after = mallinfo2();
  EXPECT_GE(after.arena, held.arena) << "the heap was trimmed at free";
  EXPECT_GE(after.fordblks, kBytes) << "the array's memory did not stay in the heap";
#else
  GTEST_SKIP() << "not glibc";
#endif
}

}  // namespace
}  // namespace perception
