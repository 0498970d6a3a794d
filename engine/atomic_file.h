// Crash-safe file replacement: write a temp file beside the target, fsync, rename, fsync the directory.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace perception {

// Replaces `path` with `bytes` so that a reader sees either the old file or the whole new one; on failure the
// temp file is removed and the error names the path and the system's reason.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

}  // namespace perception
