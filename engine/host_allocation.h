// Host allocations sized by a flag or a request, as RESOURCE_EXHAUSTED instead of std::bad_alloc: the daemon refuses
// the one call and keeps serving (a throw on its device worker or in a gRPC callback would end or wedge it).
#pragma once

#include <new>
#include <stdexcept>

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

}  // namespace perception
