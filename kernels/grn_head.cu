// The GRN head's one launch (kernels/grn_head.h): a warp carries 8 rows, lane l holding columns l and l + 32 of each;
// the G×G products read their weights from shared memory, each warp's rows from its own shared buffers. The
// formulas are those of the separate kernels (kernels/norms.cu, kernels/pointwise.cu), term by term; only the
// products' and the row sums' orders differ.
#include <cstddef>

#include "kernels/common.cuh"
#include "kernels/grn_head.h"
#include "kernels/loss.cuh"

namespace perception::kernels {
namespace {

constexpr int kWidth = kMaxGrnHeadWidth;
constexpr int kColumns = kWidth / kWarpSize;  // a lane's columns of a row
// A weight row's stride in shared memory: lanes reading rows l (or l + 32) as float4s fall on distinct banks.
constexpr int kWeightLd = kWidth + 4;
constexpr int kRows = kGrnHeadWarpRows;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kBlockRows = kWarps * kRows;
constexpr int kOutputs = kMaxGrnHeadOutputs;
// The warps whose rows make one row of the LayerNorm's partial sums.
constexpr int kPartialWarps = kNormPartialBlockRows / kRows;
static_assert(kNormPartialBlockRows % kRows == 0 && kWarps % kPartialWarps == 0);
static_assert(kRows * kOutputs == 2 * kWarpSize, "a warp's logits fill its lanes in two passes");

enum Weight { kFc1, kGate, kValue, kWeights };
enum ColumnVector { kFc1Bias, kGateBias, kValueBias, kNormWeight, kNormBias, kColumnVectors };

struct Shared {
  float w[kWeights][kWidth * kWeightLd];  // [out][in], zero past G
  // Each warp's rows: e2, then d gate_pre, then d e1; e1, then d value.
  float rows[kWarps][2][kRows][kWidth];
  float columns[kColumnVectors][kWidth];  // the biases and the LayerNorm's weight and bias, zero past G
  float w_out[kOutputs][kWidth];          // zero past G and past the outputs
  float dlogits[kWarps][kRows][kOutputs];
  float sums[kWarps][4][kWidth];
};
using WarpRows = float[kRows][kWidth];
using Values = float[kRows][kColumns];

__device__ __forceinline__ int Lane() { return threadIdx.x % kWarpSize; }
__device__ __forceinline__ int Column(int j) { return Lane() + j * kWarpSize; }

// The products below: for each run of four k, every row's four inputs are loaded first (broadcasts from shared
// memory), then each of the four steps updates all of the warp's accumulators before the next step, so that
// consecutive multiply-adds are independent. The loops stay rolled: unrolled, the kernel outgrew the instruction
// cache (H200: "no instruction" stalls 3.8 cycles an issue, 86 µs against 62 for the whole launch).

// acc[r][j] += Σ_k in[r][k]·w[Column(j)][k], k in order.
template <int kK>
__device__ __forceinline__ void AddRowProducts(const WarpRows& in, const float* w, Values& acc) {
#pragma unroll 1
  for (int k = 0; k < kK; k += 4) {
    float4 wk[kColumns], a[kRows];
#pragma unroll
    for (int j = 0; j < kColumns; ++j) wk[j] = *reinterpret_cast<const float4*>(w + Column(j) * kWeightLd + k);
#pragma unroll
    for (int r = 0; r < kRows; ++r) a[r] = *reinterpret_cast<const float4*>(&in[r][k]);
    const auto step = [&](auto input, auto weight) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int j = 0; j < kColumns; ++j) acc[r][j] = fmaf(input(a[r]), weight(wk[j]), acc[r][j]);
      }
    };
    step([](float4 v) { return v.x; }, [](float4 v) { return v.x; });
    step([](float4 v) { return v.y; }, [](float4 v) { return v.y; });
    step([](float4 v) { return v.z; }, [](float4 v) { return v.z; });
    step([](float4 v) { return v.w; }, [](float4 v) { return v.w; });
  }
}

// acc[r][j] += Σ_c in[r][c]·w[c][Column(j)], c in order: the product with the weight's transpose.
template <int kK>
__device__ __forceinline__ void AddColumnProducts(const WarpRows& in, const float* w, Values& acc) {
#pragma unroll 1
  for (int c = 0; c < kK; c += 4) {
    float wc[4][kColumns];
    float4 a[kRows];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < kColumns; ++j) wc[i][j] = w[(c + i) * kWeightLd + Column(j)];
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) a[r] = *reinterpret_cast<const float4*>(&in[r][c]);
    const auto step = [&](int i, auto input) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int j = 0; j < kColumns; ++j) acc[r][j] = fmaf(input(a[r]), wc[i][j], acc[r][j]);
      }
    };
    step(0, [](float4 v) { return v.x; });
    step(1, [](float4 v) { return v.y; });
    step(2, [](float4 v) { return v.z; });
    step(3, [](float4 v) { return v.w; });
  }
}

// WarpSum's butterfly over each of the rows' values at once.
template <int N>
__device__ __forceinline__ void RowSums(float (&v)[N]) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int r = 0; r < N; ++r) v[r] += __shfl_xor_sync(0xffffffffu, v[r], offset);
  }
}

// Sums of 32 values over the warp, lane l ending with the sum of everyone's v[l] (a reduce-scatter: at each step a
// lane keeps the half its bit selects and adds its partner's copy of that half; 31 shuffles instead of 160).
__device__ __forceinline__ float ScatterSums(float (&v)[kWarpSize]) {
#pragma unroll
  for (int level = 1; level < kWarpSize; level *= 2) {
    const int half = kWarpSize / 2 / level;
    const bool upper = Lane() & half;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float low = v[i], high = v[i + half];
      const float keep = upper ? high : low;
      const float send = upper ? low : high;
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, half);
    }
  }
  return v[0];
}

template <int kK>
__global__ void __launch_bounds__(kThreads, 2)
    GrnHeadKernel(int rows, int width, GrnHeadWeights wt, GrnHeadForward fw, LogitGradient grad, GrnHeadBackward bw) {
  extern __shared__ float4 shared_raw[];
  Shared& s = *reinterpret_cast<Shared*>(shared_raw);
  const int warp = threadIdx.x / kWarpSize, lane = Lane();
  const int outs = wt.out.outs;
  // Parameters first, before the wait: no kernel of the step's chain writes them.
  const float* const sources[kWeights] = {wt.fc1_w, wt.gate_w, wt.value_w};
  constexpr int kPerThread = kWidth * kWidth / kThreads;
#pragma unroll
  for (int m = 0; m < kWeights; ++m) {
    float staged[kPerThread];  // every load in flight before the stores
#pragma unroll
    for (int t = 0; t < kPerThread; ++t) {
      const int i = threadIdx.x + t * kThreads, o = i / kWidth, k = i % kWidth;
      staged[t] = o < width && k < width ? sources[m][o * width + k] : 0.f;
    }
#pragma unroll
    for (int t = 0; t < kPerThread; ++t) {
      const int i = threadIdx.x + t * kThreads;
      s.w[m][i / kWidth * kWeightLd + i % kWidth] = staged[t];
    }
  }
  const float* const vectors[kColumnVectors] = {wt.fc1_b, wt.gate_b, wt.value_b, wt.norm_w, wt.norm_b};
#pragma unroll
  for (int m = 0; m < kColumnVectors; ++m) {
    for (int c = threadIdx.x; c < kWidth; c += kThreads) s.columns[m][c] = c < width ? vectors[m][c] : 0.f;
  }
  for (int i = threadIdx.x; i < kOutputs * kWidth; i += kThreads) {
    const int o = i / kWidth, c = i % kWidth;
    s.w_out[o][c] = c < width && o < outs ? wt.out.w[o * width + c] : 0.f;
  }
  bool live[kColumns];
#pragma unroll
  for (int j = 0; j < kColumns; ++j) live[j] = Column(j) < width;
  // Lane l forms the logit of output l % 8 of row l / 8 (and of row 4 + l / 8).
  const int out = lane % kOutputs;
  const float b_out = out < outs ? wt.out.b[out] : 0.f;

  WaitForPriorKernels();  // the product ahead wrote pre2 and skip
  LetNextKernelLaunch();
  const int row0 = blockIdx.x * kBlockRows + warp * kRows;
  auto row_ok = [&](int r) { return row0 + r < rows; };
  auto at = [&](int r, int j) { return static_cast<size_t>(row0 + r) * width + Column(j); };
  float label[2] = {}, mask[2] = {};
  if (grad.dlogits && out < outs) {
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      const int r = pass * (kRows / 2) + lane / kOutputs;
      if (row_ok(r)) {
        label[pass] = grad.labels[static_cast<size_t>(row0 + r) * outs + out];
        mask[pass] = grad.mask[static_cast<size_t>(row0 + r) * outs + out];
      }
    }
  }
  const float denom = grad.dlogits ? static_cast<float>(fmax(*grad.mask_count, 1.0)) : 1.f;

  // e2 = elu(pre2); x starts as skip.
  Values x, v;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const bool in = row_ok(r) && live[j];
      x[r][j] = in ? fw.skip[at(r, j)] : 0.f;
      v[r][j] = in ? fw.pre2[at(r, j)] : 0.f;
    }
  }
  WarpRows& first = s.rows[warp][0];
  WarpRows& second = s.rows[warp][1];
  // Stores a warp's values to `out` ([rows, G] dense) and to its shared rows `to`.
  const auto keep = [&](const Values& values, float* out, WarpRows& to) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        if (row_ok(r) && live[j]) out[at(r, j)] = values[r][j];
        to[r][Column(j)] = values[r][j];
      }
    }
  };
  Values e2;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) e2[r][j] = Elu(v[r][j]);
  }
  keep(e2, fw.e2, first);
  __syncthreads();  // the weights (and this warp's e2)

  // e1 = fc1(e2).
  {
    Values e1;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < kColumns; ++j) e1[r][j] = s.columns[kFc1Bias][Column(j)];
    }
    AddRowProducts<kK>(first, s.w[kFc1], e1);
    keep(e1, fw.e1, second);
  }
  __syncwarp();

  // gate and value from e1; x = skip + σ(gate) ⊙ value; the LayerNorm.
  Values gv[2];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      gv[0][r][j] = s.columns[kGateBias][Column(j)];
      gv[1][r][j] = s.columns[kValueBias][Column(j)];
    }
  }
  AddRowProducts<kK>(second, s.w[kGate], gv[0]);
  AddRowProducts<kK>(second, s.w[kValue], gv[1]);
  Values& sg = gv[0];  // σ(gate) from here on
  const Values& value = gv[1];
  float mean[kRows], var[kRows], rstd[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    mean[r] = 0.f;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      sg[r][j] = Sigmoid(sg[r][j]);
      x[r][j] += sg[r][j] * value[r][j];
      mean[r] += x[r][j];
    }
  }
  RowSums(mean);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    mean[r] /= static_cast<float>(width);
    var[r] = 0.f;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const float d = x[r][j] - mean[r];
      var[r] += live[j] ? d * d : 0.f;
    }
  }
  RowSums(var);
  Values& nhat = x;  // (x − mean)·rstd, 0 past G
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    rstd[r] = 1.f / sqrtf(var[r] / static_cast<float>(width) + kNormEps);
#pragma unroll
    for (int j = 0; j < kColumns; ++j) nhat[r][j] = live[j] ? (x[r][j] - mean[r]) * rstd[r] : 0.f;
  }

  // g = nhat ⊙ w + b and the output layer, four rows a pass: each lane ends with one of their 32 logits; then its
  // loss gradient.
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    float g[kRows / 2][kColumns];
#pragma unroll
    for (int q = 0; q < kRows / 2; ++q) {
      const int r = pass * (kRows / 2) + q;
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        g[q][j] = nhat[r][j] * s.columns[kNormWeight][Column(j)] + s.columns[kNormBias][Column(j)];
        if (row_ok(r) && live[j]) fw.g[at(r, j)] = g[q][j];
      }
    }
    float dot[kWarpSize];
#pragma unroll
    for (int i = 0; i < kWarpSize; ++i) {
      const int q = i / kOutputs, o = i % kOutputs;
      dot[i] = 0.f;
#pragma unroll
      for (int j = 0; j < kColumns; ++j) dot[i] += g[q][j] * s.w_out[o][Column(j)];
    }
    const float sum = ScatterSums(dot);
    const int r = pass * (kRows / 2) + lane / kOutputs;
    float dl = 0.f;
    if (row_ok(r) && out < outs) {
      const size_t i = static_cast<size_t>(row0 + r) * outs + out;
      const float logit = sum + b_out;
      fw.logits[i] = logit;
      if (grad.dlogits) {
        dl = MaskedBceGradient(logit, label[pass], mask[pass], denom);
        grad.dlogits[i] = dl;
      }
    }
    s.dlogits[warp][r][out] = dl;
  }
  if (!grad.dlogits) return;
  __syncwarp();

  // The LayerNorm's backward from dg = d logits · w_out (formed twice: for the row sums, then for the gradients).
  const auto output_gradient = [&](int r, int j) {
    const float4 d0 = *reinterpret_cast<const float4*>(&s.dlogits[warp][r][0]);
    const float4 d1 = *reinterpret_cast<const float4*>(&s.dlogits[warp][r][4]);
    const float dl[kOutputs] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
    float dg = 0.f;
#pragma unroll
    for (int o = 0; o < kOutputs; ++o) dg += dl[o] * s.w_out[o][Column(j)];
    return dg;
  };
  float mean_dn[2 * kRows];  // Σ dn, then Σ dn·nhat
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    mean_dn[r] = 0.f;
    mean_dn[kRows + r] = 0.f;
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const float dn = output_gradient(r, j) * s.columns[kNormWeight][Column(j)];
      mean_dn[r] += dn;
      mean_dn[kRows + r] += dn * nhat[r][j];
    }
  }
  RowSums(mean_dn);
  float sums[4][kColumns] = {};  // Σ dg·nhat, Σ dg, Σ d gate_pre, Σ d value
  __syncwarp();                  // every lane is done with e2 and e1
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float m = mean_dn[r] / static_cast<float>(width), mn = mean_dn[kRows + r] / static_cast<float>(width);
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      const float dg = output_gradient(r, j);
      const float dpre = live[j] ? rstd[r] * (dg * s.columns[kNormWeight][Column(j)] - m - nhat[r][j] * mn) : 0.f;
      const float dv = dpre * sg[r][j];
      const float dgt = dpre * value[r][j] * sg[r][j] * (1.f - sg[r][j]);
      if (row_ok(r) && live[j]) {
        const size_t i = static_cast<size_t>(row0 + r) * bw.ldd + Column(j);
        bw.d_pre_ln[i] = dpre;
        bw.d_value[i] = dv;
        bw.d_gate_pre[i] = dgt;
        sums[0][j] += dg * nhat[r][j];
        sums[1][j] += dg;
        sums[2][j] += dgt;
        sums[3][j] += dv;
      }
      first[r][Column(j)] = dgt;
      second[r][Column(j)] = dv;
    }
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) s.sums[warp][q][Column(j)] = sums[q][j];
  }
  // The output layer's weight gradient over the warp's rows (d logits is 0 in rows past the end), from g formed again
  // as the forward formed it: one partial row a warp.
  if (bw.out_partials && row_ok(0)) {
    float* partial = bw.out_partials + static_cast<size_t>(row0 / kRows) * outs * width;
#pragma unroll
    for (int o = 0; o < kOutputs; ++o) {
      if (o >= outs) break;
      float sum[kColumns] = {};
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float dl = s.dlogits[warp][r][o];
#pragma unroll
        for (int j = 0; j < kColumns; ++j) {
          const float g = nhat[r][j] * s.columns[kNormWeight][Column(j)] + s.columns[kNormBias][Column(j)];
          sum[j] += dl * g;
        }
      }
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        if (live[j]) partial[o * width + Column(j)] = sum[j];
      }
    }
  }
  __syncwarp();

  // d e1 = d gate_pre · W_gate + d value · W_value.
  Values de1 = {};
  AddColumnProducts<kK>(first, s.w[kGate], de1);
  AddColumnProducts<kK>(second, s.w[kValue], de1);
  __syncwarp();  // every lane is done with d gate_pre
  keep(de1, bw.de1, first);
  __syncwarp();

  // d pre2 = elu'(pre2) ⊙ (d e1 · W_fc1).
  Values de2 = {};
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) v[r][j] = row_ok(r) && live[j] ? fw.pre2[at(r, j)] : 0.f;
  }
  AddColumnProducts<kK>(first, s.w[kFc1], de2);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) {
      if (row_ok(r) && live[j]) {
        bw.d_pre2[static_cast<size_t>(row0 + r) * bw.ldd + Column(j)] = de2[r][j] * EluGrad(v[r][j]);
      }
    }
  }

  // Each partial row: its warps' sums added in warp order.
  __syncthreads();
  constexpr int kGroups = kWarps / kPartialWarps;
  for (int i = threadIdx.x; i < kGroups * 4 * width; i += kThreads) {
    const int group = i / (4 * width), q = i / width % 4, c = i % width;
    const int partial_row = blockIdx.x * kGroups + group;
    if (partial_row * kNormPartialBlockRows >= rows) continue;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kPartialWarps; ++w) total += s.sums[group * kPartialWarps + w][q][c];
    bw.partials[static_cast<size_t>(partial_row) * 4 * width + q * width + c] = total;
  }
}

}  // namespace

cudaError_t LaunchGrnHead(int rows, int width, const GrnHeadWeights& weights, const GrnHeadForward& forward,
                          const LogitGradient& grad, const GrnHeadBackward& backward, cudaStream_t stream,
                          bool programmatic) {
  if (rows < 1) return cudaSuccess;
  if (!GrnHeadSupports(width, weights.out.outs)) return cudaErrorInvalidValue;
  if (grad.dlogits && (backward.ldd < width || !backward.d_pre_ln || !backward.d_gate_pre || !backward.d_value ||
                       !backward.d_pre2 || !backward.de1 || !backward.partials)) {
    return cudaErrorInvalidValue;
  }
  const auto launch = [&]<int kK>() {
    if (const cudaError_t e = AllowSharedMemory(GrnHeadKernel<kK>, sizeof(Shared)); e != cudaSuccess) return e;
    return LaunchKernel(GrnHeadKernel<kK>, dim3(CeilDiv(rows, kBlockRows)), dim3(kThreads), sizeof(Shared), stream,
                        programmatic, rows, width, weights, forward, grad, backward);
  };
  if (width <= 8) return launch.template operator()<8>();
  if (width <= 16) return launch.template operator()<16>();
  if (width <= 32) return launch.template operator()<32>();
  return launch.template operator()<kWidth>();
}

}  // namespace perception::kernels
