// Tests of the safetensors writer (standard layout, bit-exact round trip) and the strict reader's rejections.
#include "engine/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "engine/param_layout.h"
#include "tests/file_util.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using ::testing::HasSubstr;

using testing::BitIdentical;
using testing::ReadBytes;
using testing::ScopedTempDir;
using testing::WriteBytes;

// A safetensors file assembled by hand, so that the reader can be fed any header at all.
std::string RawFile(const std::string& header, const std::string& data) {
  const uint64_t length = header.size();
  std::string file(reinterpret_cast<const char*>(&length), sizeof length);
  return file + header + data;
}

std::vector<float> RandomFloats(Rng& rng, size_t count) {
  std::vector<float> values(count);
  for (float& v : values) v = static_cast<float>(rng.Uniform(-10.0, 10.0));
  return values;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()); }  // or the files would land in the working directory

  std::string Path(const std::string& name) const { return (dir_.path() / name).string(); }

  const ScopedTempDir dir_{"safetensors_test"};
};

TEST_F(SafetensorsTest, WritesTheStandardLayout) {
  Rng rng(11);
  const std::vector<float> a = RandomFloats(rng, 6), b = RandomFloats(rng, 4);
  const std::vector<SafetensorsTensorRef> tensors = {{"a", {2, 3}, a}, {"b", {4}, b}};
  const std::string path = Path("layout.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"purpose", "test"}}).ok());

  const std::string file = ReadBytes(path);
  uint64_t header_length;
  std::memcpy(&header_length, file.data(), sizeof header_length);
  EXPECT_EQ(header_length % 8, 0u);
  ASSERT_EQ(file.size(), 8 + header_length + (a.size() + b.size()) * sizeof(float));
  const std::string header_text = file.substr(8, header_length);
  EXPECT_EQ(header_text.find_last_not_of(' '), header_text.rfind('}'));  // padding is spaces only
  const nlohmann::json header = nlohmann::json::parse(header_text);
  EXPECT_EQ(header["__metadata__"], (nlohmann::json{{"purpose", "test"}}));
  EXPECT_EQ(header["a"], (nlohmann::json{{"dtype", "F32"}, {"shape", {2, 3}}, {"data_offsets", {0, 24}}}));
  EXPECT_EQ(header["b"], (nlohmann::json{{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {24, 40}}}));
  EXPECT_EQ(header.size(), 3u);
  const char* data = file.data() + 8 + header_length;
  EXPECT_EQ(std::memcmp(data, a.data(), 24), 0);
  EXPECT_EQ(std::memcmp(data + 24, b.data(), 16), 0);
}

TEST_F(SafetensorsTest, RoundTripIsBitExactIncludingSpecialValues) {
  Rng rng(12);
  std::vector<float> weights = RandomFloats(rng, 35);
  weights[0] = std::bit_cast<float>(0x7fc12345u);  // a NaN with a payload
  weights[1] = -0.f;
  weights[2] = std::numeric_limits<float>::infinity();
  weights[3] = std::numeric_limits<float>::denorm_min();
  weights[4] = std::numeric_limits<float>::max();
  const std::vector<float> scalar = {3.25f};
  const std::vector<SafetensorsTensorRef> tensors = {
      {"weights", {5, 1, 7}, weights}, {"scalar", {}, scalar}, {"empty", {0, 3}, {}}};
  const SafetensorsMetadata metadata = {{"format", "x"}, {"note", "ünïcode"}};
  const std::string path = Path("round_trip.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors, metadata).ok());

  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata(), metadata);
  ASSERT_EQ(file->tensors().size(), 3u);
  for (const SafetensorsTensorRef& expected : tensors) {
    SCOPED_TRACE(expected.name);
    const SafetensorsTensor& found = file->tensors().at(expected.name);
    EXPECT_EQ(found.dtype, "F32");
    EXPECT_EQ(found.shape, expected.shape);
    EXPECT_TRUE(BitIdentical(found.ToFloats(), expected.data));
  }
}

TEST_F(SafetensorsTest, WriterRejectsInconsistentTensorsAndWritesNothing) {
  const std::vector<float> six(6, 1.5f);
  const struct {
    std::vector<SafetensorsTensorRef> tensors;
    std::string message;
  } cases[] = {
      {{{"a", {2, 2}, six}}, "tensor 'a': shape [2, 2] needs 4 floats, got 6"},
      {{{"a", {6}, six}, {"a", {6}, six}}, "tensor name 'a' is reserved, empty or repeated"},
      {{{"__metadata__", {6}, six}}, "tensor name '__metadata__' is reserved"},
      {{{"a", {-2, -3}, six}}, "tensor 'a' has negative dimensions [-2, -3]"},
  };
  const std::string path = Path("rejected.safetensors");
  for (const auto& c : cases) {
    const absl::Status status = WriteSafetensors(path, c.tensors, {});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(c.message));
    EXPECT_THAT(status.message(), HasSubstr(path));
  }
  EXPECT_TRUE(dir_.Entries().empty());
}

TEST_F(SafetensorsTest, WriteIntoMissingDirectoryFailsNamingThePath) {
  const std::vector<float> values = {1.f, 2.f};
  const std::string path = Path("no_such_dir/file.safetensors");
  const absl::Status status = WriteSafetensors(path, {{{"a", {2}, values}}}, {});
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr(path));
  EXPECT_THAT(status.message(), HasSubstr("No such file or directory"));
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << "errno's own code, not INTERNAL";
  EXPECT_TRUE(dir_.Entries().empty());
}

// The temporary file gets a name of its own: a user's file and a planted link with the names of earlier versions'
// temporaries (`<path>.tmp.<pid>`, which was unlinked first, then created) are neither deleted nor followed.
TEST_F(SafetensorsTest, WriteLeavesFilesAndLinksAtTemporaryLikeNamesAlone) {
  const std::string path = Path("model.safetensors"), target = Path("elsewhere");
  const std::string users = absl::StrCat(path, ".tmp.", ::getpid());
  const std::string link = absl::StrCat(users, ".0");
  std::ofstream(target) << "untouched";
  std::ofstream(users) << "a user's file";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0) << std::strerror(errno);
  const std::vector<float> values = {1.f, 2.f};
  ASSERT_TRUE(WriteSafetensors(path, {{{"a", {2}, values}}}, {}).ok());
  for (const auto& [file, text] : {std::pair{target, "untouched"}, std::pair{users, "a user's file"}}) {
    std::stringstream kept;
    kept << std::ifstream(file).rdbuf();
    EXPECT_EQ(kept.str(), text) << file;
  }
  const absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(dir_.Entries().size(), 4u) << "the file, the user's file, the link and its target; no temporary";
}

// A name of NAME_MAX bytes is one the file system takes, and so is its temporary: before, `<name>.tmp.<pid>.<random>`
// outgrew NAME_MAX and every save to a name over ~225 bytes failed ("File name too long").
TEST_F(SafetensorsTest, AFileNameOfNameMaxBytesIsWritten) {
  for (const size_t bytes : {size_t{230}, size_t{NAME_MAX}}) {
    const std::string name(bytes, 'n');
    const std::string path = Path(name);
    const absl::Status written = WriteSafetensors(path, {{{"t", {2}, std::vector<float>{1.f, 2.f}}}}, {});
    ASSERT_TRUE(written.ok()) << bytes << " bytes: " << written;
    ASSERT_TRUE(ReadSafetensors(path).ok());
    EXPECT_EQ(dir_.Entries(), std::vector<std::string>{name}) << "no temporary left";
    std::filesystem::remove(path);
  }
}

TEST_F(SafetensorsTest, OverwriteReplacesTheFileAndLeavesNoTemporary) {
  const std::vector<float> old_values = {1.f, 2.f}, new_values = {3.f, 4.f, 5.f};
  const std::string path = Path("replaced.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{{"old", {2}, old_values}}}, {}).ok());
  ASSERT_TRUE(WriteSafetensors(path, {{{"new", {3}, new_values}}}, {}).ok());

  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors().size(), 1u);
  EXPECT_EQ(file->tensors().at("new").ToFloats(), new_values);
  EXPECT_EQ(dir_.Entries(), std::vector<std::string>{"replaced.safetensors"});
}

// Every file below is malformed in exactly one way; the reader must name that way.
TEST_F(SafetensorsTest, ReaderRejectsMalformedFilesNamingTheProblem) {
  const std::string eight(8, '\x11'), twelve(12, '\x22');
  const std::string absurd_length = RawFile("", "").replace(0, 8, "\x00\x00\x00\x00\x00\x01\x00\x00", 8);
  const struct {
    const char* what;
    std::string file;
    std::string message;
  } cases[] = {
      {"empty", "", "file is 0 bytes, shorter than the 8-byte header length"},
      {"cut length", std::string("\x08\x00\x00", 3), "file is 3 bytes, shorter than the 8-byte header length"},
      {"length past end", RawFile("{}", "").substr(0, 9), "header length 2 exceeds the 1 bytes"},
      {"absurd length", absurd_length, "header length 1099511627776 is absurd"},
      {"invalid JSON", RawFile(R"({"a": )", ""), "header is not valid JSON"},
      {"garbage", RawFile(std::string("\xff\xfe\x01garbage", 10), ""), "header is not valid JSON"},
      // The JSON parser stops at a NUL, so the valid object before it would pass; the reference reader refuses it.
      {"NUL after the JSON", RawFile(std::string("{}\0{garbage", 11), ""), "header holds a NUL byte at offset 2"},
      {"not an object", RawFile("[1, 2]", ""), "header is not a JSON object"},
      {"entry not an object", RawFile(R"({"a": 3})", ""), "entry for tensor 'a' is not a JSON object"},
      {"no dtype", RawFile(R"({"a": {"shape": [2], "data_offsets": [0, 8]}})", eight), "tensor 'a' has no 'dtype'"},
      {"no shape", RawFile(R"({"a": {"dtype": "F32", "data_offsets": [0, 8]}})", eight), "tensor 'a' has no 'shape'"},
      {"no offsets", RawFile(R"({"a": {"dtype": "F32", "shape": [2]}})", eight), "tensor 'a' has no 'data_offsets'"},
      {"unknown key", RawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}})", eight),
       "tensor 'a' has unknown key 'x'"},
      {"dtype not string", RawFile(R"({"a": {"dtype": 32, "shape": [2], "data_offsets": [0, 8]}})", eight),
       "tensor 'a': dtype is not a string"},
      {"F16", RawFile(R"({"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}})", eight),
       "tensor 'a' has unsupported dtype 'F16' (only F32 is supported)"},
      {"shape not list", RawFile(R"({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", eight),
       "tensor 'a': shape is not a list"},
      {"negative dim", RawFile(R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", eight),
       "tensor 'a': shape has negative dimension -2"},
      {"fractional dim", RawFile(R"({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}})", eight),
       "tensor 'a': shape has a number where an integer belongs"},
      {"shape overflow",
       RawFile(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", eight),
       "tensor 'a': shape [4294967296, 4294967296] overflows 64 bits"},
      {"size mismatch", RawFile(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", eight),
       "tensor 'a': shape [3] needs 12 bytes but data_offsets cover 8"},
      {"offsets not a pair", RawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8]}})", eight),
       "tensor 'a': data_offsets is not a pair of non-negative integers"},
      {"negative offset", RawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", eight),
       "tensor 'a': data_offsets is not a pair of non-negative integers"},
      {"begin past end", RawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", eight),
       "tensor 'a': data_offsets begin 8 is past end 4"},
      {"out of range", RawFile(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", eight),
       "tensor 'a': data_offsets [0, 16] exceed the data region of 8 bytes"},
      {"overlap",
       RawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
               twelve),
       "tensors 'a' and 'b' overlap"},
      {"gap",
       RawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
               twelve),
       "data bytes [4, 8) belong to no tensor"},
      {"trailing bytes", RawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", eight),
       "data bytes [4, 8) belong to no tensor"},
      {"metadata not object", RawFile(R"({"__metadata__": ["x"]})", ""), "__metadata__ is not a JSON object"},
      {"metadata value not string", RawFile(R"({"__metadata__": {"step": 3}})", ""),
       "metadata value for 'step' is not a string"},
      // nlohmann's parser keeps the last of repeated keys; the reader refuses them in any object.
      {"tensor twice",
       RawFile(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
               eight),
       "header repeats key 'a' in one object"},
      {"metadata twice", RawFile(R"({"__metadata__": {}, "__metadata__": {"step": "1"}})", ""),
       "header repeats key '__metadata__' in one object"},
      {"dtype twice",
       RawFile(R"({"a": {"dtype": "F16", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", eight),
       "header repeats key 'dtype' in the object under 'a'"},
      {"metadata key twice", RawFile(R"({"__metadata__": {"step": "1", "step": "2"}})", ""),
       "header repeats key 'step' in the object under '__metadata__'"},
      // 64 nested containers are JSON the reader goes on to check; a 65th stops the parse.
      {"64 deep",
       RawFile(absl::StrCat(R"({"__metadata__": {"x": )", std::string(62, '['), std::string(62, ']'), "}}"), ""),
       "metadata value for 'x' is not a string"},
      {"65 deep",
       RawFile(absl::StrCat(R"({"__metadata__": {"x": )", std::string(63, '['), std::string(63, ']'), "}}"), ""),
       "header nests deeper than 64 levels"},
  };
  const std::string path = Path("malformed.safetensors");
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    WriteBytes(path, c.file);
    const absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(file.status().message(), HasSubstr(c.message));
    EXPECT_THAT(file.status().message(), HasSubstr(path));
  }
}

// ReadSafetensors with the address space held to about 256 MiB above what the process uses now: a reader that
// allocates what a hostile file makes it fails instead of passing.
void ReadWithLittleMemory(const std::string& path, absl::StatusOr<SafetensorsFile>& file) {
  std::ifstream statm("/proc/self/statm");
  size_t mapped_pages = 0;
  ASSERT_TRUE(statm >> mapped_pages);
  rlimit saved_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_AS, &saved_limit), 0);
  rlimit small_limit = saved_limit;
  small_limit.rlim_cur = std::min<rlim_t>(mapped_pages * ::sysconf(_SC_PAGESIZE) + (rlim_t{256} << 20),
                                          saved_limit.rlim_max);
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &small_limit), 0) << std::strerror(errno);
  file = ReadSafetensors(path);
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &saved_limit), 0);
}

// The whole file was once read into memory before its header was checked: a 4 GB sparse file with a garbage header
// took seconds and 4 GB of memory to refuse. With little memory, a 2 GiB file can only be refused if the reader looks
// at its header before anything else.
TEST_F(SafetensorsTest, ReaderRefusesABadHeaderBeforeReadingTheData) {
  const std::string path = Path("sparse.safetensors");
  WriteBytes(path, RawFile(R"({"a": )", ""));
  ASSERT_EQ(::truncate(path.c_str(), off_t{2} << 30), 0) << std::strerror(errno);

  absl::StatusOr<SafetensorsFile> file;
  ReadWithLittleMemory(path, file);
  std::filesystem::remove(path);

  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss) << file.status();
  EXPECT_THAT(file.status().message(), HasSubstr("header is not valid JSON"));
}

// nlohmann's DOM of nested arrays costs tens of times their text: a 20 MB header of '[' took gigabytes before it was
// refused as invalid JSON. The parse now stops at kMaxJsonDepth, with little memory.
TEST_F(SafetensorsTest, ReaderRefusesDeepNestingBeforeBuildingIt) {
  const std::string path = Path("deep.safetensors");
  WriteBytes(path, RawFile(std::string(20'000'000, '['), ""));

  absl::StatusOr<SafetensorsFile> file;
  ReadWithLittleMemory(path, file);
  std::filesystem::remove(path);

  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss) << file.status();
  EXPECT_THAT(file.status().message(), HasSubstr("header nests deeper than 64 levels"));
}

// Opening a FIFO for reading waited for a writer: a FIFO named as a checkpoint held the daemon's device worker.
TEST_F(SafetensorsTest, ReaderRefusesAFifoWithoutWaitingForAWriter) {
  const std::string path = Path("fifo.safetensors");
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  const absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_THAT(file.status().message(), HasSubstr("not a regular file"));
}

TEST_F(SafetensorsTest, ReaderReportsAMissingFile) {
  const std::string path = Path("absent.safetensors");
  const absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr(path));
  // A path through a file names none either: NOT_FOUND too (it was FAILED_PRECONDITION, abseil's code for ENOTDIR).
  const std::vector<float> values = {1.f};
  ASSERT_TRUE(WriteSafetensors(Path("a_file"), {{{"a", {1}, values}}}, {}).ok());
  const absl::StatusOr<SafetensorsFile> through = ReadSafetensors(Path("a_file/x.safetensors"));
  EXPECT_EQ(through.status().code(), absl::StatusCode::kNotFound) << through.status();
  EXPECT_THAT(through.status().message(), HasSubstr("Not a directory"));
}

}  // namespace
}  // namespace perception
