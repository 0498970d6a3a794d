// The 3×TF32 GEMM behind kernels/gemm_tf32x3.h: BM×BN block tiles over k in steps of 32 through a 3-stage cp.async
// pipeline into padded shared memory (every fragment load conflict-free), each warp splitting its fragments once per
// k-step of 8 and reusing them across its 16×8 mma tiles. Grid: one block per output tile (consecutive blocks walk
// the columns of one row band, so the band's rows are read from DRAM once), times the batch or the row slices.
#include "kernels/gemm_tf32x3.h"

#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/tf32x3.cuh"

namespace perception::kernels {
namespace {

constexpr int kBk = 32;     // k per pipeline stage
constexpr int kStages = 3;  // stages in flight: two tiles loading while one is multiplied
// Blocks the weight gradient's row split aims for: a few waves of blocks on an H200's 132 SMs, so the tail wave is
// short, but no more, since each slice's partial is written and read back once more.
constexpr int kTargetBlocks = 640;
// The fewest k-tiles a row slice gets, so the pipeline's fill stays small against its steady state.
constexpr int kMinSliceTiles = 8;

// C = A·B (+ bias + beta·C) with A [m, k] and B [k, n] as the template's layouts say, `gridDim.y` times: the z-th
// reads and writes each operand at its pointer + z·stride, and with k_split > 0 covers k in
// [z·k_split, min(k, (z+1)·k_split)) (the strides then step along k).
struct GemmParams {
  const float* a;
  int64_t lda, stride_a;
  const float* b;
  int64_t ldb, stride_b;
  float* c;
  int64_t ldc, stride_c;
  const float* bias;
  int64_t stride_bias;
  float beta;
  int m, n, k, k_split;
};

__device__ __forceinline__ void CopyAsync16(float* dst, const float* src, bool valid) {
  // src-size 0 reads nothing and zero-fills: out-of-range rows and k contribute zeros.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// One operand's stage in shared memory: X (rows of A or columns of B) by kBk, stored k-contiguous as [X][kBk + 4] or
// X-contiguous as [kBk][X + 8]. The pads put the 32 lanes of a fragment load ((x g, k t) or (k t, x g) for g < 8,
// t < 4) on 32 different banks, and keep every row 16-byte aligned for the copies.
template <int X, bool kKContiguous>
struct Stage {
  static constexpr int kLd = kKContiguous ? kBk + 4 : X + 8;
  static constexpr int kFloats = kKContiguous ? X * kLd : kBk * kLd;
  __device__ static int At(int x, int k) { return kKContiguous ? x * kLd + k : k * kLd + x; }

  // Copies the tile at (x0, k0) of `g` (leading dimension ld) into `s`, zero past x_end or k_end. Operands are
  // contiguous in 4-float runs that are wholly in range or wholly out (GemmTf32x3Supports).
  template <int kThreads>
  __device__ static void Load(float* s, const float* g, int64_t ld, int x0, int x_end, int k0, int k_end, int tid) {
    constexpr int kChunks = X * kBk / 4;
    static_assert(kChunks % kThreads == 0);
#pragma unroll
    for (int i = 0; i < kChunks / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int x = kKContiguous ? c / (kBk / 4) : c % (X / 4) * 4;
      const int k = kKContiguous ? c % (kBk / 4) * 4 : c / (X / 4);
      const int gx = x0 + x, gk = k0 + k;
      const bool valid = gx < x_end && gk < k_end;
      const float* src = valid ? g + (kKContiguous ? gx * ld + gk : gk * ld + gx) : g;
      CopyAsync16(s + At(x, k), src, valid);
    }
  }
};

template <int BM, int BN, int WM, int WN, bool kAK, bool kBK>
constexpr size_t SharedBytes() {
  return sizeof(float) * kStages * (Stage<BM, kAK>::kFloats + Stage<BN, kBK>::kFloats);
}

// kAK: A is [m, k] (k contiguous), else [k, m]. kBK: B is [n, k] (k contiguous), else [k, n]. Warps tile the block
// (BM / WM) × (BN / WN), each a WM×WN patch of 16×8 mma tiles. Warps of 64×32 hold 128 accumulators (the sum and
// the k-tile's part), more than two blocks per SM leave registers for; smaller ones run two blocks per SM.
template <int BM, int BN, int WM, int WN, bool kAK, bool kBK>
__global__ void __launch_bounds__(32 * (BM / WM) * (BN / WN), WM * WN >= 64 * 32 ? 1 : 2)
    GemmTf32x3Kernel(GemmParams p) {
  using SA = Stage<BM, kAK>;
  using SB = Stage<BN, kBK>;
  constexpr int kWarpsN = BN / WN, kThreads = 32 * (BM / WM) * kWarpsN;
  constexpr int kTm = WM / 16, kTn = WN / 8;
  extern __shared__ __align__(16) float smem[];
  float* sa = smem;
  float* sb = smem + kStages * SA::kFloats;

  const int tiles_n = CeilDiv(p.n, BN);
  const int m0 = blockIdx.x / tiles_n * BM, n0 = blockIdx.x % tiles_n * BN;
  const int z = blockIdx.y;
  const float* a = p.a + z * p.stride_a;
  const float* b = p.b + z * p.stride_b;
  float* c = p.c + z * p.stride_c;
  const int k_len = p.k_split > 0 ? min(p.k_split, p.k - z * p.k_split) : p.k;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
  const int wm0 = warp / kWarpsN * WM, wn0 = warp % kWarpsN * WN;

  float acc[kTm][kTn][4] = {};
  const int ktiles = CeilDiv(k_len, kBk);
  auto load = [&](int kt) {
    const int stage = kt % kStages;
    SA::template Load<kThreads>(sa + stage * SA::kFloats, a, p.lda, m0, p.m, kt * kBk, k_len, tid);
    SB::template Load<kThreads>(sb + stage * SB::kFloats, b, p.ldb, n0, p.n, kt * kBk, k_len, tid);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load(s);
    CopyAsyncCommit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    CopyAsyncWait<kStages - 2>();
    // Tile kt is in for every thread, and every thread is done with the stage the next load overwrites.
    __syncthreads();
    if (kt + kStages - 1 < ktiles) load(kt + kStages - 1);
    CopyAsyncCommit();
    const float* ta = sa + kt % kStages * SA::kFloats;
    const float* tb = sb + kt % kStages * SB::kFloats;
    // The tensor cores round their running sum toward zero at every mma, a bias that grows with the length of the
    // sum (over all of k = 2,192 it reached 1.5e-5 relative): each k-tile is summed from zero on the tensor cores
    // and the k-tiles are added in float32, rounded to nearest.
    float part[kTm][kTn][4] = {};
#pragma unroll
    for (int ks = 0; ks < kBk; ks += 8) {
      // B's fragments split first, then A's one mma row at a time: fewer live registers than all of A at once.
      uint32_t b_big[kTn][2], b_small[kTn][2];
#pragma unroll
      for (int j = 0; j < kTn; ++j) {
        const int col = wn0 + j * 8 + g;
        const float v[2] = {tb[SB::At(col, ks + t)], tb[SB::At(col, ks + t + 4)]};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const Tf32Split split = SplitTf32(v[e]);
          b_big[j][e] = split.big;
          b_small[j][e] = split.small;
        }
      }
#pragma unroll
      for (int i = 0; i < kTm; ++i) {
        const int r = wm0 + i * 16 + g;
        const float v[4] = {ta[SA::At(r, ks + t)], ta[SA::At(r + 8, ks + t)], ta[SA::At(r, ks + t + 4)],
                            ta[SA::At(r + 8, ks + t + 4)]};
        uint32_t a_big[4], a_small[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const Tf32Split split = SplitTf32(v[e]);
          a_big[e] = split.big;
          a_small[e] = split.small;
        }
        Mma3xTf32(part[i], a_big, a_small, b_big, b_small);
      }
    }
#pragma unroll
    for (int i = 0; i < kTm; ++i) {
#pragma unroll
      for (int j = 0; j < kTn; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] += part[i][j][e];
      }
    }
  }

  // Each lane holds column pairs (2t, 2t + 1): stored as one float2 where the output's rows are 8-byte aligned.
  const float* bias = p.bias != nullptr ? p.bias + z * p.stride_bias : nullptr;
  const bool pairs = p.ldc % 2 == 0 && reinterpret_cast<uintptr_t>(c) % 8 == 0;
#pragma unroll
  for (int i = 0; i < kTm; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + wm0 + i * 16 + g + 8 * half;
      if (row >= p.m) continue;
      float* c_row = c + row * p.ldc;
#pragma unroll
      for (int j = 0; j < kTn; ++j) {
        const int col = n0 + wn0 + j * 8 + 2 * t;
        float v[2] = {acc[i][j][2 * half], acc[i][j][2 * half + 1]};
        if (pairs && col + 1 < p.n) {
          if (bias != nullptr) {
            v[0] += bias[col];
            v[1] += bias[col + 1];
          }
          if (p.beta != 0.f) {
            const float2 old = *reinterpret_cast<const float2*>(c_row + col);
            v[0] += p.beta * old.x;
            v[1] += p.beta * old.y;
          }
          *reinterpret_cast<float2*>(c_row + col) = make_float2(v[0], v[1]);
          continue;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (col + e >= p.n) continue;
          if (bias != nullptr) v[e] += bias[col + e];
          if (p.beta != 0.f) v[e] += p.beta * c_row[col + e];
          c_row[col + e] = v[e];
        }
      }
    }
  }
}

template <int BM, int BN, int WM, int WN, bool kAK, bool kBK>
cudaError_t Launch(const GemmParams& p, int count, cudaStream_t stream) {
  constexpr size_t kShared = SharedBytes<BM, BN, WM, WN, kAK, kBK>();
  const auto kernel = GemmTf32x3Kernel<BM, BN, WM, WN, kAK, kBK>;
  // Per launch rather than once: the attribute is per device, and a process may drive several.
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared);
      e != cudaSuccess) {
    return e;
  }
  const dim3 grid(CeilDiv(p.m, BM) * CeilDiv(p.n, BN), count);
  kernel<<<grid, 32 * (BM / WM) * (BN / WN), kShared, stream>>>(p);
  return cudaGetLastError();
}

template <bool kAK, bool kBK>
cudaError_t LaunchTile(GemmTile tile, const GemmParams& p, int count, cudaStream_t stream) {
  switch (tile) {
    case GemmTile::k128x128:
      return Launch<128, 128, 64, 32, kAK, kBK>(p, count, stream);
    case GemmTile::k128x64:
      return Launch<128, 64, 32, 32, kAK, kBK>(p, count, stream);
    case GemmTile::k64x64:
      return Launch<64, 64, 32, 32, kAK, kBK>(p, count, stream);
    case GemmTile::kAuto:
      break;
  }
  return cudaErrorInvalidValue;
}

int TileRows(GemmTile tile) { return tile == GemmTile::k64x64 ? 64 : 128; }
int TileCols(GemmTile tile) { return tile == GemmTile::k128x128 ? 128 : 64; }

// The fastest tile per output width n and sum length k, measured with bench_gemm on the H200 (16,384 rows): 64×64 for
// outputs up to 64 wide; 128×64 for wide outputs over short sums (small's in_proj, 580 over 128: 68.5 µs against
// 73.4 for 128×128), where the finer column tiles waste less of the last one and two blocks fit per SM; 128×128
// otherwise (out_proj 25.9 µs against 27.5; large's products).
GemmTile RowMajorTile(GemmTile tile, int n, int k) {
  if (tile != GemmTile::kAuto) return tile;
  if (n <= 64) return GemmTile::k64x64;
  return n > 256 && k <= 256 ? GemmTile::k128x64 : GemmTile::k128x128;
}

// dw[m, n] = Σ_s partials[s][m][n], the slices added in order; four columns per thread (n is a multiple of 4).
__global__ void SumSlicesKernel(const float* __restrict__ partials, int slices, int m, int n, float* dw, int lddw) {
  const int quads = n / 4;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= m * quads) return;
  const int row = idx / quads, col = idx % quads * 4;
  const size_t slice = static_cast<size_t>(m) * n;
  const float* src = partials + static_cast<size_t>(row) * n + col;
  float4 sum = *reinterpret_cast<const float4*>(src);
  for (int s = 1; s < slices; ++s) {
    const float4 v = *reinterpret_cast<const float4*>(src + s * slice);
    sum.x += v.x;
    sum.y += v.y;
    sum.z += v.z;
    sum.w += v.w;
  }
  float* out = dw + static_cast<size_t>(row) * lddw + col;
  out[0] = sum.x;
  out[1] = sum.y;
  out[2] = sum.z;
  out[3] = sum.w;
}

}  // namespace

cudaError_t LaunchGemmTf32x3Forward(int rows, int in, int out, const float* x, int ldx, int64_t stride_x,
                                    const float* w, int ldw, int64_t stride_w, const float* bias, int64_t stride_bias,
                                    float beta, float* y, int ldy, int64_t stride_y, int count, cudaStream_t stream,
                                    GemmTile tile) {
  if (rows <= 0 || out <= 0 || count <= 0) return cudaSuccess;
  const GemmParams p{x, ldx, stride_x, w, ldw, stride_w, y, ldy, stride_y, bias, stride_bias, beta, rows, out, in, 0};
  return LaunchTile<true, true>(RowMajorTile(tile, out, in), p, count, stream);
}

cudaError_t LaunchGemmTf32x3BackwardData(int rows, int in, int out, const float* dy, int lddy, const float* w, int ldw,
                                         float beta, float* dx, int lddx, cudaStream_t stream, GemmTile tile) {
  if (rows <= 0 || in <= 0) return cudaSuccess;
  const GemmParams p{dy, lddy, 0, w, ldw, 0, dx, lddx, 0, nullptr, 0, beta, rows, in, out, 0};
  return LaunchTile<true, false>(RowMajorTile(tile, in, out), p, 1, stream);
}

cudaError_t LaunchGemmTf32x3BackwardWeight(int rows, int in, int out, const float* dy, int lddy, const float* x,
                                           int ldx, float* dw, int lddw, float* workspace, size_t workspace_bytes,
                                           cudaStream_t stream, GemmTile tile, int splits) {
  if (in <= 0 || out <= 0) return cudaSuccess;
  if (tile == GemmTile::kAuto) tile = out >= 512 && in >= 512 ? GemmTile::k128x128 : GemmTile::k64x64;
  const int tiles = CeilDiv(out, TileRows(tile)) * CeilDiv(in, TileCols(tile));
  const int ktiles = CeilDiv(std::max(rows, 1), kBk);
  const size_t slice_floats = static_cast<size_t>(out) * in;
  if (splits <= 0) splits = std::min(CeilDiv(kTargetBlocks, tiles), std::max(ktiles / kMinSliceTiles, 1));
  splits = static_cast<int>(std::min<size_t>(splits, workspace_bytes / (slice_floats * sizeof(float))));
  if (splits <= 1) {
    const GemmParams p{dy, lddy, 0, x, ldx, 0, dw, lddw, 0, nullptr, 0, 0.f, out, in, rows, 0};
    return LaunchTile<false, false>(tile, p, 1, stream);
  }
  // Whole k-tiles per slice; the last slice takes what is left, so the count may come out lower.
  const int k_split = CeilDiv(ktiles, splits) * kBk;
  splits = CeilDiv(rows, k_split);
  const GemmParams p{dy,      lddy, static_cast<int64_t>(k_split) * lddy,
                     x,       ldx,  static_cast<int64_t>(k_split) * ldx,
                     workspace, in, static_cast<int64_t>(slice_floats),
                     nullptr, 0,    0.f,
                     out,     in,   rows,
                     k_split};
  if (const cudaError_t e = LaunchTile<false, false>(tile, p, splits, stream); e != cudaSuccess) return e;
  constexpr int kThreads = 256;
  const int quads = out * (in / 4);
  SumSlicesKernel<<<CeilDiv(quads, kThreads), kThreads, 0, stream>>>(workspace, splits, out, in, dw, lddw);
  return cudaGetLastError();
}

}  // namespace perception::kernels
