// Each kernel on its own against a plain CPU counterpart written here in double, over several shapes — batch 1,
// windows that are no multiple of any tile, odd widths, partial warps — in the style of ggml's test-backend-ops:
// one normalized error ‖gpu − cpu‖/‖cpu‖ per output (infinite on NaN), float32 kernels held to 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <tuple>
#include <vector>

#include "engine/cuda_model.h"
#include "engine/optimizer.h"
#include "kernels/cfc.h"
#include "kernels/column_sum.h"
#include "kernels/conv.h"
#include "kernels/grn_head.h"
#include "kernels/loss.h"
#include "kernels/norms.h"
#include "kernels/optimizer.h"
#include "kernels/pointwise.h"
#include "kernels/ssm.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/cuda/sigmoid_exhaustive.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using testing::DeviceArray;
using testing::RandomFloats;
using testing::RelativeError;
using Doubles = std::vector<double>;
using Floats = std::vector<float>;

constexpr double kTolerance = 1e-5;
constexpr double kNormEps = 1e-5;

// Norm widths start at 5: a norm's input gradient is orthogonal to the directions it normalizes away (the row itself
// for RMSNorm; the mean and the row for LayerNorm), so for a width of 1 (or 2) it is pure cancellation, ~eps/v² of
// its terms, and no float32 implementation holds a relative error there.

double Sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
double Softplus(double v) { return v > 20 ? v : std::log1p(std::exp(v)); }
double Silu(double v) { return v * Sigmoid(v); }
double SiluGrad(double v) { return Sigmoid(v) * (1 + v * (1 - Sigmoid(v))); }
double LecunTanh(double v) { return 1.7159 * std::tanh(0.666 * v); }
double LecunTanhGrad(double v) { return 1.7159 * 0.666 * (1 - std::pow(std::tanh(0.666 * v), 2)); }

// The sums over rows of a [rows, cols] array of per-block partials.
Doubles ColumnSums(const Floats& partials, int cols) {
  Doubles sums(cols, 0.0);
  for (size_t k = 0; k < partials.size(); ++k) sums[k % cols] += partials[k];
  return sums;
}

#define EXPECT_CLOSE(gpu, cpu) EXPECT_LE(RelativeError(gpu, cpu), kTolerance) << #gpu

// Every kernel's sigmoid (and so SiLU) divides without IEEE division's slow-path branch: its quotients must still be
// IEEE's, bit for bit, for every value e^−|v| can take.
TEST(KernelTest, SigmoidsBranchFreeDivisionHasIeeeBitsForEveryExponential) {
  SKIP_WITHOUT_CUDA_DEVICE();
  uint64_t mismatches = 1;
  ASSERT_EQ(testing::CountSigmoidMismatches(&mismatches), cudaSuccess);
  EXPECT_EQ(mismatches, 0u);
}

TEST(KernelTest, StandardizeAndElu) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const auto& [rows, cols] : {std::pair{1, 1}, {37, 6}, {300, 40}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
    const Floats x = RandomFloats(rows * cols, 1, -3, 3), mean = RandomFloats(cols, 2), inv = RandomFloats(cols, 3, .5, 2);
    const Floats d_out = RandomFloats(rows * cols, 4);
    DeviceArray<float> dx(x), dmean(mean), dinv(inv), xn(rows * cols), e(rows * cols), dd(d_out);
    ASSERT_EQ(kernels::LaunchStandardize(dx.get(), dmean.get(), dinv.get(), rows, cols, xn.get(), nullptr), cudaSuccess);
    ASSERT_EQ(kernels::LaunchEluForward(dx.get(), rows * cols, e.get(), nullptr), cudaSuccess);
    ASSERT_EQ(kernels::LaunchEluBackwardRows(dx.get(), cols, dd.get(), cols, rows, cols, dd.get(), cols, nullptr),
              cudaSuccess);
    Doubles xn_cpu(x.size()), e_cpu(x.size()), d_cpu(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      xn_cpu[i] = (double(x[i]) - mean[i % cols]) * inv[i % cols];
      e_cpu[i] = x[i] > 0 ? x[i] : std::expm1(double(x[i]));
      d_cpu[i] = d_out[i] * (x[i] > 0 ? 1.0 : std::exp(double(x[i])));
    }
    EXPECT_CLOSE(xn.Download(), xn_cpu);
    EXPECT_CLOSE(e.Download(), e_cpu);
    EXPECT_CLOSE(dd.Download(), d_cpu);
  }
}

// The ELU backward over a column range of wider matrices (LaunchEluBackwardRows), in place and not, vectorized (whole
// float4 rows) and not: against the CPU, and the columns outside the range as they were.
TEST(KernelTest, EluBackwardRows) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // (rows, cols, ld of pre, ld of d, column offset of the range in d)
  for (const auto& [rows, cols, ldpre, ldd, offset] :
       {std::tuple{1, 1, 1, 3, 2}, {37, 6, 6, 11, 3}, {300, 64, 64, 128, 64}, {129, 64, 68, 128, 0}, {50, 8, 12, 20, 4}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " ld " << ldpre << "/" << ldd << " +" << offset);
    const Floats pre = RandomFloats(rows * ldpre, 50, -3, 3), d = RandomFloats(rows * ldd, 51);
    Doubles expected(rows * cols);
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < cols; ++i) {
        const double x = pre[r * ldpre + i];
        expected[r * cols + i] = d[r * ldd + offset + i] * (x > 0 ? 1.0 : std::exp(x));
      }
    }
    for (const bool in_place : {true, false}) {
      SCOPED_TRACE(in_place ? "in place" : "out of place");
      DeviceArray<float> dpre(pre), dd(d), dout(d);
      float* const to = (in_place ? dd.get() : dout.get()) + offset;
      ASSERT_EQ(kernels::LaunchEluBackwardRows(dpre.get(), ldpre, dd.get() + offset, ldd, rows, cols, to, ldd, nullptr),
                cudaSuccess);
      const Floats got = (in_place ? dd : dout).Download();
      Floats range(rows * cols);
      bool untouched = true;
      for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < ldd; ++c) {
          if (c >= offset && c < offset + cols) {
            range[r * cols + c - offset] = got[r * ldd + c];
          } else {
            untouched &= got[r * ldd + c] == d[r * ldd + c];
          }
        }
      }
      EXPECT_CLOSE(range, expected);
      EXPECT_TRUE(untouched) << "columns outside the range changed";
    }
  }
}

// RmsNorm forward, and its input gradient g for the given rstd; v is [rows, ld].
double RmsNormRow(const float* v, const float* w, int n, double* y) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += double(v[i]) * v[i];
  const double rstd = 1 / std::sqrt(ss / n + kNormEps);
  for (int i = 0; i < n; ++i) y[i] = v[i] * rstd * w[i];
  return rstd;
}
void RmsNormBackwardRow(const float* v, const float* w, double rstd, const float* dy, int n, double* g) {
  double dot = 0;
  for (int i = 0; i < n; ++i) dot += double(dy[i]) * w[i] * v[i];
  for (int i = 0; i < n; ++i) g[i] = rstd * dy[i] * w[i] - v[i] * rstd * rstd * rstd * dot / n;
}

TEST(KernelTest, RmsNormForwardAndBackward) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // Row strides past cols: odd ones take the scalar path, multiples of 4 (with cols) the float4 path.
  struct Case {
    int rows, cols, ldv_pad, ldy_pad;
  };
  for (const auto& [rows, cols, ldv_pad, ldy_pad] :
       {Case{1, 5, 3, 5}, {13, 8, 3, 5}, {77, 129, 3, 5}, {300, 512, 3, 5}, {70, 128, 4, 8}, {45, 64, 0, 4}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " +" << ldv_pad << " +" << ldy_pad);
    const int ldv = cols + ldv_pad, ldy = cols + ldy_pad;
    const Floats v = RandomFloats(rows * ldv, 10, -2, 2), w = RandomFloats(cols, 11, .5, 1.5);
    const Floats dy = RandomFloats(rows * ldy, 12), dv0 = RandomFloats(rows * ldv, 13);
    Doubles y_cpu(rows * ldy, 0), rstd_cpu(rows), residual_cpu(rows * cols), g(cols);
    Doubles dv_assign(rows * ldv), dv_accumulate(rows * ldv), dw_cpu(cols, 0.0);
    for (int r = 0; r < rows; ++r) {
      rstd_cpu[r] = RmsNormRow(&v[r * ldv], w.data(), cols, &y_cpu[r * ldy]);
      for (int i = 0; i < cols; ++i) residual_cpu[r * cols + i] = v[r * ldv + i];
    }
    const Floats rstd_f(rstd_cpu.begin(), rstd_cpu.end());
    for (int r = 0; r < rows; ++r) {
      RmsNormBackwardRow(&v[r * ldv], w.data(), rstd_f[r], &dy[r * ldy], cols, g.data());
      for (int i = 0; i < cols; ++i) dw_cpu[i] += double(dy[r * ldy + i]) * v[r * ldv + i] * rstd_f[r];
      for (int i = 0; i < ldv; ++i) {
        dv_assign[r * ldv + i] = i < cols ? g[i] : 0.0;
        dv_accumulate[r * ldv + i] = dv0[r * ldv + i] + (i < cols ? g[i] : 0.0);
      }
    }
    DeviceArray<float> dvv(v), dw(w), y(rows * ldy), rstd(rows), residual(rows * cols), ddy(dy), rstd_in(rstd_f);
    Doubles dv_sums(cols, 0.0);
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < cols; ++i) dv_sums[i] += dv_accumulate[r * ldv + i];
    }
    DeviceArray<float> da(rows * ldv), dacc(dv0), dw_parts(kernels::NormPartialRows(rows) * cols);
    DeviceArray<float> dv_parts(kernels::NormPartialRows(rows) * cols);
    ASSERT_EQ(kernels::LaunchRmsNormForward(dvv.get(), ldv, dw.get(), rows, cols, y.get(), ldy, rstd.get(),
                                            residual.get(), nullptr), cudaSuccess);
    ASSERT_EQ(kernels::LaunchRmsNormBackward(dvv.get(), ldv, dw.get(), rstd_in.get(), ddy.get(), ldy, rows, cols,
                                             false, da.get(), ldv, dw_parts.get(), nullptr, nullptr), cudaSuccess);
    EXPECT_CLOSE(ColumnSums(dw_parts.Download(), cols), dw_cpu);
    ASSERT_EQ(kernels::LaunchRmsNormBackward(dvv.get(), ldv, dw.get(), rstd_in.get(), ddy.get(), ldy, rows, cols,
                                             true, dacc.get(), ldv, dw_parts.get(), dv_parts.get(), nullptr),
              cudaSuccess);
    EXPECT_CLOSE(ColumnSums(dv_parts.Download(), cols), dv_sums);
    EXPECT_CLOSE(y.Download(), y_cpu);
    EXPECT_CLOSE(rstd.Download(), rstd_cpu);
    EXPECT_CLOSE(residual.Download(), residual_cpu);
    EXPECT_CLOSE(da.Download(), dv_assign);
    EXPECT_CLOSE(dacc.Download(), dv_accumulate);
  }
}

TEST(KernelTest, GatedRmsNormForwardAndBackward) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // An odd ldz takes the scalar path, a multiple of 4 (with cols) the float4 path.
  for (const auto& [rows, cols, ldz_pad] :
       {std::tuple{1, 5, 7}, {9, 16, 7}, {70, 256, 7}, {33, 1024, 7}, {70, 256, 4}, {41, 128, 8}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " ldz +" << ldz_pad);
    const int ldz = 2 * cols + ldz_pad;
    const Floats y = RandomFloats(rows * cols, 20, -2, 2), z = RandomFloats(rows * ldz, 21, -3, 3);
    const Floats w = RandomFloats(cols, 22, .5, 1.5), dyn = RandomFloats(rows * cols, 23);
    Doubles q_cpu(rows * cols), yn_cpu(rows * cols), rstd_cpu(rows), dy_cpu(rows * cols), dz_cpu(rows * ldz, 0.0);
    Doubles dw_cpu(cols, 0.0);
    Floats q_f(rows * cols), g_row(cols);
    Doubles dq(cols);
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < cols; ++i) {
        q_cpu[r * cols + i] = y[r * cols + i] * Silu(z[r * ldz + i]);
        q_f[r * cols + i] = static_cast<float>(q_cpu[r * cols + i]);
      }
      double ss = 0;
      for (int i = 0; i < cols; ++i) ss += q_cpu[r * cols + i] * q_cpu[r * cols + i];
      rstd_cpu[r] = 1 / std::sqrt(ss / cols + kNormEps);
      for (int i = 0; i < cols; ++i) yn_cpu[r * cols + i] = q_cpu[r * cols + i] * rstd_cpu[r] * w[i];
    }
    const Floats rstd_f(rstd_cpu.begin(), rstd_cpu.end());
    for (int r = 0; r < rows; ++r) {
      RmsNormBackwardRow(&q_f[r * cols], w.data(), rstd_f[r], &dyn[r * cols], cols, dq.data());
      for (int i = 0; i < cols; ++i) {
        const double zi = z[r * ldz + i];
        dy_cpu[r * cols + i] = dq[i] * Silu(zi);
        dz_cpu[r * ldz + i] = dq[i] * y[r * cols + i] * SiluGrad(zi);
        dw_cpu[i] += double(dyn[r * cols + i]) * q_f[r * cols + i] * rstd_f[r];
      }
    }
    DeviceArray<float> dy_in(y), dz_in(z), dw(w), yn(rows * cols), rstd(rows);
    DeviceArray<float> ddyn(dyn), drstd(rstd_f), dy(rows * cols), dz(rows * ldz);
    DeviceArray<float> dw_parts(kernels::NormPartialRows(rows) * cols);
    ASSERT_EQ(kernels::LaunchGatedRmsNormForward(dy_in.get(), dz_in.get(), ldz, dw.get(), rows, cols, yn.get(),
                                                 rstd.get(), nullptr), cudaSuccess);
    ASSERT_EQ(kernels::LaunchGatedRmsNormBackward(ddyn.get(), drstd.get(), dw.get(), dy_in.get(), dz_in.get(), ldz, rows,
                                                  cols, dy.get(), dz.get(), ldz, dw_parts.get(), nullptr),
              cudaSuccess);
    EXPECT_CLOSE(yn.Download(), yn_cpu);
    EXPECT_CLOSE(rstd.Download(), rstd_cpu);
    EXPECT_CLOSE(dy.Download(), dy_cpu);
    EXPECT_CLOSE(dz.Download(), dz_cpu);
    EXPECT_CLOSE(ColumnSums(dw_parts.Download(), cols), dw_cpu);
  }
}

TEST(KernelTest, GrnGateLayerNormForwardAndBackward) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // (rows, cols, outputs of the folded output layer): more than 32 outputs take two runs of a warp's stores.
  for (const auto& [rows, cols, outs] : {std::tuple{1, 5, 5}, {9, 6, 1}, {70, 64, 5}, {40, 128, 37}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " → " << outs);
    const Floats skip = RandomFloats(rows * cols, 30, -2, 2), gate = RandomFloats(rows * cols, 31, -3, 3);
    const Floats value = RandomFloats(rows * cols, 32), w = RandomFloats(cols, 33, .5, 1.5), b = RandomFloats(cols, 34);
    const Floats w_out = RandomFloats(outs * cols, 36), b_out = RandomFloats(outs, 37);
    const Floats dlogits = RandomFloats(rows * outs, 35);
    Doubles x_cpu(rows * cols), nhat_cpu(rows * cols), g_cpu(rows * cols), rstd_cpu(rows), logits_cpu(rows * outs);
    for (int r = 0; r < rows; ++r) {
      double mean = 0, var = 0;
      for (int i = 0; i < cols; ++i) {
        const int k = r * cols + i;
        x_cpu[k] = skip[k] + Sigmoid(gate[k]) * value[k];
        mean += x_cpu[k] / cols;
      }
      for (int i = 0; i < cols; ++i) var += std::pow(x_cpu[r * cols + i] - mean, 2) / cols;
      rstd_cpu[r] = 1 / std::sqrt(var + kNormEps);
      for (int i = 0; i < cols; ++i) {
        const int k = r * cols + i;
        nhat_cpu[k] = (x_cpu[k] - mean) * rstd_cpu[r];
        g_cpu[k] = nhat_cpu[k] * w[i] + b[i];
      }
      for (int o = 0; o < outs; ++o) {
        logits_cpu[r * outs + o] = b_out[o];
        for (int i = 0; i < cols; ++i) logits_cpu[r * outs + o] += g_cpu[r * cols + i] * w_out[o * cols + i];
      }
    }
    Doubles dg(rows * cols, 0.0);  // the output layer's input gradient, which the backward forms from d logits
    for (int r = 0; r < rows; ++r) {
      for (int o = 0; o < outs; ++o) {
        for (int i = 0; i < cols; ++i) dg[r * cols + i] += double(dlogits[r * outs + o]) * w_out[o * cols + i];
      }
    }
    const Floats nhat_f(nhat_cpu.begin(), nhat_cpu.end()), rstd_f(rstd_cpu.begin(), rstd_cpu.end());
    Doubles dpre_cpu(rows * cols), dgate_cpu(rows * cols), dvalue_cpu(rows * cols), sums_cpu(4 * cols, 0.0);
    for (int r = 0; r < rows; ++r) {
      double mean_dn = 0, mean_dn_n = 0;
      for (int i = 0; i < cols; ++i) {
        mean_dn += dg[r * cols + i] * w[i] / cols;
        mean_dn_n += dg[r * cols + i] * w[i] * nhat_f[r * cols + i] / cols;
      }
      for (int i = 0; i < cols; ++i) {
        const int k = r * cols + i;
        const double dpre = rstd_f[r] * (dg[k] * w[i] - mean_dn - nhat_f[k] * mean_dn_n), sg = Sigmoid(gate[k]);
        dpre_cpu[k] = dpre;
        dvalue_cpu[k] = dpre * sg;
        dgate_cpu[k] = dpre * value[k] * sg * (1 - sg);
        sums_cpu[i] += dg[k] * nhat_f[k];
        sums_cpu[cols + i] += dg[k];
        sums_cpu[2 * cols + i] += dgate_cpu[k];
        sums_cpu[3 * cols + i] += dvalue_cpu[k];
      }
    }
    DeviceArray<float> pre_ln(skip), dgate_in(gate), dvalue_in(value), dw(w), db(b), nhat(rows * cols), g(rows * cols);
    DeviceArray<float> dw_out(w_out), db_out(b_out), logits(rows * outs), ddlogits(dlogits);
    DeviceArray<float> rstd(rows), dnhat(nhat_f), drstd(rstd_f), dpre(rows * cols), dgt(rows * cols),
        dval(rows * cols), parts(kernels::NormPartialRows(rows) * 4 * cols);
    const kernels::NormOutputLayer out{dw_out.get(), db_out.get(), outs};
    ASSERT_EQ(kernels::LaunchGrnGateLayerNormForward(pre_ln.get(), dgate_in.get(), dvalue_in.get(), dw.get(), db.get(),
                                                     out, kernels::LogitGradient{}, rows, cols, nhat.get(), g.get(),
                                                     rstd.get(), logits.get(), nullptr),
              cudaSuccess);
    ASSERT_EQ(kernels::LaunchGrnGateLayerNormBackward(ddlogits.get(), out, dnhat.get(), drstd.get(), dw.get(),
                                                      dgate_in.get(), dvalue_in.get(), rows, cols, dpre.get(),
                                                      dgt.get(), dval.get(), cols, parts.get(), nullptr),
              cudaSuccess);
    EXPECT_CLOSE(nhat.Download(), nhat_cpu);
    EXPECT_CLOSE(g.Download(), g_cpu);
    EXPECT_CLOSE(logits.Download(), logits_cpu);
    EXPECT_CLOSE(rstd.Download(), rstd_cpu);
    EXPECT_CLOSE(dpre.Download(), dpre_cpu);
    EXPECT_CLOSE(dgt.Download(), dgate_cpu);
    EXPECT_CLOSE(dval.Download(), dvalue_cpu);
    EXPECT_CLOSE(ColumnSums(parts.Download(), 4 * cols), sums_cpu);

    // The gradients at leading dimension 2·cols, as CudaModel lays them out for its stacked products: d gate_pre and
    // d value side by side in one matrix, d pre_ln in the left half of another whose right half stays as it was.
    // The same bits as the dense launch.
    const int ldd = 2 * cols;
    constexpr float kUntouched = 7.f;
    DeviceArray<float> pair(Floats(rows * ldd, kUntouched)), gate_value(Floats(rows * ldd, kUntouched)),
        parts2(kernels::NormPartialRows(rows) * 4 * cols);
    ASSERT_EQ(kernels::LaunchGrnGateLayerNormBackward(ddlogits.get(), out, dnhat.get(), drstd.get(), dw.get(),
                                                      dgate_in.get(), dvalue_in.get(), rows, cols, pair.get(),
                                                      gate_value.get(), gate_value.get() + cols, ldd, parts2.get(),
                                                      nullptr),
              cudaSuccess);
    const Floats pair_h = pair.Download(), gv_h = gate_value.Download();
    Floats dpre_s(rows * cols), dgt_s(rows * cols), dval_s(rows * cols);
    bool untouched = true;
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < cols; ++i) {
        dpre_s[r * cols + i] = pair_h[r * ldd + i];
        dgt_s[r * cols + i] = gv_h[r * ldd + i];
        dval_s[r * cols + i] = gv_h[r * ldd + cols + i];
        untouched &= pair_h[r * ldd + cols + i] == kUntouched;
      }
    }
    EXPECT_TRUE(untouched) << "the strided launch wrote past its columns";
    EXPECT_CLOSE(dpre_s, dpre_cpu);
    EXPECT_CLOSE(dgt_s, dgate_cpu);
    EXPECT_CLOSE(dval_s, dvalue_cpu);
    EXPECT_TRUE(testing::BitIdentical(dpre_s, dpre.Download()));
    EXPECT_TRUE(testing::BitIdentical(dgt_s, dgt.Download()));
    EXPECT_TRUE(testing::BitIdentical(dval_s, dval.Download()));
    EXPECT_TRUE(testing::BitIdentical(parts2.Download(), parts.Download()));
  }
}

// The GRN head's one launch against the head written out here in double, from fc2's and skip's outputs to d pre2 and
// d pre_ln: the forward's outputs held to the logits' 1e-5, the loss gradient and everything after it to the
// gradients' 1e-4 (MODEL.md §8). Widths below a warp's 64 columns, partial warps and blocks, whole blocks at the
// kernel's widths, one row, strided gradients, a forward without gradient, and fc2's bias added by the kernel to
// inputs side by side.
TEST(KernelTest, GrnHeadMatchesTheHeadInDouble) {
  SKIP_WITHOUT_CUDA_DEVICE();
  constexpr double kGradientTolerance = 1e-4;
  for (const auto& [rows, cols, outs] :
       {std::tuple{1, 5, 3}, {9, 6, 3}, {70, 64, 5}, {130, 33, 8}, {1000, 64, 5}, {37, 17, 1},
        // Whole blocks of rows at the kernels' widths: the instances that know both (kernels/grn_head.cu's kFull).
        {128, 64, 5}, {192, 32, 8}, {64, 16, 2}, {64, 8, 1}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " → " << outs);
    const uint64_t seed = 40 + rows + cols;
    const Floats pre2 = RandomFloats(rows * cols, seed, -2, 2), skip = RandomFloats(rows * cols, seed + 1, -2, 2);
    const double scale = 1 / std::sqrt(double(cols));
    const Floats w1 = RandomFloats(cols * cols, seed + 2, -scale, scale), b1 = RandomFloats(cols, seed + 3);
    const Floats wg = RandomFloats(cols * cols, seed + 4, -scale, scale), bg = RandomFloats(cols, seed + 5);
    const Floats wv = RandomFloats(cols * cols, seed + 6, -scale, scale), bv = RandomFloats(cols, seed + 7);
    const Floats nw = RandomFloats(cols, seed + 8, .5, 1.5), nb = RandomFloats(cols, seed + 9);
    const Floats wo = RandomFloats(outs * cols, seed + 10), bo = RandomFloats(outs, seed + 11);
    Floats labels = RandomFloats(rows * outs, seed + 12, 0, 1), mask = RandomFloats(rows * outs, seed + 13, 0, 1);
    double mask_count = 0;
    for (size_t i = 0; i < labels.size(); ++i) {
      labels[i] = labels[i] < .5f ? 0.f : 1.f;
      mask[i] = mask[i] < .3f ? 0.f : 1.f;
      mask_count += mask[i];
    }
    const double denom = std::max(mask_count, 1.0);

    // The head in double, row by row.
    const int n = rows * cols;
    Doubles e2(n), e1(n), gate(n), value(n), g(n), logits(rows * outs), dlogits(rows * outs);
    Doubles dpre(n), dgate(n), dvalue(n), de1(n, 0.0), dpre2(n, 0.0), sums(4 * cols, 0.0), d_out(outs * cols, 0.0);
    for (int r = 0; r < rows; ++r) {
      const int o0 = r * cols;
      for (int c = 0; c < cols; ++c) e2[o0 + c] = pre2[o0 + c] > 0 ? pre2[o0 + c] : std::expm1(double(pre2[o0 + c]));
      for (int c = 0; c < cols; ++c) {
        e1[o0 + c] = b1[c];
        for (int k = 0; k < cols; ++k) e1[o0 + c] += e2[o0 + k] * w1[c * cols + k];
      }
      Doubles x(cols), nhat(cols), dg(cols, 0.0);
      double mean = 0, var = 0;
      for (int c = 0; c < cols; ++c) {
        gate[o0 + c] = bg[c];
        value[o0 + c] = bv[c];
        for (int k = 0; k < cols; ++k) {
          gate[o0 + c] += e1[o0 + k] * wg[c * cols + k];
          value[o0 + c] += e1[o0 + k] * wv[c * cols + k];
        }
        x[c] = skip[o0 + c] + Sigmoid(gate[o0 + c]) * value[o0 + c];
        mean += x[c] / cols;
      }
      for (int c = 0; c < cols; ++c) var += (x[c] - mean) * (x[c] - mean) / cols;
      const double rstd = 1 / std::sqrt(var + kNormEps);
      for (int c = 0; c < cols; ++c) {
        nhat[c] = (x[c] - mean) * rstd;
        g[o0 + c] = nhat[c] * nw[c] + nb[c];
      }
      for (int o = 0; o < outs; ++o) {
        const int i = r * outs + o;
        logits[i] = bo[o];
        for (int c = 0; c < cols; ++c) logits[i] += g[o0 + c] * wo[o * cols + c];
        dlogits[i] = mask[i] * (Sigmoid(logits[i]) - labels[i]) / denom;
        for (int c = 0; c < cols; ++c) {
          dg[c] += dlogits[i] * wo[o * cols + c];
          d_out[o * cols + c] += dlogits[i] * g[o0 + c];
        }
      }
      double mean_dn = 0, mean_dn_n = 0;
      for (int c = 0; c < cols; ++c) {
        mean_dn += dg[c] * nw[c] / cols;
        mean_dn_n += dg[c] * nw[c] * nhat[c] / cols;
      }
      for (int c = 0; c < cols; ++c) {
        const int k = o0 + c;
        const double sg = Sigmoid(gate[k]);
        dpre[k] = rstd * (dg[c] * nw[c] - mean_dn - nhat[c] * mean_dn_n);
        dvalue[k] = dpre[k] * sg;
        dgate[k] = dpre[k] * value[k] * sg * (1 - sg);
        sums[c] += dg[c] * nhat[c];
        sums[cols + c] += dg[c];
        sums[2 * cols + c] += dgate[k];
        sums[3 * cols + c] += dvalue[k];
      }
      for (int c = 0; c < cols; ++c) {
        for (int k = 0; k < cols; ++k) de1[o0 + k] += dgate[o0 + c] * wg[c * cols + k] + dvalue[o0 + c] * wv[c * cols + k];
      }
      for (int c = 0; c < cols; ++c) {
        for (int k = 0; k < cols; ++k) dpre2[o0 + k] += de1[o0 + c] * w1[c * cols + k];
      }
      for (int k = 0; k < cols; ++k) dpre2[o0 + k] *= pre2[o0 + k] > 0 ? 1.0 : std::exp(double(pre2[o0 + k]));
    }

    // The kernel, its gradients at leading dimension 2·cols (as CudaModel's stacks lay them out), with its products in
    // 3×TF32 (held to float32's bars) and in plain TF32 (held to the `tf32` precision's 5e-3, and required to miss
    // float32's, so that a flag that changed nothing would fail).
    DeviceArray<float> d_pre2_in(pre2), d_skip(skip), d_w1(w1), d_b1(b1), d_wg(wg), d_bg(bg), d_wv(wv), d_bv(bv);
    DeviceArray<float> d_nw(nw), d_nb(nb), d_wo(wo), d_bo(bo), d_labels(labels), d_mask(mask);
    DeviceArray<double> d_count(std::vector<double>{mask_count});
    const kernels::GrnHeadWeights weights{d_w1.get(), d_b1.get(), d_wg.get(), d_bg.get(), d_wv.get(), d_bv.get(),
                                          d_nw.get(), d_nb.get(), {d_wo.get(), d_bo.get(), outs}};
    for (const bool tf32 : {false, true}) {
      SCOPED_TRACE(tf32 ? "plain TF32" : "3xTF32");
      const double forward_bar = tf32 ? 5e-3 : kTolerance, gradient_bar = tf32 ? 5e-3 : kGradientTolerance;
      const int ldd = 2 * cols;
      constexpr float kUntouched = 7.f;
      DeviceArray<float> d_e2(n), d_e1(n), d_g(n), d_logits(rows * outs), d_dlogits(rows * outs), d_de1(n);
      DeviceArray<float> d_pre_ln_pre2(Floats(rows * ldd, kUntouched)), d_gate_value(Floats(rows * ldd, kUntouched));
      DeviceArray<float> d_parts(kernels::NormPartialRows(rows) * 4 * cols);
      DeviceArray<float> d_out_parts(kernels::GrnHeadOutputPartialRows(rows) * outs * cols);
      const kernels::GrnHeadForward forward{d_pre2_in.get(), d_skip.get(), d_e2.get(), d_e1.get(), d_g.get(),
                                            d_logits.get()};
      const kernels::GrnHeadBackward backward{d_pre_ln_pre2.get(), d_gate_value.get(), d_gate_value.get() + cols,
                                              d_pre_ln_pre2.get() + cols, ldd, d_de1.get(), d_parts.get(),
                                              d_out_parts.get()};
      const kernels::LogitGradient grad{d_labels.get(), d_mask.get(), d_count.get(), d_dlogits.get()};
      ASSERT_EQ(kernels::LaunchGrnHead(rows, cols, weights, forward, grad, backward, tf32, nullptr), cudaSuccess);
      EXPECT_CLOSE(d_e2.Download(), e2);  // no product: float32 in both
      const double e1_error = RelativeError(d_e1.Download(), e1);
      EXPECT_LE(e1_error, forward_bar);
      if (tf32) {
        EXPECT_GT(e1_error, kTolerance);
      }
      EXPECT_LE(RelativeError(d_g.Download(), g), forward_bar);
      EXPECT_LE(RelativeError(d_logits.Download(), logits), forward_bar);
      EXPECT_LE(RelativeError(d_dlogits.Download(), dlogits), gradient_bar);
      EXPECT_LE(RelativeError(d_de1.Download(), de1), gradient_bar);
      EXPECT_LE(RelativeError(ColumnSums(d_parts.Download(), 4 * cols), sums), gradient_bar);
      EXPECT_LE(RelativeError(ColumnSums(d_out_parts.Download(), outs * cols), d_out), gradient_bar);
      const Floats pair = d_pre_ln_pre2.Download(), gate_value = d_gate_value.Download();
      Floats dpre_k(n), dpre2_k(n), dgate_k(n), dvalue_k(n);
      for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < cols; ++c) {
          dpre_k[r * cols + c] = pair[r * ldd + c];
          dpre2_k[r * cols + c] = pair[r * ldd + cols + c];
          dgate_k[r * cols + c] = gate_value[r * ldd + c];
          dvalue_k[r * cols + c] = gate_value[r * ldd + cols + c];
        }
      }
      EXPECT_LE(RelativeError(dpre_k, dpre), gradient_bar);
      EXPECT_LE(RelativeError(dpre2_k, dpre2), gradient_bar);
      EXPECT_LE(RelativeError(dgate_k, dgate), gradient_bar);
      EXPECT_LE(RelativeError(dvalue_k, dvalue), gradient_bar);

      // Without a gradient: the forward's outputs, the same bits, and nothing of the backward's written.
      DeviceArray<float> f_e2(n), f_e1(n), f_g(n), f_logits(rows * outs);
      DeviceArray<float> untouched(Floats(rows * ldd, kUntouched));
      const kernels::GrnHeadBackward unused{untouched.get(), untouched.get(), untouched.get(), untouched.get(), ldd,
                                            untouched.get(), untouched.get(), untouched.get()};
      ASSERT_EQ(kernels::LaunchGrnHead(rows, cols, weights,
                                       {d_pre2_in.get(), d_skip.get(), f_e2.get(), f_e1.get(), f_g.get(), f_logits.get()},
                                       kernels::LogitGradient{}, unused, tf32, nullptr),
                cudaSuccess);
      EXPECT_TRUE(testing::BitIdentical(f_e2.Download(), d_e2.Download()));
      EXPECT_TRUE(testing::BitIdentical(f_e1.Download(), d_e1.Download()));
      EXPECT_TRUE(testing::BitIdentical(f_g.Download(), d_g.Download()));
      EXPECT_TRUE(testing::BitIdentical(f_logits.Download(), d_logits.Download()));
      EXPECT_TRUE(testing::BitIdentical(untouched.Download(), Floats(rows * ldd, kUntouched)));

      // skip's and fc2's outputs side by side at leading dimension 2·cols, fc2's without its bias, which the kernel
      // adds (CudaModel's stacked forward): every output the bits of a launch given pre2 with the bias added in
      // float32, as a product's epilogue adds it.
      const Floats b2 = RandomFloats(cols, seed + 14);
      Floats biased(n), side_by_side(rows * ldd);
      for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < cols; ++c) {
          biased[r * cols + c] = pre2[r * cols + c] + b2[c];
          side_by_side[r * ldd + c] = skip[r * cols + c];
          side_by_side[r * ldd + cols + c] = pre2[r * cols + c];
        }
      }
      DeviceArray<float> d_biased(biased), d_side(side_by_side), d_b2(b2);
      const auto run = [&](const kernels::GrnHeadWeights& w, const float* in_pre2, const float* in_skip, int ld_in) {
        DeviceArray<float> e2_k(n), e1_k(n), g_k(n), logits_k(rows * outs), dlogits_k(rows * outs), de1_k(n);
        DeviceArray<float> pair_k(Floats(rows * ldd, kUntouched)), gate_value_k(Floats(rows * ldd, kUntouched));
        DeviceArray<float> parts_k(kernels::NormPartialRows(rows) * 4 * cols);
        DeviceArray<float> out_parts_k(kernels::GrnHeadOutputPartialRows(rows) * outs * cols);
        const kernels::GrnHeadForward f{in_pre2, in_skip, e2_k.get(), e1_k.get(), g_k.get(), logits_k.get(), ld_in};
        const kernels::GrnHeadBackward b{pair_k.get(), gate_value_k.get(), gate_value_k.get() + cols,
                                         pair_k.get() + cols, ldd, de1_k.get(), parts_k.get(), out_parts_k.get()};
        const kernels::LogitGradient lg{d_labels.get(), d_mask.get(), d_count.get(), dlogits_k.get()};
        EXPECT_EQ(kernels::LaunchGrnHead(rows, cols, w, f, lg, b, tf32, nullptr), cudaSuccess);
        return std::vector<Floats>{e2_k.Download(),     e1_k.Download(),   g_k.Download(),
                                   logits_k.Download(), dlogits_k.Download(), de1_k.Download(),
                                   pair_k.Download(),   gate_value_k.Download(), parts_k.Download(),
                                   out_parts_k.Download()};
      };
      kernels::GrnHeadWeights with_fc2_bias = weights;
      with_fc2_bias.fc2_b = d_b2.get();
      const std::vector<Floats> dense = run(weights, d_biased.get(), d_skip.get(), 0);
      const std::vector<Floats> stacked = run(with_fc2_bias, d_side.get() + cols, d_side.get(), ldd);
      for (size_t i = 0; i < dense.size(); ++i) EXPECT_TRUE(testing::BitIdentical(stacked[i], dense[i])) << i;
    }
  }
  // Shapes past the kernel's registers are refused.
  const kernels::GrnHeadWeights too_many{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                         {nullptr, nullptr, kernels::kMaxGrnHeadOutputs + 1}};
  EXPECT_EQ(kernels::LaunchGrnHead(4, 8, too_many, {}, {}, {}, false, nullptr), cudaErrorInvalidValue);
  const kernels::GrnHeadWeights wide{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                     {nullptr, nullptr, 5}};
  EXPECT_EQ(kernels::LaunchGrnHead(4, kernels::kMaxGrnHeadWidth + 1, wide, {}, {}, {}, false, nullptr),
            cudaErrorInvalidValue);
  kernels::GrnHeadForward narrow_rows;
  narrow_rows.ld_in = 7;  // inputs' rows narrower than the width
  EXPECT_EQ(kernels::LaunchGrnHead(4, 8, wide, narrow_rows, {}, {}, false, nullptr), cudaErrorInvalidValue);
}

struct ConvCase {
  int batch, window, channels, width, inner, heads;
  bool with_state;
};

TEST(KernelTest, CausalConvForwardAndBackward) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const ConvCase k : {ConvCase{1, 1, 5, 4, 3, 1, true}, ConvCase{2, 9, 22, 4, 16, 4, false},
                           ConvCase{3, 70, 37, 4, 30, 3, true}, ConvCase{1, 2, 7, 8, 1, 2, true},
                           ConvCase{2, 33, 9, 1, 9, 1, false}, ConvCase{1, 40, 11, 3, 5, 2, true},
                           ConvCase{3, 150, 72, 4, 48, 4, true}, ConvCase{2, 64, 96, 4, 64, 4, false},
                           ConvCase{2, 20, 40, 8, 16, 2, true}, ConvCase{2, 24, 40, 4, 16, 6, true},
                           // Training's windows (64 steps, no state) at widths 4 and 2.
                           ConvCase{3, 64, 72, 4, 40, 4, false}, ConvCase{2, 64, 40, 2, 32, 4, false}}) {
    SCOPED_TRACE(::testing::Message() << "B" << k.batch << " T" << k.window << " ch" << k.channels << " W" << k.width);
    // Channels in whole float4s get rows on 16-byte boundaries (the backward's vector loads), the others odd rows.
    const int B = k.batch, T = k.window, CH = k.channels, W = k.width, rows = B * T, carried = W - 1;
    const int ldx = CH % 4 == 0 ? CH + 4 : CH + 3;
    const Floats x = RandomFloats(rows * ldx, 40, -2, 2), weight = RandomFloats(CH * W, 41), bias = RandomFloats(CH, 42);
    const Floats state = RandomFloats(std::max(1, B * carried * CH), 43);
    const int bc = CH - k.inner;
    const Floats dxs = RandomFloats(rows * k.inner, 44), dbc = RandomFloats(std::max(1, rows * k.heads * bc), 45);
    auto hist = [&](int b, int r, int c) -> double {
      if (r < carried) return k.with_state ? state[(b * carried + r) * CH + c] : 0.0;
      return x[(b * T + r - carried) * ldx + c];
    };
    Doubles pre(rows * CH), out(rows * CH), state_out(std::max(1, B * carried * CH), 0.0);
    for (int b = 0; b < B; ++b) {
      for (int t = 0; t < T; ++t) {
        for (int c = 0; c < CH; ++c) {
          double acc = bias[c];
          for (int j = 0; j < W; ++j) acc += weight[c * W + j] * hist(b, t + j, c);
          pre[(b * T + t) * CH + c] = acc;
          out[(b * T + t) * CH + c] = Silu(acc);
        }
      }
      for (int j = 0; j < carried; ++j) {
        for (int c = 0; c < CH; ++c) state_out[(b * carried + j) * CH + c] = hist(b, T + j, c);
      }
    }
    const Floats pre_f(pre.begin(), pre.end());
    Doubles dx(rows * ldx, 0.0), partials(B * (CH * W + CH), 0.0), dpre(rows * CH);
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < CH; ++c) {
        double g = 0;
        if (c < k.inner) {
          g = dxs[r * k.inner + c];
        } else {
          for (int h = 0; h < k.heads; ++h) g += dbc[(r * k.heads + h) * bc + c - k.inner];
        }
        dpre[r * CH + c] = g * SiluGrad(pre_f[r * CH + c]);
      }
    }
    for (int b = 0; b < B; ++b) {
      double* part = &partials[b * (CH * W + CH)];
      for (int t = 0; t < T; ++t) {
        for (int c = 0; c < CH; ++c) {
          const double g = dpre[(b * T + t) * CH + c];
          part[CH * W + c] += g;
          for (int j = 0; j < W; ++j) {
            part[c * W + j] += g * hist(b, t + j, c);
            const int input = t + j - carried;  // the raw input this tap read, if inside the window
            if (input >= 0) dx[(b * T + input) * ldx + c] += g * weight[c * W + j];
          }
        }
      }
    }
    DeviceArray<float> dx_in(x), dweight(weight), dbias(bias), dstate(state), dout(rows * CH);
    DeviceArray<float> dstate_out(std::max(1, B * carried * CH)), ddxs(dxs), ddbc(dbc);
    DeviceArray<float> ddx(rows * ldx), dpart(B * (CH * W + CH));
    const kernels::ConvInput in{B, T, CH, W, dx_in.get(), ldx, dweight.get(), dbias.get(),
                                k.with_state ? dstate.get() : nullptr};
    ASSERT_EQ(kernels::LaunchConvForward(in, dout.get(), carried ? dstate_out.get() : nullptr, nullptr), cudaSuccess);
    const kernels::ConvOutputGrad grad{ddxs.get(), k.inner, ddbc.get(), k.heads};
    ASSERT_EQ(kernels::LaunchConvBackward(in, grad, ddx.get(), ldx, dpart.get(), nullptr), cudaSuccess);
    EXPECT_CLOSE(dout.Download(), out);
    if (carried) {
      EXPECT_CLOSE(dstate_out.Download(), state_out);
    }
    DeviceArray<float> out_only(rows * CH);  // without the final state, as training runs it
    ASSERT_EQ(kernels::LaunchConvForward(in, out_only.get(), nullptr, nullptr), cudaSuccess);
    EXPECT_CLOSE(out_only.Download(), out);
    Floats dx_gpu = ddx.Download();
    for (int r = 0; r < rows; ++r) {
      for (int c = CH; c < ldx; ++c) dx_gpu[r * ldx + c] = 0.f;  // columns past the channels are not the kernel's
    }
    EXPECT_CLOSE(dx_gpu, dx);
    EXPECT_CLOSE(dpart.Download(), partials);
  }
}

struct SsmCase {
  int batch, window, heads, headdim, d_state;
  bool with_state;
  int ld_pad = 2;  // xbc's row stride is E + 2N + ld_pad: 0 (with E and N multiples of 4) takes the 16-byte copies
};

// The scan in double with every state kept: forward outputs, and the backward as engine/cpu_reference.cc writes it.
struct SsmReference {
  Doubles y, state_out, dxs, dbc, d_dt_raw, partials;
};

SsmReference RunSsmReference(const SsmCase& k, const Floats& xbc, int ld_xbc, const Floats& dt_raw, int ld_dt,
                             const Floats& dt_bias, const Floats& a_log, const Floats& d_skip, const Floats& state_in,
                             const Floats& dy) {
  const int B = k.batch, T = k.window, H = k.heads, P = k.headdim, N = k.d_state, E = H * P, rows = B * T;
  SsmReference ref{Doubles(rows * E), Doubles(B * H * P * N), Doubles(rows * E), Doubles(rows * H * 2 * N),
                   Doubles(rows * ld_dt, 0.0), Doubles(rows * 2 * H)};
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const double A = -std::exp(double(a_log[h]));
      std::vector<Doubles> s(T + 1, Doubles(P * N, 0.0));
      if (k.with_state) {
        for (int i = 0; i < P * N; ++i) s[0][i] = state_in[(b * H + h) * P * N + i];
      }
      Doubles dt(T), pre(T), decay(T);
      for (int t = 0; t < T; ++t) {
        const int row = b * T + t;
        pre[t] = double(dt_raw[row * ld_dt + h]) + dt_bias[h];
        dt[t] = Softplus(pre[t]);
        decay[t] = std::exp(dt[t] * A);
        const float* xr = &xbc[row * ld_xbc];
        for (int p = 0; p < P; ++p) {
          double acc = 0;
          for (int n = 0; n < N; ++n) {
            double& sv = s[t + 1][p * N + n];
            sv = decay[t] * s[t][p * N + n] + xr[h * P + p] * dt[t] * xr[E + n];
            acc += xr[E + N + n] * sv;
          }
          ref.y[row * E + h * P + p] = acc + d_skip[h] * xr[h * P + p];
        }
      }
      for (int i = 0; i < P * N; ++i) ref.state_out[(b * H + h) * P * N + i] = s[T][i];
      Doubles ds(P * N, 0.0);
      for (int t = T - 1; t >= 0; --t) {
        const int row = b * T + t;
        const float* xr = &xbc[row * ld_xbc];
        double d_decay = 0, d_dt = 0, d_d = 0;
        double* dbc = &ref.dbc[(row * H + h) * 2 * N];
        for (int p = 0; p < P; ++p) {
          const double x = xr[h * P + p], g = dy[row * E + h * P + p];
          double dx_b = 0;
          d_d += g * x;
          for (int n = 0; n < N; ++n) {
            const double gs = ds[p * N + n] + g * xr[E + N + n];
            dbc[N + n] += g * s[t + 1][p * N + n];
            d_decay += gs * s[t][p * N + n];
            dbc[n] += gs * dt[t] * x;
            dx_b += gs * xr[E + n];
            ds[p * N + n] = gs * decay[t];
          }
          ref.dxs[row * E + h * P + p] = g * d_skip[h] + dx_b * dt[t];
          d_dt += dx_b * x;
        }
        d_dt += d_decay * decay[t] * A;
        ref.d_dt_raw[row * ld_dt + h] = d_dt * Sigmoid(pre[t]);
        ref.partials[row * 2 * H + h] = d_decay * decay[t] * dt[t] * A;
        ref.partials[row * 2 * H + H + h] = d_d;
      }
    }
  }
  return ref;
}

// Case k's scan on the device (forward with and without the final state, then the backward; the training windows'
// tensor-core products in plain TF32 where `tf32_products`), every output against the double reference: the largest
// normalized error, each checked against `tolerance`.
double ExpectSsmScanMatches(const SsmCase& k, bool tf32_products, double tolerance) {
  SCOPED_TRACE(::testing::Message() << "B" << k.batch << " T" << k.window << " H" << k.heads << " P" << k.headdim
                                    << " N" << k.d_state << " ld+" << k.ld_pad << (tf32_products ? " tf32" : ""));
  const int B = k.batch, T = k.window, H = k.heads, P = k.headdim, N = k.d_state, E = H * P, rows = B * T;
  const int ld_xbc = E + 2 * N + k.ld_pad, ld_dt = H + 1;
  const Floats xbc = RandomFloats(rows * ld_xbc, 50), dt_raw = RandomFloats(rows * ld_dt, 51, -3, 1);
  const Floats dt_bias = RandomFloats(H, 52, -4, -1), d_skip = RandomFloats(H, 54, .5, 1.5);
  Floats a_log(H);
  for (int h = 0; h < H; ++h) a_log[h] = std::log(1.f + 15.f * RandomFloats(1, 53 + h, 0, 1)[0]);
  const Floats state = RandomFloats(B * H * P * N, 55, -.5, .5), dy = RandomFloats(rows * E, 56);
  const SsmReference ref = RunSsmReference(k, xbc, ld_xbc, dt_raw, ld_dt, dt_bias, a_log, d_skip, state, dy);

  DeviceArray<float> dxbc(xbc), ddt_raw(dt_raw), dbias(dt_bias), dalog(a_log), dd(d_skip), dstate(state), ddy(dy);
  DeviceArray<float> y(rows * E), state_out(B * H * P * N), dxs(rows * E), dbc(rows * H * 2 * N);
  DeviceArray<float> d_dt_raw(std::vector<float>(rows * ld_dt, 0.f)), partials(rows * 2 * H);
  kernels::SsmInput in{B, T, H, P, N, dxbc.get(), ld_xbc, ddt_raw.get(), ld_dt, dbias.get(), dalog.get(),
                       dd.get(), k.with_state ? dstate.get() : nullptr};
  in.tf32_products = tf32_products;
  EXPECT_EQ(kernels::LaunchSsmScanForward(in, y.get(), state_out.get(), nullptr), cudaSuccess);
  DeviceArray<float> y_only(rows * E);  // without the final state, as training runs it
  EXPECT_EQ(kernels::LaunchSsmScanForward(in, y_only.get(), nullptr, nullptr), cudaSuccess);
  DeviceArray<float> scratch(std::max<size_t>(1, kernels::SsmBackwardScratchFloats(B, T, H, P, N)));
  const kernels::SsmGrad grad{dxs.get(), dbc.get(), d_dt_raw.get(), ld_dt, partials.get(), scratch.get()};
  EXPECT_EQ(kernels::LaunchSsmScanBackward(in, ddy.get(), grad, nullptr), cudaSuccess);
  double worst = 0;
  for (const auto& [name, gpu, cpu] :
       {std::tuple{"y", y.Download(), &ref.y}, std::tuple{"y_only", y_only.Download(), &ref.y},
        std::tuple{"state_out", state_out.Download(), &ref.state_out}, std::tuple{"dxs", dxs.Download(), &ref.dxs},
        std::tuple{"dbc", dbc.Download(), &ref.dbc}, std::tuple{"d_dt_raw", d_dt_raw.Download(), &ref.d_dt_raw},
        std::tuple{"partials", partials.Download(), &ref.partials}}) {
    const double error = RelativeError(gpu, *cpu);
    EXPECT_LE(error, tolerance) << name;
    worst = std::max(worst, error);
  }
  return worst;
}

TEST(KernelTest, SsmScanForwardAndBackward) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const SsmCase k : {SsmCase{1, 1, 1, 1, 1, false}, SsmCase{2, 9, 4, 4, 3, true}, SsmCase{1, 70, 3, 64, 32, true},
                          SsmCase{2, 37, 2, 33, 64, false}, SsmCase{1, 100, 2, 16, 16, true},
                          SsmCase{3, 5, 1, 70, 8, true}, SsmCase{2, 64, 2, 64, 32, false},
                          SsmCase{1, 64, 2, 64, 64, true}, SsmCase{1, 50, 1, 128, 16, true},
                          SsmCase{2, 200, 2, 64, 64, false}, SsmCase{1, 130, 1, 8, 5, true},
                          SsmCase{3, 64, 4, 64, 64, false}, SsmCase{2, 23, 3, 20, 12, false},
                          SsmCase{4, 64, 2, 8, 32, false},
                          // Aligned rows (as the model's): the tensor-core kernels' 16-byte copies, at d_state ≤ 32
                          // and ≤ 64, windows of the tile and short of it, one to eight heads.
                          SsmCase{3, 64, 4, 64, 32, false, 0}, SsmCase{2, 41, 3, 48, 16, false, 0},
                          SsmCase{2, 64, 2, 64, 64, false, 0}, SsmCase{2, 33, 8, 16, 8, false, 0},
                          SsmCase{3, 64, 1, 64, 32, false, 0}}) {
    ExpectSsmScanMatches(k, false, kTolerance);
  }
}

// The `tf32` precision's scan: training windows' tensor-core products in plain TF32 (operands rounded to 10 mantissa
// bits, unit roundoff 2⁻¹¹ ≈ 4.9e-4, over sums of up to 64 steps and 64 state columns). Held to 5e-3, the tf32
// model's bar on logits (tests/cuda/backend_parity_test.cc), and required to miss the float32 bar that the 3×TF32
// products hold, so that a flag that did nothing would fail.
TEST(KernelTest, SsmScanInPlainTf32StaysWithinTheTf32Tolerance) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const SsmCase k : {SsmCase{3, 64, 4, 64, 32, false, 0}, SsmCase{2, 41, 3, 48, 16, false, 0},
                          SsmCase{2, 64, 2, 64, 64, false, 0}, SsmCase{2, 33, 8, 16, 8, false, 0}}) {
    const double worst = ExpectSsmScanMatches(k, true, 5e-3);
    EXPECT_GT(worst, kTolerance) << "the plain TF32 products look float32-accurate: not taken?";
    std::printf("[scan] B%d T%d H%d P%d N%d plain TF32: worst normalized error %.2e\n", k.batch, k.window, k.heads,
                k.headdim, k.d_state, worst);
  }
}

struct CfcCase {
  int batch, window, d_model, units, backbone;
};

// The CfC kernels against a double-precision walk of the same recurrences; returns the worst normalized error over
// their outputs, each of which must be within `tolerance`.
double ExpectCfcMatches(const CfcCase& k, bool tf32_products, double tolerance) {
  SCOPED_TRACE(::testing::Message() << "B" << k.batch << " T" << k.window << " C" << k.units << " K" << k.backbone
                                    << (tf32_products ? " TF32" : ""));
  const int B = k.batch, T = k.window, D = k.d_model, C = k.units, K = k.backbone, rows = B * T, ldc = C + 3;
  // Weights at their initialization scale (MODEL.md §4): much larger ones make the recurrence chaotic, and then
  // float32 itself (numpy included) drifts from double by ~1e-3 within 20 steps, whatever the kernel.
  const double backbone_bound = 1 / std::sqrt(double(D + C)), head_bound = 1 / std::sqrt(double(K));
  const Floats backbone = RandomFloats(K * (D + C), 60, -backbone_bound, backbone_bound);
  const Floats u = RandomFloats(rows * K, 61, -1.5, 1.5);
  const Floats dt = RandomFloats(rows, 62, 0, 3), state = RandomFloats(B * C, 63, -.9, .9);
  const Floats dc_head = RandomFloats(rows * ldc, 64);
  std::vector<Floats> w, bias;
  for (int j = 0; j < kernels::kCfcHeads; ++j) {
    w.push_back(RandomFloats(C * K, 65 + j, -head_bound, head_bound));
    bias.push_back(RandomFloats(C, 70 + j, -.5, .5));
  }
  Doubles bb_pre(rows * K), bb(rows * K), gates(rows * 3 * C), c_out(rows * ldc, 0.0), c_prev(rows * C),
      state_out(B * C);
  for (int b = 0; b < B; ++b) {
    Doubles c(state.begin() + b * C, state.begin() + (b + 1) * C), heads(4 * C);
    for (int t = 0; t < T; ++t) {
      const int row = b * T + t;
      for (int kk = 0; kk < K; ++kk) {
        double acc = u[row * K + kk];
        for (int j = 0; j < C; ++j) acc += backbone[kk * (D + C) + D + j] * c[j];
        bb_pre[row * K + kk] = acc;
        bb[row * K + kk] = LecunTanh(acc);
      }
      for (int j = 0; j < 4 * C; ++j) {
        double acc = bias[j / C][j % C];
        for (int kk = 0; kk < K; ++kk) acc += w[j / C][(j % C) * K + kk] * bb[row * K + kk];
        heads[j] = acc;
      }
      for (int i = 0; i < C; ++i) {
        const double f1 = std::tanh(heads[i]), f2 = std::tanh(heads[C + i]);
        const double tau = Sigmoid(heads[2 * C + i] * dt[row] + heads[3 * C + i]);
        gates[row * 3 * C + i] = f1;
        gates[row * 3 * C + C + i] = f2;
        gates[row * 3 * C + 2 * C + i] = tau;
        c_prev[row * C + i] = c[i];
        c[i] = f1 * (1 - tau) + tau * f2;
        c_out[row * ldc + i] = c[i];
      }
    }
    for (int i = 0; i < C; ++i) state_out[b * C + i] = c[i];
  }
  const Floats gates_f(gates.begin(), gates.end()), bb_pre_f(bb_pre.begin(), bb_pre.end());
  Doubles dp(rows * 4 * C), dbb_pre(rows * K);
  for (int b = 0; b < B; ++b) {
    Doubles dc(C, 0.0);
    for (int t = T - 1; t >= 0; --t) {
      const int row = b * T + t;
      for (int i = 0; i < C; ++i) {
        const double grad = dc[i] + dc_head[row * ldc + i];
        const double f1 = gates_f[row * 3 * C + i], f2 = gates_f[row * 3 * C + C + i];
        const double tau = gates_f[row * 3 * C + 2 * C + i], d_tau = grad * (f2 - f1) * tau * (1 - tau);
        dp[row * 4 * C + i] = grad * (1 - tau) * (1 - f1 * f1);
        dp[row * 4 * C + C + i] = grad * tau * (1 - f2 * f2);
        dp[row * 4 * C + 2 * C + i] = d_tau * dt[row];
        dp[row * 4 * C + 3 * C + i] = d_tau;
      }
      for (int kk = 0; kk < K; ++kk) {
        double acc = 0;
        for (int j = 0; j < 4 * C; ++j) acc += w[j / C][(j % C) * K + kk] * dp[row * 4 * C + j];
        dbb_pre[row * K + kk] = acc * LecunTanhGrad(bb_pre_f[row * K + kk]);
      }
      for (int i = 0; i < C; ++i) {
        double acc = 0;
        for (int kk = 0; kk < K; ++kk) acc += backbone[kk * (D + C) + D + i] * dbb_pre[row * K + kk];
        dc[i] = acc;
      }
    }
  }
  DeviceArray<float> dbackbone(backbone), du(u), ddt(dt), dstate(state), ddc_head(dc_head);
  std::vector<std::unique_ptr<DeviceArray<float>>> dw, dbias;
  kernels::CfcWeights weights{dbackbone.get(), {}, {}};
  for (int j = 0; j < kernels::kCfcHeads; ++j) {
    dw.push_back(std::make_unique<DeviceArray<float>>(w[j]));
    dbias.push_back(std::make_unique<DeviceArray<float>>(bias[j]));
    weights.head_weight[j] = dw[j]->get();
    weights.head_bias[j] = dbias[j]->get();
  }
  const kernels::CfcShape shape{B, T, D, C, K, tf32_products};
  DeviceArray<float> packed(kernels::CfcPackedFloats(shape)), gbb_pre(rows * K), gbb(rows * K);
  DeviceArray<float> ggates(rows * 3 * C), gc(std::vector<float>(rows * ldc, 0.f)), gc_prev(rows * C),
      gstate(B * C), gdp(rows * 4 * C), gdbb(rows * K), ggates_in(gates_f), gbb_pre_in(bb_pre_f);
  EXPECT_EQ(kernels::LaunchCfcPackWeights(weights, shape, packed.get(), nullptr), cudaSuccess);
  const kernels::CfcActivations act{gbb_pre.get(), gbb.get(), ggates.get(), gc.get(), ldc, gc_prev.get()};
  EXPECT_EQ(kernels::LaunchCfcForward(shape, packed.get(), du.get(), ddt.get(), dstate.get(), act, gstate.get(),
                                      nullptr), cudaSuccess);
  DeviceArray<float> gbias_sums(B * (4 * C + K));
  EXPECT_EQ(kernels::LaunchCfcBackward(shape, packed.get(), ddt.get(), ggates_in.get(), gbb_pre_in.get(),
                                       ddc_head.get(), ldc, gdp.get(), gdbb.get(), nullptr, gbias_sums.get()),
            cudaSuccess);
  // Each sequence's sums over its steps of dp's and dbb_pre's columns (the biases' gradients before the batch sum).
  Doubles bias_sums(B * (4 * C + K), 0.0);
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < 4 * C; ++j) bias_sums[b * (4 * C + K) + j] += dp[(b * T + t) * 4 * C + j];
      for (int kk = 0; kk < K; ++kk) bias_sums[b * (4 * C + K) + 4 * C + kk] += dbb_pre[(b * T + t) * K + kk];
    }
  }
  double worst = 0;
  auto expect_close = [&](const Floats& gpu, const Doubles& cpu, const char* name) {
    const double error = RelativeError(gpu, cpu);
    EXPECT_LE(error, tolerance) << name;
    worst = std::max(worst, error);
  };
  expect_close(gbb_pre.Download(), bb_pre, "bb_pre");
  expect_close(gbb.Download(), bb, "bb");
  expect_close(ggates.Download(), gates, "gates");
  expect_close(gc.Download(), c_out, "c");
  expect_close(gc_prev.Download(), c_prev, "c_prev");
  expect_close(gstate.Download(), state_out, "state_out");
  expect_close(gdp.Download(), dp, "dp");
  expect_close(gdbb.Download(), dbb_pre, "dbb_pre");
  expect_close(gbias_sums.Download(), bias_sums, "bias_sums");
  return worst;
}

TEST(KernelTest, CfcForwardAndBackward) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // Shapes cover one sequence, tiny and padded ones in `small`'s register tile, several sequences per block (batch
  // above the multiprocessor or cluster count, the last block partly empty), `small`'s and `large`'s tiles exactly,
  // `large`'s cluster tile padded, the general kernels (a shape beyond `large`'s tile), and `small`'s skewed pair
  // kernels at its own C and K with the last block's second half empty, and over a single step.
  for (const CfcCase k : {CfcCase{1, 1, 3, 5, 7}, CfcCase{2, 9, 8, 5, 7}, CfcCase{3, 70, 16, 12, 20},
                          CfcCase{301, 5, 4, 6, 10}, CfcCase{5, 33, 8, 64, 128}, CfcCase{2, 20, 8, 128, 256},
                          CfcCase{40, 4, 8, 128, 256}, CfcCase{64, 6, 8, 100, 200}, CfcCase{150, 3, 4, 70, 20},
                          CfcCase{3, 5, 4, 130, 9}, CfcCase{263, 12, 8, 64, 128}, CfcCase{200, 1, 3, 5, 7}}) {
    ExpectCfcMatches(k, false, kTolerance);
  }
}

// The `tf32` precision's recurrences (C ≤ 64, K ≤ 128): mma's TF32 operands (unit roundoff 2⁻¹¹ ≈ 4.9e-4) in every
// step's products, whose errors the recurrence carries from step to step. Held to 5e-3, the tf32 model's bar on
// logits (tests/cuda/backend_parity_test.cc), and required to miss the float32 bar, so that a flag that did nothing
// would fail. Shapes: `small`'s exactly over its whole window, padded units, backbone rows and sequences, one step, a
// batch of one, and (on an H200's 132 multiprocessors) blocks of two, four and eight sequences with the last one
// partly empty.
TEST(KernelTest, CfcInPlainTf32StaysWithinTheTf32Tolerance) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const CfcCase k : {CfcCase{263, 12, 8, 64, 128}, CfcCase{16, 64, 16, 64, 128}, CfcCase{5, 33, 8, 60, 100},
                          CfcCase{11, 1, 3, 5, 7}, CfcCase{1, 9, 8, 5, 7}, CfcCase{301, 6, 8, 64, 128},
                          CfcCase{1100, 3, 8, 60, 128}}) {
    const double worst = ExpectCfcMatches(k, true, 5e-3);
    EXPECT_GT(worst, kTolerance) << "the plain TF32 products look float32-accurate: not taken?";
    std::printf("[cfc] B%d T%d C%d K%d plain TF32: worst normalized error %.2e\n", k.batch, k.window, k.units,
                k.backbone, worst);
  }
}

// The mask count over lengths around its block's width, from an aligned and an unaligned start: a mask of zeros and
// ones (small's is 16,384 × 5 values) counted exactly, fractional values within double rounding of the sum.
TEST(KernelTest, MaskCountSumsEveryValue) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const int n : {0, 1, 3, 1023, 1025, 81920, 81923}) {
    for (const int offset : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << n << " values from offset " << offset);
      const Floats draws = RandomFloats(n + offset, 91, 0, 1);
      Floats ones(n + offset);
      for (int i = 0; i < n + offset; ++i) ones[i] = draws[i] < .7f ? 1.f : 0.f;
      for (const bool fractional : {false, true}) {
        const Floats& mask = fractional ? draws : ones;
        const DeviceArray<float> dmask(mask);
        DeviceArray<double> count(1);
        ASSERT_EQ(kernels::LaunchMaskCount(dmask.get() + offset, n, count.get(), nullptr), cudaSuccess);
        double want = 0;
        for (int i = offset; i < n + offset; ++i) want += mask[i];
        const double got = count.Download()[0];
        if (fractional) {
          EXPECT_NEAR(got, want, 1e-12 * want);
        } else {
          EXPECT_EQ(got, want);
        }
      }
    }
  }
}

// The loss of the logits the GRN forward forms: the mask count first, d logits in the forward, then the report.
TEST(KernelTest, MaskedBceOfTheGrnLogitsAndItsGradient) {
  SKIP_WITHOUT_CUDA_DEVICE();
  constexpr int kCols = 64;
  // (rows, outputs): the step's 5 logits a row, and 11, which take two passes of the forward's logits.
  for (const auto& [rows, outs] : {std::pair{1, 5}, {9, 11}, {16384, 5}, {1000, 11}}) {
    for (const bool masked_out : {false, true}) {
      SCOPED_TRACE(::testing::Message() << rows << " rows, " << outs << " outputs"
                                        << (masked_out ? ", all masked" : ""));
      const int n = rows * outs;
      const Floats skip = RandomFloats(rows * kCols, 83, -2, 2), gate = RandomFloats(rows * kCols, 84, -3, 3);
      const Floats value = RandomFloats(rows * kCols, 85), w = RandomFloats(kCols, 86, .5, 1.5);
      const Floats b = RandomFloats(kCols, 87), w_out = RandomFloats(outs * kCols, 88, -3, 3);
      const Floats b_out = RandomFloats(outs, 89), coin = RandomFloats(n, 81, 0, 1), keep = RandomFloats(n, 82, 0, 1);
      Floats labels(n), mask(n);
      for (int i = 0; i < n; ++i) {
        labels[i] = coin[i] < .5f ? 1.f : 0.f;
        mask[i] = !masked_out && keep[i] < .8f ? 1.f : 0.f;
      }
      DeviceArray<float> pre_ln(skip), dgate(gate), dvalue(value), dw(w), db(b), dw_out(w_out), db_out(b_out);
      DeviceArray<float> nhat(rows * kCols), g(rows * kCols), rstd(rows), logits(n), dd(n);
      DeviceArray<float> dlabels(labels), dmask(mask);
      DeviceArray<double> count(1), partials(kernels::kMaskedBceBlocks);
      DeviceArray<kernels::StepReport> report(1);
      ASSERT_EQ(kernels::LaunchMaskCount(dmask.get(), n, count.get(), nullptr), cudaSuccess);
      const kernels::LogitGradient grad{dlabels.get(), dmask.get(), count.get(), dd.get()};
      ASSERT_EQ(kernels::LaunchGrnGateLayerNormForward(pre_ln.get(), dgate.get(), dvalue.get(), dw.get(), db.get(),
                                                       {dw_out.get(), db_out.get(), outs}, grad, rows, kCols,
                                                       nhat.get(), g.get(), rstd.get(), logits.get(), nullptr),
                cudaSuccess);
      ASSERT_EQ(kernels::LaunchMaskedBcePartials(logits.get(), dlabels.get(), dmask.get(), n, partials.get(), nullptr),
                cudaSuccess);
      ASSERT_EQ(kernels::LaunchMaskedBceReport(partials.get(), count.get(), report.get(), nullptr), cudaSuccess);
      // The loss of the kernel's own logits (the logits themselves: GrnGateLayerNormForwardAndBackward).
      const Floats l = logits.Download();
      double sum = 0, total = 0;
      for (int i = 0; i < n; ++i) {
        const double li = l[i];
        sum += mask[i] * (std::max(li, 0.0) - li * labels[i] + std::log1p(std::exp(-std::abs(li))));
        total += mask[i];
      }
      Doubles dlogits(n);
      for (int i = 0; i < n; ++i) dlogits[i] = mask[i] * (Sigmoid(l[i]) - labels[i]) / std::max(total, 1.0);
      const kernels::StepReport r = report.Download()[0];
      EXPECT_EQ(r.mask_count, total);
      EXPECT_NEAR(r.loss_sum, sum, 1e-9 * std::max(1.0, sum));
      EXPECT_NEAR(r.loss, sum / std::max(total, 1.0), 1e-9);
      if (masked_out) {
        EXPECT_EQ(RelativeError(dd.Download(), Floats(n, 0.f)), 0.0);
      } else {
        EXPECT_CLOSE(dd.Download(), dlogits);
      }
    }
  }
}

TEST(KernelTest, ColumnSumsOfManyJobsAtOnce) {
  SKIP_WITHOUT_CUDA_DEVICE();
  struct Shape {
    int rows, cols, lda;
    bool factor, scale;
  };
  const std::vector<Shape> shapes = {{1, 1, 1, false, false},   {300, 37, 42, true, true}, {513, 70, 70, false, true},
                                     {16384, 3, 8, true, false}, {7, 300, 301, false, false}};
  std::vector<std::unique_ptr<DeviceArray<float>>> arrays;
  std::vector<kernels::ColumnSumJob> jobs;
  std::vector<Doubles> expected;
  for (size_t s = 0; s < shapes.size(); ++s) {
    const Shape& k = shapes[s];
    const Floats a = RandomFloats(k.rows * k.lda, 90 + s), b = RandomFloats(k.rows * k.lda, 100 + s);
    const Floats scale = RandomFloats(k.rows, 110 + s);
    Doubles sum(k.cols, 0.0);
    for (int r = 0; r < k.rows; ++r) {
      for (int c = 0; c < k.cols; ++c) {
        sum[c] += double(a[r * k.lda + c]) * (k.factor ? b[r * k.lda + c] : 1.f) * (k.scale ? scale[r] : 1.f);
      }
    }
    expected.push_back(sum);
    for (const Floats* host : {&a, &b, &scale}) arrays.push_back(std::make_unique<DeviceArray<float>>(*host));
    arrays.push_back(std::make_unique<DeviceArray<float>>(k.cols));
    const size_t base = arrays.size() - 4;
    jobs.push_back({arrays[base]->get(), k.lda, k.factor ? arrays[base + 1]->get() : nullptr, k.lda,
                    k.scale ? arrays[base + 2]->get() : nullptr, k.rows, k.cols, arrays[base + 3]->get()});
  }
  const kernels::ColumnSumPlan plan = kernels::PlanColumnSums(jobs);
  DeviceArray<kernels::ColumnSumJob> djobs(jobs);
  DeviceArray<kernels::ColumnSumTile> tiles(plan.tiles);
  DeviceArray<kernels::ColumnSumFinish> finishes(plan.finishes);
  DeviceArray<float> partials(plan.partial_floats);
  const kernels::ColumnSumBatch batch{djobs.get(), tiles.get(), static_cast<int>(plan.tiles.size()), finishes.get(),
                                      static_cast<int>(plan.finishes.size()), partials.get()};
  ASSERT_EQ(kernels::LaunchColumnSums(batch, nullptr), cudaSuccess);
  for (size_t s = 0; s < shapes.size(); ++s) {
    EXPECT_LE(RelativeError(arrays[4 * s + 3]->Download(), expected[s]), kTolerance) << "job " << s;
  }
}

// Against ClipAndAdamW<float>, whose float operations the kernel repeats (1 − β2 rounded to float alone is 1.3e-5
// away from its double value, so double is the wrong counterpart here; the model-level parity tests compare the
// whole training step with double).
TEST(KernelTest, ClipAndAdamWMatchTheCpuOptimizer) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ParamLayout layout(*NamedConfig("tiny"));
  OptimizerConfig cosine;
  cosine.schedule = LrSchedule::kWarmupCosine;
  cosine.warmup_steps = 2;
  cosine.total_steps = 4;
  cosine.min_lr = 1e-4;
  OptimizerConfig unclipped;
  unclipped.max_grad_norm = 0;
  // Pieces of 7, so tensors span several chunks; pieces of 1: more chunks (1,863) than a device holds blocks of the
  // cooperative launch at once, so blocks take several chunks each.
  for (const auto& [config, piece] : {std::pair{OptimizerConfig{}, size_t{7}}, {cosine, size_t{7}},
                                      {unclipped, size_t{7}}, {OptimizerConfig{}, size_t{1}}}) {
    Floats params = testing::RandomParams(layout, 130);
    Floats p_cpu = params, m_cpu(params.size(), 0.f), v_cpu(params.size(), 0.f);
    DeviceArray<float> p(params), m(params.size()), v(params.size()), g(params.size());
    std::vector<kernels::AdamWChunk> chunks;
    for (const TensorSpec& t : layout.tensors()) {
      for (size_t i = 0; t.trained && i < t.size; i += piece) {
        chunks.push_back({t.offset + i, static_cast<int>(std::min(piece, t.size - i)), t.weight_decay ? 1 : 0});
      }
    }
    DeviceArray<kernels::AdamWChunk> dchunks(chunks);
    DeviceArray<double> norm_partials(chunks.size());
    DeviceArray<int64_t> step(1);
    DeviceArray<kernels::StepReport> report(1);
    const kernels::AdamWConfig c = DeviceAdamW(config);
    for (int s = 1; s <= 5; ++s) {
      SCOPED_TRACE(::testing::Message() << "step " << s << " schedule " << static_cast<int>(config.schedule)
                                        << " pieces of " << piece);
      Floats grads(params.size(), 0.f);  // zero on buffers and padding, as the backend's gradient buffer is
      const Floats random = RandomFloats(params.size(), 140 + s, -2, 2);
      for (const TensorSpec& t : layout.tensors()) {
        for (size_t i = t.offset; t.trained && i < t.offset + t.size; ++i) grads[i] = random[i];
      }
      Floats g_cpu = grads;
      EXPECT_EQ(cudaMemcpy(g.get(), grads.data(), grads.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
      const int n = static_cast<int>(chunks.size());
      ASSERT_EQ(kernels::LaunchClipAdamW(dchunks.get(), n, norm_partials.get(), step.get(), c, p.get(), g.get(), m.get(),
                                         v.get(), report.get(), nullptr), cudaSuccess);
      const double norm = ClipAndAdamW<float>(layout, config, s, p_cpu, g_cpu, m_cpu, v_cpu);
      const kernels::StepReport r = report.Download()[0];
      EXPECT_EQ(r.step, s);
      EXPECT_NEAR(r.grad_norm, norm, 1e-12 * norm);
      EXPECT_CLOSE(p.Download(), p_cpu);
      EXPECT_CLOSE(m.Download(), m_cpu);
      EXPECT_CLOSE(v.Download(), v_cpu);
      EXPECT_CLOSE(g.Download(), g_cpu);
    }
  }
}

}  // namespace
}  // namespace perception
