// The product precisions by name, and the backend factory's refusal of a non-fp32 precision on the CPU backend
// (the CUDA side is tests/cuda: parity in 3xtf32 and TF32).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "engine/param_layout.h"
#include "engine/precision.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using ::testing::HasSubstr;

TEST(PrecisionTest, NamesRoundTripAndUnknownOnesAreRefused) {
  for (const Precision p : {Precision::kFloat32, Precision::kFloat32Tf32x3, Precision::kTf32}) {
    const absl::StatusOr<Precision> parsed = ParsePrecision(PrecisionName(p));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, p);
  }
  const absl::StatusOr<Precision> fp16 = ParsePrecision("fp16");
  EXPECT_EQ(fp16.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fp16.status().message(), HasSubstr("unknown precision 'fp16' (fp32, 3xtf32 or tf32)"));
}

TEST(PrecisionTest, TheCpuBackendRefusesAnyButFp32) {
  const ModelConfig config = *NamedConfig("tiny");
  const std::vector<float> params = testing::RandomParams(ParamLayout(config), 7);
  EXPECT_TRUE(MakeBackend("cpu", config, OptimizerConfig{}, params, nullptr, Precision::kFloat32).ok());
  for (const Precision p : {Precision::kFloat32Tf32x3, Precision::kTf32}) {
    const auto backend = MakeBackend("cpu", config, OptimizerConfig{}, params, nullptr, p);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(backend.status().message(), HasSubstr(absl::StrCat("precision ", PrecisionName(p), " is the CUDA")));
  }
}

}  // namespace
}  // namespace perception
