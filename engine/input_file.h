// What an input file that cannot be opened means to a caller, as one absl::Status for every reader.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace perception {

// errno's code and text after `message` (a missing file NOT_FOUND, a refused permission PERMISSION_DENIED, ...),
// except that a path through a file (ENOTDIR) names no file either and is NOT_FOUND too: abseil's code for ENOTDIR,
// FAILED_PRECONDITION, reads as "the daemon's state refuses this; retry later" to a client.
absl::Status InputNotOpened(int error, absl::string_view message);

}  // namespace perception
