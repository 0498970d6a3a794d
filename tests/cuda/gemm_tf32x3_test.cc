// The 3×TF32 products (kernels/gemm_tf32x3.h) against a double-precision CPU product at the small, large and tiny
// configs' shapes and awkward ones: float32-level normalized error (printed beside cuBLAS float32's on the same
// inputs) for every tile, bit-identical reruns, the same bits from a replayed CUDA graph; and Blas in the 3×TF32
// precision, which routes what the kernels do not take to cuBLAS, at float32 accuracy on every shape; and Blas's
// plans bounded over many shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "engine/cuda_blas.h"
#include "kernels/gemm_tf32x3.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using kernels::GemmTile;
using testing::BitIdentical;
using testing::DeviceArray;
using testing::RandomFloats;
using testing::RelativeError;
using testing::WeightGradientReference;
using testing::kBlasWorkspaceBytes;
using testing::kFloat32ProductError;


// y[rows, out] = x[rows, in] · w[out, in]ᵀ; the activations' leading dimensions are their width + pad.
struct Product {
  std::string name;
  int rows, in, out, pad;
};

void PrintTo(const Product& p, std::ostream* os) { *os << p.name; }

// The reference in double, every loop an axpy over the output's contiguous dimension.
std::vector<double> ForwardReference(const Product& p, const std::vector<float>& x, const std::vector<float>& w,
                                     const std::vector<float>& bias, double beta, const std::vector<float>& y0) {
  const int ldx = p.in + p.pad;
  std::vector<double> wt(static_cast<size_t>(p.in) * p.out), y(static_cast<size_t>(p.rows) * p.out);
  for (int o = 0; o < p.out; ++o) {
    for (int i = 0; i < p.in; ++i) wt[static_cast<size_t>(i) * p.out + o] = w[static_cast<size_t>(o) * p.in + i];
  }
  for (int r = 0; r < p.rows; ++r) {
    double* row = &y[static_cast<size_t>(r) * p.out];
    for (int o = 0; o < p.out; ++o) row[o] = bias[o] + beta * y0[static_cast<size_t>(r) * p.out + o];
    for (int i = 0; i < p.in; ++i) {
      const double v = x[static_cast<size_t>(r) * ldx + i];
      const double* wrow = &wt[static_cast<size_t>(i) * p.out];
      for (int o = 0; o < p.out; ++o) row[o] += v * wrow[o];
    }
  }
  return y;
}

std::vector<double> BackwardDataReference(const Product& p, const std::vector<float>& dy, const std::vector<float>& w) {
  const int lddy = p.out + p.pad;
  std::vector<double> dx(static_cast<size_t>(p.rows) * p.in);
  for (int r = 0; r < p.rows; ++r) {
    double* row = &dx[static_cast<size_t>(r) * p.in];
    for (int o = 0; o < p.out; ++o) {
      const double v = dy[static_cast<size_t>(r) * lddy + o];
      const float* wrow = &w[static_cast<size_t>(o) * p.in];
      for (int i = 0; i < p.in; ++i) row[i] += v * wrow[i];
    }
  }
  return dx;
}

class GemmTf32x3Test : public testing::ProductTest<Product> {
 protected:
  void SetUp() override {
    ProductTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    auto blas = Blas::Create(stream_, workspace_->get(), kBlasWorkspaceBytes, Precision::kFloat32);
    ASSERT_TRUE(blas.ok()) << blas.status();
    cublas_ = *std::move(blas);
  }
  void TearDown() override {
    cublas_.reset();
    ProductTest::TearDown();
  }

  // `out` starts as `init` before every run. cuBLAS float32 first, then each tile of the 3×TF32 kernels, each held to
  // float32 level against `expected`; then auto's rerun and a captured graph's replay, bit for bit.
  void Check(const char* form, const std::vector<double>& expected, const std::vector<float>& init,
             const std::function<absl::Status(float* out)>& cublas,
             const std::function<cudaError_t(GemmTile, float* out)>& launch) {
    const DeviceArray<float> initial(init);
    DeviceArray<float> out(init.size());
    const size_t bytes = init.size() * sizeof(float);
    auto reset = [&] {
      ASSERT_EQ(cudaMemcpyAsync(out.get(), initial.get(), bytes, cudaMemcpyDeviceToDevice, stream_), cudaSuccess);
    };
    reset();
    ASSERT_TRUE(cublas(out.get()).ok());
    const double cublas_error = RelativeError(out.Download(), expected);
    const double bar = std::max(kFloat32ProductError, 2 * cublas_error);
    std::string line;
    for (const GemmTile tile : {GemmTile::kAuto, GemmTile::k128x128, GemmTile::k128x64}) {
      reset();
      ASSERT_EQ(launch(tile, out.get()), cudaSuccess);
      const double error = RelativeError(out.Download(), expected);
      EXPECT_LE(error, bar) << form << " tile " << static_cast<int>(tile);
      char buffer[32];
      std::snprintf(buffer, sizeof(buffer), " %.2e", error);
      line += buffer;
    }
    std::printf("[gemm] %-18s %-15s 3xTF32 (auto 128x128 128x64)%s | cuBLAS fp32 %.2e\n",
                GetParam().name.c_str(), form, line.c_str(), cublas_error);

    reset();
    ASSERT_EQ(launch(GemmTile::kAuto, out.get()), cudaSuccess);
    const std::vector<float> first = out.Download();
    reset();
    ASSERT_EQ(launch(GemmTile::kAuto, out.get()), cudaSuccess);
    EXPECT_TRUE(BitIdentical(out.Download(), first)) << form << " rerun";

    ASSERT_EQ(cudaMemsetAsync(out.get(), 0, bytes, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    reset();
    const cudaError_t captured = launch(GemmTile::kAuto, out.get());
    ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
    ASSERT_EQ(captured, cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int replay = 0; replay < 2; ++replay) ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    EXPECT_TRUE(BitIdentical(out.Download(), first)) << form << " graph replay";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }

  // y = x·wᵀ + bias + beta·y0 (beta 1 adds onto y, e.g. the residual stream: the kernels' tensor reduce-add; other
  // betas store from registers).
  void CheckForward(const char* form, float beta, unsigned seed) {
    const Product& p = GetParam();
    const int ldx = p.in + p.pad;
    const auto x = RandomFloats(static_cast<size_t>(p.rows) * ldx, seed);
    const auto w = RandomFloats(static_cast<size_t>(p.out) * p.in, seed + 1);
    const auto bias = RandomFloats(p.out, seed + 2);
    const auto y0 = RandomFloats(static_cast<size_t>(p.rows) * p.out, seed + 3);
    const auto expected = ForwardReference(p, x, w, bias, beta, y0);
    const DeviceArray<float> dx(x), dw(w), dbias(bias);
    Check(
        form, expected, y0,
        [&](float* y) {
          return cublas_->Forward(p.rows, p.in, p.out, dx.get(), ldx, dw.get(), p.in, dbias.get(), beta, y, p.out);
        },
        [&](GemmTile tile, float* y) {
          return kernels::LaunchGemmTf32x3Forward(p.rows, p.in, p.out, dx.get(), ldx, 0, dw.get(), p.in, 0,
                                                  dbias.get(), 0, beta, y, p.out, 0, 1, stream_, tile);
        });
  }

  std::unique_ptr<Blas> cublas_;
};

TEST_P(GemmTf32x3Test, ForwardWithBiasAndBeta) { CheckForward("forward", 0.5f, 1); }

TEST_P(GemmTf32x3Test, ForwardWithBiasAddsOntoTheOutputWithBetaOne) { CheckForward("forward_beta1", 1.f, 21); }

TEST_P(GemmTf32x3Test, BackwardDataOverwritesWithBetaZero) {
  const Product& p = GetParam();
  const int lddy = p.out + p.pad;
  const auto dy = RandomFloats(static_cast<size_t>(p.rows) * lddy, 5);
  const auto w = RandomFloats(static_cast<size_t>(p.out) * p.in, 6);
  const auto expected = BackwardDataReference(p, dy, w);
  const DeviceArray<float> ddy(dy), dw(w);
  // NaN where the output starts: beta = 0 must not read it.
  const std::vector<float> init(static_cast<size_t>(p.rows) * p.in, std::numeric_limits<float>::quiet_NaN());
  Check(
      "backward_data", expected, init,
      [&](float* dx) { return cublas_->BackwardData(p.rows, p.in, p.out, ddy.get(), lddy, dw.get(), p.in, 0.f, dx, p.in); },
      [&](GemmTile tile, float* dx) {
        return kernels::LaunchGemmTf32x3BackwardData(p.rows, p.in, p.out, ddy.get(), lddy, dw.get(), p.in, 0.f, dx,
                                                     p.in, stream_, tile);
      });
}

TEST_P(GemmTf32x3Test, BackwardWeightSplitOverRows) {
  const Product& p = GetParam();
  const int lddy = p.out + p.pad, ldx = p.in + p.pad;
  const auto dy = RandomFloats(static_cast<size_t>(p.rows) * lddy, 7);
  const auto x = RandomFloats(static_cast<size_t>(p.rows) * ldx, 8);
  const auto expected = WeightGradientReference(p.rows, p.in, p.out, dy, lddy, x, ldx);
  const DeviceArray<float> ddy(dy), dx(x);
  const std::vector<float> init(static_cast<size_t>(p.out) * p.in, std::numeric_limits<float>::quiet_NaN());
  Check(
      "backward_weight", expected, init,
      [&](float* dw) { return cublas_->BackwardWeight(p.rows, p.in, p.out, ddy.get(), lddy, dx.get(), ldx, dw, p.in); },
      [&](GemmTile tile, float* dw) {
        return kernels::LaunchGemmTf32x3BackwardWeight(p.rows, p.in, p.out, ddy.get(), lddy, dx.get(), ldx, dw, p.in,
                                                       workspace_->get(), kBlasWorkspaceBytes, stream_, tile);
      });
}

// A weight split once into its planes (LaunchTf32x3SplitWeights) gives the bits of the kernels that split it in every
// block: forward with bias and beta (0.5 from registers, 1 by tensor reduce-add), a batch of two weights one stride
// apart, and backward data from the transposed planes, at every tile.
TEST_P(GemmTf32x3Test, WeightPlanesGiveTheSameBits) {
  const Product& p = GetParam();
  const int ldx = p.in + p.pad, lddy = p.out + p.pad;
  const size_t sw = static_cast<size_t>(p.out) * p.in, sy = static_cast<size_t>(p.rows) * p.out;
  const auto x = RandomFloats(static_cast<size_t>(p.rows) * ldx, 31);
  const auto w = RandomFloats(2 * sw, 32);  // two weights, one after the other
  const auto bias = RandomFloats(2 * p.out, 33);
  const auto y0 = RandomFloats(2 * sy, 34);
  const auto dy = RandomFloats(static_cast<size_t>(p.rows) * lddy, 35);
  const DeviceArray<float> dx(x), dw(w), dbias(bias), ddy(dy), initial(y0);
  // Each plane kind holds both weights' planes one stride apart, as CudaModel lays them out.
  DeviceArray<float> planes(8 * sw);
  float* const kinds[4] = {planes.get(), planes.get() + 2 * sw, planes.get() + 4 * sw, planes.get() + 6 * sw};
  std::vector<kernels::Tf32x3SplitJob> jobs;
  for (size_t i = 0; i < 2; ++i) {
    jobs.push_back({dw.get() + i * sw, p.out, p.in, kinds[0] + i * sw, kinds[1] + i * sw, kinds[2] + i * sw,
                    kinds[3] + i * sw});
  }
  const DeviceArray<kernels::Tf32x3SplitJob> device_jobs(jobs);
  ASSERT_EQ(kernels::LaunchTf32x3SplitWeights(device_jobs.get(), 2, p.out, p.in, stream_), cudaSuccess);
  const kernels::Tf32x3Planes parts{kinds[0], kinds[1], kinds[2], kinds[3], p.out, p.in};

  DeviceArray<float> y(2 * sy);
  auto forward = [&](GemmTile tile, float beta, int count, const kernels::Tf32x3Planes* planes) {
    EXPECT_EQ(cudaMemcpyAsync(y.get(), initial.get(), 2 * sy * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
              cudaSuccess);
    EXPECT_EQ(kernels::LaunchGemmTf32x3Forward(p.rows, p.in, p.out, dx.get(), ldx, 0, dw.get(), p.in, sw, dbias.get(),
                                               p.out, beta, y.get(), p.out, sy, count, stream_, tile, planes),
              cudaSuccess);
    return y.Download();
  };
  DeviceArray<float> dxo(static_cast<size_t>(p.rows) * p.in);
  auto backward_data = [&](GemmTile tile, const kernels::Tf32x3Planes* planes) {
    EXPECT_EQ(kernels::LaunchGemmTf32x3BackwardData(p.rows, p.in, p.out, ddy.get(), lddy, dw.get(), p.in, 0.f,
                                                    dxo.get(), p.in, stream_, tile, planes),
              cudaSuccess);
    return dxo.Download();
  };
  for (const GemmTile tile : {GemmTile::kAuto, GemmTile::k128x128, GemmTile::k128x64}) {
    SCOPED_TRACE(static_cast<int>(tile));
    for (const float beta : {0.5f, 1.f}) {
      for (const int count : {1, 2}) {
        EXPECT_TRUE(BitIdentical(forward(tile, beta, count, &parts), forward(tile, beta, count, nullptr)))
            << "forward, beta " << beta << ", count " << count;
      }
    }
    EXPECT_TRUE(BitIdentical(backward_data(tile, &parts), backward_data(tile, nullptr))) << "backward data";
  }
  // Planes of a weight of another shape than the one passed are refused, not read at the wrong stride.
  kernels::Tf32x3Planes other_shape = parts;
  other_shape.cols = p.in + 4;
  EXPECT_EQ(kernels::LaunchGemmTf32x3Forward(p.rows, p.in, p.out, dx.get(), ldx, 0, dw.get(), p.in, sw, dbias.get(),
                                             p.out, 0.f, y.get(), p.out, sy, 1, stream_, GemmTile::kAuto, &other_shape),
            cudaErrorInvalidValue);
  other_shape = parts;
  other_shape.rows = p.out - 1;
  EXPECT_EQ(kernels::LaunchGemmTf32x3BackwardData(p.rows, p.in, p.out, ddy.get(), lddy, dw.get(), p.in, 0.f, dxo.get(),
                                                  p.in, stream_, GemmTile::kAuto, &other_shape),
            cudaErrorInvalidValue);
}

// The `tf32` precision's one product of operands rounded to TF32 (plain_tf32): forward and backward data at every
// tile within 2e-3 of double (TF32's unit roundoff 2⁻¹¹ ≈ 4.9e-4 on each operand), and missing the float32 bar, so
// that a flag that did nothing would fail; a weight's planes (their big parts) give the bits of the kernel's own
// rounding.
TEST_P(GemmTf32x3Test, PlainTf32StaysWithinTheTf32Tolerance) {
  const Product& p = GetParam();
  const int ldx = p.in + p.pad, lddy = p.out + p.pad;
  const size_t sw = static_cast<size_t>(p.out) * p.in;
  const auto x = RandomFloats(static_cast<size_t>(p.rows) * ldx, 41), w = RandomFloats(sw, 42);
  const auto bias = RandomFloats(p.out, 43), y0 = RandomFloats(static_cast<size_t>(p.rows) * p.out, 44);
  const auto dy = RandomFloats(static_cast<size_t>(p.rows) * lddy, 45);
  const DeviceArray<float> dx(x), dw(w), dbias(bias), ddy(dy), initial(y0);
  DeviceArray<float> planes(4 * sw);
  const std::vector<kernels::Tf32x3SplitJob> jobs = {
      {dw.get(), p.out, p.in, planes.get(), planes.get() + sw, planes.get() + 2 * sw, planes.get() + 3 * sw}};
  const DeviceArray<kernels::Tf32x3SplitJob> device_jobs(jobs);
  ASSERT_EQ(kernels::LaunchTf32x3SplitWeights(device_jobs.get(), 1, p.out, p.in, stream_), cudaSuccess);
  const kernels::Tf32x3Planes parts{planes.get(), planes.get() + sw, planes.get() + 2 * sw, planes.get() + 3 * sw,
                                    p.out, p.in};
  DeviceArray<float> y(static_cast<size_t>(p.rows) * p.out), dxo(static_cast<size_t>(p.rows) * p.in);
  auto forward = [&](GemmTile tile, const kernels::Tf32x3Planes* with) {
    EXPECT_EQ(cudaMemcpyAsync(y.get(), initial.get(), y0.size() * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
              cudaSuccess);
    EXPECT_EQ(kernels::LaunchGemmTf32x3Forward(p.rows, p.in, p.out, dx.get(), ldx, 0, dw.get(), p.in, 0, dbias.get(),
                                               0, 0.5f, y.get(), p.out, 0, 1, stream_, tile, with, false, true),
              cudaSuccess);
    return y.Download();
  };
  auto backward_data = [&](GemmTile tile, const kernels::Tf32x3Planes* with) {
    EXPECT_EQ(kernels::LaunchGemmTf32x3BackwardData(p.rows, p.in, p.out, ddy.get(), lddy, dw.get(), p.in, 0.f,
                                                    dxo.get(), p.in, stream_, tile, with, true),
              cudaSuccess);
    return dxo.Download();
  };
  const auto expected_forward = ForwardReference(p, x, w, bias, 0.5, y0);
  const auto expected_data = BackwardDataReference(p, dy, w);
  double worst = 0;
  for (const GemmTile tile : {GemmTile::kAuto, GemmTile::k128x128, GemmTile::k128x64}) {
    SCOPED_TRACE(static_cast<int>(tile));
    const auto f = forward(tile, nullptr), d = backward_data(tile, nullptr);
    for (const double error : {RelativeError(f, expected_forward), RelativeError(d, expected_data)}) {
      EXPECT_LE(error, 2e-3);
      worst = std::max(worst, error);
    }
    EXPECT_TRUE(BitIdentical(forward(tile, &parts), f)) << "forward from planes";
    EXPECT_TRUE(BitIdentical(backward_data(tile, &parts), d)) << "backward data from planes";
  }
  EXPECT_GT(worst, kFloat32ProductError) << "the plain TF32 products look float32-accurate: not taken?";
  std::printf("[gemm] %-18s plain TF32: worst normalized error %.2e\n", p.name.c_str(), worst);
}

// Two weights [half, in] apart in memory (a gap between them, as a bias sits between the GRN's gate and value), each
// split with the transposed planes' leading dimension 2·half into one [in, 2·half] matrix, its columns [0, half) and
// [half, 2·half): the stack's planes (CudaModel's stacked GRN products). They hold the transposed split of the
// contiguous stack [w_1; w_2], bit for bit; a backward-data product on them, dx = [dy_1 | dy_2] · [w_1; w_2], matches
// the CPU at float32 level and the kernel that splits the contiguous stack itself bit for bit; each weight's own
// planes at that leading dimension give its own product's bits; a leading dimension below the rows is refused.
TEST(GemmTf32x3Stacked, TransposedPlanesAtALeadingDimension) {
  SKIP_WITHOUT_CUDA_DEVICE();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  // (rows, half = each weight's out, in): small's gate + value and skip + fc2, and an awkward one.
  for (const auto& [rows, half, in] : {std::tuple{16384, 64, 64}, {16384, 64, 192}, {1001, 36, 60}}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows, 2x" << half << " -> " << in);
    const int out = 2 * half, gap = 4;
    const size_t sw = static_cast<size_t>(half) * in;
    const auto w = RandomFloats(2 * sw + gap, 61);  // w_1, a gap, w_2
    std::vector<float> stack(w.begin(), w.begin() + sw);
    stack.insert(stack.end(), w.begin() + sw + gap, w.end());
    const auto dy = RandomFloats(static_cast<size_t>(rows) * out, 62);
    const DeviceArray<float> dw(w), dstack(stack), ddy(dy);
    // Plane kinds for the weights as they are (big, small: 2·sw + gap each), then the stack's transposed planes.
    DeviceArray<float> planes(2 * (2 * sw + gap) + 2 * 2 * sw), reference(4 * 2 * sw);
    float* const big = planes.get();
    float* const small = big + 2 * sw + gap;
    float* const big_t = small + 2 * sw + gap;
    float* const small_t = big_t + 2 * sw;
    std::vector<kernels::Tf32x3SplitJob> jobs;
    for (int i = 0; i < 2; ++i) {
      const size_t at = i * (sw + gap);
      jobs.push_back({dw.get() + at, half, in, big + at, small + at, big_t + i * half, small_t + i * half, out});
    }
    float* const r = reference.get();  // the contiguous stack split as one weight
    jobs.push_back({dstack.get(), out, in, r, r + 2 * sw, r + 4 * sw, r + 6 * sw});
    const DeviceArray<kernels::Tf32x3SplitJob> device_jobs(jobs);
    ASSERT_EQ(kernels::LaunchTf32x3SplitWeights(device_jobs.get(), 3, out, in, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto got = planes.Download(), ref = reference.Download();
    const size_t t0 = 2 * (2 * sw + gap);
    EXPECT_TRUE(BitIdentical(std::vector<float>(got.begin() + t0, got.end()),
                             std::vector<float>(ref.begin() + 4 * sw, ref.end())))
        << "the stack's transposed planes";

    const kernels::Tf32x3Planes stacked{nullptr, nullptr, big_t, small_t, out, in};
    DeviceArray<float> dx(static_cast<size_t>(rows) * in), dx_ref(static_cast<size_t>(rows) * in);
    ASSERT_EQ(kernels::LaunchGemmTf32x3BackwardData(rows, in, out, ddy.get(), out, dw.get(), in, 0.f, dx.get(), in,
                                                    stream, GemmTile::kAuto, &stacked),
              cudaSuccess);
    ASSERT_EQ(kernels::LaunchGemmTf32x3BackwardData(rows, in, out, ddy.get(), out, dstack.get(), in, 0.f, dx_ref.get(),
                                                    in, stream),
              cudaSuccess);
    const auto dx_h = dx.Download();
    const double error = RelativeError(dx_h, BackwardDataReference(Product{"stack", rows, in, out, 0}, dy, stack));
    EXPECT_LE(error, kFloat32ProductError);
    EXPECT_TRUE(BitIdentical(dx_h, dx_ref.Download())) << "stacked planes against the kernel's own split";
    std::printf("[gemm] stacked %dx(2x%d)->%d backward_data from ld_t planes %.2e\n", rows, half, in, error);

    // The second weight alone, from its own planes at ld_t = out (dy_2 is dy's right half).
    const kernels::Tf32x3Planes second{big + sw + gap, small + sw + gap, big_t + half, small_t + half, half, in, out};
    ASSERT_EQ(kernels::LaunchGemmTf32x3BackwardData(rows, in, half, ddy.get() + half, out, dw.get() + sw + gap, in, 0.f,
                                                    dx.get(), in, stream, GemmTile::kAuto, &second),
              cudaSuccess);
    ASSERT_EQ(kernels::LaunchGemmTf32x3BackwardData(rows, in, half, ddy.get() + half, out, dw.get() + sw + gap, in, 0.f,
                                                    dx_ref.get(), in, stream),
              cudaSuccess);
    EXPECT_TRUE(BitIdentical(dx.Download(), dx_ref.Download())) << "one weight's planes at ld_t";
    kernels::Tf32x3Planes narrow = stacked;
    narrow.ld_t = out - 4;
    EXPECT_EQ(kernels::LaunchGemmTf32x3BackwardData(rows, in, out, ddy.get(), out, dw.get(), in, 0.f, dx.get(), in,
                                                    stream, GemmTile::kAuto, &narrow),
              cudaErrorInvalidValue);
  }
  cudaStreamDestroy(stream);
}

// small: B·T = 16,384 rows (in_proj, out_proj, embed, GRN, the CfC backbone reading [s | c] at ld D + C); large's
// widest products over fewer rows (the double reference stays quick); tiny's 8-wide ones; and sizes that are neither
// tile multiples nor even.
INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmTf32x3Test,
    ::testing::Values(Product{"small_in_proj", 16384, 128, 580, 0}, Product{"small_out_proj", 16384, 256, 128, 0},
                      Product{"small_embed", 16384, 40, 128, 0}, Product{"small_grn", 16384, 64, 64, 0},
                      Product{"small_cfc_backbone", 16384, 128, 128, 64}, Product{"large_in_proj", 520, 512, 2192, 0},
                      Product{"large_out_proj", 520, 1024, 512, 0}, Product{"tiny_out_proj", 18, 16, 8, 0},
                      Product{"tiny_8x8", 18, 8, 8, 0}, Product{"awkward", 1001, 36, 60, 4},
                      Product{"awkward_wide", 77, 300, 132, 8}, Product{"one_row", 1, 4, 4, 0}),
    [](const ::testing::TestParamInfo<Product>& info) { return info.param.name; });

// Blas in the 3×TF32 precision on shapes the kernels take and shapes they leave to cuBLAS (head_out's 5 outputs,
// tiny's in_proj of 42, odd widths): every product form at float32 accuracy.
TEST(BlasTf32x3, EveryShapeAtFloat32Accuracy) {
  SKIP_WITHOUT_CUDA_DEVICE();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  {
    DeviceArray<float> workspace(kBlasWorkspaceBytes / sizeof(float));
    auto blas = Blas::Create(stream, workspace.get(), kBlasWorkspaceBytes, Precision::kFloat32Tf32x3);
    ASSERT_TRUE(blas.ok()) << blas.status();
    for (const Product& p : {Product{"head_out", 2000, 64, 5, 0}, Product{"tiny_in_proj", 18, 8, 42, 0},
                             Product{"odd", 333, 37, 21, 0}, Product{"small_in_proj", 4096, 128, 580, 0}}) {
      SCOPED_TRACE(p.name);
      const auto x = RandomFloats(static_cast<size_t>(p.rows) * p.in, 11);
      const auto w = RandomFloats(static_cast<size_t>(p.out) * p.in, 12);
      const auto bias = RandomFloats(p.out, 13);
      const auto dy = RandomFloats(static_cast<size_t>(p.rows) * p.out, 14);
      const DeviceArray<float> dx_in(x), dw_in(w), dbias(bias), ddy(dy);
      DeviceArray<float> y(static_cast<size_t>(p.rows) * p.out), dx(static_cast<size_t>(p.rows) * p.in),
          dw(static_cast<size_t>(p.out) * p.in);
      const std::vector<float> zeros(static_cast<size_t>(p.rows) * p.out);
      ASSERT_TRUE((*blas)->Forward(p.rows, p.in, p.out, dx_in.get(), p.in, dw_in.get(), p.in, dbias.get(), 0.f, y.get(),
                                   p.out)
                      .ok());
      ASSERT_TRUE((*blas)->BackwardData(p.rows, p.in, p.out, ddy.get(), p.out, dw_in.get(), p.in, 0.f, dx.get(), p.in)
                      .ok());
      ASSERT_TRUE(
          (*blas)->BackwardWeight(p.rows, p.in, p.out, ddy.get(), p.out, dx_in.get(), p.in, dw.get(), p.in).ok());
      const double forward = RelativeError(y.Download(), ForwardReference(p, x, w, bias, 0, zeros));
      const double data = RelativeError(dx.Download(), BackwardDataReference(p, dy, w));
      const double weight =
          RelativeError(dw.Download(), WeightGradientReference(p.rows, p.in, p.out, dy, p.out, x, p.in));
      EXPECT_LE(forward, kFloat32ProductError);
      EXPECT_LE(data, kFloat32ProductError);
      EXPECT_LE(weight, kFloat32ProductError);
      std::printf("[gemm] Blas 3xtf32 %-13s forward %.2e backward_data %.2e backward_weight %.2e\n", p.name.c_str(),
                  forward, data, weight);
    }
  }
  cudaStreamDestroy(stream);
}

// Blas's plan map over many product shapes (every Evaluate shape brings shapes of its own): one float32 product
// y[rows, 5] = x[rows, 8] · wᵀ + bias per row count, each row count a shape.
class BlasPlans : public ::testing::Test {
 protected:
  static constexpr int kIn = 8, kOut = 5;
  static constexpr int kMaxRows = static_cast<int>(Blas::kMaxPlans) + 200;

  void SetUp() override {
    SKIP_WITHOUT_CUDA_DEVICE();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    workspace_.emplace(kBlasWorkspaceBytes / sizeof(float));
    auto blas = Blas::Create(stream_, workspace_->get(), kBlasWorkspaceBytes, Precision::kFloat32);
    ASSERT_TRUE(blas.ok()) << blas.status();
    blas_ = *std::move(blas);
    x_.emplace(x_host_);
    w_.emplace(w_host_);
    bias_.emplace(bias_host_);
    y_.emplace(static_cast<size_t>(kMaxRows) * kOut);
  }
  void TearDown() override {
    blas_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::vector<float> Multiply(int rows) {
    EXPECT_TRUE(blas_->Forward(rows, kIn, kOut, x_->get(), kIn, w_->get(), kIn, bias_->get(), 0.f, y_->get(), kOut)
                    .ok());
    std::vector<float> out = y_->Download();
    out.resize(static_cast<size_t>(rows) * kOut);
    return out;
  }
  double ProductError(int rows, const std::vector<float>& out) const {
    const Product p{"rows", rows, kIn, kOut, 0};
    return RelativeError(out, ForwardReference(p, x_host_, w_host_, bias_host_, 0, std::vector<float>(out.size())));
  }

  const std::vector<float> x_host_ = RandomFloats(static_cast<size_t>(kMaxRows) * kIn, 21);
  const std::vector<float> w_host_ = RandomFloats(static_cast<size_t>(kOut) * kIn, 22);
  const std::vector<float> bias_host_ = RandomFloats(kOut, 23);
  cudaStream_t stream_ = nullptr;
  std::optional<DeviceArray<float>> workspace_, x_, w_, bias_, y_;
  std::unique_ptr<Blas> blas_;
};

// Blas keeps at most kMaxPlans plans, every product stays right past the bound, and a shape whose plan was evicted
// is planned again and gives the bits it gave before.
TEST_F(BlasPlans, StayWithinTheirBoundOverManyShapes) {
  std::vector<std::vector<float>> first(9);
  for (int rows = 1; rows <= kMaxRows; ++rows) {
    const std::vector<float> out = Multiply(rows);
    ASSERT_LE(blas_->plan_count(), Blas::kMaxPlans) << "after " << rows << " shapes";
    ASSERT_LE(ProductError(rows, out), kFloat32ProductError) << rows << " rows";
    if (rows < static_cast<int>(first.size())) first[rows] = out;
  }
  EXPECT_EQ(blas_->plan_count(), Blas::kMaxPlans);
  for (int rows = 1; rows < static_cast<int>(first.size()); ++rows) {  // planned again, long evicted
    EXPECT_TRUE(BitIdentical(Multiply(rows), first[rows])) << rows << " rows";
  }
  EXPECT_EQ(blas_->plan_count(), Blas::kMaxPlans);
}

// At the bound a new shape evicts the plan used longest ago, not the oldest made: a daemon's training step, planned
// first and used every step, keeps its plans however many Evaluate shapes come after it.
TEST_F(BlasPlans, EvictTheLeastRecentlyUsedFirst) {
  const int kept = static_cast<int>(Blas::kMaxPlans);
  for (int rows = 1; rows <= kept; ++rows) Multiply(rows);
  ASSERT_EQ(blas_->plan_count(), Blas::kMaxPlans);
  const uint64_t made = blas_->plans_made();
  Multiply(1);  // the first made, now the last used
  EXPECT_EQ(blas_->plans_made(), made) << "a kept plan was made again";
  Multiply(kept + 1);  // evicts 2 rows' plan
  EXPECT_EQ(blas_->plans_made(), made + 1);
  Multiply(1);
  Multiply(kept);
  EXPECT_EQ(blas_->plans_made(), made + 1) << "a recently used plan was evicted";
  Multiply(2);
  EXPECT_EQ(blas_->plans_made(), made + 2) << "the least recently used plan was kept";
  EXPECT_EQ(blas_->plan_count(), Blas::kMaxPlans);
}

}  // namespace
}  // namespace perception
