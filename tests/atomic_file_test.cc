// Tests of the atomic whole-file write's refusals: what already holds the name is replaced only when it is a file.
#include "engine/atomic_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "tests/file_util.h"

namespace perception {
namespace {

using ::testing::HasSubstr;
using testing::ReadBytes;
using testing::ScopedTempDir;
using testing::WriteBytes;

// The rename over a FIFO, or over a link to a character device, made a regular file of it: `--out /dev/null` run as
// root replaced the machine's /dev/null. Both writers refuse such a name and leave it as it was; a regular file
// and a link to one are still replaced (the link by the file).
TEST(AtomicFileTest, ADeviceOrFifoIsRefusedAndLeftInPlace) {
  const ScopedTempDir dir("atomic_file_test");
  const std::string fifo = (dir.path() / "fifo").string(), to_null = (dir.path() / "to_null").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::filesystem::create_symlink("/dev/null", to_null);
  for (const auto& [path, kind] : {std::pair<std::string, std::string>{fifo, " is a FIFO;"},
                                   {to_null, " is a character device (through a link);"}}) {
    SCOPED_TRACE(path);
    for (const absl::Status& status : {CheckWritableDestination(path), WriteFileAtomically(path, "bytes")}) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_THAT(status.message(), HasSubstr(path + kind));
    }
  }
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
  EXPECT_TRUE(std::filesystem::is_symlink(to_null));
  EXPECT_EQ(dir.Entries().size(), 2u) << "a temporary file was left behind";

  const std::string file = (dir.path() / "file").string(), to_file = (dir.path() / "to_file").string();
  WriteBytes(file, "old");
  std::filesystem::create_symlink(file, to_file);
  for (const std::string& path : {file, to_file}) {
    ASSERT_TRUE(CheckWritableDestination(path).ok());
    ASSERT_TRUE(WriteFileAtomically(path, "new " + path).ok());
    EXPECT_EQ(ReadBytes(path), "new " + path);
  }
}

// /dev/stdout links through /proc to whatever stdout is: a regular file where it is redirected to one, so the check
// of the link's target passed and the rename replaced the machine's /dev/stdout with a file. A link through /proc is
// refused whatever it reaches (the system's own links only by the check: a regression must not write into /dev).
TEST(AtomicFileTest, LinksThroughProcAreRefused) {
  const ScopedTempDir dir("atomic_file_proc");
  const std::string to_stdout = (dir.path() / "to_stdout").string();
  std::filesystem::create_symlink("/proc/self/fd/1", to_stdout);
  for (const absl::Status& status : {CheckWritableDestination(to_stdout), WriteFileAtomically(to_stdout, "bytes")}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr(to_stdout + " is a link through /proc (/proc/self/fd/1)"));
  }
  EXPECT_TRUE(std::filesystem::is_symlink(to_stdout));
  for (const std::string path : {"/dev/stdout", "/dev/stderr", "/dev/null"}) {
    SCOPED_TRACE(path);
    std::error_code absent;
    if (std::filesystem::symlink_status(path, absent).type() == std::filesystem::file_type::not_found) continue;
    EXPECT_EQ(CheckReplaceableByAFile(path).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(CheckWritableDestination(path).code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace perception
