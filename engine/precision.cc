// Names of the product precisions.
#include "engine/precision.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace perception {
namespace {

constexpr std::string_view kAutoName = "auto";

}  // namespace

absl::StatusOr<Precision> ParsePrecision(std::string_view name) {
  for (const Precision p : {Precision::kFloat32, Precision::kFloat32Tf32x3, Precision::kTf32}) {
    if (name == PrecisionName(p)) return p;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown precision '", std::string(name), "' (fp32, 3xtf32 or tf32)"));
}

absl::StatusOr<std::optional<Precision>> ParsePrecisionChoice(std::string_view name) {
  if (name == kAutoName) return std::nullopt;
  if (absl::StatusOr<Precision> precision = ParsePrecision(name); precision.ok()) return *precision;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown precision '", std::string(name), "' (auto, fp32, 3xtf32 or tf32)"));
}

std::string_view PrecisionChoiceName(std::optional<Precision> choice) {
  return choice ? PrecisionName(*choice) : kAutoName;
}

Precision DefaultPrecision(bool cuda) { return cuda ? Precision::kFloat32Tf32x3 : Precision::kFloat32; }

const char* PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFloat32:
      return "fp32";
    case Precision::kFloat32Tf32x3:
      return "3xtf32";
    case Precision::kTf32:
      return "tf32";
  }
  return "?";
}

}  // namespace perception
