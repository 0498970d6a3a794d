// The product precisions by name, "auto" and what it resolves to, and the backend factory's refusal of a non-fp32
// precision on the CPU backend (the CUDA side is tests/cuda: parity in 3xtf32 and TF32, auto's 3xtf32).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>

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

TEST(PrecisionTest, AutoIsTheDevicesFloat32AccurateDefault) {
  for (const Precision p : {Precision::kFloat32, Precision::kFloat32Tf32x3, Precision::kTf32}) {
    const absl::StatusOr<std::optional<Precision>> parsed = ParsePrecisionChoice(PrecisionName(p));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, p);
    EXPECT_EQ(PrecisionChoiceName(p), PrecisionName(p));
  }
  const absl::StatusOr<std::optional<Precision>> automatic = ParsePrecisionChoice("auto");
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_EQ(*automatic, std::nullopt);
  EXPECT_EQ(PrecisionChoiceName(std::nullopt), "auto");
  const absl::StatusOr<std::optional<Precision>> fp16 = ParsePrecisionChoice("fp16");
  EXPECT_EQ(fp16.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fp16.status().message(), HasSubstr("unknown precision 'fp16' (auto, fp32, 3xtf32 or tf32)"));
  // "auto" is not a product arithmetic of its own: the parser of one refuses it.
  EXPECT_EQ(ParsePrecision("auto").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DefaultPrecision(/*cuda=*/true), Precision::kFloat32Tf32x3);
  EXPECT_EQ(DefaultPrecision(/*cuda=*/false), Precision::kFloat32);
}

// fp32, and "auto" (nullopt), which on the CPU is fp32, are taken; the CUDA precisions are refused.
TEST(PrecisionTest, TheCpuBackendRefusesAnyButFp32) {
  const ModelConfig config = *NamedConfig("tiny");
  const std::vector<float> params = testing::RandomParams(ParamLayout(config), 7);
  for (const std::optional<Precision> p : {std::optional(Precision::kFloat32), std::optional<Precision>()}) {
    const auto backend = MakeBackend("cpu", config, OptimizerConfig{}, params, nullptr, p);
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->precision(), Precision::kFloat32) << PrecisionChoiceName(p);
  }
  for (const Precision p : {Precision::kFloat32Tf32x3, Precision::kTf32}) {
    const auto backend = MakeBackend("cpu", config, OptimizerConfig{}, params, nullptr, p);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(backend.status().message(), HasSubstr(absl::StrCat("precision ", PrecisionName(p), " is the CUDA")));
  }
}

}  // namespace
}  // namespace perception
