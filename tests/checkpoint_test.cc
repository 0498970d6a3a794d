// Tests of the PerceptionNet checkpoint: bit-exact round trip, standard safetensors layout, every rejection, fuzzing.
#include "engine/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "engine/backend.h"
#include "engine/param_layout.h"
#include "tests/file_util.h"
#include "tests/model_spec_table.h"
#include "tests/test_util.h"
#include "engine/safetensors.h"

namespace perception {
namespace {

using ::testing::HasSubstr;

using testing::BitIdentical;
using testing::ReadBytes;
using testing::ScopedTempDir;
using testing::WriteBytes;

uint64_t HeaderLength(const std::string& file) {
  uint64_t length;
  std::memcpy(&length, file.data(), sizeof length);
  return length;
}

ModelConfig Config(const std::string& name) { return NamedConfig(name).value(); }

// Random contents everywhere the format stores something: parameters from the model's initializer
// with random normalizer buffers, random moments on the trained tensors, zero on padding.
Checkpoint RandomCheckpoint(const ModelConfig& config, uint64_t seed) {
  const ParamLayout layout(config);
  Checkpoint checkpoint;
  checkpoint.config = config;
  checkpoint.params.resize(layout.total_size());
  InitializeParameters(layout, seed, checkpoint.params);
  checkpoint.exp_avg.assign(layout.total_size(), 0.f);
  checkpoint.exp_avg_sq.assign(layout.total_size(), 0.f);
  Rng rng(seed + 1);
  for (const TensorSpec& t : layout.tensors()) {
    for (size_t i = t.offset; i < t.offset + t.size; ++i) {
      if (!t.trained) {
        checkpoint.params[i] = static_cast<float>(rng.Uniform(0.5, 2.0));
        continue;
      }
      checkpoint.exp_avg[i] = static_cast<float>(rng.Uniform(-1e-2, 1e-2));
      checkpoint.exp_avg_sq[i] = static_cast<float>(rng.Uniform(0.0, 1e-4));
    }
  }
  checkpoint.step = 1000 + static_cast<int64_t>(rng.Below(100000));
  return checkpoint;
}

void ExpectSameCheckpoint(const Checkpoint& a, const Checkpoint& b) {
  EXPECT_EQ(a.config, b.config);
  EXPECT_TRUE(BitIdentical(a.params, b.params));
  EXPECT_TRUE(BitIdentical(a.exp_avg, b.exp_avg));
  EXPECT_TRUE(BitIdentical(a.exp_avg_sq, b.exp_avg_sq));
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.optimizer, b.optimizer);
}

// Every tensor name a checkpoint of `config` must hold.
// MODEL.md §6's tensors for the preset `name`: §4's names as transcribed in tests/model_spec_table.h (not taken from
// ParamLayout), the two moments of each trained one, and optim.step; each with its shape.
std::map<std::string, std::vector<int64_t>> ExpectedTensors(const std::string& name) {
  const auto preset = std::ranges::find(testing::SpecPresets(), name, &testing::SpecPreset::name);
  EXPECT_NE(preset, testing::SpecPresets().end()) << name;
  std::map<std::string, std::vector<int64_t>> tensors = {{"optim.step", {1}}};
  for (const testing::SpecTensor& t : testing::SpecTensors(*preset)) {
    tensors[t.name] = t.shape;
    if (t.trained) {
      tensors["optim.exp_avg." + t.name] = t.shape;
      tensors["optim.exp_avg_sq." + t.name] = t.shape;
    }
  }
  return tensors;
}

// A file's tensors as owned values, so that a test can edit them and write them back.
struct OwnedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()); }  // or the files would land in the working directory

  void SaveTiny(uint64_t seed = 1) { ASSERT_TRUE(SaveCheckpoint(path_, RandomCheckpoint(Config("tiny"), seed)).ok()); }

  // Rewrites the checkpoint through the generic writer after `edit` changed its tensors or metadata.
  void RewriteTensors(const std::function<void(std::vector<OwnedTensor>&, SafetensorsMetadata&)>& edit) {
    absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path_);
    ASSERT_TRUE(file.ok()) << file.status();
    std::vector<OwnedTensor> tensors;
    for (const auto& [name, tensor] : file->tensors()) tensors.push_back({name, tensor.shape, tensor.ToFloats()});
    SafetensorsMetadata metadata = file->metadata();
    edit(tensors, metadata);
    std::vector<SafetensorsTensorRef> refs;
    for (const OwnedTensor& t : tensors) refs.push_back({t.name, t.shape, t.values});
    ASSERT_TRUE(WriteSafetensors(path_, refs, metadata).ok());
  }

  // Rewrites the JSON header by hand (keeping the data bytes), for damage the writer cannot produce.
  void RewriteHeader(const std::function<void(nlohmann::json&)>& edit) {
    const std::string file = ReadBytes(path_);
    const uint64_t length = HeaderLength(file);
    nlohmann::json header = nlohmann::json::parse(file.substr(8, length));
    edit(header);
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const uint64_t new_length = text.size();
    WriteBytes(path_, std::string(reinterpret_cast<const char*>(&new_length), 8) + text + file.substr(8 + length));
  }

  void ExpectLoadFails(const std::string& message) {
    const absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path_);
    ASSERT_FALSE(loaded.ok());
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
    EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(message));
    EXPECT_THAT(loaded.status().message(), HasSubstr(path_));
  }

  const ScopedTempDir dir_{"checkpoint_test"};
  const std::string path_ = (dir_.path() / "model.safetensors").string();
};

class CheckpointRoundTripTest : public CheckpointTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(CheckpointRoundTripTest, IsBitIdentical) {
  const Checkpoint saved = RandomCheckpoint(Config(GetParam()), 42);
  ASSERT_TRUE(SaveCheckpoint(path_, saved).ok());
  const absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameCheckpoint(*loaded, saved);
}

INSTANTIATE_TEST_SUITE_P(NamedConfigs, CheckpointRoundTripTest, ::testing::Values("tiny", "small"));

// Training resumed from the file goes on exactly as the run that never stopped: the same loss and the same weights,
// moments and step after two more steps, under a schedule and bias corrections that depend on the step (a load that
// dropped the moments or the step would give the same logits at once, and another update only at the next step).
TEST_F(CheckpointTest, TrainingResumedFromTheFileGoesOnAsTheUninterruptedRun) {
  const ModelConfig config = Config("tiny");
  OptimizerConfig optimizer;
  optimizer.schedule = LrSchedule::kWarmupCosine;
  optimizer.warmup_steps = 2;
  optimizer.total_steps = 6;
  const std::unique_ptr<Backend> uninterrupted =
      MakeCpuBackend(config, optimizer, testing::InitialParams(config, 31));
  auto batch = [&](int step) { return testing::MakeRandomBatch(config, config.batch, config.window, 600 + step); };
  for (int step = 1; step <= 3; ++step) ASSERT_TRUE(uninterrupted->TrainStep(batch(step).view()).ok());
  const absl::StatusOr<Checkpoint> saved = uninterrupted->ExportState();
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_TRUE(SaveCheckpoint(path_, *saved).ok());
  const absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::unique_ptr<Backend> resumed = MakeCpuBackend(config, optimizer, testing::InitialParams(config, 32));
  ASSERT_TRUE(resumed->ImportState(*loaded).ok());
  for (int step = 4; step <= 5; ++step) {
    const auto a = uninterrupted->TrainStep(batch(step).view()), b = resumed->TrainStep(batch(step).view());
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(b->step, step);
    EXPECT_EQ(std::memcmp(&a->loss, &b->loss, sizeof(double)), 0) << a->loss << " vs " << b->loss;
  }
  const absl::StatusOr<Checkpoint> a = uninterrupted->ExportState(), b = resumed->ExportState();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(b->step, 5);
  EXPECT_TRUE(BitIdentical(a->params, b->params)) << "parameters";
  EXPECT_TRUE(BitIdentical(a->exp_avg, b->exp_avg)) << "first moments";
  EXPECT_TRUE(BitIdentical(a->exp_avg_sq, b->exp_avg_sq)) << "second moments";
}

TEST_F(CheckpointTest, FileIsStandardSafetensors) {
  const ModelConfig config = Config("small");
  const Checkpoint saved = RandomCheckpoint(config, 7);
  ASSERT_TRUE(SaveCheckpoint(path_, saved).ok());

  const std::string file = ReadBytes(path_);
  const uint64_t length = HeaderLength(file);
  EXPECT_EQ(length % 8, 0u);
  ASSERT_LE(8 + length, file.size());
  const nlohmann::json header = nlohmann::json::parse(file.substr(8, length), nullptr, false);
  ASSERT_TRUE(header.is_object());
  const nlohmann::json& metadata = header.at("__metadata__");
  EXPECT_EQ(metadata.at("format"), "perception-v1");
  EXPECT_EQ(metadata.at("config"), ConfigToJson(config));
  EXPECT_EQ(metadata.at("step"), std::to_string(saved.step));

  // small: 46 layout tensors (2 buffers + 44 trained), 2 × 44 moments, optim.step.
  std::map<std::string, std::vector<int64_t>> tensors;
  for (const auto& [name, entry] : header.items()) {
    if (name != "__metadata__") tensors[name] = entry.at("shape").get<std::vector<int64_t>>();
  }
  EXPECT_EQ(tensors.size(), 46u + 2 * 44u + 1u);
  EXPECT_EQ(tensors, ExpectedTensors("small"));

  // Raw data, read without the project's reader: one parameter, one moment and the step.
  const char* data = file.data() + 8 + length;
  const ParamLayout layout(config);
  const TensorSpec& in_proj = layout.tensor(layout.layers[1].in_proj);
  auto bytes_of = [&](const std::string& name) {
    const nlohmann::json& entry = header.at(name);
    EXPECT_EQ(entry.at("dtype"), "F32");
    const size_t begin = entry.at("data_offsets").at(0), end = entry.at("data_offsets").at(1);
    return std::make_pair(data + begin, end - begin);
  };
  EXPECT_EQ(header.at(in_proj.name).at("shape"), nlohmann::json(in_proj.shape));
  const auto [param_bytes, param_size] = bytes_of(in_proj.name);
  ASSERT_EQ(param_size, in_proj.size * sizeof(float));
  EXPECT_EQ(std::memcmp(param_bytes, saved.params.data() + in_proj.offset, param_size), 0);
  const auto [moment_bytes, moment_size] = bytes_of("optim.exp_avg_sq." + in_proj.name);
  ASSERT_EQ(moment_size, in_proj.size * sizeof(float));
  EXPECT_EQ(std::memcmp(moment_bytes, saved.exp_avg_sq.data() + in_proj.offset, moment_size), 0);
  const auto [step_bytes, step_size] = bytes_of("optim.step");
  ASSERT_EQ(step_size, sizeof(float));
  float step;
  std::memcpy(&step, step_bytes, sizeof step);
  EXPECT_EQ(step, static_cast<float>(saved.step));
}

TEST_F(CheckpointTest, StepIsExactBeyondFloatPrecision) {
  Checkpoint saved = RandomCheckpoint(Config("tiny"), 3);
  saved.step = (int64_t{1} << 24) + 1;  // the float in optim.step rounds to 2^24
  ASSERT_TRUE(SaveCheckpoint(path_, saved).ok());
  const absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step, saved.step);
}

// Before, a checkpoint at step INT64_MAX loaded, and its next training step overflowed (NaN weights on the device).
TEST_F(CheckpointTest, StepsFrom2To53AreRefused) {
  for (const int64_t step : {int64_t{1} << 53, std::numeric_limits<int64_t>::max()}) {
    SCOPED_TRACE(step);
    SaveTiny();
    RewriteTensors([&](std::vector<OwnedTensor>& tensors, SafetensorsMetadata& metadata) {
      metadata["step"] = absl::StrCat(step);
      for (OwnedTensor& t : tensors) {
        if (t.name == "optim.step") t.values = {static_cast<float>(step)};
      }
    });
    ExpectLoadFails(absl::StrCat("metadata step ", step, " is not below 2^53 (9007199254740992), beyond which"));
  }
  Checkpoint saved = RandomCheckpoint(Config("tiny"), 3);
  saved.step = (int64_t{1} << 53) - 1;
  ASSERT_TRUE(SaveCheckpoint(path_, saved).ok());
  const absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step, saved.step);
}

TEST_F(CheckpointTest, PaddingAndBufferMomentsAreNotStoredAndLoadAsZero) {
  const ModelConfig config = Config("tiny");
  const ParamLayout layout(config);
  const Checkpoint clean = RandomCheckpoint(config, 5);
  Checkpoint dirty = clean;
  const TensorSpec& mean = layout.tensor(layout.norm_mean);
  const size_t padding = mean.offset + mean.size;  // tiny: F = 6 floats, then padding to the next 4
  ASSERT_LT(padding, layout.tensor(layout.norm_inv_std).offset);
  dirty.params[padding] = 123.f;
  dirty.exp_avg[mean.offset] = 4.f;
  dirty.exp_avg_sq[padding] = 5.f;
  ASSERT_TRUE(SaveCheckpoint(path_, dirty).ok());
  const absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameCheckpoint(*loaded, clean);
}

TEST_F(CheckpointTest, SaveRejectsInconsistentCheckpointsAndWritesNothing) {
  const Checkpoint good = RandomCheckpoint(Config("tiny"), 9);
  const size_t total = good.params.size();
  const struct {
    std::function<void(Checkpoint&)> damage;
    std::string message;
  } cases[] = {
      {[](Checkpoint& c) { c.params.pop_back(); },
       absl::StrCat("params has ", total - 1, " floats, the layout of this config needs ", total)},
      {[](Checkpoint& c) { c.exp_avg.push_back(0.f); }, absl::StrCat("exp_avg has ", total + 1, " floats")},
      {[](Checkpoint& c) { c.exp_avg_sq.clear(); }, "exp_avg_sq has 0 floats"},
      {[](Checkpoint& c) { c.step = -1; }, "step -1 is negative"},
      {[](Checkpoint& c) { c.step = int64_t{1} << 53; }, "step 9007199254740992 is not below 2^53"},
      {[](Checkpoint& c) { c.config.headdim = 3; }, "not divisible by headdim 3"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    Checkpoint bad = good;
    c.damage(bad);
    const absl::Status status = SaveCheckpoint(path_, bad);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(c.message));
    EXPECT_THAT(status.message(), HasSubstr(path_));
  }
  EXPECT_TRUE(dir_.Entries().empty());
}

TEST_F(CheckpointTest, TruncatedFilesAreRejected) {
  SaveTiny();
  const std::string file = ReadBytes(path_);
  const size_t data_start = 8 + HeaderLength(file);
  const struct {
    size_t cut;
    std::string message;
  } cases[] = {
      {0, "file is 0 bytes, shorter than the 8-byte header length"},
      {5, "file is 5 bytes, shorter than the 8-byte header length"},
      {8, "exceeds the 0 bytes that follow the length field"},
      {data_start / 2, "bytes that follow the length field"},
      {data_start - 1, "bytes that follow the length field"},
      {data_start, "exceed the data region of 0 bytes"},
      {data_start + 10, "exceed the data region of 10 bytes"},
      {(data_start + file.size()) / 2, "exceed the data region"},
      {file.size() - 1, absl::StrCat("exceed the data region of ", file.size() - 1 - data_start, " bytes")},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.cut);
    WriteBytes(path_, file.substr(0, c.cut));
    ExpectLoadFails(c.message);
  }
}

TEST_F(CheckpointTest, CorruptedHeaderIsRejected) {
  SaveTiny();
  std::string file = ReadBytes(path_);
  file.replace(20, 6, "\x01\xff\"}{]", 6);
  WriteBytes(path_, file);
  ExpectLoadFails("header is not valid JSON");

  // JSON, then a NUL and garbage: the JSON parser alone stops at the NUL and would load the checkpoint.
  SaveTiny();
  file = ReadBytes(path_);
  const uint64_t length = HeaderLength(file);
  std::string header = file.substr(8, length) + std::string("\0{garbage", 9);
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t new_length = header.size();
  WriteBytes(path_, std::string(reinterpret_cast<const char*>(&new_length), 8) + header + file.substr(8 + length));
  ExpectLoadFails(absl::StrCat("header holds a NUL byte at offset ", length));

  // The same inside the metadata's config and optimizer strings (JSON carries the NUL as \u0000).
  for (const std::string key : {"config", "optimizer"}) {
    SCOPED_TRACE(key);
    ASSERT_TRUE(SaveCheckpoint(path_, [] {
                  Checkpoint checkpoint = RandomCheckpoint(Config("tiny"), 1);
                  checkpoint.optimizer = OptimizerConfig{};
                  return checkpoint;
                }()).ok());
    RewriteTensors([&](std::vector<OwnedTensor>&, SafetensorsMetadata& metadata) {
      metadata[key] += std::string("\0{garbage", 9);
    });
    ExpectLoadFails(absl::StrCat(key, ": holds a NUL byte"));
  }
}

TEST_F(CheckpointTest, WrongShapeIsRejected) {
  SaveTiny();
  RewriteTensors([](std::vector<OwnedTensor>& tensors, SafetensorsMetadata&) {
    for (OwnedTensor& t : tensors) {
      if (t.name == "embed.weight") t.shape = {6, 8};  // transposed: same size, wrong shape
    }
  });
  ExpectLoadFails("tensor 'embed.weight' has shape [6, 8], expected [8, 6]");
}

TEST_F(CheckpointTest, MissingTensorIsRejected) {
  SaveTiny();
  RewriteTensors([](std::vector<OwnedTensor>& tensors, SafetensorsMetadata&) {
    std::erase_if(tensors, [](const OwnedTensor& t) { return t.name == "optim.exp_avg_sq.head.out.bias"; });
  });
  ExpectLoadFails("missing tensor 'optim.exp_avg_sq.head.out.bias' (expected shape [3])");
}

TEST_F(CheckpointTest, UnexpectedTensorIsRejected) {
  SaveTiny();
  RewriteTensors([](std::vector<OwnedTensor>& tensors, SafetensorsMetadata&) {
    tensors.push_back({"optim.exp_avg.norm.mean", {6}, std::vector<float>(6, 0.5f)});  // buffers have no moments
  });
  ExpectLoadFails("unexpected tensor 'optim.exp_avg.norm.mean'");
}

TEST_F(CheckpointTest, WrongDtypeIsRejected) {
  SaveTiny();
  std::string file = ReadBytes(path_);
  const size_t f32 = file.find("\"F32\"");
  ASSERT_NE(f32, std::string::npos);
  file.replace(f32, 5, "\"F16\"");
  WriteBytes(path_, file);
  ExpectLoadFails("has unsupported dtype 'F16' (only F32 is supported)");
}

TEST_F(CheckpointTest, DataOffsetsOutOfRangeAreRejected) {
  SaveTiny();
  uint64_t begin = 0, end = 0;
  RewriteHeader([&](nlohmann::json& header) {
    nlohmann::json& offsets = header["optim.step"]["data_offsets"];  // the last tensor of the data region
    begin = offsets[0];
    end = offsets[1];
    offsets = {begin + 4, end + 4};
  });
  ExpectLoadFails(absl::StrCat("tensor 'optim.step': data_offsets [", begin + 4, ", ", end + 4,
                               "] exceed the data region of ", end, " bytes"));
}

TEST_F(CheckpointTest, OverlappingDataOffsetsAreRejected) {
  SaveTiny();
  RewriteHeader([](nlohmann::json& header) {
    header["norm.inv_std"]["data_offsets"] = header["norm.mean"]["data_offsets"];  // same shape [6]
  });
  ExpectLoadFails("tensors 'norm.inv_std' and 'norm.mean' overlap");
}

TEST_F(CheckpointTest, MetadataProblemsAreRejected) {
  const struct {
    std::string key, value, message;
  } cases[] = {
      {"format", "perception-v0", "metadata format is 'perception-v0', expected 'perception-v1'"},
      {"config", "{\"n_features\": 6,", "metadata config is invalid: config: not a JSON object"},
      {"config", "{\"n_features\": 6, \"n_features\": 8}",
       "metadata config is invalid: config: repeats key 'n_features' in one object"},
      {"config", ConfigToJson(Config("small")), "tensor 'norm.mean' has shape [6], expected [40]"},
      {"step", "12a", "metadata step '12a' is not a non-negative integer"},
      {"step", "-3", "metadata step '-3' is not a non-negative integer"},
      {"step", "7", "optim.step holds"},
      {"optimizer", "{\"lr\": 0.001}", "metadata optimizer is invalid: optimizer: 'beta1' must be a number"},
      {"optimizer", "{\"lr\": 0.001, \"lr\": 0.002}",
       "metadata optimizer is invalid: optimizer: repeats key 'lr' in one object"},
      {"optimizer", OptimizerToJson(OptimizerConfig{.lr = -1}), "metadata optimizer is invalid: optimizer: lr must"},
      {"optimizer", OptimizerToJson(OptimizerConfig{.lr = 1e39}),
       "metadata optimizer is invalid: optimizer: lr 1e+39 exceeds float32's largest value"},
      // β and eps are fixed (MODEL.md §5) and no request shows them: other values trained unreported.
      {"optimizer", OptimizerToJson(OptimizerConfig{.beta1 = 0.5}),
       "metadata optimizer is invalid: optimizer: beta1 is 0.5 where MODEL.md §5 fixes it at 0.9"},
      {"optimizer", OptimizerToJson(OptimizerConfig{.eps = 1}),
       "metadata optimizer is invalid: optimizer: eps is 1 where MODEL.md §5 fixes it at 1e-08"},
      // The constant schedule does not read them, but they are shown and saved: a negative one was kept, and a
      // count past int64's range wrapped to a negative one.
      {"optimizer", OptimizerToJson(OptimizerConfig{.warmup_steps = -5}),
       "metadata optimizer is invalid: optimizer: warmup_steps (-5), total_steps (0) and min_lr (0) must be >= 0"},
      {"optimizer",
       absl::StrReplaceAll(OptimizerToJson(OptimizerConfig{.warmup_steps = 7}),
                           {{"\"warmup_steps\":7", "\"warmup_steps\":9223372036854775813"}}),
       "metadata optimizer is invalid: optimizer: 'warmup_steps' 9223372036854775813 exceeds the largest step count"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    SaveTiny();
    RewriteTensors([&](std::vector<OwnedTensor>&, SafetensorsMetadata& metadata) { metadata[c.key] = c.value; });
    ExpectLoadFails(c.message);
  }
}

// A resumed run continues with the settings it was saved under: a schedule's shape, doubles to the last bit.
TEST_F(CheckpointTest, OptimizerSettingsRoundTripExactlyAndAreOptional) {
  Checkpoint saved = RandomCheckpoint(Config("tiny"), 7);
  saved.optimizer = OptimizerConfig{.lr = 0.1 + 0.2,  // 0.30000000000000004: no short decimal
                                    .weight_decay = 0.05,
                                    .max_grad_norm = 0.5,
                                    .schedule = LrSchedule::kWarmupCosine,
                                    .warmup_steps = 7,
                                    .total_steps = 1000,
                                    .min_lr = 1.0 / 3.0 * 1e-5};
  ASSERT_TRUE(SaveCheckpoint(path_, saved).ok());
  absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameCheckpoint(*loaded, saved);

  saved.optimizer = std::nullopt;  // as written before checkpoints held them, and by PyTorch's save_checkpoint
  ASSERT_TRUE(SaveCheckpoint(path_, saved).ok());
  loaded = LoadCheckpoint(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_FALSE(loaded->optimizer.has_value());
}

TEST_F(CheckpointTest, MissingFormatIsRejected) {
  SaveTiny();
  RewriteTensors([](std::vector<OwnedTensor>&, SafetensorsMetadata& metadata) { metadata.erase("format"); });
  ExpectLoadFails("no 'format' in the metadata; not a PerceptionNet checkpoint");
}

TEST_F(CheckpointTest, InvalidConfigValuesAreRejected) {
  const struct {
    std::string key;
    int value;
    std::string message;
  } cases[] = {
      {"headdim", 3, "metadata config is invalid: config: d_inner = expand*d_model = 16 is not divisible by headdim 3"},
      {"n_layers", 1000000000, "metadata config is invalid: config: n_layers must be in [1, 65536]"},
      {"d_model", 100000000, "metadata config is invalid: config: d_model must be in [1, 65536]"},
      // Valid dimensions whose layout would still dwarf the file: refused before anything is allocated.
      {"n_layers", 60000, "config n_layers = 60000 exceeds the"},
      {"d_model", 4000, "config expand * d_model = 8000 does not fit the"},
      // ... or past what the daemon holds at all.
      {"d_model", 60000, "metadata config is invalid: config: d_inner = expand*d_model = 120000 must be at most 65536"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    SaveTiny();
    RewriteTensors([&](std::vector<OwnedTensor>&, SafetensorsMetadata& metadata) {
      nlohmann::json config = nlohmann::json::parse(metadata["config"]);
      config[c.key] = c.value;
      metadata["config"] = config.dump();
    });
    ExpectLoadFails(c.message);
  }
}

TEST_F(CheckpointTest, NonFiniteOrImpossibleValuesAreRejected) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const struct {
    std::string tensor;
    std::function<void(std::vector<float>&)> edit;
    std::string message;
  } cases[] = {
      {"embed.weight", [&](std::vector<float>& v) { v[0] = nan; }, "tensor 'embed.weight' element 0 is nan"},
      {"head.out.bias", [&](std::vector<float>& v) { v[2] = -inf; }, "tensor 'head.out.bias' element 2 is -inf"},
      {"norm.inv_std", [&](std::vector<float>& v) { v[0] = inf; }, "tensor 'norm.inv_std' element 0 is inf"},
      {"norm.mean", [&](std::vector<float>& v) { v[4] = nan; }, "tensor 'norm.mean' element 4 is nan"},
      {"norm.inv_std", [](std::vector<float>& v) { std::fill(v.begin(), v.end(), 0.f); },
       "tensors 'norm.mean' and 'norm.inv_std': normalizer feature 0: mean "},
      {"norm.inv_std", [](std::vector<float>& v) { v[3] = -1.f; }, "normalizer feature 3: mean "},
      {"optim.exp_avg.cfc.ff1.weight", [&](std::vector<float>& v) { v[1] = inf; },
       "tensor 'optim.exp_avg.cfc.ff1.weight' element 1 is inf"},
      {"optim.exp_avg_sq.layers.1.mixer.A_log", [](std::vector<float>& v) { v[1] = -1.f; },
       "tensor 'optim.exp_avg_sq.layers.1.mixer.A_log' element 1 is -1; a second moment cannot be negative"},
      {"optim.exp_avg_sq.embed.bias", [&](std::vector<float>& v) { v[7] = nan; },
       "tensor 'optim.exp_avg_sq.embed.bias' element 7 is nan"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    SaveTiny();
    RewriteTensors([&](std::vector<OwnedTensor>& tensors, SafetensorsMetadata&) {
      for (OwnedTensor& t : tensors) {
        if (t.name == c.tensor) c.edit(t.values);
      }
    });
    ExpectLoadFails(c.message);
  }
}

TEST_F(CheckpointTest, AModelHoldingANonFiniteValueIsNotSaved) {
  // What the loader refuses is not written either, so that a model that diverged does not replace a good file with
  // one that cannot be loaded.
  SaveTiny(21);
  const std::string good = ReadBytes(path_);
  Checkpoint diverged = RandomCheckpoint(Config("tiny"), 22);
  diverged.params[5] = std::numeric_limits<float>::quiet_NaN();
  const absl::Status status = SaveCheckpoint(path_, diverged);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("element 5 is nan): not saved"));
  EXPECT_EQ(ReadBytes(path_), good);
}

TEST_F(CheckpointTest, FailedLoadLeavesTheCallersCheckpointUntouched) {
  SaveTiny(21);
  absl::StatusOr<Checkpoint> held = LoadCheckpoint(path_);
  ASSERT_TRUE(held.ok()) << held.status();
  const Checkpoint snapshot = *held;
  const std::string file = ReadBytes(path_);
  WriteBytes(path_, file.substr(0, file.size() - 4));
  EXPECT_FALSE(LoadCheckpoint(path_).ok());
  ExpectSameCheckpoint(*held, snapshot);
}

TEST_F(CheckpointTest, SaveIntoMissingDirectoryFailsNamingThePath) {
  const std::string path = (dir_.path() / "missing" / "model.safetensors").string();
  const absl::Status status = SaveCheckpoint(path, RandomCheckpoint(Config("tiny"), 1));
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr(path));
  EXPECT_THAT(status.message(), HasSubstr("No such file or directory"));
  EXPECT_TRUE(dir_.Entries().empty());
}

TEST_F(CheckpointTest, SaveReplacesAnExistingCheckpoint) {
  SaveTiny(1);
  const Checkpoint newer = RandomCheckpoint(Config("tiny"), 2);
  ASSERT_TRUE(SaveCheckpoint(path_, newer).ok());
  const absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameCheckpoint(*loaded, newer);
  EXPECT_EQ(dir_.Entries(), std::vector<std::string>{"model.safetensors"});
}

// A write that dies halfway (here: the file size limit, as a full disk would) must leave the old
// checkpoint exactly as it was and no temporary file behind.
TEST_F(CheckpointTest, InterruptedSaveKeepsTheOldCheckpoint) {
  const Checkpoint old = RandomCheckpoint(Config("tiny"), 1);
  ASSERT_TRUE(SaveCheckpoint(path_, old).ok());
  const std::string old_bytes = ReadBytes(path_);

  rlimit saved_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved_limit), 0);
  rlimit small_limit = saved_limit;
  small_limit.rlim_cur = 64 * 1024;  // the tiny file fits, the small one (about 3.8 MB) does not
  ASSERT_LT(old_bytes.size(), small_limit.rlim_cur);
  const sighandler_t saved_handler = ::signal(SIGXFSZ, SIG_IGN);  // make the write fail with EFBIG instead
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small_limit), 0);
  const absl::Status status = SaveCheckpoint(path_, RandomCheckpoint(Config("small"), 2));
  ::setrlimit(RLIMIT_FSIZE, &saved_limit);
  ::signal(SIGXFSZ, saved_handler);

  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("File too large"));
  EXPECT_EQ(ReadBytes(path_), old_bytes);
  EXPECT_EQ(dir_.Entries(), std::vector<std::string>{"model.safetensors"});
  const absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameCheckpoint(*loaded, old);
}

// Random damage must always end in a load or an error, never a crash. Truncation always fails;
// a flipped data byte outside optim.step changes a value but leaves a loadable file.
// Whether the float holding data byte `position` of `file` is one the loader accepts in its tensor: finite, and for a
// second moment non-negative, for the normalizer's inv_std positive.
bool HoldsValidValue(const nlohmann::json& header, const std::string& file, size_t data_start, size_t position) {
  const size_t offset = position - data_start;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const size_t begin = entry.at("data_offsets").at(0).get<size_t>();
    const size_t end = entry.at("data_offsets").at(1).get<size_t>();
    if (offset < begin || offset >= end) continue;
    float value;
    std::memcpy(&value, file.data() + data_start + begin + (offset - begin) / 4 * 4, sizeof value);
    if (!std::isfinite(value)) return false;
    if (name.starts_with("optim.exp_avg_sq.")) return value >= 0;
    if (name == "norm.inv_std") return value > 0;
    return true;
  }
  return false;
}

TEST_F(CheckpointTest, FuzzedFilesLoadOrFailCleanly) {
  SaveTiny(17);
  const std::string original = ReadBytes(path_);
  const size_t data_start = 8 + HeaderLength(original);
  const nlohmann::json header = nlohmann::json::parse(original.substr(8, data_start - 8));
  const size_t step_begin = data_start + header.at("optim.step").at("data_offsets").at(0).get<size_t>();
  const size_t expected_size = ParamLayout(Config("tiny")).total_size();

  Rng rng(2024);
  int loaded = 0, failed = 0;
  for (int i = 0; i < 2000; ++i) {
    std::string file = original;
    const bool truncate = i % 2 == 1;
    // Mutations land in the header half the time: it is small, and that is where the parser works.
    const size_t position = i % 4 == 0 ? rng.Below(data_start) : rng.Below(file.size());
    if (truncate) {
      file.resize(rng.Below(file.size()));
    } else {
      file[position] = static_cast<char>(file[position] ^ (1 + rng.Below(255)));
    }
    WriteBytes(path_, file);
    const absl::StatusOr<Checkpoint> result = LoadCheckpoint(path_);
    if (result.ok()) {
      ++loaded;
      EXPECT_EQ(result->params.size(), expected_size);
      EXPECT_EQ(result->exp_avg_sq.size(), expected_size);
    } else {
      ++failed;
      EXPECT_FALSE(result.status().message().empty());
    }
    if (truncate) {
      EXPECT_FALSE(result.ok()) << "truncated to " << file.size();
    }
    const bool data_byte = !truncate && position >= data_start && (position < step_begin || position >= step_begin + 4);
    if (data_byte && HoldsValidValue(header, file, data_start, position)) {
      EXPECT_TRUE(result.ok()) << "byte " << position << ": " << result.status();
    }
  }
  EXPECT_GT(loaded, 0);
  EXPECT_GT(failed, 1000);
}

}  // namespace
}  // namespace perception
