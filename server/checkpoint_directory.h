// The daemon's checkpoint folder: client-given checkpoint names resolve inside it and nowhere else.
#pragma once

#include <filesystem>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace perception::server {

class CheckpointDirectory {
 public:
  // Creates the folder when it is missing.
  static absl::StatusOr<CheckpointDirectory> Open(const std::string& path);

  // The file a name stands for. INVALID_ARGUMENT, its message opening with `source` (where the name came from: a
  // request's field, a flag), for an empty or absolute name, a NUL byte (the OS would end the path there), a ".."
  // component, a name that does not end in a file name ("a/", "a/."), or one that resolves outside the folder
  // through a symlink (or onto the folder itself). Creates nothing.
  absl::StatusOr<std::string> Resolve(const std::string& name, absl::string_view source) const;
  // Resolve, for a save: also INVALID_ARGUMENT where a folder has the name. Creates nothing either: the save creates
  // the missing folders on the way to the file (ModelHost::Save) once it knows it has something to write.
  absl::StatusOr<std::string> ResolveForWriting(const std::string& name, absl::string_view source) const;

 private:
  explicit CheckpointDirectory(std::filesystem::path root) : root_(std::move(root)) {}

  std::filesystem::path root_;  // canonical
};

}  // namespace perception::server
