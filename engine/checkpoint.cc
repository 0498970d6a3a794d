// Saves and loads PerceptionNet v1 checkpoints (MODEL.md §6) through the safetensors reader and writer.
#include "engine/checkpoint.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <set>
#include <span>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/dataset.h"
#include "engine/param_layout.h"
#include "engine/safetensors.h"
#include "engine/status_macros.h"

namespace perception {
namespace {

constexpr char kStepTensor[] = "optim.step";

// Training takes step + 1 and its bias corrections and schedule from the step as a double: from 2^53 on a double no
// longer counts every step, and near INT64_MAX the next step overflows (NaN weights on the device). Checked on saving
// too, so that every file written loads.
absl::Status CheckStepLimit(int64_t step) {
  constexpr int64_t kStepLimit = int64_t{1} << 53;
  if (step < kStepLimit) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("step ", step, " is not below 2^53 (", kStepLimit,
                                                 "), beyond which training cannot count its steps exactly in float64 ",
                                                 "and the step counter overflows"));
}

// The flat buffers whose slices make up the file's tensors.
enum Buffer { kParams, kExpAvg, kExpAvgSq, kStep, kBufferCount };

// One tensor of the file and the slice of a flat buffer it is written from or read into.
struct TensorPlace {
  std::string name;
  std::vector<int64_t> shape;
  Buffer buffer;
  size_t offset;
  size_t size;
};

// Every tensor of a checkpoint of `layout`, in file order.
std::vector<TensorPlace> CheckpointTensors(const ParamLayout& layout) {
  std::vector<TensorPlace> places;
  for (const TensorSpec& t : layout.tensors()) places.push_back({t.name, t.shape, kParams, t.offset, t.size});
  // The normalizer buffers are fitted, not optimized, so they have no moments.
  const std::pair<const char*, Buffer> moments[] = {{"optim.exp_avg.", kExpAvg}, {"optim.exp_avg_sq.", kExpAvgSq}};
  for (const auto& [prefix, buffer] : moments) {
    for (const TensorSpec& t : layout.tensors()) {
      if (t.trained) places.push_back({prefix + t.name, t.shape, buffer, t.offset, t.size});
    }
  }
  places.push_back({kStepTensor, {1}, kStep, 0, 1});
  return places;
}

absl::Status Annotate(const absl::Status& status, absl::string_view action, const std::string& path) {
  return absl::Status(status.code(), absl::StrCat(action, " checkpoint '", path, "': ", status.message()));
}

// A file can pass every structural check and still hold values no trained model has (a flipped bit, a model saved
// after it diverged); loaded, they would turn every later loss into NaN. Every stored float must be finite, the
// second moments non-negative (Adam takes their square root) and the normalizer one the model can apply. Checked on
// saving too, so that every file written loads.
absl::Status CheckValues(const ParamLayout& layout, const std::vector<TensorPlace>& places,
                         const std::array<std::span<const float>, kBufferCount>& buffers) {
  for (const TensorPlace& place : places) {
    if (place.buffer == kStep) continue;  // checked against the metadata step
    const std::span<const float> values = buffers[place.buffer].subspan(place.offset, place.size);
    for (size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i])) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", place.name, "' element ", i, " is ", values[i]));
      }
      if (place.buffer == kExpAvgSq && values[i] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", place.name, "' element ", i, " is ", values[i],
                                                       "; a second moment cannot be negative"));
      }
    }
  }
  const TensorSpec& mean = layout.tensor(layout.norm_mean);
  const TensorSpec& inv_std = layout.tensor(layout.norm_inv_std);
  const absl::Status normalizer = ValidateNormalizer(buffers[kParams].subspan(mean.offset, mean.size),
                                                     buffers[kParams].subspan(inv_std.offset, inv_std.size));
  if (!normalizer.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensors '", mean.name, "' and '", inv_std.name, "': ", normalizer.message()));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Saving.

absl::Status CheckSaveable(const ParamLayout& layout, const Checkpoint& checkpoint) {
  const std::pair<const char*, const std::vector<float>*> buffers[] = {
      {"params", &checkpoint.params}, {"exp_avg", &checkpoint.exp_avg}, {"exp_avg_sq", &checkpoint.exp_avg_sq}};
  for (const auto& [name, buffer] : buffers) {
    if (buffer->size() != layout.total_size()) {
      return absl::InvalidArgumentError(absl::StrCat(name, " has ", buffer->size(),
                                                     " floats, the layout of this config needs ", layout.total_size()));
    }
  }
  if (checkpoint.step < 0) return absl::InvalidArgumentError(absl::StrCat("step ", checkpoint.step, " is negative"));
  return CheckStepLimit(checkpoint.step);
}

absl::Status WriteCheckpoint(const std::string& path, const Checkpoint& checkpoint) {
  RETURN_IF_ERROR(ValidateConfig(checkpoint.config));
  const ParamLayout layout(checkpoint.config);
  RETURN_IF_ERROR(CheckSaveable(layout, checkpoint));
  const float step_value = static_cast<float>(checkpoint.step);
  const std::array<std::span<const float>, kBufferCount> buffers = {
      checkpoint.params, checkpoint.exp_avg, checkpoint.exp_avg_sq, std::span<const float>(&step_value, 1)};
  std::vector<TensorPlace> places = CheckpointTensors(layout);
  if (const absl::Status values = CheckValues(layout, places, buffers); !values.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the model holds a value no checkpoint may (", values.message(), "): not saved"));
  }
  std::vector<SafetensorsTensorRef> tensors;
  for (TensorPlace& place : places) {
    tensors.push_back({std::move(place.name), std::move(place.shape),
                       buffers[place.buffer].subspan(place.offset, place.size)});
  }
  SafetensorsMetadata metadata = {{"format", kCheckpointFormat},
                                  {"config", ConfigToJson(checkpoint.config)},
                                  {"step", absl::StrCat(checkpoint.step)}};
  if (checkpoint.optimizer.has_value()) metadata.emplace("optimizer", OptimizerToJson(*checkpoint.optimizer));
  return WriteSafetensors(path, tensors, metadata);
}

// ---------------------------------------------------------------------------------------------
// Loading.

absl::StatusOr<std::string> MetadataValue(const SafetensorsMetadata& metadata, const std::string& key) {
  auto it = metadata.find(key);
  if (it == metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat("no '", key, "' in the metadata; not a PerceptionNet checkpoint"));
  }
  return it->second;
}

absl::Status CheckFormat(const SafetensorsMetadata& metadata) {
  ASSIGN_OR_RETURN(const std::string format, MetadataValue(metadata, "format"));
  if (format != kCheckpointFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata format is '", format, "', expected '", kCheckpointFormat, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ConfigFromMetadata(const SafetensorsMetadata& metadata) {
  ASSIGN_OR_RETURN(const std::string json, MetadataValue(metadata, "config"));
  absl::StatusOr<ModelConfig> config = ConfigFromJson(json);
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metadata config is invalid: ", config.status().message()));
  }
  return config;
}

absl::StatusOr<std::optional<OptimizerConfig>> OptimizerFromMetadata(const SafetensorsMetadata& metadata) {
  const auto it = metadata.find("optimizer");
  if (it == metadata.end()) return std::nullopt;
  absl::StatusOr<OptimizerConfig> optimizer = OptimizerFromJson(it->second);
  if (!optimizer.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metadata optimizer is invalid: ", optimizer.status().message()));
  }
  return *optimizer;
}

absl::StatusOr<int64_t> StepFromMetadata(const SafetensorsMetadata& metadata) {
  ASSIGN_OR_RETURN(const std::string text, MetadataValue(metadata, "step"));
  int64_t step = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), step);
  if (error != std::errc() || end != text.data() + text.size() || step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("metadata step '", text, "' is not a non-negative integer"));
  }
  if (const absl::Status limit = CheckStepLimit(step); !limit.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metadata ", limit.message()));
  }
  return step;
}

// A tampered config can describe a model far larger than the file. Every bound below is a tensor
// dimension of a genuine checkpoint, so rejecting what exceeds the file's float count keeps the
// layout (its size and its int arithmetic) proportional to the file actually read.
absl::Status CheckConfigFitsFile(const ModelConfig& c, const SafetensorsFile& file) {
  uint64_t floats = 0;
  for (const auto& [name, tensor] : file.tensors()) floats += tensor.bytes.size() / sizeof(float);
  const int64_t limit = static_cast<int64_t>(std::min<uint64_t>(floats, INT_MAX));
  const int64_t d_inner = int64_t{c.expand} * c.d_model;
  const std::pair<const char*, int64_t> dimensions[] = {
      {"n_features", c.n_features},
      {"d_model", c.d_model},
      {"expand * d_model", d_inner},
      {"d_state", c.d_state},
      {"d_conv", c.d_conv},
      {"cfc_units", c.cfc_units},
      {"cfc_backbone", c.cfc_backbone},
      {"grn_hidden", c.grn_hidden},
      {"n_horizons", c.n_horizons},
      {"in_proj rows", 2 * d_inner + 2 * int64_t{c.d_state} + d_inner / c.headdim},
      {"d_model + cfc_units", int64_t{c.d_model} + c.cfc_units}};
  for (const auto& [name, value] : dimensions) {
    if (value > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("config ", name, " = ", value, " does not fit the ", floats, " floats the file holds"));
    }
  }
  // Each layer contributes several tensors, so a genuine file has more tensors than layers.
  if (static_cast<size_t>(c.n_layers) > file.tensors().size()) {
    return absl::InvalidArgumentError(absl::StrCat("config n_layers = ", c.n_layers, " exceeds the ",
                                                   file.tensors().size(), " tensors the file holds"));
  }
  return absl::OkStatus();
}

absl::Status CheckTensorSet(const std::vector<TensorPlace>& places,
                            const std::map<std::string, SafetensorsTensor>& tensors) {
  std::set<std::string_view> expected;
  for (const TensorPlace& place : places) {
    auto it = tensors.find(place.name);
    if (it == tensors.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("missing tensor '", place.name, "' (expected shape ", FormatShape(place.shape), ")"));
    }
    if (it->second.shape != place.shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", place.name, "' has shape ",
                                                     FormatShape(it->second.shape), ", expected ",
                                                     FormatShape(place.shape)));
    }
    expected.insert(place.name);
  }
  for (const auto& [name, tensor] : tensors) {
    if (!expected.contains(name)) return absl::InvalidArgumentError(absl::StrCat("unexpected tensor '", name, "'"));
  }
  return absl::OkStatus();
}

// Builds the whole checkpoint in a local so that no error can leave a partial result behind.
// The reader has already checked dtype (F32) and that each tensor's bytes match its shape.
absl::StatusOr<Checkpoint> CheckpointFromFile(const SafetensorsFile& file) {
  RETURN_IF_ERROR(CheckFormat(file.metadata()));
  Checkpoint checkpoint;
  ASSIGN_OR_RETURN(checkpoint.config, ConfigFromMetadata(file.metadata()));
  ASSIGN_OR_RETURN(checkpoint.step, StepFromMetadata(file.metadata()));
  ASSIGN_OR_RETURN(checkpoint.optimizer, OptimizerFromMetadata(file.metadata()));
  RETURN_IF_ERROR(CheckConfigFitsFile(checkpoint.config, file));
  const ParamLayout layout(checkpoint.config);
  const std::vector<TensorPlace> places = CheckpointTensors(layout);
  RETURN_IF_ERROR(CheckTensorSet(places, file.tensors()));

  // Zero-filled first: padding and the buffers' moments are not in the file and must stay zero.
  checkpoint.params.assign(layout.total_size(), 0.f);
  checkpoint.exp_avg.assign(layout.total_size(), 0.f);
  checkpoint.exp_avg_sq.assign(layout.total_size(), 0.f);
  float stored_step = 0.f;
  const std::array<std::span<float>, kBufferCount> buffers = {checkpoint.params, checkpoint.exp_avg,
                                                              checkpoint.exp_avg_sq, std::span<float>(&stored_step, 1)};
  for (const TensorPlace& place : places) {
    const std::span<const std::byte> bytes = file.tensors().at(place.name).bytes;
    std::memcpy(buffers[place.buffer].subspan(place.offset, place.size).data(), bytes.data(), bytes.size());
  }
  RETURN_IF_ERROR(CheckValues(layout, places, {checkpoint.params, checkpoint.exp_avg, checkpoint.exp_avg_sq,
                                                std::span<const float>(&stored_step, 1)}));
  if (stored_step != static_cast<float>(checkpoint.step)) {
    return absl::InvalidArgumentError(absl::StrCat(kStepTensor, " holds ", stored_step, " but the metadata step is ",
                                                   checkpoint.step));
  }
  return checkpoint;
}

}  // namespace

absl::Status SaveCheckpoint(const std::string& path, const Checkpoint& checkpoint) {
  absl::Status status = WriteCheckpoint(path, checkpoint);
  return status.ok() ? status : Annotate(status, "saving", path);
}

absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& path) {
  ASSIGN_OR_RETURN(const SafetensorsFile file, ReadSafetensors(path));
  absl::StatusOr<Checkpoint> checkpoint = CheckpointFromFile(file);
  if (checkpoint.ok()) return checkpoint;
  // A readable safetensors file that is not a valid PerceptionNet checkpoint is corrupt for the caller, as a
  // garbled one is (DATA_LOSS); INVALID_ARGUMENT is for requests.
  const absl::Status content(absl::StatusCode::kDataLoss, checkpoint.status().message());
  return Annotate(checkpoint.status().code() == absl::StatusCode::kInvalidArgument ? content : checkpoint.status(),
                  "loading", path);
}

}  // namespace perception
