// The JSON objects the checkpoint metadata carries (the model config, the optimizer settings), parsed strictly.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace perception {

// `text` as a JSON object; INVALID_ARGUMENT "<what>: ..." for anything else. A NUL byte is refused first: nlohmann's
// parser takes it for the end of its input and would ignore whatever follows it.
inline absl::StatusOr<nlohmann::json> ParseJsonObject(const std::string& text, absl::string_view what) {
  if (text.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": holds a NUL byte"));
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a JSON object"));
  }
  return j;
}

}  // namespace perception
