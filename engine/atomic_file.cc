// Atomic whole-file writes (temp file, fsync, rename, directory fsync).
#include "engine/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <filesystem>
#include <random>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"

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

// A new file of our own beside `path`, named `<path>.tmp.<pid>.<random>` (the name cut to fit NAME_MAX where it is
// long): never a name that exists (a user's file, another writer's temporary, a planted link), which O_EXCL |
// O_NOFOLLOW refuse rather than replace or follow.
struct Temporary {
  std::string path;
  int fd = -1;
};
// `path` with its last component cut so that `suffix_bytes` more still make a name the file system takes (NAME_MAX):
// a valid name up to NAME_MAX long must get a temporary too. The cut keeps whole UTF-8 characters (file systems that
// hold names to UTF-8 refuse a split one).
std::string WithinNameMax(const std::string& path, size_t suffix_bytes) {
  const size_t name_start = path.rfind('/') + 1;  // (0 without a folder: npos + 1)
  const size_t name_bytes = path.size() - name_start;
  if (name_bytes + suffix_bytes <= NAME_MAX) return path;
  size_t end = name_start + (NAME_MAX - suffix_bytes);
  while (end > name_start && (static_cast<unsigned char>(path[end]) & 0xC0) == 0x80) --end;
  return path.substr(0, end);
}

absl::StatusOr<Temporary> CreateTemporary(const std::string& path) {
  thread_local std::mt19937_64 random(std::random_device{}() ^ static_cast<uint64_t>(::getpid()));
  constexpr int kAttempts = 16;
  for (int attempt = 1;; ++attempt) {
    const std::string suffix = absl::StrCat(".tmp.", ::getpid(), ".", absl::Hex(random(), absl::kZeroPad16));
    Temporary temp{absl::StrCat(WithinNameMax(path, suffix.size()), suffix)};
    temp.fd = ::open(temp.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (temp.fd >= 0) return temp;
    if (errno != EEXIST || attempt == kAttempts) {
      return Errno(absl::StrCat("cannot write ", path, ": cannot create its temporary file"), temp.path);
    }
  }
}

// The rename is durable only once the directory entry is. A file system that cannot sync a directory (EINVAL) has
// nothing more to give.
absl::Status SyncDirectoryOf(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return Errno(absl::StrCat("wrote ", path, " but cannot open its folder to sync it:"), dir);
  absl::Status status;
  if (::fsync(dir_fd) != 0 && errno != EINVAL) {
    status = Errno(absl::StrCat("wrote ", path, " but cannot sync its folder (the new file may not survive a crash):"),
                   dir);
  }
  ::close(dir_fd);
  return status;
}

}  // namespace

absl::Status CheckCanCreateBeside(const std::string& path) {
  ASSIGN_OR_RETURN(const Temporary temp, CreateTemporary(path));
  ::close(temp.fd);
  ::unlink(temp.path.c_str());
  return absl::OkStatus();
}

absl::Status CheckReplaceableByAFile(const std::string& path) {
  std::error_code error;
  // /dev/stdout links to /proc/self/fd/1, which is a regular file while stdout goes to one: only the link tells.
  std::filesystem::path hop = path;
  for (int hops = 0; hops < 40 && std::filesystem::is_symlink(std::filesystem::symlink_status(hop, error)); ++hops) {
    std::filesystem::path target = std::filesystem::read_symlink(hop, error);
    if (error) break;
    if (target.is_relative()) target = hop.parent_path() / target;
    if (target.lexically_normal().string().starts_with("/proc/")) {
      return absl::InvalidArgumentError(absl::StrCat(path, " is a link through /proc (", target.string(), ") to a ",
                                                     "process's descriptor, which the rename would replace with a ",
                                                     "file; give a file's path"));
    }
    hop = target;
  }
  const char* kind = nullptr;
  switch (std::filesystem::status(path, error).type()) {
    case std::filesystem::file_type::character: kind = "a character device"; break;
    case std::filesystem::file_type::block: kind = "a block device"; break;
    case std::filesystem::file_type::fifo: kind = "a FIFO"; break;
    case std::filesystem::file_type::socket: kind = "a socket"; break;
    default: return absl::OkStatus();
  }
  const bool through_link = std::filesystem::is_symlink(std::filesystem::symlink_status(path, error));
  return absl::InvalidArgumentError(absl::StrCat(path, " is ", kind, through_link ? " (through a link)" : "",
                                                 "; the output is a regular file, written beside it and renamed ",
                                                 "over its name, so give a file's path"));
}

absl::Status CheckWritableDestination(const std::string& path) {
  // The trial file goes beside the path, so a folder (or a name ending in '/') would pass it, and only the rename
  // at the end of the work would fail. A symbolic link to a folder is replaced by the rename, as any link is.
  std::error_code error;
  if (path.ends_with('/') || std::filesystem::is_directory(std::filesystem::symlink_status(path, error))) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is a folder; the output is a file"));
  }
  RETURN_IF_ERROR(CheckReplaceableByAFile(path));
  return CheckCanCreateBeside(path);
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  RETURN_IF_ERROR(CheckReplaceableByAFile(path));
  ASSIGN_OR_RETURN(const Temporary temp, CreateTemporary(path));
  absl::Status status = WriteAll(temp.fd, bytes, temp.path);
  if (status.ok() && ::fsync(temp.fd) != 0) status = Errno("cannot fsync", temp.path);
  if (::close(temp.fd) != 0 && status.ok()) status = Errno("cannot close", temp.path);
  if (status.ok() && ::rename(temp.path.c_str(), path.c_str()) != 0) status = Errno("cannot rename onto", path);
  if (!status.ok()) {
    ::unlink(temp.path.c_str());
    return status;
  }
  return SyncDirectoryOf(path);
}

}  // namespace perception
