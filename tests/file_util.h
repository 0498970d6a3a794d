// Files for tests: a scoped temporary folder, and whole-file reads and writes for building or tampering byte by byte.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace perception::testing {

// A fresh folder under the test temp dir, removed with everything in it when the test passed (kept for a look
// when it failed). Declare it before whatever writes into it (a Daemon, say), so that it outlives the writer.
class ScopedTempDir {
 public:
  explicit ScopedTempDir(const std::string& prefix) {
    std::string pattern = (std::filesystem::path(::testing::TempDir()) / (prefix + ".XXXXXX")).string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "cannot create " << pattern << ": " << std::strerror(errno);
      return;
    }
    path_ = pattern;
  }
  ~ScopedTempDir() {
    std::error_code ignored;
    if (!path_.empty() && !::testing::Test::HasFailure()) std::filesystem::remove_all(path_, ignored);
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

  // The names in the folder, in directory order: what a failed or replaced write left behind.
  std::vector<std::string> Entries() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(path_)) names.push_back(entry.path().filename());
    return names;
  }

 private:
  std::filesystem::path path_;
};

inline std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

inline void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace perception::testing
