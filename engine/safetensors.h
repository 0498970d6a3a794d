// A strict reader and an atomic writer of safetensors files holding float32 tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace perception {

// The only dtype this project stores; the reader rejects every other one.
inline constexpr char kSafetensorsF32[] = "F32";

// A reader refuses headers longer than this: no real header comes close, a corrupt length could.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

using SafetensorsMetadata = std::map<std::string, std::string>;

// One tensor to write: float32 contents, row-major, `data.size()` equal to the product of `shape`.
struct SafetensorsTensorRef {
  std::string name;
  std::vector<int64_t> shape;
  std::span<const float> data;
};

// Writes `tensors` (stored in the order given, contiguous) and `metadata` to `path` atomically
// (WriteFileAtomically: temporary file beside `path`, fsync, rename), so a reader sees either the
// old file or the whole new one. The file is assembled in memory first. On failure no temporary
// file remains and the error names the path.
absl::Status WriteSafetensors(const std::string& path, std::span<const SafetensorsTensorRef> tensors,
                              const SafetensorsMetadata& metadata);

// A tensor of a file returned by ReadSafetensors.
struct SafetensorsTensor {
  std::string dtype;  // always kSafetensorsF32
  std::vector<int64_t> shape;
  // Little-endian float32 bytes inside the file's buffer. Not necessarily 4-byte aligned
  // (safetensors does not promise it), so copy them out with memcpy or ToFloats().
  std::span<const std::byte> bytes;

  std::vector<float> ToFloats() const;
};

// A safetensors file read into memory and fully validated. Move-only: the tensors' byte spans
// point into the buffer it owns.
class SafetensorsFile {
 public:
  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;

  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsMetadata& metadata() const { return metadata_; }

 private:
  friend absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);
  SafetensorsFile() = default;

  std::unique_ptr<std::byte[]> contents_;  // the data region (the header is parsed and dropped)
  std::map<std::string, SafetensorsTensor> tensors_;
  SafetensorsMetadata metadata_;
};

// Reads and validates the whole file: header length, JSON header (no NUL byte), entry keys and types, dtype
// (F32 only), shapes, data offsets (in range, no overlap, covering the data region exactly) and
// metadata values (strings). The header is read and validated before the data, so a corrupt file is refused
// without reading (or allocating) its size. Every problem is an error naming the path and the problem; no
// input, however malformed or truncated, makes it read out of bounds.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// "[8, 6]": the notation every shape mismatch message uses.
std::string FormatShape(std::span<const int64_t> shape);

}  // namespace perception
