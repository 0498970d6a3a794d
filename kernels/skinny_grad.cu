// The narrow weight gradients (kernels/skinny_grad.h): cuBLAS runs them as a SIMT sgemm plus a split-K reduce, and
// the 3×TF32 wgmma kernel's 128-row tiles are mostly empty on them.
#include "kernels/skinny_grad.h"

#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/tf32x3.cuh"

namespace perception::kernels {
namespace {

constexpr int kT = kSkinnyTile;
constexpr int kThreads = 256;
constexpr int kChunk = 32;  // rows per stage: one 32 × 64 tile of dy and one of x
// Row pitch of a stage in floats: 64 + 8 puts the tensor-core fragments' 4 rows × 8 columns on 32 distinct banks
// (72·t + g mod 32 = 8t + g) and keeps every row 16-byte aligned for the FFMA path's vector loads.
constexpr int kLd = kT + 8;
// Chunks in flight by cp.async, which holds no registers for them (staging through registers, one chunk ahead, took
// 16 of them and left one chunk in flight).
constexpr int kStages = 3;
constexpr int kStageFloats = 2 * kChunk * kLd;
constexpr int kSharedBytes = kStages * kStageFloats * static_cast<int>(sizeof(float));
constexpr int kLoads = kChunk * kT / kThreads;  // floats of each operand a thread copies per stage
constexpr int kTileFloats = kT * kT;
static_assert(kStages * kStageFloats >= kTileFloats, "the group reduction reuses the stages for one tile");

// A 4-byte asynchronous copy into shared memory, zero-filled where `valid` is false (src then only names a mapped
// address; nothing is read).
__device__ __forceinline__ void CopyAsync4(float* dst, const float* src, bool valid) {
  const unsigned smem = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

// How a block's 8 warps cover its 64 × 64 tile and the chunk's 32 rows. The groups take different rows of each chunk
// and are added in order at the end.
// kTf32x3 (mma.sync m16n8k8, kernels/tf32x3.cuh): two groups of four warps, each warp a 32 × 32 quadrant over 16 rows
// (two k-steps of 2 × 4 fragments, three products each); a chunk's products are summed from zero on the tensor cores
// (which round toward zero) and added to the float32 sums.
// kFfma: four groups of 64 threads, each thread 8 × 8 outputs over 8 rows: 64 FFMA per four 16-byte shared loads.
// On the H200 at 16,384 rows the two take about the same time (64 × 64: 9.6 µs 3×TF32, 8.8 FFMA; 192 × 64: 16.9,
// 16.8; both well over their arithmetic), so what bounds them is moving the operands, not the products.
template <SkinnyMath kMath>
struct Layout {
  static constexpr int kGroups = kMath == SkinnyMath::kTf32x3 ? 2 : 4;
  static constexpr int kOutputs = kT * kT * kGroups / kThreads;  // per thread
  static constexpr int kGroupRows = kChunk / kGroups;
};

// One block: the tile (blockIdx.x, row-major over the out × in tiles) over the rows of slice blockIdx.y. Its sum goes
// to dw (partials null: a single slice) or to partials[slice][tile] as a full 64 × 64 tile.
template <SkinnyMath kMath>
__global__ void __launch_bounds__(kThreads, 2)
    SkinnyWeightGradKernel(int rows, int in, int out, const float* __restrict__ dy, int lddy,
                           const float* __restrict__ x, int ldx, int slice_rows, float* __restrict__ dw, int lddw,
                           float* __restrict__ partials) {
  using L = Layout<kMath>;
  // Stage s: [0][row][col] dy's columns o0.., [1][row][col] x's columns i0.., rows kLd apart.
  extern __shared__ __align__(16) float shared[];
  const int tiles_in = CeilDiv(in, kT);
  const int o0 = blockIdx.x / tiles_in * kT, i0 = blockIdx.x % tiles_in * kT;
  const int r_begin = blockIdx.y * slice_rows, r_end = min(rows, r_begin + slice_rows);
  const int chunks = CeilDiv(max(r_end - r_begin, 0), kChunk);
  const int t = threadIdx.x;
  // Copies: a thread moves column `lcol` of rows lrow, lrow + 4, …: each warp reads 128 contiguous bytes of a row.
  const int lcol = t % kT, lrow = t / kT;
  constexpr int kRowStep = kThreads / kT;
  const bool o_in = o0 + lcol < out, i_in = i0 + lcol < in;
  const float* dy_col = dy + (o_in ? o0 + lcol : 0);
  const float* x_col = x + (i_in ? i0 + lcol : 0);
  // Chunk c into its stage, as one commit group (empty past the slice, so that every thread counts the same groups).
  auto issue = [&](int c) {
    if (c < chunks) {
      const int r0 = r_begin + c * kChunk;
      float* s = shared + c % kStages * kStageFloats;
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const int row = lrow + j * kRowStep, r = r0 + row;
        const bool row_in = r < r_end;
        const size_t rr = row_in ? r : r_begin;
        CopyAsync4(s + row * kLd + lcol, dy_col + rr * lddy, o_in && row_in);
        CopyAsync4(s + (kChunk + row) * kLd + lcol, x_col + rr * ldx, i_in && row_in);
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };

  const int group = t / (kThreads / L::kGroups);
  float acc[L::kOutputs] = {};
  // The tile row and column of acc[k].
  auto out_row = [&](int k) {
    if constexpr (kMath == SkinnyMath::kTf32x3) {
      const int q = t % 128 / 32, g = t % 32 / 4;
      return q / 2 * 32 + k / 16 * 16 + g + k % 4 / 2 * 8;
    } else {
      const int ty = t % 64 / 8, a = k / 8;
      return (a < 4 ? 0 : 32) + ty * 4 + a % 4;
    }
  };
  auto out_col = [&](int k) {
    if constexpr (kMath == SkinnyMath::kTf32x3) {
      const int q = t % 128 / 32, tq = t % 4;
      return q % 2 * 32 + k / 4 % 4 * 8 + 2 * tq + k % 2;
    } else {
      const int tx = t % 8, b = k % 8;
      return (b < 4 ? 0 : 32) + tx * 4 + b % 4;
    }
  };

#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) issue(c);
  for (int c = 0; c < chunks; ++c) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2) : "memory");  // this thread's copies of chunk c
    __syncthreads();  // everyone's copies of chunk c have landed, and chunk c − 1's stage is consumed
    issue(c + kStages - 1);
    const float* sdy = shared + c % kStages * kStageFloats + group * L::kGroupRows * kLd;
    const float* sx = sdy + kChunk * kLd;
    if constexpr (kMath == SkinnyMath::kTf32x3) {
      // A = dyᵀ (m: out, k: rows), B = x (k: rows, n: in); acc[(mi·4 + ni)·4 + r] is fragment (mi, ni)'s d[r].
      const int q = t % 128 / 32, g = t % 32 / 4, tq = t % 4;
      const int m0 = q / 2 * 32, n0 = q % 2 * 32;
      float d[L::kOutputs] = {};
#pragma unroll
      for (int k0 = 0; k0 < L::kGroupRows; k0 += 8) {
        const float* r_lo = sdy + (k0 + tq) * kLd;
        const float* r_hi = r_lo + 4 * kLd;
        Tf32Split a[2][4], b[4][2];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const int m = m0 + mi * 16 + g;
          a[mi][0] = SplitTf32ForMma(r_lo[m]);
          a[mi][1] = SplitTf32ForMma(r_lo[m + 8]);
          a[mi][2] = SplitTf32ForMma(r_hi[m]);
          a[mi][3] = SplitTf32ForMma(r_hi[m + 8]);
        }
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int n = n0 + ni * 8 + g;
          b[ni][0] = SplitTf32ForMma(sx[(k0 + tq) * kLd + n]);
          b[ni][1] = SplitTf32ForMma(sx[(k0 + tq + 4) * kLd + n]);
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
          for (int ni = 0; ni < 4; ++ni) {
            MmaTf32x3(*reinterpret_cast<float(*)[4]>(&d[(mi * 4 + ni) * 4]), a[mi], b[ni]);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < L::kOutputs; ++k) acc[k] += d[k];
    } else {
      const int ty = t % 64 / 8, tx = t % 8;
#pragma unroll
      for (int k = 0; k < L::kGroupRows; ++k) {
        const float4 a0 = *reinterpret_cast<const float4*>(sdy + k * kLd + ty * 4);
        const float4 a1 = *reinterpret_cast<const float4*>(sdy + k * kLd + 32 + ty * 4);
        const float4 b0 = *reinterpret_cast<const float4*>(sx + k * kLd + tx * 4);
        const float4 b1 = *reinterpret_cast<const float4*>(sx + k * kLd + 32 + tx * 4);
        const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i * 8 + j] = fmaf(a[i], b[j], acc[i * 8 + j]);
        }
      }
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");  // only empty groups remain, but the stages are reused below
  float* sum = shared;  // one 64 × 64 tile
  for (int g = 1; g < L::kGroups; ++g) {  // group 0 += group 1, then group 2, …
    __syncthreads();
    if (group == g) {
#pragma unroll
      for (int k = 0; k < L::kOutputs; ++k) sum[out_row(k) * kT + out_col(k)] = acc[k];
    }
    __syncthreads();
    if (group == 0) {
#pragma unroll
      for (int k = 0; k < L::kOutputs; ++k) acc[k] += sum[out_row(k) * kT + out_col(k)];
    }
  }
  if (group != 0) return;
  if (partials == nullptr) {
#pragma unroll
    for (int k = 0; k < L::kOutputs; ++k) {
      const int o = o0 + out_row(k), i = i0 + out_col(k);
      if (o < out && i < in) dw[static_cast<size_t>(o) * lddw + i] = acc[k];
    }
    return;
  }
  float* tile = partials + (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kTileFloats;
#pragma unroll
  for (int k = 0; k < L::kOutputs; ++k) tile[out_row(k) * kT + out_col(k)] = acc[k];
}

// dw[o, i] = Σ_s partials[s][tile of (o, i)][(o, i) within it]. Unlike gemm_tf32x3's SumSlicesKernel (dense
// [slice][out][in] partials, in a multiple of 4, a thread per four outputs over every slice), the partials here are
// whole 64 × 64 tiles, dw may be any width, and a block takes 32 outputs with its warps over interleaved slices, so
// that no thread walks a chain of 128 dependent loads (ncu on the H200, small's step, caches flushed: 3.3–4.1 µs a
// sum). Warp w adds slices w, w + kSumWarps, … in order, then warp 0 adds the warps' sums in order.
constexpr int kSumWarps = 16;
constexpr int kSliceBatch = 4;  // loads a lane issues before it adds them
__global__ void __launch_bounds__(kSumWarps * 32)
    SumSkinnySlicesKernel(const float* __restrict__ partials, int slices, int in, int out, float* dw, int lddw) {
  __shared__ float warp_sums[kSumWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int idx = blockIdx.x * 32 + lane;
  const bool valid = idx < out * in;
  const int o = valid ? idx / in : 0, i = valid ? idx % in : 0, tiles_in = CeilDiv(in, kT);
  const size_t slice = static_cast<size_t>(CeilDiv(out, kT)) * tiles_in * kTileFloats;
  const float* src = partials + static_cast<size_t>(o / kT * tiles_in + i / kT) * kTileFloats + o % kT * kT + i % kT;
  float sum = 0.f;
  if (valid) {
    for (int s0 = warp; s0 < slices; s0 += kSumWarps * kSliceBatch) {
      float v[kSliceBatch];
#pragma unroll
      for (int j = 0; j < kSliceBatch; ++j) {
        const int s = s0 + j * kSumWarps;
        if (s < slices) v[j] = src[s * slice];
      }
#pragma unroll
      for (int j = 0; j < kSliceBatch; ++j) {
        if (s0 + j * kSumWarps >= slices) break;
        sum += v[j];
      }
    }
  }
  warp_sums[warp][lane] = sum;
  __syncthreads();
  if (warp != 0 || !valid) return;
  float total = warp_sums[0][lane];
#pragma unroll
  for (int w = 1; w < kSumWarps; ++w) total += warp_sums[w][lane];
  dw[static_cast<size_t>(o) * lddw + i] = total;
}

}  // namespace

cudaError_t LaunchSkinnyWeightGrad(int rows, int in, int out, const float* dy, int lddy, const float* x, int ldx,
                                   float* dw, int lddw, float* workspace, size_t workspace_bytes, cudaStream_t stream,
                                   int slices, SkinnyMath math) {
  if (in <= 0 || out <= 0) return cudaSuccess;
  rows = std::max(rows, 0);
  const int tiles = CeilDiv(out, kT) * CeilDiv(in, kT);
  const int chunks = std::max(CeilDiv(rows, kChunk), 1);
  const size_t slice_bytes = static_cast<size_t>(tiles) * kTileFloats * sizeof(float);
  const int most = static_cast<int>(std::min<size_t>(workspace_bytes / slice_bytes, chunks));
  if (slices <= 0) {
    int sms = 0;
    if (const cudaError_t e = MultiprocessorCount(&sms); e != cudaSuccess) return e;
    // One block per SM (H200, 16,384 rows, 3×TF32: 64 × 64 9.5 µs at 132 slices against 11.0 at 264, 192 × 64 16.9
    // at 44 against 17.7 at 88; FFMA alike): every further slice's partial is written and read back once more.
    slices = std::max(sms / tiles, 1);
  }
  slices = std::max(std::min(slices, most), 1);
  // Whole chunks per slice; the last slice takes what is left, so the count may come out lower.
  const int slice_rows = CeilDiv(chunks, slices) * kChunk;
  slices = CeilDiv(chunks * kChunk, slice_rows);
  const dim3 grid(tiles, slices);
  auto kernel = math == SkinnyMath::kFfma ? SkinnyWeightGradKernel<SkinnyMath::kFfma>
                                          : SkinnyWeightGradKernel<SkinnyMath::kTf32x3>;
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
      e != cudaSuccess) {
    return e;
  }
  kernel<<<grid, kThreads, kSharedBytes, stream>>>(rows, in, out, dy, lddy, x, ldx, slice_rows,
                                                   slices == 1 ? dw : nullptr, lddw,
                                                   slices == 1 ? nullptr : workspace);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess || slices == 1) return e;
  SumSkinnySlicesKernel<<<CeilDiv(out * in, 32), kSumWarps * 32, 0, stream>>>(workspace, slices, in, out, dw, lddw);
  return cudaGetLastError();
}

}  // namespace perception::kernels
