// Checkpoint names through the service in process: a name that does not end in a file name, or holds a NUL, is
// refused before anything is created, and a refused save leaves no folders behind that would block a later one.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "tests/forwarding_backend.h"
#include "tests/in_process_daemon.h"

namespace perception::server {
namespace {

using testing::InProcessDaemon;

// The running test's checkpoint folder (one a test: ctest runs them side by side), emptied of what an earlier run of
// the test left in it.
std::string EmptiedFolder() {
  const std::string folder =
      std::string("checkpoint_names_") + ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::filesystem::remove_all(std::filesystem::path(::testing::TempDir()) / folder);
  return folder;
}

class CheckpointNamesTest : public ::testing::Test {
 protected:
  explicit CheckpointNamesTest(ModelHost::BackendDecorator decorate = nullptr)
      : daemon_(std::move(decorate), folder_) {}

  grpc::Status Save(const std::string& name) {
    v1::SaveCheckpointRequest request;
    request.set_name(name);
    return daemon_.Call(&v1::Perception::Stub::SaveCheckpoint, request);
  }

  grpc::Status Load(const std::string& name) {
    v1::LoadCheckpointRequest request;
    request.set_name(name);
    return daemon_.Call(&v1::Perception::Stub::LoadCheckpoint, request);
  }

  void InitModel() {
    const grpc::Status status = daemon_.InitTinyModel(0);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }

  // Everything in the checkpoint folder, as paths relative to it.
  std::vector<std::string> FolderContents() const {
    std::vector<std::string> contents;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root_)) {
      contents.push_back(std::filesystem::relative(entry.path(), root_).string());
    }
    return contents;
  }

  const std::string folder_ = EmptiedFolder();
  InProcessDaemon daemon_;
  const std::filesystem::path root_ = std::filesystem::path(::testing::TempDir()) / folder_;
};

// Before, "x/" created the folder x and failed on writing it, and then "x" failed with "Is a directory".
TEST_F(CheckpointNamesTest, ANameEndingInASeparatorIsRefusedAndBlocksNothing) {
  ASSERT_NO_FATAL_FAILURE(InitModel());
  for (const std::string name : {"x/", "x/.", ".", "sub/x/"}) {
    SCOPED_TRACE(name);
    const grpc::Status refused = Save(name);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
    EXPECT_THAT(refused.error_message(), ::testing::StartsWith("name: "));
  }
  EXPECT_THAT(FolderContents(), ::testing::IsEmpty());

  const grpc::Status saved = Save("x");
  ASSERT_TRUE(saved.ok()) << saved.error_message();
  EXPECT_TRUE(std::filesystem::is_regular_file(root_ / "x"));
}

TEST_F(CheckpointNamesTest, ANameThatIsAFolderIsRefused) {
  ASSERT_NO_FATAL_FAILURE(InitModel());
  std::filesystem::create_directories(root_ / "runs");
  const grpc::Status refused = Save("runs");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("folder"));
}

// Before, the folders deep/er were created although there was nothing to save.
TEST_F(CheckpointNamesTest, ASaveWithoutAModelCreatesNoFolders) {
  const grpc::Status refused = Save("deep/er/x.safetensors");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << refused.error_message();
  EXPECT_THAT(FolderContents(), ::testing::IsEmpty());
}

TEST_F(CheckpointNamesTest, ASaveCreatesTheMissingFolders) {
  ASSERT_NO_FATAL_FAILURE(InitModel());
  const grpc::Status saved = Save("deep/er/x.safetensors");
  ASSERT_TRUE(saved.ok()) << saved.error_message();
  EXPECT_TRUE(std::filesystem::is_regular_file(root_ / "deep/er/x.safetensors"));
}

// A name through a file answered FAILED_PRECONDITION, which this API keeps for the model's state (retry later), where
// LoadCheckpoint answers the same name NOT_FOUND.
TEST_F(CheckpointNamesTest, ANameThroughAFileIsTheCallersMistake) {
  ASSERT_NO_FATAL_FAILURE(InitModel());
  ASSERT_TRUE(Save("a.safetensors").ok());
  const grpc::Status refused = Save("a.safetensors/x");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("cannot create the folder for checkpoint"));
  EXPECT_EQ(Load("a.safetensors/x").error_code(), grpc::StatusCode::NOT_FOUND);
}

// A FIFO in the checkpoint folder was replaced by the save's rename (and a --checkpoint_on_exit of its name would
// have failed only after the drain): refused, and left in place.
TEST_F(CheckpointNamesTest, ANameThatIsAFifoIsRefusedAndLeftInPlace) {
  ASSERT_NO_FATAL_FAILURE(InitModel());
  std::filesystem::create_directories(root_);
  ASSERT_EQ(::mkfifo((root_ / "pipe").c_str(), 0600), 0) << std::strerror(errno);
  const grpc::Status refused = Save("pipe");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("checkpoint name 'pipe' cannot be written: "));
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("is a FIFO"));
  EXPECT_TRUE(std::filesystem::is_fifo(root_ / "pipe"));
}

// The OS reads a path up to its first NUL: before, "x\0.safetensors" saved to and loaded from the file "x".
TEST_F(CheckpointNamesTest, ANameWithANulIsRefused) {
  ASSERT_NO_FATAL_FAILURE(InitModel());
  const std::string name("x\0.safetensors", 14);
  const grpc::Status save = Save(name);
  EXPECT_EQ(save.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << save.error_message();
  EXPECT_THAT(save.error_message(), ::testing::HasSubstr("name: checkpoint name 'x\\000.safetensors' contains a NUL"));
  EXPECT_THAT(FolderContents(), ::testing::IsEmpty());

  ASSERT_TRUE(Save("x").ok());
  const grpc::Status load = Load(name);
  EXPECT_EQ(load.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << load.error_message();
  EXPECT_THAT(load.error_message(), ::testing::HasSubstr("contains a NUL"));
}

// A backend whose exported state holds a NaN, as a model that diverged would: SaveCheckpoint refuses to write it.
class NonFiniteStateBackend : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::StatusOr<Checkpoint> ExportState() const override {
    absl::StatusOr<Checkpoint> state = ForwardingBackend::ExportState();
    if (state.ok()) state->params[layout().tensor(layout().embed.weight).offset] = std::nanf("");
    return state;
  }
};

class NonFiniteModelTest : public CheckpointNamesTest {
 protected:
  NonFiniteModelTest()
      : CheckpointNamesTest([](std::unique_ptr<Backend> inner) -> std::unique_ptr<Backend> {
          return std::make_unique<NonFiniteStateBackend>(std::move(inner));
        }) {}
};

// Before, the folders deep/er were created before SaveCheckpoint refused the model's values, and stayed.
TEST_F(NonFiniteModelTest, ARefusedSaveRemovesTheFoldersItCreatedOnly) {
  ASSERT_NO_FATAL_FAILURE(InitModel());
  std::filesystem::create_directories(root_ / "deep");
  const grpc::Status refused = Save("deep/er/est/x.safetensors");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << refused.error_message();
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("not saved"));
  EXPECT_THAT(FolderContents(), ::testing::ElementsAre("deep")) << "the folder that was there stays";
}

}  // namespace
}  // namespace perception::server
