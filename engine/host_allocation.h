// Host allocations sized by a flag or a request, as RESOURCE_EXHAUSTED instead of std::bad_alloc: the daemon refuses
// the one call and keeps serving (a throw on its device worker or in a gRPC callback would end or wedge it); and the
// allocator kept from handing freed megabytes back to the kernel between requests.
#pragma once

#include <new>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace perception {

// Runs `allocate`; RESOURCE_EXHAUSTED naming `what` where the host's memory (or a container's size) ran out.
template <typename Allocate>
absl::Status AllocateOrExhausted(absl::string_view what, Allocate&& allocate) {
  try {
    allocate();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", what, ": out of host memory"));
  } catch (const std::length_error&) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", what, ": larger than a vector holds"));
  }
  return absl::OkStatus();
}

// Runs `work` (returning absl::Status or absl::StatusOr<T>): its result, or AllocateOrExhausted's refusal where it ran
// the host out of memory.
template <typename Work>
std::invoke_result_t<Work&> RunOrExhausted(absl::string_view what, Work&& work) {
  std::optional<std::invoke_result_t<Work&>> result;
  const absl::Status allocated = AllocateOrExhausted(what, [&] { result.emplace(work()); });
  if (!allocated.ok()) return allocated;
  return std::move(*result);
}

// Has glibc's allocator keep freed blocks of up to 32 MiB, and up to 256 MiB of free heap, for reuse instead of handing
// them back to the kernel. By default a block above a threshold that starts at 128 KiB is mapped afresh and unmapped
// at free, and the heap's free top is trimmed, so that a request's megabytes of arrays could be faulted in again page
// by page (on the development machine, a Train stream's host side alone, `small` batches at 10 book levels: 269
// steps/s without this, 329 with it; bench/RESULTS.md, sixty-sixth session; on the H100 host's CPU, 16 cores, it made
// no measurable difference to a batch's parse, to unary TrainStep calls, or to the daemon's Train stream at 10 book
// levels: medians of 6 rotated rounds 639.6 steps/s without it, 639.2 with it, sixty-eighth session). Kept for
// hosts of few cores, where it paid. The price: the process's resident memory stays near its peak instead of
// shrinking after large requests. For the programs' main, before anything is allocated; false where the allocator
// refused them (not glibc's: a sanitizer's, say).
bool KeepFreedHostMemoryForReuse();

}  // namespace perception
