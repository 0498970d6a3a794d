// The daemon's checkpoint folder: client-given checkpoint names resolve inside it and nowhere else.
#pragma once

#include <filesystem>
#include <string>

#include "absl/status/statusor.h"

namespace perception::server {

class CheckpointDirectory {
 public:
  // Creates the folder when it is missing.
  static absl::StatusOr<CheckpointDirectory> Open(const std::string& path);

  // The file a name stands for. INVALID_ARGUMENT for an empty or absolute name, a ".." component, or a name that
  // resolves outside the folder through a symlink (or onto the folder itself).
  absl::StatusOr<std::string> Resolve(const std::string& name) const;
  // Resolve, then create the missing folders on the way to the file, for a save.
  absl::StatusOr<std::string> ResolveForWriting(const std::string& name) const;

 private:
  explicit CheckpointDirectory(std::filesystem::path root) : root_(std::move(root)) {}

  std::filesystem::path root_;  // canonical
};

}  // namespace perception::server
