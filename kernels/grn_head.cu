// The GRN head's one launch (kernels/grn_head.h): a warp carries 8 rows, lane l holding columns l and l + 32 of each;
// the G×G products run on the TF32 tensor cores with the warp's rows as an mma tile's 8 columns, from weights in
// shared memory and each warp's rows in its own shared buffers. The elementwise formulas are those of the separate
// kernels (kernels/norms.cu, kernels/pointwise.cu), term by term; the products' and the row sums' orders differ.
#include <cstddef>

#include "kernels/common.cuh"
#include "kernels/grn_head.h"
#include "kernels/loss.cuh"
#include "kernels/tf32x3.cuh"

namespace perception::kernels {
namespace {

constexpr int kWidth = kMaxGrnHeadWidth;
constexpr int kColumns = kWidth / kWarpSize;  // a lane's columns of a row
// A weight row's stride in shared memory: an mma's A fragment, rows g and columns t (g < 8, t < 4), falls on
// distinct banks.
constexpr int kWeightLd = kWidth + 4;
constexpr int kRows = kGrnHeadWarpRows;
// A warp's shared row's stride: the tensor-core products read rows g and columns t (g < 8, t < 4) at once, which
// fall on distinct banks at 68 floats.
constexpr int kRowLd = kWidth + 4;
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
  // Each warp's rows: e2, then gate, then d gate_pre, then d e1; e1, then value, then d value, then d pre2.
  float rows[kWarps][2][kRows][kRowLd];
  float columns[kColumnVectors][kWidth];  // the biases and the LayerNorm's weight and bias, zero past G
  float w_out[kOutputs][kWidth];          // zero past G and past the outputs
  float dlogits[kWarps][kRows][kOutputs];
  float sums[kWarps][4][kWidth];
};
using WarpRows = float[kRows][kRowLd];
using Values = float[kRows][kColumns];

__device__ __forceinline__ int Column(int j) { return Lane() + j * kWarpSize; }

// How the G×G products run on the TF32 tensor cores: as 3×TF32 (float32 accuracy, tf32x3.cuh) or as one TF32 product
// (the `tf32` precision).
enum class Products { kTf32x3, kTf32 };

// The tensor-core products: an m16n8k8 tile's 8 columns are the warp's 8 rows and its 16 rows 16 of the products'
// outputs, so four tiles give the 64 outputs (zero past G) of one product. A fragment tile `acc[m]` holds, with
// g = lane/4 and t = lane%4, outputs 16m + g and 16m + g + 8 of rows 2t and 2t + 1 (tf32x3.cuh's MmaTf32 layout).
// The k loops stay rolled: with every loop unrolled, the kernel outgrew the instruction cache (H200: "no instruction"
// stalls 3.8 cycles an issue, 86 µs against 62 for the launch, with the products then on FMAs).
using Tiles = float[kWidth / 16][4];

// a: weights from shared memory, which hold them rounded to TF32 already under kTf32 (WeightInShared).
template <Products kMode>
__device__ __forceinline__ void Mma(float (&d)[4], const float (&a)[4], const float (&b)[2]) {
  if constexpr (kMode == Products::kTf32) {
    const uint32_t a_big[4] = {__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]),
                               __float_as_uint(a[3])};
    const uint32_t b_big[2] = {Tf32Big(b[0]), Tf32Big(b[1])};
    MmaTf32(d, a_big, b_big);
  } else {
    Tf32Split as[4], bs[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) as[i] = SplitTf32ForMma(a[i]);
#pragma unroll
    for (int i = 0; i < 2; ++i) bs[i] = SplitTf32ForMma(b[i]);
    MmaTf32x3(d, as, bs);
  }
}

// A weight as the products read it from shared memory: under kTf32 rounded once, as the block stores it, rather than
// by every mma that reads it (Tf32Big of a rounded value is that value: the same bits).
template <Products kMode>
__device__ __forceinline__ float WeightInShared(float w) {
  return kMode == Products::kTf32 ? __uint_as_float(Tf32Big(w)) : w;
}

// acc[m] += W_m · inᵀ for the M weights (they share the rows' fragments): outputs of in · W_mᵀ, k in runs of 8.
template <int kK, Products kMode, int M>
__device__ __forceinline__ void MmaRowProducts(const WarpRows& in, const float* const (&w)[M], Tiles (&acc)[M]) {
  const int g = Lane() / 4, t = Lane() % 4;
#pragma unroll 1
  for (int k = 0; k < kK; k += 8) {
    const float b[2] = {in[g][k + t], in[g][k + t + 4]};
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int tile = 0; tile < kWidth / 16; ++tile) {
        const float* a = w[m] + (16 * tile + g) * kWeightLd + k + t;
        const float af[4] = {a[0], a[8 * kWeightLd], a[4], a[8 * kWeightLd + 4]};
        Mma<kMode>(acc[m][tile], af, b);
      }
    }
  }
}

// acc += Wᵀ · inᵀ: outputs of in · W, c in runs of 8.
template <int kK, Products kMode>
__device__ __forceinline__ void MmaColumnProducts(const WarpRows& in, const float* w, Tiles& acc) {
  const int g = Lane() / 4, t = Lane() % 4;
#pragma unroll 1
  for (int c = 0; c < kK; c += 8) {
    const float b[2] = {in[g][c + t], in[g][c + t + 4]};
#pragma unroll
    for (int tile = 0; tile < kWidth / 16; ++tile) {
      const float* a = w + (c + t) * kWeightLd + 16 * tile + g;
      const float af[4] = {a[0], a[8], a[4 * kWeightLd], a[4 * kWeightLd + 8]};
      Mma<kMode>(acc[tile], af, b);
    }
  }
}

// Starts a product's tiles at its bias (zero where null).
__device__ __forceinline__ void StartTiles(Tiles& acc, const float* bias) {
  const int g = Lane() / 4;
#pragma unroll
  for (int tile = 0; tile < kWidth / 16; ++tile) {
    const float lo = bias ? bias[16 * tile + g] : 0.f, hi = bias ? bias[16 * tile + g + 8] : 0.f;
    acc[tile][0] = acc[tile][1] = lo;
    acc[tile][2] = acc[tile][3] = hi;
  }
}

// The tiles into the warp's shared rows, [row][output].
__device__ __forceinline__ void StoreTiles(const Tiles& acc, WarpRows& out) {
  const int g = Lane() / 4, t = Lane() % 4;
#pragma unroll
  for (int tile = 0; tile < kWidth / 16; ++tile) {
    out[2 * t][16 * tile + g] = acc[tile][0];
    out[2 * t + 1][16 * tile + g] = acc[tile][1];
    out[2 * t][16 * tile + g + 8] = acc[tile][2];
    out[2 * t + 1][16 * tile + g + 8] = acc[tile][3];
  }
}

// A lane's values of the warp's shared rows.
__device__ __forceinline__ void LoadValues(const WarpRows& in, Values& v) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) v[r][j] = in[r][Column(j)];
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

// kFull: width == kK and every block's rows are in the batch, so that the width (a row's stride, and which columns
// hold values) and which rows exist are known to the compiler: fewer address and predicate instructions, fewer spills
// (H200, small, with the weights rounded once: the kernel 47.6 -> 42.3 µs under tf32 and 16.2 -> 12.1 M warp
// instructions; the step 3xtf32 960-963 -> 951-954 µs, tf32 824-826 -> 815-819; bench/RESULTS.md).
template <int kK, Products kMode, bool kFull>
__global__ void __launch_bounds__(kThreads, 2) GrnHeadKernel(int rows, int width_arg, GrnHeadWeights wt,
                                                             GrnHeadForward fw, LogitGradient grad,
                                                             GrnHeadBackward bw) {
  const int width = kFull ? kK : width_arg;
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
      s.w[m][i / kWidth * kWeightLd + i % kWidth] = WeightInShared<kMode>(staged[t]);
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
  auto row_ok = [&](int r) { return kFull || row0 + r < rows; };
  auto at = [&](int r, int j) { return static_cast<size_t>(row0 + r) * width + Column(j); };
  const int ld_in = fw.ld_in > 0 ? fw.ld_in : width;
  auto at_in = [&](int r, int j) { return static_cast<size_t>(row0 + r) * ld_in + Column(j); };
  // pre2 as fc2's product with its bias (GrnHeadWeights::fc2_b; −0 adds nothing, bit for bit), read where it is
  // used rather than held in registers through the kernel.
  auto pre2 = [&](int r, int j) {
    return fw.pre2[at_in(r, j)] + (wt.fc2_b != nullptr ? wt.fc2_b[Column(j)] : -0.f);
  };
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
      x[r][j] = in ? fw.skip[at_in(r, j)] : 0.f;
      v[r][j] = in ? pre2(r, j) : 0.f;
    }
  }
  WarpRows& first = s.rows[warp][0];
  WarpRows& second = s.rows[warp][1];
  // Stores a warp's values to `out` ([rows, G] dense).
  const auto store = [&](const Values& values, float* out) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < kColumns; ++j) {
        if (row_ok(r) && live[j]) out[at(r, j)] = values[r][j];
      }
    }
  };
  // ... and to its shared rows `to`.
  const auto keep = [&](const Values& values, float* out, WarpRows& to) {
    store(values, out);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < kColumns; ++j) to[r][Column(j)] = values[r][j];
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
    Tiles acc[1];
    StartTiles(acc[0], s.columns[kFc1Bias]);
    MmaRowProducts<kK, kMode, 1>(first, {s.w[kFc1]}, acc);
    StoreTiles(acc[0], second);
    __syncwarp();
    LoadValues(second, e1);
    store(e1, fw.e1);  // `second` holds them already
  }
  __syncwarp();

  // gate and value from e1; x = skip + σ(gate) ⊙ value; the LayerNorm.
  Values gv[2];
  {
    Tiles acc[2];
    StartTiles(acc[0], s.columns[kGateBias]);
    StartTiles(acc[1], s.columns[kValueBias]);
    MmaRowProducts<kK, kMode, 2>(second, {s.w[kGate], s.w[kValue]}, acc);
    __syncwarp();  // every lane is done with e1
    StoreTiles(acc[0], first);
    StoreTiles(acc[1], second);
    __syncwarp();
    LoadValues(first, gv[0]);
    LoadValues(second, gv[1]);
  }
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
  __syncwarp();                  // every lane is done with the gate and value rows
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
  Values de1;
  {
    Tiles acc;
    StartTiles(acc, nullptr);
    MmaColumnProducts<kK, kMode>(first, s.w[kGate], acc);
    MmaColumnProducts<kK, kMode>(second, s.w[kValue], acc);
    __syncwarp();  // every lane is done with d gate_pre
    StoreTiles(acc, first);
    __syncwarp();
    LoadValues(first, de1);
  }
  store(de1, bw.de1);  // `first` holds them already
  __syncwarp();

  // d pre2 = elu'(pre2) ⊙ (d e1 · W_fc1).
  Values de2;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int j = 0; j < kColumns; ++j) v[r][j] = row_ok(r) && live[j] ? pre2(r, j) : 0.f;
  }
  {
    Tiles acc;
    StartTiles(acc, nullptr);
    MmaColumnProducts<kK, kMode>(first, s.w[kFc1], acc);
    StoreTiles(acc, second);
    __syncwarp();
    LoadValues(second, de2);
  }
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
                          const LogitGradient& grad, const GrnHeadBackward& backward, bool tf32_products,
                          cudaStream_t stream, bool programmatic) {
  if (rows < 1) return cudaSuccess;
  if (!GrnHeadSupports(width, weights.out.outs) || (forward.ld_in != 0 && forward.ld_in < width)) {
    return cudaErrorInvalidValue;
  }
  if (grad.dlogits && (backward.ldd < width || !backward.d_pre_ln || !backward.d_gate_pre || !backward.d_value ||
                       !backward.d_pre2 || !backward.de1 || !backward.partials)) {
    return cudaErrorInvalidValue;
  }
  const auto launch = [&]<int kK>() {
    const auto go = [&](auto kernel) {
      if (const cudaError_t e = AllowSharedMemory(kernel, sizeof(Shared)); e != cudaSuccess) return e;
      return LaunchKernel(kernel, dim3(CeilDiv(rows, kBlockRows)), dim3(kThreads), sizeof(Shared), stream,
                          programmatic, rows, width, weights, forward, grad, backward);
    };
    return WithFlags(tf32_products, width == kK && rows % kBlockRows == 0, [&]<bool kTf32, bool kFull>() {
      return go(GrnHeadKernel<kK, kTf32 ? Products::kTf32 : Products::kTf32x3, kFull>);
    });
  };
  if (width <= 8) return launch.template operator()<8>();
  if (width <= 16) return launch.template operator()<16>();
  if (width <= 32) return launch.template operator()<32>();
  return launch.template operator()<kWidth>();
}

}  // namespace perception::kernels
