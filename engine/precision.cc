// Names of the product precisions.
#include "engine/precision.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace perception {

absl::StatusOr<Precision> ParsePrecision(std::string_view name) {
  for (const Precision p : {Precision::kFloat32, Precision::kFloat32Tf32x3, Precision::kTf32}) {
    if (name == PrecisionName(p)) return p;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown precision '", std::string(name), "' (fp32, 3xtf32 or tf32)"));
}

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
