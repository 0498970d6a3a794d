// Safetensors: the strict, bounds-checked reader and the writer (atomic through engine/atomic_file.h).
#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <new>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "engine/atomic_file.h"
#include "engine/input_file.h"
#include "engine/json_object.h"
#include "engine/status_macros.h"

namespace perception {

// The format stores little-endian IEEE floats; this code copies them as raw bytes.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");
static_assert(std::numeric_limits<float>::is_iec559 && sizeof(float) == 4, "F32 must be IEEE binary32");

namespace {

constexpr char kMetadataKey[] = "__metadata__";
constexpr size_t kLengthFieldBytes = sizeof(uint64_t);
// The reference implementation pads the header so that the data region starts 8-byte aligned.
constexpr size_t kHeaderAlignment = 8;

// ---------------------------------------------------------------------------------------------
// Reading.

// A header entry after validation: where its bytes lie, relative to the start of the data region.
struct TensorEntry {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

absl::Status Corrupt(absl::string_view message) { return absl::DataLossError(message); }

absl::Status InFile(const std::string& path, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("safetensors file '", path, "': ", status.message()));
}

absl::Status ReadExactly(int fd, std::byte* out, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, out + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, "read failed");
    if (n == 0) {
      return Corrupt(absl::StrCat("file ended after ", done, " of ", size, " bytes (truncated while reading?)"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// The header length, read from the file and checked against its size so that the JSON and data ranges are in bounds.
absl::StatusOr<uint64_t> ReadHeaderLength(int fd, uint64_t file_size) {
  if (file_size < kLengthFieldBytes) {
    return Corrupt(absl::StrCat("file is ", file_size, " bytes, shorter than the 8-byte header length"));
  }
  uint64_t length;
  RETURN_IF_ERROR(ReadExactly(fd, reinterpret_cast<std::byte*>(&length), sizeof length));
  if (length > kMaxSafetensorsHeaderBytes) {
    return Corrupt(absl::StrCat("header length ", length, " is absurd (limit ", kMaxSafetensorsHeaderBytes, " bytes)"));
  }
  if (length > file_size - kLengthFieldBytes) {
    return Corrupt(absl::StrCat("header length ", length, " exceeds the ", file_size - kLengthFieldBytes,
                                " bytes that follow the length field"));
  }
  return length;
}

absl::StatusOr<SafetensorsMetadata> ParseMetadata(const nlohmann::json& value) {
  if (!value.is_object()) return Corrupt("__metadata__ is not a JSON object");
  SafetensorsMetadata metadata;
  for (const auto& [key, entry] : value.items()) {
    if (!entry.is_string()) return Corrupt(absl::StrCat("metadata value for '", key, "' is not a string"));
    metadata.emplace(key, entry.get<std::string>());
  }
  return metadata;
}

absl::StatusOr<std::vector<int64_t>> ParseShape(const std::string& name, const nlohmann::json& value) {
  if (!value.is_array()) return Corrupt(absl::StrCat("tensor '", name, "': shape is not a list"));
  std::vector<int64_t> shape;
  for (const nlohmann::json& dim : value) {
    if (!dim.is_number_integer()) {
      return Corrupt(absl::StrCat("tensor '", name, "': shape has a ", dim.type_name(), " where an integer belongs"));
    }
    if (!dim.is_number_unsigned()) {
      return Corrupt(absl::StrCat("tensor '", name, "': shape has negative dimension ", dim.get<int64_t>()));
    }
    const uint64_t extent = dim.get<uint64_t>();
    if (extent > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Corrupt(absl::StrCat("tensor '", name, "': shape dimension ", extent, " is too large"));
    }
    shape.push_back(static_cast<int64_t>(extent));
  }
  return shape;
}

absl::Status ParseOffsets(const nlohmann::json& value, TensorEntry& entry) {
  if (!value.is_array() || value.size() != 2 || !value[0].is_number_unsigned() || !value[1].is_number_unsigned()) {
    return Corrupt(absl::StrCat("tensor '", entry.name, "': data_offsets is not a pair of non-negative integers"));
  }
  entry.begin = value[0].get<uint64_t>();
  entry.end = value[1].get<uint64_t>();
  return absl::OkStatus();
}

// Bytes a float32 tensor of `shape` occupies, or an error when that does not fit in 64 bits.
absl::StatusOr<uint64_t> F32ByteCount(const std::string& name, const std::vector<int64_t>& shape) {
  uint64_t bytes = sizeof(float);
  for (int64_t extent : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(extent), &bytes)) {
      return Corrupt(absl::StrCat("tensor '", name, "': shape ", FormatShape(shape), " overflows 64 bits"));
    }
  }
  return bytes;
}

absl::Status CheckEntryKeys(const std::string& name, const nlohmann::json& value) {
  if (!value.is_object()) return Corrupt(absl::StrCat("entry for tensor '", name, "' is not a JSON object"));
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) return Corrupt(absl::StrCat("tensor '", name, "' has no '", key, "'"));
  }
  for (const auto& [key, unused] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return Corrupt(absl::StrCat("tensor '", name, "' has unknown key '", key, "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorEntry> ParseTensorEntry(const std::string& name, const nlohmann::json& value,
                                             uint64_t data_bytes) {
  RETURN_IF_ERROR(CheckEntryKeys(name, value));
  const nlohmann::json& dtype = value["dtype"];
  if (!dtype.is_string()) return Corrupt(absl::StrCat("tensor '", name, "': dtype is not a string"));
  if (dtype.get<std::string>() != kSafetensorsF32) {
    return Corrupt(absl::StrCat("tensor '", name, "' has unsupported dtype '", dtype.get<std::string>(),
                                "' (only ", kSafetensorsF32, " is supported)"));
  }
  TensorEntry entry;
  entry.name = name;
  ASSIGN_OR_RETURN(entry.shape, ParseShape(name, value["shape"]));
  RETURN_IF_ERROR(ParseOffsets(value["data_offsets"], entry));
  if (entry.begin > entry.end) {
    return Corrupt(absl::StrCat("tensor '", name, "': data_offsets begin ", entry.begin, " is past end ", entry.end));
  }
  if (entry.end > data_bytes) {
    return Corrupt(absl::StrCat("tensor '", name, "': data_offsets [", entry.begin, ", ", entry.end,
                                "] exceed the data region of ", data_bytes, " bytes"));
  }
  ASSIGN_OR_RETURN(const uint64_t expected_bytes, F32ByteCount(name, entry.shape));
  if (expected_bytes != entry.end - entry.begin) {
    return Corrupt(absl::StrCat("tensor '", name, "': shape ", FormatShape(entry.shape), " needs ", expected_bytes,
                                " bytes but data_offsets cover ", entry.end - entry.begin));
  }
  return entry;
}

// safetensors requires the tensors to tile the data region exactly: no overlap, no stray bytes.
// Ties sort by name so that the error for identical ranges is the same on every run.
absl::Status CheckCoverage(std::vector<const TensorEntry*> entries, uint64_t data_bytes) {
  std::sort(entries.begin(), entries.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  uint64_t covered = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry* entry : entries) {
    if (entry->begin < covered) {
      return Corrupt(absl::StrCat("tensors '", previous->name, "' and '", entry->name, "' overlap (data_offsets ",
                                  entry->begin, " < ", covered, ")"));
    }
    if (entry->begin > covered) {
      return Corrupt(absl::StrCat("data bytes [", covered, ", ", entry->begin, ") belong to no tensor"));
    }
    covered = entry->end;
    previous = entry;
  }
  if (covered != data_bytes) {
    return Corrupt(absl::StrCat("data bytes [", covered, ", ", data_bytes, ") belong to no tensor"));
  }
  return absl::OkStatus();
}

struct ParsedHeader {
  SafetensorsMetadata metadata;
  std::vector<TensorEntry> entries;
};

// `data_bytes` is what the file holds after the header: the tensors must tile exactly that.
absl::StatusOr<ParsedHeader> ParseHeader(absl::string_view text, uint64_t data_bytes) {
  // nlohmann's parser takes a NUL for the end of its input, so JSON + NUL + garbage would pass; the reference
  // reader refuses it.
  if (const size_t nul = text.find('\0'); nul != absl::string_view::npos) {
    return Corrupt(absl::StrCat("header holds a NUL byte at offset ", nul));
  }
  const absl::StatusOr<nlohmann::json> header = ParseJsonStrictly(text);
  if (!header.ok()) return Corrupt(absl::StrCat("header ", header.status().message()));
  if (header->is_discarded()) return Corrupt("header is not valid JSON");
  if (!header->is_object()) return Corrupt("header is not a JSON object");

  ParsedHeader parsed;
  for (const auto& [key, value] : header->items()) {
    if (key == kMetadataKey) {
      ASSIGN_OR_RETURN(parsed.metadata, ParseMetadata(value));
    } else {
      ASSIGN_OR_RETURN(TensorEntry entry, ParseTensorEntry(key, value, data_bytes));
      parsed.entries.push_back(std::move(entry));
    }
  }
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& entry : parsed.entries) by_offset.push_back(&entry);
  RETURN_IF_ERROR(CheckCoverage(std::move(by_offset), data_bytes));
  return parsed;
}

// A validated header and the data region it describes.
struct FileContents {
  ParsedHeader header;
  std::unique_ptr<std::byte[]> data;
};

// Reads the length field and the header and validates them before reading the data: a corrupt or hostile file
// costs what its header costs, not its size (a sparse file can claim gigabytes it never stored).
absl::StatusOr<FileContents> ReadOpenFile(int fd) {
  struct stat info;
  if (::fstat(fd, &info) != 0) return absl::ErrnoToStatus(errno, "fstat failed");
  if (!S_ISREG(info.st_mode)) return absl::InvalidArgumentError("not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(info.st_size);
  ASSIGN_OR_RETURN(const uint64_t header_length, ReadHeaderLength(fd, file_size));
  std::string text(header_length, '\0');
  RETURN_IF_ERROR(ReadExactly(fd, reinterpret_cast<std::byte*>(text.data()), text.size()));
  const uint64_t data_bytes = file_size - kLengthFieldBytes - header_length;
  FileContents contents;
  ASSIGN_OR_RETURN(contents.header, ParseHeader(text, data_bytes));
  // Allocated without throwing, so that a data region too large for memory is an error, not std::bad_alloc.
  contents.data.reset(new (std::nothrow) std::byte[data_bytes]);
  if (contents.data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", data_bytes, " bytes"));
  }
  RETURN_IF_ERROR(ReadExactly(fd, contents.data.get(), data_bytes));
  return contents;
}

absl::StatusOr<FileContents> ReadFileContents(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; fstat then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return InputNotOpened(errno, "cannot open");
  absl::StatusOr<FileContents> contents = ReadOpenFile(fd);
  ::close(fd);
  return contents;
}

// ---------------------------------------------------------------------------------------------
// Writing.

absl::StatusOr<nlohmann::ordered_json> HeaderJson(std::span<const SafetensorsTensorRef> tensors,
                                                  const SafetensorsMetadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsTensorRef& tensor : tensors) {
    if (tensor.name == kMetadataKey || tensor.name.empty() || header.contains(tensor.name)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor name '", tensor.name, "' is reserved, empty or repeated"));
    }
    if (std::any_of(tensor.shape.begin(), tensor.shape.end(), [](int64_t d) { return d < 0; })) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor.name, "' has negative dimensions ", FormatShape(tensor.shape)));
    }
    ASSIGN_OR_RETURN(const uint64_t bytes, F32ByteCount(tensor.name, tensor.shape));
    if (bytes != tensor.data.size_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor.name, "': shape ", FormatShape(tensor.shape),
                                                     " needs ", bytes / sizeof(float), " floats, got ",
                                                     tensor.data.size()));
    }
    header[tensor.name] = {
        {"dtype", kSafetensorsF32}, {"shape", tensor.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  return header;
}

// The whole file: length field, JSON header padded with spaces, then the tensors' bytes in order.
absl::StatusOr<std::string> EncodeFile(const nlohmann::ordered_json& header,
                                       std::span<const SafetensorsTensorRef> tensors) {
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // the only failure: a name or value that is not UTF-8
    return absl::InvalidArgumentError(absl::StrCat("header cannot be encoded: ", e.what()));
  }
  text.append((kHeaderAlignment - text.size() % kHeaderAlignment) % kHeaderAlignment, ' ');
  const uint64_t length = text.size();
  size_t data_bytes = 0;
  for (const SafetensorsTensorRef& tensor : tensors) data_bytes += tensor.data.size_bytes();

  std::string file;
  file.reserve(kLengthFieldBytes + text.size() + data_bytes);
  file.append(reinterpret_cast<const char*>(&length), sizeof length);
  file.append(text);
  for (const SafetensorsTensorRef& tensor : tensors) {
    // An empty span may hold a null pointer, which no copy routine may be handed.
    if (!tensor.data.empty()) file.append(reinterpret_cast<const char*>(tensor.data.data()), tensor.data.size_bytes());
  }
  return file;
}

}  // namespace

std::string FormatShape(std::span<const int64_t> shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

std::vector<float> SafetensorsTensor::ToFloats() const {
  std::vector<float> values(bytes.size() / sizeof(float));
  if (!values.empty()) std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));  // memcpy rejects null
  return values;
}

absl::Status WriteSafetensors(const std::string& path, std::span<const SafetensorsTensorRef> tensors,
                              const SafetensorsMetadata& metadata) {
  absl::StatusOr<nlohmann::ordered_json> header = HeaderJson(tensors, metadata);
  absl::StatusOr<std::string> file = header.ok() ? EncodeFile(*header, tensors) : header.status();
  if (!file.ok()) return InFile(path, file.status());
  return WriteFileAtomically(path, *file);
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  absl::StatusOr<FileContents> contents = ReadFileContents(path);
  if (!contents.ok()) return InFile(path, contents.status());
  SafetensorsFile file;
  file.metadata_ = std::move(contents->header.metadata);
  file.contents_ = std::move(contents->data);
  for (TensorEntry& entry : contents->header.entries) {
    const std::span<const std::byte> tensor_bytes(file.contents_.get() + entry.begin, entry.end - entry.begin);
    file.tensors_[entry.name] = SafetensorsTensor{kSafetensorsF32, std::move(entry.shape), tensor_bytes};
  }
  return file;
}

}  // namespace perception
