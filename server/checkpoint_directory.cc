// Checkpoint names resolved against the checkpoint folder, refusing every way out of it.
#include "server/checkpoint_directory.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "engine/atomic_file.h"

namespace perception::server {
namespace {

absl::Status Refused(absl::string_view source, const std::string& name, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": checkpoint name '", name, "' ", why));
}

bool IsStrictlyInside(const std::filesystem::path& path, const std::filesystem::path& root) {
  const auto [root_end, path_end] = std::mismatch(root.begin(), root.end(), path.begin(), path.end());
  return root_end == root.end() && path_end != path.end();
}

}  // namespace

absl::StatusOr<CheckpointDirectory> CheckpointDirectory::Open(const std::string& path) {
  std::error_code error;
  std::filesystem::create_directories(path, error);
  std::filesystem::path root = error ? std::filesystem::path() : std::filesystem::canonical(path, error);
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint directory '", path, "' cannot be created: ", error.message()));
  }
  return CheckpointDirectory(std::move(root));
}

absl::StatusOr<std::string> CheckpointDirectory::Resolve(const std::string& name, absl::string_view source) const {
  const std::filesystem::path relative(name);
  if (name.empty()) return Refused(source, name, "is empty");
  // The OS reads a path up to its first NUL: the rest of the name would be ignored, and another file used.
  if (name.find('\0') != std::string::npos) return Refused(source, absl::CEscape(name), "contains a NUL byte ('\\0')");
  if (relative.is_absolute()) {
    return Refused(source, name, "is absolute; names are relative to the checkpoint directory");
  }
  if (std::ranges::find(relative, "..") != relative.end()) return Refused(source, name, "must not contain '..'");
  // A name must end in a file's name: "a/" or "a/." stands for a folder, which a save would create and then fail on.
  if (relative.filename().empty() || relative.filename() == ".") {
    return Refused(source, name, "does not end in a file name");
  }
  // Resolves symlinks along the existing part of the path, so a link that points elsewhere is seen for what it is.
  std::error_code error;
  const std::filesystem::path resolved = std::filesystem::weakly_canonical(root_ / relative, error);
  if (error) return Refused(source, name, absl::StrCat("cannot be resolved: ", error.message()));
  if (!IsStrictlyInside(resolved, root_))
    return Refused(source, name, "does not resolve to a file inside the checkpoint directory");
  return resolved.string();
}

absl::StatusOr<std::string> CheckpointDirectory::ResolveForWriting(const std::string& name,
                                                                   absl::string_view source) const {
  absl::StatusOr<std::string> path = Resolve(name, source);
  if (!path.ok()) return path;
  std::error_code error;
  if (std::filesystem::is_directory(*path, error)) return Refused(source, name, "is a folder; a checkpoint is a file");
  // A FIFO or device left in the folder: refused now, not by the save at the end of a drain (--checkpoint_on_exit).
  if (const absl::Status replaceable = CheckReplaceableByAFile(*path); !replaceable.ok()) {
    return Refused(source, name, absl::StrCat("cannot be written: ", replaceable.message()));
  }
  return path;
}

}  // namespace perception::server
