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
constexpr int kChunk = 32;  // rows staged per step: one 32 × 64 tile of dy and one of x, 16 KB
constexpr int kGroupRows = kChunk / kGroups;
constexpr int kLoads = kChunk * kT / kThreads;  // floats of each operand a thread stages per step
constexpr int kTileFloats = kT * kT;
static_assert(2 * kChunk * kT == kTileFloats, "the group reduction reuses the staging buffer for one tile");

// One block: the tile (blockIdx.x, row-major over the out × in tiles) over the rows of slice blockIdx.y. Its sum goes
// to dw (partials null: a single slice) or to partials[slice][tile] as a full 64 × 64 tile.
__global__ void __launch_bounds__(kThreads, 1)
    SkinnyWeightGradKernel(int rows, int in, int out, const float* __restrict__ dy, int lddy,
                           const float* __restrict__ x, int ldx, int slice_rows, float* __restrict__ dw, int lddw,
                           float* __restrict__ partials) {
  __shared__ __align__(16) float stage[2][kChunk][kT];  // [0]: dy's columns o0.., [1]: x's columns i0..
  const int tiles_in = CeilDiv(in, kT);
  const int o0 = blockIdx.x / tiles_in * kT, i0 = blockIdx.x % tiles_in * kT;
  const int r_begin = blockIdx.y * slice_rows, r_end = min(rows, r_begin + slice_rows);
  const int t = threadIdx.x, group = t / 64, ty = t % 64 / 8, tx = t % 8;
  // Staging: a thread loads column `lcol` of rows lrow, lrow + 8, …: each warp reads 128 contiguous bytes of a row.
  const int lcol = t % kT, lrow = t / kT;
  constexpr int kRowStep = kThreads / kT;
  const bool o_in = o0 + lcol < out, i_in = i0 + lcol < in;
  const float* dy_col = dy + o0 + lcol;
  const float* x_col = x + i0 + lcol;
  float next_dy[kLoads], next_x[kLoads];
  auto load = [&](int r0) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int r = r0 + lrow + j * kRowStep;
      next_dy[j] = o_in && r < r_end ? dy_col[static_cast<size_t>(r) * lddy] : 0.f;
      next_x[j] = i_in && r < r_end ? x_col[static_cast<size_t>(r) * ldx] : 0.f;
    }
  };
  float acc[8][8] = {};
  load(r_begin);
  for (int r0 = r_begin; r0 < r_end; r0 += kChunk) {
    __syncthreads();  // the previous chunk is consumed
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      stage[0][lrow + j * kRowStep][lcol] = next_dy[j];
      stage[1][lrow + j * kRowStep][lcol] = next_x[j];
    }
    __syncthreads();
    if (r0 + kChunk < r_end) load(r0 + kChunk);  // in flight while this chunk is multiplied
#pragma unroll
    for (int k = 0; k < kGroupRows; ++k) {
      const int row = group * kGroupRows + k;
      const float4 a0 = *reinterpret_cast<const float4*>(&stage[0][row][ty * 4]);
      const float4 a1 = *reinterpret_cast<const float4*>(&stage[0][row][32 + ty * 4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&stage[1][row][tx * 4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&stage[1][row][32 + tx * 4]);
      const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
  }
  // Output (o, i) of this thread's acc[a][b] within the tile: rows ty·4 + a and 32 + ty·4 + a − 4, columns likewise.
  auto tile_row = [&](int a) { return (a < 4 ? 0 : 32) + ty * 4 + a % 4; };
  float* sum = &stage[0][0][0];
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

// dw[o, i] = Σ_s partials[s][tile of (o, i)][(o, i) within it], the slices added in order, one output per thread.
// Unlike gemm_tf32x3's SumSlicesKernel (dense [slice][out][in] partials, in a multiple of 4), the partials here are
// whole 64 × 64 tiles and dw may be any width. A thread issues kSliceBatch loads before it adds them.
constexpr int kSliceBatch = 8;
__global__ void SumSkinnySlicesKernel(const float* __restrict__ partials, int slices, int in, int out, float* dw,
                                      int lddw) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= out * in) return;
  const int o = idx / in, i = idx % in, tiles_in = CeilDiv(in, kT);
  const size_t slice = static_cast<size_t>(CeilDiv(out, kT)) * tiles_in * kTileFloats;
  const float* src = partials + static_cast<size_t>(o / kT * tiles_in + i / kT) * kTileFloats + o % kT * kT + i % kT;
  float sum = src[0];
  for (int s0 = 1; s0 < slices; s0 += kSliceBatch) {
    float v[kSliceBatch];
#pragma unroll
    for (int j = 0; j < kSliceBatch; ++j) {
      if (s0 + j < slices) v[j] = src[(s0 + j) * slice];
    }
#pragma unroll
    for (int j = 0; j < kSliceBatch; ++j) {
      if (s0 + j >= slices) break;
      sum += v[j];
    }
  }
  dw[static_cast<size_t>(o) * lddw + i] = sum;
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
  constexpr int kSumThreads = 128;
  SumSkinnySlicesKernel<<<CeilDiv(out * in, kSumThreads), kSumThreads, 0, stream>>>(workspace, slices, in, out, dw,
                                                                                     lddw);
  return cudaGetLastError();
}

}  // namespace perception::kernels
