// Atomic whole-file writes (temp file, fsync, rename, directory fsync).
#include "engine/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace perception {
namespace {

// errno's own code (a full disk RESOURCE_EXHAUSTED, a refused permission PERMISSION_DENIED, ...) and its text.
absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::ErrnoToStatus(errno, absl::StrCat(what, " ", path));
}

absl::Status WriteAll(int fd, std::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", path);
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

std::string TemporaryPathFor(const std::string& path) { return absl::StrCat(path, ".tmp.", ::getpid()); }

// A new file of our own: whatever has the name (a crashed writer's leftover, a planted link) goes first, and a
// link that appears in between fails the create instead of redirecting the write.
absl::StatusOr<int> CreateTemporary(const std::string& temp) {
  ::unlink(temp.c_str());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot create", temp);
  return fd;
}

}  // namespace

absl::Status CheckWritableDestination(const std::string& path) {
  const std::string temp = TemporaryPathFor(path);
  const absl::StatusOr<int> fd = CreateTemporary(temp);
  if (!fd.ok()) return fd.status();
  ::close(*fd);
  ::unlink(temp.c_str());
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  const std::string temp = TemporaryPathFor(path);
  const absl::StatusOr<int> created = CreateTemporary(temp);
  if (!created.ok()) return created.status();
  const int fd = *created;
  absl::Status status = WriteAll(fd, bytes, temp);
  if (status.ok() && ::fsync(fd) != 0) status = Errno("cannot fsync", temp);
  if (::close(fd) != 0 && status.ok()) status = Errno("cannot close", temp);
  if (status.ok() && ::rename(temp.c_str(), path.c_str()) != 0) status = Errno("cannot rename onto", path);
  if (!status.ok()) {
    ::unlink(temp.c_str());
    return status;
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {  // the rename is durable only once the directory entry is
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  return absl::OkStatus();
}

}  // namespace perception
