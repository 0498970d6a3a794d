// Whole-file reads and writes for tests that build, truncate or tamper with files byte by byte.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

namespace perception::testing {

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
