// Crash-safe file replacement: write a temp file beside the target, fsync, rename, fsync the directory.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace perception {

// Replaces `path` with `bytes` so that a reader sees either the old file or the whole new one; on failure the
// temp file is removed and the error names the path and the system's reason. An error after the rename (the folder
// could not be synced) says the file was written: it is in place but may not survive a crash. What
// CheckReplaceableByAFile refuses is refused first.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

// INVALID_ARGUMENT where the rename onto `path` would put a regular file in place of something that is not one: a
// device, FIFO or socket at `path` or behind a link there (the output would not reach it, and as root `--out
// /dev/null` replaced the machine's /dev/null), or a link through /proc (`/dev/stdout`, whatever stdout is).
absl::Status CheckReplaceableByAFile(const std::string& path);

// OK when WriteFileAtomically could start writing `path` now: it creates a temporary file beside `path` as that
// would (`<path>.tmp.<pid>.<random>`, the name cut to fit NAME_MAX, never one that exists) and removes it again. For
// a long job that writes only at its end, so that a mistyped or read-only destination fails before the work instead
// of after it. The error names the path and the system's reason; a folder (or a path ending in '/') is refused, and
// so is what CheckReplaceableByAFile refuses.
absl::Status CheckWritableDestination(const std::string& path);
// Only the trial file of CheckWritableDestination: for a caller whose `path` stands in for a file of its folder
// that is not there yet (whatever holds the name `path` itself).
absl::Status CheckCanCreateBeside(const std::string& path);

}  // namespace perception
