// NumPy .npy (v1.0) writer for float32 arrays.
#include "engine/npy.h"

#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/atomic_file.h"

namespace perception {

static_assert(std::endian::native == std::endian::little, "the .npy writer emits the host's bytes as '<f4'");

absl::Status WriteNpy(const std::string& path, std::span<const float> data, const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  if (count != static_cast<int64_t>(data.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("npy: shape holds ", count, " elements but ", data.size(), " were given"));
  }
  std::string dims = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) dims += ",";
  std::string header = absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims, "), }");
  // Magic (6) + version (2) + header length (2) + header, padded with spaces and a newline to 64 bytes.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes = "\x93NUMPY";
  bytes.push_back('\x01');
  bytes.push_back('\x00');
  bytes.push_back(static_cast<char>(header.size() & 0xff));
  bytes.push_back(static_cast<char>(header.size() >> 8));
  bytes += header;
  const size_t offset = bytes.size();
  bytes.resize(offset + data.size_bytes());
  std::memcpy(bytes.data() + offset, data.data(), data.size_bytes());
  return WriteFileAtomically(path, bytes);
}

}  // namespace perception
