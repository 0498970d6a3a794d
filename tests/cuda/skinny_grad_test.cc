// The narrow weight gradient (kernels/skinny_grad.h, 3×TF32 and FFMA) against a double-precision CPU product on every
// narrow weight gradient of the small config and awkward shapes (rows not a multiple of a chunk, widths not multiples
// of the tile, odd leading dimensions, a dw wider than its rows): float32-level error (beside cuBLAS float32's on the
// same inputs) at several row splits, dw's padding untouched, bit-identical reruns and graph replays, and Blas routing
// them to it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/cuda_blas.h"
#include "kernels/skinny_grad.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using testing::BitIdentical;
using testing::DeviceArray;
using testing::RandomFloats;
using testing::RelativeError;
using testing::WeightGradientReference;
using testing::kBlasWorkspaceBytes;
using testing::kFloat32ProductError;

constexpr float kUntouched = 12345.f;  // dw's padding columns, which the kernel must not write

// dw[out, in] (leading dimension lddw) = dy[rows, out]ᵀ · x[rows, in] at leading dimensions lddy, ldx.
struct Product {
  std::string name;
  int rows, in, out, lddy, ldx, lddw;
};

void PrintTo(const Product& p, std::ostream* os) { *os << p.name; }

// dw's [out, in] part, and whether every padding column still holds kUntouched.
std::vector<float> Dense(const Product& p, const std::vector<float>& dw, bool* padding_untouched) {
  std::vector<float> dense(static_cast<size_t>(p.out) * p.in);
  *padding_untouched = true;
  for (int o = 0; o < p.out; ++o) {
    for (int c = 0; c < p.lddw; ++c) {
      const float v = dw[static_cast<size_t>(o) * p.lddw + c];
      if (c < p.in) {
        dense[static_cast<size_t>(o) * p.in + c] = v;
      } else if (v != kUntouched) {
        *padding_untouched = false;
      }
    }
  }
  return dense;
}

using SkinnyGradTest = testing::ProductTest<Product>;

TEST_P(SkinnyGradTest, MatchesDoubleReferenceAtEverySplitAndRerunsBitIdentical) {
  const Product& p = GetParam();
  const auto dy = RandomFloats(static_cast<size_t>(std::max(p.rows, 1)) * p.lddy, 7);
  const auto x = RandomFloats(static_cast<size_t>(std::max(p.rows, 1)) * p.ldx, 8);
  const auto expected = WeightGradientReference(p.rows, p.in, p.out, dy, p.lddy, x, p.ldx);
  const DeviceArray<float> ddy(dy), dx(x);
  // NaN where dw starts (the kernel overwrites), kUntouched in the padding columns.
  std::vector<float> init(static_cast<size_t>(p.out) * p.lddw, std::numeric_limits<float>::quiet_NaN());
  for (int o = 0; o < p.out; ++o) {
    std::fill(init.begin() + static_cast<size_t>(o) * p.lddw + p.in, init.begin() + static_cast<size_t>(o + 1) * p.lddw,
              kUntouched);
  }
  const DeviceArray<float> initial(init);
  DeviceArray<float> dw(init.size());
  auto reset = [&] {
    ASSERT_EQ(cudaMemcpyAsync(dw.get(), initial.get(), init.size() * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
              cudaSuccess);
  };
  // The error of a zero product is 0/0: there every output must be exactly 0.
  auto error_of = [&](const std::vector<float>& result) {
    bool untouched = false;
    const std::vector<float> dense = Dense(p, result, &untouched);
    EXPECT_TRUE(untouched) << "padding of dw written";
    if (p.rows == 0) {
      return std::all_of(dense.begin(), dense.end(), [](float v) { return v == 0.f; }) ? 0.0 : 1.0;
    }
    return RelativeError(dense, expected);
  };

  double cublas_error = 0;  // no product to compare over no rows
  if (p.rows > 0) {
    auto cublas = Blas::Create(stream_, workspace_->get(), kBlasWorkspaceBytes, Precision::kFloat32);
    ASSERT_TRUE(cublas.ok()) << cublas.status();
    reset();
    ASSERT_TRUE(
        (*cublas)->BackwardWeight(p.rows, p.in, p.out, ddy.get(), p.lddy, dx.get(), p.ldx, dw.get(), p.lddw).ok());
    cublas_error = error_of(dw.Download());
  }
  const double bar = std::max(kFloat32ProductError, 2 * cublas_error);

  // Each kind of arithmetic at auto, one slice (straight into dw), a few, many, more than the rows allow, and with a
  // workspace too small for two.
  for (const auto math : {kernels::SkinnyMath::kTf32x3, kernels::SkinnyMath::kFfma}) {
    std::string line;
    for (const int slices : {0, 1, 3, 64, 100000, -1}) {
      reset();
      const size_t workspace_bytes = slices < 0 ? sizeof(float) : kBlasWorkspaceBytes;
      ASSERT_EQ(kernels::LaunchSkinnyWeightGrad(p.rows, p.in, p.out, ddy.get(), p.lddy, dx.get(), p.ldx, dw.get(),
                                                p.lddw, workspace_->get(), workspace_bytes, stream_,
                                                std::max(slices, 0), math),
                cudaSuccess);
      const double error = error_of(dw.Download());
      EXPECT_LE(error, bar) << (math == kernels::SkinnyMath::kFfma ? "FFMA" : "3xTF32") << " slices " << slices;
      char buffer[32];
      std::snprintf(buffer, sizeof(buffer), " %.2e", error);
      line += buffer;
    }
    std::printf("[skinny] %-16s %-6s (auto 1 3 64 max no-workspace)%s | cuBLAS fp32 %.2e\n", p.name.c_str(),
                math == kernels::SkinnyMath::kFfma ? "FFMA" : "3xTF32", line.c_str(), cublas_error);
  }

  reset();
  ASSERT_EQ(kernels::LaunchSkinnyWeightGrad(p.rows, p.in, p.out, ddy.get(), p.lddy, dx.get(), p.ldx, dw.get(), p.lddw,
                                            workspace_->get(), kBlasWorkspaceBytes, stream_),
            cudaSuccess);
  const std::vector<float> first = dw.Download();
  reset();
  ASSERT_EQ(kernels::LaunchSkinnyWeightGrad(p.rows, p.in, p.out, ddy.get(), p.lddy, dx.get(), p.ldx, dw.get(), p.lddw,
                                            workspace_->get(), kBlasWorkspaceBytes, stream_),
            cudaSuccess);
  EXPECT_TRUE(BitIdentical(dw.Download(), first)) << "rerun";

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  reset();
  const cudaError_t captured =
      kernels::LaunchSkinnyWeightGrad(p.rows, p.in, p.out, ddy.get(), p.lddy, dx.get(), p.ldx, dw.get(), p.lddw,
                                      workspace_->get(), kBlasWorkspaceBytes, stream_);
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_EQ(captured, cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(dw.get(), 0, init.size() * sizeof(float), stream_), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  EXPECT_TRUE(BitIdentical(dw.Download(), first)) << "graph replay";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  // Blas in the 3×TF32 precision routes every shape here (none wider than 192, none with both sides over 64) to this
  // kernel: the same bits.
  auto blas3x = Blas::Create(stream_, workspace_->get(), kBlasWorkspaceBytes, Precision::kFloat32Tf32x3);
  ASSERT_TRUE(blas3x.ok()) << blas3x.status();
  reset();
  ASSERT_TRUE((*blas3x)->BackwardWeight(p.rows, p.in, p.out, ddy.get(), p.lddy, dx.get(), p.ldx, dw.get(), p.lddw).ok());
  const std::vector<float> routed = dw.Download();
  EXPECT_TRUE(BitIdentical(routed, first)) << "Blas 3xtf32 did not take the narrow kernel";
}

// small (B·T = 16,384 rows): the embedding (40 → 128), GRN skip and fc2 (192 → 64), value, gate and fc1 (64 → 64),
// the CfC backbone's c part (64 → 128 into the [K, D + C] gradient at ld 192, reading c at ld 64), head_out
// (64 → 5); then shapes off every grid: odd widths and leading dimensions, a tile's edge ± 1, fewer rows than a
// chunk, one row, none.
INSTANTIATE_TEST_SUITE_P(
    Shapes, SkinnyGradTest,
    ::testing::Values(Product{"small_embed", 16384, 40, 128, 128, 40, 40},
                      Product{"small_grn_skip", 16384, 192, 64, 64, 192, 192},
                      Product{"small_grn_64x64", 16384, 64, 64, 64, 64, 64},
                      Product{"small_cfc_c", 16384, 64, 128, 128, 64, 192},
                      Product{"small_head_out", 16384, 64, 5, 5, 64, 64},
                      Product{"awkward", 1001, 37, 70, 73, 41, 39}, Product{"tile_edges", 4097, 65, 63, 63, 65, 66},
                      Product{"wide_thin", 333, 130, 3, 3, 131, 130}, Product{"few_rows", 17, 5, 9, 11, 5, 5},
                      Product{"one_row", 1, 1, 1, 1, 1, 1}, Product{"no_rows", 0, 12, 7, 7, 12, 12}),
    [](const ::testing::TestParamInfo<Product>& info) { return info.param.name; });

}  // namespace
}  // namespace perception
