// The narrow weight gradients in float32 FFMA (kernels/skinny_grad.h): cuBLAS runs them as a SIMT sgemm plus a
// split-K reduce, and the 3×TF32 wgmma kernel's 128-row tiles are mostly empty on them.
#include "kernels/skinny_grad.h"

#include <algorithm>

#include "kernels/common.cuh"

namespace perception::kernels {
namespace {

constexpr int kT = kSkinnyTile;
constexpr int kThreads = 256;
// The block's threads are four groups of 64, each an 8 × 8 grid of threads holding 8 × 8 outputs (64 FFMA per four
// 16-byte shared loads); the groups take different rows of each staged chunk and are added in order at the end.
constexpr int kGroups = kThreads / 64;
constexpr int kChunk = 32;  // rows per stage: one 32 × 64 tile of dy and one of x, 16 KB
// Stages in flight: one staged chunk at a time (loaded into registers during the previous chunk) kept a block waiting
// on memory (16 KB in flight per SM, ~1.2 µs a chunk on the H200 against ~0.5 µs of FFMA); three fill the 48 KB of
// static shared memory and need no registers.
constexpr int kStages = 3;
constexpr int kGroupRows = kChunk / kGroups;
constexpr int kLoads = kChunk * kT / kThreads;  // floats of each operand a thread copies per stage
constexpr int kTileFloats = kT * kT;
static_assert(kStages * 2 * kChunk * kT >= kTileFloats, "the group reduction reuses the stages for one tile");

// A 4-byte asynchronous copy into shared memory, zero-filled where `valid` is false (src then only names a mapped
// address; nothing is read).
__device__ __forceinline__ void CopyAsync4(float* dst, const float* src, bool valid) {
  const unsigned smem = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

// One block: the tile (blockIdx.x, row-major over the out × in tiles) over the rows of slice blockIdx.y. Its sum goes
// to dw (partials null: a single slice) or to partials[slice][tile] as a full 64 × 64 tile.
__global__ void __launch_bounds__(kThreads, 2)
    SkinnyWeightGradKernel(int rows, int in, int out, const float* __restrict__ dy, int lddy,
                           const float* __restrict__ x, int ldx, int slice_rows, float* __restrict__ dw, int lddw,
                           float* __restrict__ partials) {
  // [stage][0]: dy's columns o0.., [stage][1]: x's columns i0..
  __shared__ __align__(16) float stage[kStages][2][kChunk][kT];
  const int tiles_in = CeilDiv(in, kT);
  const int o0 = blockIdx.x / tiles_in * kT, i0 = blockIdx.x % tiles_in * kT;
  const int r_begin = blockIdx.y * slice_rows, r_end = min(rows, r_begin + slice_rows);
  const int chunks = CeilDiv(max(r_end - r_begin, 0), kChunk);
  const int t = threadIdx.x, group = t / 64, ty = t % 64 / 8, tx = t % 8;
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
      float(*s)[kChunk][kT] = stage[c % kStages];
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const int r = r0 + lrow + j * kRowStep;
        const bool row_in = r < r_end;
        const size_t rr = row_in ? r : r_begin;
        CopyAsync4(&s[0][lrow + j * kRowStep][lcol], dy_col + rr * lddy, o_in && row_in);
        CopyAsync4(&s[1][lrow + j * kRowStep][lcol], x_col + rr * ldx, i_in && row_in);
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  float acc[8][8] = {};
#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) issue(c);
  for (int c = 0; c < chunks; ++c) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2) : "memory");  // this thread's copies of chunk c
    __syncthreads();  // everyone's copies of chunk c have landed, and chunk c − 1's stage is consumed
    issue(c + kStages - 1);
    const float(*s)[kChunk][kT] = stage[c % kStages];
#pragma unroll
    for (int k = 0; k < kGroupRows; ++k) {
      const int row = group * kGroupRows + k;
      const float4 a0 = *reinterpret_cast<const float4*>(&s[0][row][ty * 4]);
      const float4 a1 = *reinterpret_cast<const float4*>(&s[0][row][32 + ty * 4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&s[1][row][tx * 4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&s[1][row][32 + tx * 4]);
      const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");  // only empty groups remain, but the stages are reused below
  // Output (o, i) of this thread's acc[a][b] within the tile: rows ty·4 + a and 32 + ty·4 + a − 4, columns likewise.
  auto tile_row = [&](int a) { return (a < 4 ? 0 : 32) + ty * 4 + a % 4; };
  float* sum = &stage[0][0][0][0];
  for (int g = 1; g < kGroups; ++g) {  // group 0 += group 1, then group 2, then group 3
    __syncthreads();
    if (group == g) {
#pragma unroll
      for (int a = 0; a < 8; ++a) {
        float* dst = sum + tile_row(a) * kT + tx * 4;
        *reinterpret_cast<float4*>(dst) = make_float4(acc[a][0], acc[a][1], acc[a][2], acc[a][3]);
        *reinterpret_cast<float4*>(dst + 32) = make_float4(acc[a][4], acc[a][5], acc[a][6], acc[a][7]);
      }
    }
    __syncthreads();
    if (group == 0) {
#pragma unroll
      for (int a = 0; a < 8; ++a) {
        const float* src = sum + tile_row(a) * kT + tx * 4;
#pragma unroll
        for (int b = 0; b < 8; ++b) acc[a][b] += src[b < 4 ? b : 32 + b - 4];
      }
    }
  }
  if (group != 0) return;
  if (partials == nullptr) {
#pragma unroll
    for (int a = 0; a < 8; ++a) {
      const int o = o0 + tile_row(a);
      if (o >= out) continue;
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        const int i = i0 + (b < 4 ? 0 : 32) + tx * 4 + b % 4;
        if (i < in) dw[static_cast<size_t>(o) * lddw + i] = acc[a][b];
      }
    }
    return;
  }
  float* tile = partials + (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kTileFloats;
#pragma unroll
  for (int a = 0; a < 8; ++a) {
    float* dst = tile + tile_row(a) * kT + tx * 4;
    *reinterpret_cast<float4*>(dst) = make_float4(acc[a][0], acc[a][1], acc[a][2], acc[a][3]);
    *reinterpret_cast<float4*>(dst + 32) = make_float4(acc[a][4], acc[a][5], acc[a][6], acc[a][7]);
  }
}

// dw[o, i] = Σ_s partials[s][tile of (o, i)][(o, i) within it]. Unlike gemm_tf32x3's SumSlicesKernel (dense
// [slice][out][in] partials, in a multiple of 4, a thread per four outputs over every slice), the partials here are
// whole 64 × 64 tiles, dw may be any width, and a block takes 32 outputs with its warps over interleaved slices:
// one thread per output walking 132 slices took ~8 µs of latency on the H200. Warp w adds slices w, w + kSumWarps,
// … in order, then warp 0 adds the warps' sums in order.
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
                                   int slices) {
  if (in <= 0 || out <= 0) return cudaSuccess;
  rows = std::max(rows, 0);
  const int tiles = CeilDiv(out, kT) * CeilDiv(in, kT);
  const int chunks = std::max(CeilDiv(rows, kChunk), 1);
  const size_t slice_bytes = static_cast<size_t>(tiles) * kTileFloats * sizeof(float);
  const int most = static_cast<int>(std::min<size_t>(workspace_bytes / slice_bytes, chunks));
  if (slices <= 0) {
    int device = 0, sms = 0;
    if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) {
      return e;
    }
    // One block per SM: a block's 64 × 64 tile is FFMA-bound, and every further slice's partial is written and read
    // back once more.
    slices = std::max(sms / tiles, 1);
  }
  slices = std::max(std::min(slices, most), 1);
  // Whole chunks per slice; the last slice takes what is left, so the count may come out lower.
  const int slice_rows = CeilDiv(chunks, slices) * kChunk;
  slices = CeilDiv(chunks * kChunk, slice_rows);
  const dim3 grid(tiles, slices);
  if (slices == 1) {
    SkinnyWeightGradKernel<<<grid, kThreads, 0, stream>>>(rows, in, out, dy, lddy, x, ldx, slice_rows, dw, lddw,
                                                          nullptr);
    return cudaGetLastError();
  }
  SkinnyWeightGradKernel<<<grid, kThreads, 0, stream>>>(rows, in, out, dy, lddy, x, ldx, slice_rows, nullptr, 0,
                                                        workspace);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  SumSkinnySlicesKernel<<<CeilDiv(out * in, 32), kSumWarps * 32, 0, stream>>>(workspace, slices, in, out, dw, lddw);
  return cudaGetLastError();
}

}  // namespace perception::kernels
