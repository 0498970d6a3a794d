// Strict JSON for checkpoints: the safetensors header and the objects its metadata carries (config, optimizer).
#pragma once

#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace perception {

// A checkpoint's JSON nests 3 deep at most. Nested JSON costs nlohmann's DOM about 37 times its text, so a 100 MB
// header of brackets would take gigabytes before anything could refuse it; the parse stops past this depth.
inline constexpr int kMaxJsonDepth = 64;

// `text` parsed as nlohmann::json::parse(text, nullptr, false) does (a discarded value when it is not JSON), except
// that a key repeated within one object (which nlohmann resolves silently to its last value) and nesting deeper
// than kMaxJsonDepth are INVALID_ARGUMENT: "repeats key 'k' ..." or "nests deeper than 64 levels".
inline absl::StatusOr<nlohmann::json> ParseJsonStrictly(absl::string_view text) {
  using Event = nlohmann::json::parse_event_t;
  // Per open object or array, outermost first: the keys seen so far and the latest (none for an array).
  struct Container {
    std::set<std::string> keys;
    std::string key;
  };
  std::vector<Container> open;
  // The callback sees containers start and keys at `depth`, the count of containers around them; it can stop the
  // parser only by throwing, and what it throws is caught below.
  const nlohmann::json::parser_callback_t check = [&open](int depth, Event event, nlohmann::json& parsed) {
    const size_t level = static_cast<size_t>(depth);
    if (event == Event::object_start || event == Event::array_start) {
      if (depth >= kMaxJsonDepth) {
        throw absl::InvalidArgumentError(absl::StrCat("nests deeper than ", kMaxJsonDepth, " levels"));
      }
      open.resize(level);
      open.emplace_back();
    } else if (event == Event::key) {
      Container& object = open[level - 1];
      object.key = parsed.get<std::string>();
      if (!object.keys.insert(object.key).second) {
        const std::string where = level >= 2 && !open[level - 2].key.empty()
                                      ? absl::StrCat("the object under '", open[level - 2].key, "'")
                                      : "one object";
        throw absl::InvalidArgumentError(absl::StrCat("repeats key '", object.key, "' in ", where));
      }
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), check, /*allow_exceptions=*/false);
  } catch (const absl::Status& refused) {
    return refused;
  }
}

// `text` as a JSON object; INVALID_ARGUMENT "<what>: ..." for anything else. A NUL byte is refused first: nlohmann's
// parser takes it for the end of its input and would ignore whatever follows it.
inline absl::StatusOr<nlohmann::json> ParseJsonObject(const std::string& text, absl::string_view what) {
  if (text.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": holds a NUL byte"));
  }
  absl::StatusOr<nlohmann::json> j = ParseJsonStrictly(text);
  if (!j.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", j.status().message()));
  if (j->is_discarded() || !j->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a JSON object"));
  }
  return j;
}

}  // namespace perception
