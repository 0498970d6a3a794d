// The selective scan in its quadratic ("SSD") form: one block per (head, sequence) stages a chunk of up to kTile (64)
// steps in shared memory and forms the time × time products on the FMA pipes, with no sequential dependence inside
// the chunk. The backward computes w_t = a_t·⟨gs_t, s_{t−1}⟩ (for d dt and d A_log) as a sum of terms that all carry
// a_t, so float32 holds it for any decay; longer windows run it chunk by chunk from the last, with the states at the
// chunk boundaries computed first and the adjoint of each chunk's start state handed to the chunk before.
// Training's windows (up to kTile steps from a zero state, headdim ≤ 64) form the same products on the tensor cores
// instead, as float32-accurate 3×TF32 products (SsmMma*Kernel), or in plain TF32 under the `tf32` precision
// (SsmInput::tf32_products): on the FMA pipes the instruction issue, not the arithmetic, bounded them.
//
// The forward of longer windows (evaluation and `large`) is the recurrence: one thread per row p of the head's state
// s[p, 0..N), which it keeps in registers; B, C, dt and the decay of the next steps are staged in shared memory.
#include <cuda_pipeline.h>

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/ssm.h"
#include "kernels/tf32x3.cuh"

namespace perception::kernels {
namespace {

constexpr int kForwardStageSteps = 32;

// Per-step inputs of up to kSteps steps, staged for the whole block: B and C as [step][B: kN | C: kN] (zero past
// d_state, so the state loops need no bounds and load 16 bytes at a time), dt and exp(dt·A).
template <int kN, int kSteps>
struct Stage {
  float* bc;
  float* dt;
  float* decay;

  __host__ __device__ static constexpr size_t Bytes() { return kSteps * (2 * kN + 2) * sizeof(float); }
  __device__ static Stage At(void* base) {
    Stage s;
    s.bc = static_cast<float*>(base);
    s.dt = s.bc + kSteps * 2 * kN;
    s.decay = s.dt + kSteps;
    return s;
  }

  // Fills the stage; callers put a __syncthreads before (the previous stage is consumed) and after.
  __device__ void Load(const SsmInput& in, int b, int h, int t0, int len, float A) const {
    const int N = in.d_state, inner = in.heads * in.headdim;
    for (int i = threadIdx.x; i < len * 2 * kN; i += blockDim.x) {
      const int step = i / (2 * kN), half = (i / kN) % 2, n = i % kN;  // half 0: B, 1: C
      const size_t row = static_cast<size_t>(b) * in.window + t0 + step;
      bc[i] = n < N ? in.xbc[row * in.ld_xbc + inner + half * N + n] : 0.f;
    }
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
      const size_t row = static_cast<size_t>(b) * in.window + t0 + i;
      const float d = Softplus(in.dt_raw[row * in.ld_dt_raw + h] + in.dt_bias[h]);
      dt[i] = d;
      decay[i] = expf(d * A);
    }
  }
};

__device__ __forceinline__ size_t StateOffset(const SsmInput& in, int b, int h, int p) {
  return ((static_cast<size_t>(b) * in.heads + h) * in.headdim + p) * in.d_state;
}

template <int kN>
__global__ void SsmScanForwardKernel(SsmInput in, float* y, float* state_out) {
  WaitForPriorKernels();  // the forward's chain (engine/cuda_model.cc): the kernel ahead wrote its input
  LetNextKernelLaunch();
  extern __shared__ float4 shared_f4[];
  using ForwardStage = Stage<kN, kForwardStageSteps>;
  const ForwardStage stage = ForwardStage::At(shared_f4);
  const int N = in.d_state, P = in.headdim, E = in.heads * P;
  const int h = blockIdx.x, b = blockIdx.y, p = threadIdx.x;
  const bool active = p < P;
  const float A = -expf(in.a_log[h]), Dh = in.d_skip[h];
  float s[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    s[n] = (active && n < N && in.state_in) ? in.state_in[StateOffset(in, b, h, p) + n] : 0.f;
  }
  for (int t0 = 0; t0 < in.window; t0 += kForwardStageSteps) {
    const int len = min(kForwardStageSteps, in.window - t0);
    __syncthreads();
    stage.Load(in, b, h, t0, len, A);
    __syncthreads();
    if (!active) continue;
    for (int i = 0; i < len; ++i) {
      const size_t row = static_cast<size_t>(b) * in.window + t0 + i;
      const float x = in.xbc[row * in.ld_xbc + h * P + p];
      const float xv = x * stage.dt[i], decay = stage.decay[i];
      const float4* B4 = reinterpret_cast<const float4*>(stage.bc + i * 2 * kN);
      const float4* C4 = B4 + kN / 4;
      float acc = 0.f;
#pragma unroll
      for (int q = 0; q < kN / 4; ++q) {
        const float4 bq = B4[q], cq = C4[q];
        const float bn[4] = {bq.x, bq.y, bq.z, bq.w}, cn[4] = {cq.x, cq.y, cq.z, cq.w};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          float& sv = s[4 * q + r];
          sv = decay * sv + xv * bn[r];
          acc += cn[r] * sv;
        }
      }
      y[row * E + h * P + p] = acc + Dh * x;
    }
  }
  if (active && state_out) {
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      if (n < N) state_out[StateOffset(in, b, h, p) + n] = s[n];
    }
  }
}

// ---- The backward of windows of up to kTile steps, in the quadratic ("SSD") form ----
//
// With L(k,j) = Π_{i=j+1..k} a_i = exp(A·(cs_k − cs_j)) (cs the running sum of dt, in double, so the difference
// keeps its digits), XD[k,j] = dy_k·x_j and CB[k,j] = C_k·B_j, the unrolled scan gives for j ≤ k:
//     d C_k = Σ_j M1[k,j]·B_j,   d B_j = Σ_k M1[k,j]·C_k,   dxb_j = Σ_k M2[k,j]·dy_k   (M1 = L·dt_j·XD, M2 = L·CB),
//     w_t = a_t·⟨gs_t, s_{t−1}⟩ = Σ_{k≥t} Σ_{j<t} M1[k,j]·CB[k,j],
// plus, with a state_in S, d C_k += Λ_k·dy_k·S and w_t += Σ_{k≥t} Λ_k·(dy_k·S·C_k), Λ_k = L(k,−1). Every term of
// w_t carries the factor a_t, so nothing cancels and float32 holds it for any decay. The products run from shared
// memory on 4×4 register tiles of 16-row groups (rows r, r+16, r+32, r+48), skipping the groups above the diagonal.
constexpr int kTile = 64, kTileThreads = 256;

// One chunk of the window for the backward: its steps [t0, t0 + kTile) ∩ [0, T), the state at its start, and the
// adjoint of its end state (from the chunk after it); it emits the adjoint of its start state for the chunk before.
// A window of up to kTile steps is one chunk with neither adjoint.
struct TileChunk {
  int t0 = 0;
  const float* state = nullptr;  // [batch, heads, P, N] like state_in, or null for a zero state
  const float* ds_in = nullptr;  // [batch, heads, P, N], or null for the window's last chunk
  float* ds_out = nullptr;       // [batch, heads, P, N], or null for the window's first chunk
};

// Shared-memory plan of one backward block, the same on the host and the device. Strides are ≡ 4 (mod 32) floats so
// that 16-byte loads of 8 consecutive rows hit distinct banks.
struct TileLayout {
  int pc, nc;           // headdim and d_state padded to multiples of 4
  int sp, sn, sq, sbc;  // row strides of [t][p], [t][n], [t][t] and the [t][d B | d C] output
  int dy, x, m1, m1t, m2t, b, c, s, g, ds, dst, vec, floats;  // offsets in floats

  __host__ __device__ TileLayout(const SsmInput& in, const TileChunk& chunk, bool chunked) {
    pc = (in.headdim + 3) / 4 * 4;
    nc = (in.d_state + 3) / 4 * 4;
    sp = pc + 4;
    sn = nc + 4;
    sq = kTile + 4;
    sbc = 2 * nc + 4;
    const int rows_tt = kTile * sq, rows_p = kTile * sp, rows_bc = kTile * sbc;
    dy = 2 * kTile;  // after cs (float pairs)
    x = dy + rows_p;
    // One window: G, then the d B | d C tile, take x's place (x comes back where M1ᵀ was, for the last phase).
    // Chunks keep x (their end-state terms read it late) and give G its own room.
    m1 = x + (chunked ? rows_p : Max(Max(rows_p, rows_tt), rows_bc));
    m1t = m1 + Max(rows_tt, rows_p);
    m2t = m1t + Max(rows_tt, rows_p);
    b = m2t + rows_tt;
    c = b + kTile * sn;
    s = c + kTile * sn;
    g = s + (chunk.state ? pc * sn : 0);
    ds = g + (chunked ? Max(rows_tt, rows_bc) : 0);
    dst = ds + (chunk.ds_in ? pc * sn : 0);
    vec = dst + (chunk.ds_in ? nc * sp : 0);
    floats = vec + kTileVectors * kTile + 2 * (nc / 4) * kTile + kWarpSize;
  }
  // Per-step vectors after `vec`: dt, softplus', w, d D, 4 partial column sums of w; then per-column-group partials
  // of the state's and the end adjoint's terms of w, and a block-sum scratch.
  static constexpr int kTileVectors = 8;
  __host__ __device__ static constexpr int Max(int a, int b) { return a > b ? a : b; }
};

// acc[i][c] += Σ_q A[(r + 16i)·lda + q]·Bt[(col + 16c)·ldb + q] over q < depth (a multiple of 4): a Gram tile of two
// [time][depth] arrays; with kLower only the group pairs i ≥ c (on or below the diagonal) are formed.
template <bool kLower>
__device__ __forceinline__ void GramTile(const float* A, int lda, const float* Bt, int ldb, int depth, int r, int col,
                                         float (&acc)[4][4]) {
  for (int q = 0; q < depth; q += 4) {
    float4 a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = *reinterpret_cast<const float4*>(A + (r + 16 * i) * lda + q);
      b[i] = *reinterpret_cast<const float4*>(Bt + (col + 16 * i) * ldb + q);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (kLower && i < c) continue;
        float v = acc[i][c];
        v = fmaf(a[i].x, b[c].x, v);
        v = fmaf(a[i].y, b[c].y, v);
        v = fmaf(a[i].z, b[c].z, v);
        v = fmaf(a[i].w, b[c].w, v);
        acc[i][c] = v;
      }
    }
  }
}

enum class Band { kFull, kLower, kUpper };

// acc[i][c] += Σ_q A[(r + 16i)·lda + q]·Bm[q·ldb + col4 + c] over q < depth. With a band, depth is kTile and A is a
// [time][time] array that vanishes above (kLower: q > row) or below (kUpper: q < row) the diagonal, so the 16-step
// segments that lie wholly in the vanishing part are skipped for each row group.
template <Band kBand>
__device__ __forceinline__ void RowTile(const float* A, int lda, const float* Bm, int ldb, int depth, int r, int col4,
                                        float (&acc)[4][4]) {
  auto step = [&](int q, int first, int last) {  // row groups first..last take part
    float4 b[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) b[u] = *reinterpret_cast<const float4*>(Bm + (q + u) * ldb + col4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i < first || i > last) continue;
      const float4 a = *reinterpret_cast<const float4*>(A + (r + 16 * i) * lda + q);
      const float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float bv[4] = {b[u].x, b[u].y, b[u].z, b[u].w};
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(av[u], bv[c], acc[i][c]);
      }
    }
  };
  if constexpr (kBand == Band::kFull) {
    for (int q = 0; q < depth; q += 4) step(q, 0, 3);
  } else {
#pragma unroll
    for (int seg = 0; seg < 4; ++seg) {
#pragma unroll
      for (int q = 16 * seg; q < 16 * seg + 16; q += 4) {
        if constexpr (kBand == Band::kLower) {
          step(q, seg, 3);
        } else {
          step(q, 0, seg);
        }
      }
    }
  }
}

__device__ __forceinline__ void StoreTile(float* out, int ld, int r, int col4, const float (&acc)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    *reinterpret_cast<float4*>(out + (r + 16 * i) * ld + col4) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
  }
}

template <int kRows, int kCols>
__device__ __forceinline__ void Zero(float (&acc)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[i][c] = 0.f;
  }
}

// exp(A·(cs_k − cs_j)) = Π_{i=j+1..k} a_i, and exp(A·cs_k) = Π_{i≤k} a_i; a2 = A·log2(e).
__device__ __forceinline__ float DecayBetween(const float2* cs, int k, int j, float a2) {
  return exp2f(a2 * ((cs[k].x - cs[j].x) + (cs[k].y - cs[j].y)));
}
__device__ __forceinline__ float DecayFromStart(const float2* cs, int k, float a2) {
  return exp2f(a2 * (cs[k].x + cs[k].y));
}

// DecayBetween for the epilogues of the tensor-core kernels, where each lane forms those of its fragment of a strip
// of 16×8 tiles (rows r0 + g and r0 + g + 8, columns c0 + 8q + 2·(lane mod 4) + {0, 1}), from cs loaded once, and
// all of them (the callers select 0 above the diagonal, without a branch): ex2.approx.ftz is exp2f without its
// fixups for results below 2⁻¹²⁶, which become 0 (far below what the float32 sums they enter keep).
template <int kTiles>
struct FragmentDecays {
  float2 row[2], col[kTiles][2];
  __device__ FragmentDecays(const float2* cs, int r0, int c0) {
    const int g = threadIdx.x % kWarpSize / 4, t4 = threadIdx.x % 4;
    row[0] = cs[r0 + g];
    row[1] = cs[r0 + g + 8];
#pragma unroll
    for (int q = 0; q < kTiles; ++q) {
      col[q][0] = cs[c0 + 8 * q + 2 * t4];
      col[q][1] = cs[c0 + 8 * q + 2 * t4 + 1];
    }
  }
  // The decay of element e of tile q's fragment (rows g, g, g + 8, g + 8).
  __device__ float operator()(int q, int e, float a2) const {
    const float2 k = row[e / 2], j = col[q][e % 2];
    float decay;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(decay) : "f"(a2 * ((k.x - j.x) + (k.y - j.y))));
    return decay;
  }
};

// Warp 0 of a block: dt and softplus' of the steps row0.. row0 + len − 1 (zero past len, up to kTile) and cs, the
// running sum of dt, summed in double and kept as float pairs hi + lo: then hi_k − hi_j rounds only once, and the
// decays between any two steps keep their digits without FP64 in the products' epilogues. The loads all go out
// first, so the block waits for one load's latency, not one per 32 steps.
__device__ void StageSteps(const SsmInput& in, size_t row0, int len, int h, float2* cs, float* vdt, float* vdtg) {
  const int lane = threadIdx.x % kWarpSize;
  const float bias = in.dt_bias[h];
  float raw[kTile / kWarpSize];
#pragma unroll
  for (int s = 0; s < kTile / kWarpSize; ++s) {
    const int t = s * kWarpSize + lane;
    raw[s] = t < len ? in.dt_raw[(row0 + t) * in.ld_dt_raw + h] : 0.f;
  }
  double run = 0.0;
#pragma unroll
  for (int s = 0; s < kTile / kWarpSize; ++s) {
    const int t = s * kWarpSize + lane;
    float d = 0.f, g = 0.f;
    if (t < len) {
      const float pre = raw[s] + bias;
      d = Softplus(pre);
      g = SoftplusGrad(pre);
    }
    vdt[t] = d;
    if (vdtg) vdtg[t] = g;
    double v = d;
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const double up = __shfl_up_sync(0xffffffffu, v, offset);
      if (lane >= offset) v += up;
    }
    const double sum = run + v;
    const float hi = static_cast<float>(sum);
    cs[t] = make_float2(hi, static_cast<float>(sum - hi));
    run += __shfl_sync(0xffffffffu, v, kWarpSize - 1);
  }
}

// Column c of row t in the [time][·] arrays of the tensor-core kernels (rows of at least 32 floats): bits 4 and 3 of
// the column flip with bits 0 and 1 of the row. No padding, and no bank conflicts for GramStrip's 16-byte loads (the
// two rows of a quarter warp sit 16 floats apart) nor for MmaStrip's 4-byte loads of 8 columns at 4 consecutive rows.
__device__ __forceinline__ int Swizzled(int t, int c) { return c ^ ((t & 1) << 4) ^ ((t & 2) << 2); }

// dst[t·stride + c] = src[t·ld + c] for t < rows, c < cols, and zero up to padded_rows × padded (by the whole block),
// at column Swizzled(t, c) where `swizzled`. The copies are asynchronous (all of a thread's loads in flight at once):
// callers end the staging with StagingDone().
__device__ void StageRows(const float* src, size_t ld, int rows, int cols, int padded, float* dst, int stride,
                          int padded_rows = kTile, bool swizzled = false) {
  auto at = [&](int t, int c) { return dst + t * stride + (swizzled ? Swizzled(t, c) : c); };
  if (cols % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {  // 16 bytes at a time
    const int chunks = padded / 4;
    for (int i = threadIdx.x; i < padded_rows * chunks; i += blockDim.x) {
      const int t = i / chunks, c = (i - t * chunks) * 4;
      if (t < rows && c < cols) {
        __pipeline_memcpy_async(at(t, c), src + t * ld + c, 4 * sizeof(float));
      } else {
        *reinterpret_cast<float4*>(at(t, c)) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    return;
  }
  for (int i = threadIdx.x; i < padded_rows * padded; i += blockDim.x) {
    const int t = i / padded, c = i % padded;
    if (t < rows && c < cols) {
      __pipeline_memcpy_async(at(t, c), src + t * ld + c, sizeof(float));
    } else {
      *at(t, c) = 0.f;
    }
  }
}

// StageRows into the tensor-core kernels' swizzled [kTile][kWidth] arrays, zero up to kTile × kWidth (so MmaStrip
// may read whole tiles past `cols`), by kTileThreads threads: on the 16-byte path each thread keeps one column and
// walks rows of one swizzle, so a copy costs a few instructions, not a division.
template <int kWidth>
__device__ void StageSwizzled(const float* src, size_t ld, int rows, int cols, float* dst) {
  if (cols % 4 != 0 || ld % 4 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    StageRows(src, ld, rows, cols, kWidth, dst, kWidth, kTile, true);
    return;
  }
  constexpr int kChunks = kWidth / 4, kRowStep = kTileThreads / kChunks;
  static_assert(kTileThreads % kChunks == 0 && kRowStep % 4 == 0 && kTile % kRowStep == 0);
  const int c = threadIdx.x % kChunks * 4, t0 = threadIdx.x / kChunks;
  float* const d = dst + Swizzled(t0, c);  // the rows t0 + kRowStep·r share t0's swizzle
#pragma unroll
  for (int t = t0; t < kTile; t += kRowStep) {
    if (t < rows && c < cols) {
      __pipeline_memcpy_async(d + t * kWidth, src + t * ld + c, 4 * sizeof(float));
    } else {
      *reinterpret_cast<float4*>(d + t * kWidth) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// dst[c·stride + t] = src[t·ld + c]: StageRows transposed (4 bytes at a time), zero up to padded_rows × padded.
__device__ void StageTransposed(const float* src, size_t ld, int rows, int cols, int padded_rows, int padded,
                                float* dst, int stride) {
  for (int i = threadIdx.x; i < padded_rows * padded; i += blockDim.x) {
    const int t = i / padded, c = i % padded;
    if (t < rows && c < cols) {
      __pipeline_memcpy_async(dst + c * stride + t, src + t * ld + c, sizeof(float));
    } else {
      dst[c * stride + t] = 0.f;
    }
  }
}

__device__ __forceinline__ void StagingDone() {
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
}

// w_t = Σ_{k≥t} R[k,t] with R[k,t] = Σ_{j<t} G[k,j] (G [k][j] with row stride sq, read only for j < t ≤ k):
// exclusive scans along the rows (a warp per row, lane l scanning the sums of columns 2l and 2l + 1), then partial
// column sums over k ≡ part (mod 4), added in order into w[t] by thread t (no barrier after it). By the whole block
// of kTileThreads, after a barrier over G; sq even.
__device__ void SumsOfG(float* sg, int sq, float* vwpart, float* vw) {
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  for (int k = warp; k < kTile; k += kTileThreads / kWarpSize) {
    float2* const row = reinterpret_cast<float2*>(sg + k * sq);
    const float2 v = row[lane];
    float sum = v.x + v.y;
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const float up = __shfl_up_sync(0xffffffffu, sum, offset);
      if (lane >= offset) sum += up;
    }
    const float before = __shfl_up_sync(0xffffffffu, sum, 1), e = lane == 0 ? 0.f : before;
    row[lane] = make_float2(e, e + v.x);
  }
  __syncthreads();
  {
    const int t = tid % kTile, part = tid / kTile;
    float sum = 0.f;
    for (int k = t + (part - t % 4 + 4) % 4; k < kTile; k += 4) sum += sg[k * sq + t];
    vwpart[part * kTile + t] = sum;
  }
  __syncthreads();
  if (tid < kTile) vw[tid] = ((vwpart[tid] + vwpart[kTile + tid]) + vwpart[2 * kTile + tid]) + vwpart[3 * kTile + tid];
}

// The backward of one chunk (kChunked) or of a whole window of up to kTile steps. A chunk's start state S adds
// Λ_k·dy_k·S to d C_k and Σ_{k≥t} Λ_k·(dy_k·S·C_k) to w_t; the adjoint dS of its end state adds
// L(end,j)·dt_j·x_jᵀ·dS to d B_j, L(end,j)·dS·B_j to dxb_j and Σ_{j<t} L(end,j)·dt_j·x_jᵀ·dS·B_j + Λ_end·⟨dS, S⟩ to
// w_t — again sums of terms that carry a_t; the start state's adjoint is Λ_end·dS + Σ_k Λ_k·dy_k ⊗ C_k.
template <bool kChunked>
__global__ void __launch_bounds__(kTileThreads, 2)
    SsmTileBackwardKernel(SsmInput in, const float* dy, SsmGrad grad, TileChunk chunk) {
  extern __shared__ double2 shared_tile[];
  const bool with_state = chunk.state != nullptr, with_ds = kChunked && chunk.ds_in != nullptr;
  const TileLayout lay(in, chunk, kChunked);
  float2* cs = reinterpret_cast<float2*>(shared_tile);
  float* const base = reinterpret_cast<float*>(shared_tile);
  float *const sdy = base + lay.dy, *const sx = base + lay.x, *const sm1 = base + lay.m1;
  float *const sm1t = base + lay.m1t, *const sm2t = base + lay.m2t, *const sb = base + lay.b, *const sc = base + lay.c;
  float *const ss = base + lay.s, *const sds = base + lay.ds, *const sdst = base + lay.dst;
  float *const vdt = base + lay.vec, *const vdtg = vdt + kTile, *const vw = vdtg + kTile, *const vdiag = vw + kTile;
  float *const vwpart = vdiag + kTile, *const vzpart = vwpart + 4 * kTile, *const vvpart = vzpart + lay.nc / 4 * kTile;
  float* const vscratch = vvpart + lay.nc / 4 * kTile;
  float* const sg = kChunked ? base + lay.g : sx;  // G, then the d B | d C tile
  float* const sbc = sg;
  float* const sdxb = sm1;                       // dxb once M1 is consumed
  float* const sxf = kChunked ? sx : sm1t;       // x for the last phase
  float* const sdyt = sm1t;                      // chunks: dyᵀ [p][k] once M1ᵀ is consumed

  const int T = in.window, P = in.headdim, N = in.d_state, H = in.heads, E = H * P;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int len = min(kTile, T - chunk.t0);
  const float A = -expf(in.a_log[h]), Dh = in.d_skip[h], a2 = A * 1.44269504f;
  const size_t row0 = static_cast<size_t>(b) * T + chunk.t0;

  // Stage the chunk, zero past its length, headdim and d_state, so that the products need no bounds.
  if (warp == 0) StageSteps(in, row0, len, h, cs, vdt, vdtg);
  StageRows(dy + row0 * E + h * P, E, len, P, lay.pc, sdy, lay.sp);
  StageRows(in.xbc + row0 * in.ld_xbc + h * P, in.ld_xbc, len, P, lay.pc, sx, lay.sp);
  StageRows(in.xbc + row0 * in.ld_xbc + E, in.ld_xbc, len, N, lay.nc, sb, lay.sn);
  StageRows(in.xbc + row0 * in.ld_xbc + E + N, in.ld_xbc, len, N, lay.nc, sc, lay.sn);
  if (with_state) StageRows(chunk.state + StateOffset(in, b, h, 0), N, P, N, lay.nc, ss, lay.sn, lay.pc);
  if (with_ds) {
    StageRows(chunk.ds_in + StateOffset(in, b, h, 0), N, P, N, lay.nc, sds, lay.sn, lay.pc);
    StageTransposed(chunk.ds_in + StateOffset(in, b, h, 0), N, P, N, lay.pc, lay.nc, sdst, lay.sp);
  }
  StagingDone();
  float ds_dot_state = 0.f;  // ⟨dS, S⟩
  if (with_ds && with_state) {
    float part = 0.f;
    for (int i = tid; i < lay.pc * lay.nc; i += kTileThreads) {
      const int p = i / lay.nc, n = i % lay.nc;
      part = fmaf(sds[p * lay.sn + n], ss[p * lay.sn + n], part);
    }
    ds_dot_state = BlockSum(part, vscratch);
  }

  // XD and CB on the lower triangle, then M1, M1ᵀ, M2ᵀ and G = M1·CB strictly below the diagonal.
  {
    const int r = tid % 16, col = tid / 16;
    float xd[4][4], cb[4][4];
    Zero(xd);
    Zero(cb);
    GramTile<true>(sdy, lay.sp, sx, lay.sp, lay.pc, r, col, xd);
    GramTile<true>(sc, lay.sn, sb, lay.sn, lay.nc, r, col, cb);
    if (!kChunked) __syncthreads();  // x is read by all; G takes its place
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int k = r + 16 * i, j = col + 16 * c;
        float m1 = 0.f, m2 = 0.f, g = 0.f;
        if (i >= c && k >= j) {
          const float L = DecayBetween(cs, k, j, a2);
          m1 = L * vdt[j] * xd[i][c];
          m2 = L * cb[i][c];
          if (k > j) g = m1 * cb[i][c];
          if (k == j) vdiag[k] = xd[i][c];
        }
        sm1[k * lay.sq + j] = m1;
        sm1t[j * lay.sq + k] = m1;
        sm2t[j * lay.sq + k] = m2;
        sg[k * lay.sq + j] = g;
      }
    }
  }
  __syncthreads();

  SumsOfG(sg, lay.sq, vwpart, vw);
  // (vw is next read after two more barriers.)

  // d C (rows k) and d B (rows j), into the [t][d B | d C] tile where G was.
  const int bc_slots = 4 * lay.nc;
  for (int slot = tid; slot < 2 * bc_slots; slot += kTileThreads) {
    const bool is_dc = slot < bc_slots;
    const int local = is_dc ? slot : slot - bc_slots, r = local % 16, col4 = local / 16 * 4;
    float acc[4][4];
    Zero(acc);
    if (is_dc) {
      RowTile<Band::kLower>(sm1, lay.sq, sb, lay.sn, kTile, r, col4, acc);
      if (with_state) {
        float st[4][4];
        Zero(st);
        RowTile<Band::kFull>(sdy, lay.sp, ss, lay.sn, lay.pc, r, col4, st);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int k = r + 16 * i;
          const float lam = DecayFromStart(cs, k, a2);
          float z = 0.f;
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            st[i][c] *= lam;
            acc[i][c] += st[i][c];
            z = fmaf(sc[k * lay.sn + col4 + c], st[i][c], z);
          }
          vzpart[col4 / 4 * kTile + k] = z;
        }
      }
    } else {
      RowTile<Band::kUpper>(sm1t, lay.sq, sc, lay.sn, kTile, r, col4, acc);
      if (with_ds) {
        float st[4][4];
        Zero(st);
        RowTile<Band::kFull>(sx, lay.sp, sds, lay.sn, lay.pc, r, col4, st);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int j = r + 16 * i;
          const float coef = DecayBetween(cs, kTile - 1, j, a2) * vdt[j];
          float v = 0.f;
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            st[i][c] *= coef;
            acc[i][c] += st[i][c];
            v = fmaf(sb[j * lay.sn + col4 + c], st[i][c], v);
          }
          vvpart[col4 / 4 * kTile + j] = v;
        }
      }
    }
    StoreTile(sbc, lay.sbc, r, col4 + (is_dc ? lay.nc : 0), acc);
  }
  __syncthreads();
  if (with_state || with_ds) {  // the column groups' partials of z_k and v_j summed in order, into their first row
    if (tid < kTile) {
      float z = 0.f, v = 0.f;
      for (int q = 0; q < lay.nc / 4; ++q) {
        z += with_state ? vzpart[q * kTile + tid] : 0.f;
        v += with_ds ? vvpart[q * kTile + tid] : 0.f;
      }
      vzpart[tid] = z;
      vvpart[tid] = v;
    }
    __syncthreads();
  }
  if (tid == 0 && with_state) {  // w_t += Σ_{k≥t} z_k, z_k = Λ_k·dy_k·S·C_k
    float suffix = 0.f;
    for (int k = kTile - 1; k >= 0; --k) {
      suffix += vzpart[k];
      vw[k] += suffix;
    }
  }
  if (tid == 0 && with_ds) {  // w_t += Σ_{j<t} v_j + Λ_end·⟨dS, S⟩, v_j = L(end,j)·dt_j·x_jᵀ·dS·B_j
    const float end_term = DecayFromStart(cs, kTile - 1, a2) * ds_dot_state;
    float prefix = 0.f;
    for (int t = 0; t < kTile; ++t) {
      vw[t] += prefix + end_term;
      prefix += vvpart[t];
    }
  }

  // dxb (rows j) where M1 was; meanwhile x comes back for the last phase (one window), or dyᵀ and Λ_k·C_k are
  // prepared for the start state's adjoint (chunks).
  if (!kChunked) {
    StageRows(in.xbc + row0 * in.ld_xbc + h * P, in.ld_xbc, len, P, lay.pc, sxf, lay.sp);
  } else if (chunk.ds_out) {
    StageTransposed(dy + row0 * E + h * P, E, len, P, kTile, lay.pc, sdyt, lay.sq);
    for (int i = tid; i < kTile * lay.nc; i += kTileThreads) sc[i / lay.nc * lay.sn + i % lay.nc] *=
        DecayFromStart(cs, i / lay.nc, a2);
  }
  __pipeline_commit();
  for (int slot = tid; slot < 4 * lay.pc; slot += kTileThreads) {
    const int r = slot % 16, col4 = slot / 16 * 4;
    float acc[4][4];
    Zero(acc);
    RowTile<Band::kUpper>(sm2t, lay.sq, sdy, lay.sp, kTile, r, col4, acc);
    if (with_ds) {
      float st[4][4];
      Zero(st);
      RowTile<Band::kFull>(sb, lay.sn, sdst, lay.sp, lay.nc, r, col4, st);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float L = DecayBetween(cs, kTile - 1, r + 16 * i, a2);
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(L, st[i][c], acc[i][c]);
      }
    }
    StoreTile(sdxb, lay.sp, r, col4, acc);
  }
  StagingDone();

  if (kChunked && chunk.ds_out) {  // rows p of the start state's adjoint (headdim ≤ kTile)
    const float lam_end = DecayFromStart(cs, kTile - 1, a2);
    for (int slot = tid; slot < 4 * lay.nc; slot += kTileThreads) {
      const int r = slot % 16, col4 = slot / 16 * 4;
      float acc[4][4];
      Zero(acc);
      RowTile<Band::kFull>(sdyt, lay.sq, sc, lay.sn, kTile, r, col4, acc);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int p = r + 16 * i;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int n = col4 + c;
          if (p >= P || n >= N) continue;
          const float carried = with_ds ? lam_end * sds[p * lay.sn + n] : 0.f;
          chunk.ds_out[StateOffset(in, b, h, p) + n] = acc[i][c] + carried;
        }
      }
    }
  }

  // One warp per step: d xs, d B | d C, d dt_raw and the A_log / D terms.
  for (int t = warp; t < len; t += kTileThreads / kWarpSize) {
    const size_t row = row0 + t;
    const float dt = vdt[t];
    float direct = 0.f;  // Σ_p dxb·x
    for (int p = lane; p < P; p += kWarpSize) {
      const float dxb = sdxb[t * lay.sp + p];
      direct = fmaf(dxb, sxf[t * lay.sp + p], direct);
      grad.dxs[row * E + h * P + p] = sdy[t * lay.sp + p] * Dh + dxb * dt;
    }
    direct = WarpSum(direct);
    float* dbc = grad.dbc + (row * H + h) * 2 * N;
    for (int n = lane; n < 2 * N; n += kWarpSize) dbc[n] = sbc[t * lay.sbc + (n < N ? n : lay.nc + n - N)];
    if (lane == 0) {
      const float w = vw[t];
      grad.d_dt_raw[row * grad.ld_d_dt_raw + h] = (direct + w * A) * vdtg[t];
      grad.param_partials[row * 2 * H + h] = w * dt * A;
      grad.param_partials[row * 2 * H + H + h] = vdiag[t];
    }
  }
}

// ---- Windows of up to kTile steps from a zero state (training), on the tensor cores ----
//
// The products of SsmTileBackwardKernel and SsmTileForwardKernel as float32-accurate 3×TF32 products
// (kernels/tf32x3.cuh) on m16n8k8 tiles. The backward: each warp forms XD and CB for its 16×16 strips of the lower
// triangle and turns them into M1, M2 and G in registers; then d C = M1·B, d B = M1ᵀ·C and dxb = M2ᵀ·dy go from
// shared memory straight to global memory. Σ_p dxb_j·x_j is Σ_k M2[k,j]·XD[k,j], formed with M2, so x is dead after
// the first products and G takes its place, then M1 (kept in registers as XD until G is summed) takes G's.

// Element (r, k) of a [rows][depth] operand at p[r·kRs + k·kKs].
template <int kRs, int kKs>
struct MmaOperand {
  const float* p;
};

// One k-step of 8 for the 16×8 tiles q: big[q] += A_big·B_big, small[q] += A_big·B_small + A_small·B_big, from this
// lane's float32 fragments a and b[q]. The tensor cores truncate their running sum at every mma, so big·big has its
// own accumulator and the cross terms, 2⁻¹¹ of it, another; consecutive mma go to different tiles. kPlainTf32 (the
// `tf32` precision): big·big alone, the operands rounded to TF32, small untouched.
template <bool kPlainTf32, int kTiles>
__device__ __forceinline__ void Mma3xTf32(const float (&a)[4], const float (&b)[kTiles][2], float (&big)[kTiles][4],
                                          float (&small)[kTiles][4]) {
  uint32_t ab[4], as[4], bb[kTiles][2], bs[kTiles][2];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const Tf32Split split = SplitTf32ForMma(a[e]);
    ab[e] = split.big;
    as[e] = split.small;
  }
#pragma unroll
  for (int q = 0; q < kTiles; ++q) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const Tf32Split split = SplitTf32ForMma(b[q][e]);
      bb[q][e] = split.big;
      bs[q][e] = split.small;
    }
  }
#pragma unroll
  for (int q = 0; q < kTiles; ++q) MmaTf32(big[q], ab, bb[q]);
  if constexpr (!kPlainTf32) {
#pragma unroll
    for (int q = 0; q < kTiles; ++q) MmaTf32(small[q], ab, bs[q]);
#pragma unroll
    for (int q = 0; q < kTiles; ++q) MmaTf32(small[q], as, bb[q]);
  }
}

// big[q] + small[q] += Σ_{k0 ≤ k < k1} A(m0 + row, k)·B[k][n0 + q·kNStep + col]: this lane's fragment of 16×8 tile q
// (k1 − k0 a multiple of 8), B a [depth][kLdB] array staged by StageSwizzled. Every tile is formed: B's columns past
// those staged read zeros, and their tiles are not stored.
template <bool kPlainTf32, int kTiles, int kNStep, int kLdB, int kRa, int kKa>
__device__ __forceinline__ void MmaStrip(MmaOperand<kRa, kKa> a, int m0, const float* B, int n0, int k0, int k1,
                                         float (&big)[kTiles][4], float (&small)[kTiles][4]) {
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, t = lane % 4;
  const float* pa = a.p + (m0 + g) * kRa + (k0 + t) * kKa;
  const float* pb = B + (k0 + t) * kLdB;
  // This lane's depths k0 + t + 4u (k0 a multiple of 8) are ≡ t (mod 4), and so share the swizzle of their rows.
  int nb[kTiles];
#pragma unroll
  for (int q = 0; q < kTiles; ++q) nb[q] = Swizzled(t, n0 + g + q * kNStep);
  for (int k = k0; k < k1; k += 8, pa += 8 * kKa, pb += 8 * kLdB) {
    const float av[4] = {pa[0], pa[8 * kRa], pa[4 * kKa], pa[8 * kRa + 4 * kKa]};
    float bv[kTiles][2];
#pragma unroll
    for (int q = 0; q < kTiles; ++q) {
      bv[q][0] = pb[nb[q]];
      bv[q][1] = pb[nb[q] + 4 * kLdB];
    }
    Mma3xTf32<kPlainTf32>(av, bv, big, small);
  }
}

// Component i of v; with i known at compile time (unrolled loops) it is a register, not a local-memory index.
__device__ __forceinline__ float Component(const float4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The Gram strip big[q] + small[q] = Σ_{k < depth} A[m0 + row][k]·B[n0 + 8q + col][k] of two [row][depth] arrays
// staged by StageSwizzled (depth a multiple of 16, m0 and n0 multiples of 8): a lane loads 4 consecutive depths of a
// row with one conflict-free 16-byte load and hands them to two k-steps, as the mma's depth order is free when A and
// B share it.
template <bool kPlainTf32, int kTiles, int kLdA, int kLdB>
__device__ __forceinline__ void GramStrip(const float* A, int m0, const float* B, int n0, int depth,
                                          float (&big)[kTiles][4], float (&small)[kTiles][4]) {
  Zero(big);
  Zero(small);
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, t = lane % 4;
  // Every row this lane reads is ≡ g (mod 8): Swizzled(row, k + 4t) = k ^ Swizzled(g, 4t) for k a multiple of 16.
  const int swizzle = Swizzled(g, 4 * t);
  const float* pa = A + (m0 + g) * kLdA;
  const float* pb = B + (n0 + g) * kLdB;
  for (int k = 0; k < depth; k += 16) {
    const int ks = k ^ swizzle;
    const float4 lo = *reinterpret_cast<const float4*>(pa + ks);
    const float4 hi = *reinterpret_cast<const float4*>(pa + 8 * kLdA + ks);
    float4 bq[kTiles];
#pragma unroll
    for (int q = 0; q < kTiles; ++q) bq[q] = *reinterpret_cast<const float4*>(pb + 8 * q * kLdB + ks);
    // The first k-step takes depths 0 and 1 of each load (x, y), the second depths 2 and 3 (z, w).
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      const float a[4] = {Component(lo, 2 * step), Component(hi, 2 * step), Component(lo, 2 * step + 1),
                          Component(hi, 2 * step + 1)};
      float b[kTiles][2];
#pragma unroll
      for (int q = 0; q < kTiles; ++q) {
        b[q][0] = Component(bq[q], 2 * step);
        b[q][1] = Component(bq[q], 2 * step + 1);
      }
      Mma3xTf32<kPlainTf32>(a, b, big, small);
    }
  }
}

// The 16×16 strips (row block i, columns 16·cp..16·cp + 15, cp ≤ i) that reach the lower triangle of a [time][time]
// array: strip s of the 10, row block i's first at s = i(i + 1)/2.
constexpr int kTimeBlocks = kTile / 16, kLowerStrips = kTimeBlocks * (kTimeBlocks + 1) / 2;
__device__ __forceinline__ int StripRowBlock(int s) { return s < 1 ? 0 : s < 3 ? 1 : s < 6 ? 2 : 3; }
// Strip s's column block, given its row block i.
__device__ __forceinline__ int StripColumnBlock(int s, int i) { return s - i * (i + 1) / 2; }

// The input as a tensor-core kernel instance sees it: with kWhole (TakesWholeTile), a window and headdim of one tile
// and a d_state of kNc as constants, so that the loops' trip counts and the bounds fold away (H200, small: backward
// 11-12% and forward 11-13% fewer instructions; the step 3xtf32 947-950 -> 941 µs, tf32 813-814 -> 810-812).
template <int kNc, bool kWhole>
__device__ __forceinline__ SsmInput TileShape(SsmInput in) {
  if constexpr (kWhole) {
    in.window = kTile;
    in.headdim = kTile;
    in.d_state = kNc;
  }
  return in;
}

// Shared-memory plan of the tensor-core kernels, for d_state up to kNc (32 or 64). Headdim and d_state are padded
// to multiples of 16 (the Gram depth); the [time][p] and [time][n] arrays are swizzled (Swizzled) rows of 64 and kNc
// floats for GramStrip's 16-byte loads, the [time][time] arrays have row strides ≡ 4 (mod 32) for MmaStrip's 4-byte
// loads along rows, M2 (read only down its columns) ≡ 8. Small enough for 3 backward and 4 forward blocks per
// multiprocessor at kNc = 32 (72,192 and 50,944 bytes), which hide each other's staging and barriers.
template <int kNc>
struct MmaLayout {
  static constexpr int kSp = kTile, kSn = kNc, kSq = kTile + 4, kSq2 = kTile + 8;
  int pc, nc;
  __host__ __device__ explicit MmaLayout(const SsmInput& in)
      : pc((in.headdim + 15) / 16 * 16), nc((in.d_state + 15) / 16 * 16) {}
  // The backward: cs (float pairs), dy, x then G then M1, B, C, M2, and per-step vectors: dt, softplus', w, d D, 4
  // partial column sums of w, 4 of Σ_p dxb·x (one per row block).
  static constexpr int kDy = 2 * kTile, kXg = kDy + kTile * kSp, kB = kXg + kTile * kSq, kC = kB + kTile * kSn;
  static constexpr int kM2 = kC + kTile * kSn, kVec = kM2 + kTile * kSq2;
  static constexpr int kBackwardFloats = kVec + 12 * kTile;
  // The forward: cs, x, B, C, M, dt.
  static constexpr int kFx = 2 * kTile, kFb = kFx + kTile * kSp, kFc = kFb + kTile * kSn, kFm = kFc + kTile * kSn;
  static constexpr int kFvec = kFm + kTile * kSq, kForwardFloats = kFvec + kTile;
};

// Stores v0, v1 at out[0], out[1] (out[1] only where `both`), as one 8-byte store where `paired` (out 8-byte aligned).
__device__ __forceinline__ void StorePair(float* out, float v0, float v1, bool paired, bool both) {
  if (paired) {
    *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
  } else {
    out[0] = v0;
    if (both) out[1] = v1;
  }
}

// Stores a strip of m16n8 fragments (tile r's eight columns from col0 + step·r, this thread's two of them from
// col0 + step·r + 2·(lane mod 4)): out[t·ld + c] = value(t, c, big + small) for rows t = row0 + lane / 4 and 8 below
// it, rows < rows and columns < cols, as column pairs where `paired`.
template <int kTiles, class Value>
__device__ __forceinline__ void StoreStrip(float* out, size_t ld, int tiles, int row0, int rows, int col0, int step,
                                           int cols, bool paired, const float (&big)[kTiles][4],
                                           const float (&small)[kTiles][4], Value value) {
  const int g = threadIdx.x % kWarpSize / 4, t4 = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < kTiles; ++r) {
    if (r >= tiles) break;
    const int c = col0 + step * r + 2 * t4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = row0 + g + 8 * half;
      if (t < rows && c < cols) {
        StorePair(out + t * ld + c, value(t, c, big[r][2 * half] + small[r][2 * half]),
                  value(t, c + 1, big[r][2 * half + 1] + small[r][2 * half + 1]), paired, c + 1 < cols);
      }
    }
  }
}

// How the tensor-core forward ends: out[t][p] = value(t, p, Σ_k M[t][k]·V[k][p]) of a lower-triangular [time][time]
// M and a [time][p] V, row stride ld. Warp w takes row blocks w / 4 and 3 − w / 4 (depths of 1 and 4, or 2 and 3
// blocks, whichever side of the diagonal M's depth lies) on column groups 2q and 2q + 1, q = w mod 4;
// product(i, q, big, small) adds row block i's sums into zeroed fragments.
template <class Product, class Value>
__device__ __forceinline__ void RowBlockPasses(int pc, int T, int P, float* out, int ld, Product product,
                                               Value value) {
  const int warp = threadIdx.x / kWarpSize;
  const int q = warp % 4, tiles = min(2, pc / 8 - 2 * q);
  const bool pairs = P % 2 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  for (int pass = 0; pass < 2 && tiles > 0; ++pass) {
    const int i = pass == 0 ? warp / 4 : kTimeBlocks - 1 - warp / 4;
    float big[2][4], small[2][4];
    Zero(big);
    Zero(small);
    product(i, q, big, small);
    StoreStrip(out, ld, tiles, 16 * i, T, 16 * q, 8, P, pairs, big, small, value);
  }
}

template <int kNc, bool kPlainTf32, bool kWhole>
__global__ void __launch_bounds__(kTileThreads, 3)
    SsmMmaBackwardKernel(SsmInput in_arg, const float* dy, SsmGrad grad) {
  const SsmInput in = TileShape<kNc, kWhole>(in_arg);
  extern __shared__ double2 shared_tile[];
  using Layout = MmaLayout<kNc>;
  constexpr int sp = Layout::kSp, sn = Layout::kSn, sq = Layout::kSq, sq2 = Layout::kSq2;
  constexpr int kWarps = kTileThreads / kWarpSize;
  const Layout lay(in);
  float2* cs = reinterpret_cast<float2*>(shared_tile);
  float* const base = reinterpret_cast<float*>(shared_tile);
  float *const sdy = base + Layout::kDy, *const sx = base + Layout::kXg, *const sg = sx, *const sm1 = sx;
  float *const sb = base + Layout::kB, *const sc = base + Layout::kC;
  float *const sm2 = base + Layout::kM2, *const vdt = base + Layout::kVec, *const vdtg = vdt + kTile;
  float *const vw = vdtg + kTile, *const vdiag = vw + kTile, *const vwpart = vdiag + kTile;
  float* const vdirect = vwpart + 4 * kTile;

  const int T = in.window, P = in.headdim, N = in.d_state, H = in.heads, E = H * P;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, warp = tid / kWarpSize;
  const int g = tid % kWarpSize / 4, t4 = tid % 4;
  const size_t row0 = static_cast<size_t>(b) * T;

  // The copies go out first, before any load the warp would wait for (warp 0's StageSteps, the parameters).
  StageSwizzled<sp>(dy + row0 * E + h * P, E, T, P, sdy);
  StageSwizzled<sp>(in.xbc + row0 * in.ld_xbc + h * P, in.ld_xbc, T, P, sx);
  StageSwizzled<sn>(in.xbc + row0 * in.ld_xbc + E, in.ld_xbc, T, N, sb);
  StageSwizzled<sn>(in.xbc + row0 * in.ld_xbc + E + N, in.ld_xbc, T, N, sc);
  if (warp == 0) StageSteps(in, row0, T, h, cs, vdt, vdtg);
  StagingDone();
  const float A = -expf(in.a_log[h]), Dh = in.d_skip[h], a2 = A * 1.44269504f;

  // CB of the strips of the lower triangle (L·CB comes below, with the decays XD needs too), on warps 2..7 (two strips
  // each on 2..5, one on 6 and 7); XD of strip s on warp s mod 8. For `small` (XD twice as deep as CB) every warp
  // forms about the same number of tiles.
  if (warp >= 2) {
    const int first = warp < 6 ? 2 * (warp - 2) : warp + 2, last = warp < 6 ? first + 2 : first + 1;
    for (int strip = first; strip < last; ++strip) {
      const int i = StripRowBlock(strip), cp = StripColumnBlock(strip, i);
      float big[2][4], small[2][4];
      GramStrip<kPlainTf32, 2, sn, sn>(sc, 16 * i, sb, 16 * cp, lay.nc, big, small);
#pragma unroll
      for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int k = 16 * i + g + 8 * (e / 2), j = 16 * cp + 8 * q + 2 * t4 + e % 2;
          sm2[k * sq2 + j] = big[q][e] + small[q][e];
        }
      }
    }
  }
  constexpr int kPerWarp = CeilDiv(kLowerStrips, kWarps);
  float xd[kPerWarp][2][4];
#pragma unroll
  for (int s = 0; s < kPerWarp; ++s) {
    const int strip = warp + s * kWarps;
    if (strip >= kLowerStrips) break;
    const int i = StripRowBlock(strip), cp = StripColumnBlock(strip, i);
    float big[2][4], small[2][4];
    GramStrip<kPlainTf32, 2, sp, sp>(sdy, 16 * i, sx, 16 * cp, lay.pc, big, small);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
#pragma unroll
      for (int e = 0; e < 4; ++e) xd[s][q][e] = big[q][e] + small[q][e];
    }
  }
  __syncthreads();  // x is consumed (G takes its place) and CB is complete

  // On the strips, with each decay L formed once for M2 and M1: M2 = L·CB in CB's place, G = dt_j·XD·M2 (G right of
  // the strips is stale: it reaches only R[k,t] for t > k, never read), each strip's column sums of M2·XD into its row
  // block's partial of Σ_p dxb·x, and M1 = L·dt_j·XD, which waits in XD's registers for G's space.
#pragma unroll
  for (int s = 0; s < kPerWarp; ++s) {
    const int strip = warp + s * kWarps;
    if (strip >= kLowerStrips) break;
    const int i = StripRowBlock(strip), cp = StripColumnBlock(strip, i);
    const FragmentDecays<2> decay(cs, 16 * i, 16 * cp);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      float direct[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 16 * i + g + 8 * (e / 2), j = 16 * cp + 8 * q + 2 * t4 + e % 2;
        const float L = decay(q, e, a2), lcb = L * sm2[k * sq2 + j], m2 = k >= j ? lcb : 0.f;
        const float x = xd[s][q][e], xdt = vdt[j] * x, m1 = L * xdt;
        sm2[k * sq2 + j] = m2;
        sg[k * sq + j] = k > j ? xdt * m2 : 0.f;
        if (k == j) vdiag[k] = x;
        direct[e % 2] = fmaf(m2, x, direct[e % 2]);  // M2 is zero above the diagonal
        xd[s][q][e] = k >= j ? m1 : 0.f;
      }
#pragma unroll
      for (int offset = 4; offset < kWarpSize; offset *= 2) {
        direct[0] += __shfl_xor_sync(0xffffffffu, direct[0], offset);
        direct[1] += __shfl_xor_sync(0xffffffffu, direct[1], offset);
      }
      if (g == 0) {
        const int j = 16 * cp + 8 * q + 2 * t4;
        vdirect[i * kTile + j] = direct[0];
        vdirect[i * kTile + j + 1] = direct[1];
      }
    }
  }
  __syncthreads();
  SumsOfG(sg, sq, vwpart, vw);  // its last reads of G are behind a barrier

  // M1 on the strips, in G's place.
#pragma unroll
  for (int s = 0; s < kPerWarp; ++s) {
    const int strip = warp + s * kWarps;
    if (strip >= kLowerStrips) break;
    const int i = StripRowBlock(strip), cp = StripColumnBlock(strip, i);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 16 * i + g + 8 * (e / 2), j = 16 * cp + 8 * q + 2 * t4 + e % 2;
        sm1[k * sq + j] = xd[s][q][e];
      }
    }
  }

  // Per step: d dt_raw and the A_log / D terms (vw[t] was written by this thread).
  if (tid < T) {
    const int t = tid;
    float direct = 0.f;
    for (int i = t / 16; i < kTimeBlocks; ++i) direct += vdirect[i * kTile + t];
    const size_t row = row0 + t;
    const float w = vw[t];
    grad.d_dt_raw[row * grad.ld_d_dt_raw + h] = (direct + w * A) * vdtg[t];
    grad.param_partials[row * 2 * H + h] = w * vdt[t] * A;
    grad.param_partials[row * 2 * H + H + h] = vdiag[t];
  }

  __syncthreads();  // M1 is complete

  // The products on units of 16 rows × 32 columns, four 16×8 tiles that share each k-step's A fragment and its split:
  // d C and d B of row block i (depths 16(i + 1) and 64 − 16i, 10 k-steps together), then dxb (over k ≥ j) of row
  // blocks i and 3 − i (again 10 k-steps) and d xs = D·dy + dt·dxb. Warp w takes units w, w + 8, ...: at d_state ≤ 32
  // and headdim ≤ 64 four of each, one per warp.
  const int dbc_units = kTimeBlocks * ((lay.nc + 31) / 32), units = dbc_units + 2 * ((lay.pc + 31) / 32);
  const bool dbc_pairs = N % 2 == 0 && reinterpret_cast<uintptr_t>(grad.dbc) % 8 == 0;
  float* const dxs = grad.dxs + row0 * E + h * P;
  const bool dxs_pairs = P % 2 == 0 && reinterpret_cast<uintptr_t>(dxs) % 8 == 0;
  for (int unit = warp; unit < units; unit += kWarps) {
    float big[4][4], small[4][4];
    if (unit < dbc_units) {
      const int i = unit % kTimeBlocks, col0 = 32 * (unit / kTimeBlocks), tiles = min(4, (lay.nc - col0) / 8);
      auto store = [&](int offset) {  // offset 0: d B, N: d C
        StoreStrip(grad.dbc + (row0 * H + h) * 2 * N + offset, static_cast<size_t>(H) * 2 * N, tiles, 16 * i, T, col0,
                   8, N, dbc_pairs, big, small, [](int, int, float v) { return v; });
      };
      Zero(big);
      Zero(small);
      MmaStrip<kPlainTf32, 4, 8, sn>(MmaOperand<sq, 1>{sm1}, 16 * i, sb, col0, 0, 16 * (i + 1), big, small);
      store(N);
      Zero(big);
      Zero(small);
      MmaStrip<kPlainTf32, 4, 8, sn>(MmaOperand<1, sq>{sm1}, 16 * i, sc, col0, 16 * i, kTile, big, small);
      store(0);
    } else {
      const int pair = (unit - dbc_units) % 2, col0 = 32 * ((unit - dbc_units) / 2);
      const int tiles = min(4, (lay.pc - col0) / 8);
      for (int pass = 0; pass < 2; ++pass) {
        const int i = pass == 0 ? pair : kTimeBlocks - 1 - pair;
        Zero(big);
        Zero(small);
        MmaStrip<kPlainTf32, 4, 8, sp>(MmaOperand<1, sq2>{sm2}, 16 * i, sdy, col0, 16 * i, kTile, big, small);
        StoreStrip(dxs, E, tiles, 16 * i, T, col0, 8, P, dxs_pairs, big, small,
                   [&](int j, int p, float dxb) { return sdy[j * sp + Swizzled(j, p)] * Dh + dxb * vdt[j]; });
      }
    }
  }
}

// The forward from a zero state, without the final state: M = L·dt_j·CB on the lower triangle's strips, then
// y = M·x + D·x.
template <int kNc, bool kPlainTf32, bool kWhole>
__global__ void __launch_bounds__(kTileThreads, 4) SsmMmaForwardKernel(SsmInput in_arg, float* y) {
  const SsmInput in = TileShape<kNc, kWhole>(in_arg);
  WaitForPriorKernels();  // the forward's chain (engine/cuda_model.cc): the kernel ahead wrote its input
  LetNextKernelLaunch();
  extern __shared__ double2 shared_tile[];
  using Layout = MmaLayout<kNc>;
  constexpr int sp = Layout::kSp, sn = Layout::kSn, sq = Layout::kSq, kWarps = kTileThreads / kWarpSize;
  const Layout lay(in);
  float2* cs = reinterpret_cast<float2*>(shared_tile);
  float* const base = reinterpret_cast<float*>(shared_tile);
  float *const sx = base + Layout::kFx, *const sb = base + Layout::kFb, *const sc = base + Layout::kFc;
  float *const sm = base + Layout::kFm, *const vdt = base + Layout::kFvec;
  const int T = in.window, P = in.headdim, N = in.d_state, E = in.heads * P;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, warp = tid / kWarpSize;
  const int g = tid % kWarpSize / 4, t4 = tid % 4;
  const size_t row0 = static_cast<size_t>(b) * T;

  // The copies go out first, before any load the warp would wait for (warp 0's StageSteps, the parameters).
  StageSwizzled<sp>(in.xbc + row0 * in.ld_xbc + h * P, in.ld_xbc, T, P, sx);
  StageSwizzled<sn>(in.xbc + row0 * in.ld_xbc + E, in.ld_xbc, T, N, sb);
  StageSwizzled<sn>(in.xbc + row0 * in.ld_xbc + E + N, in.ld_xbc, T, N, sc);
  if (warp == 0) StageSteps(in, row0, T, h, cs, vdt, nullptr);
  StagingDone();
  const float Dh = in.d_skip[h], a2 = -expf(in.a_log[h]) * 1.44269504f;

  // M on kTiles 16×8 tiles of row block i from column c0.
  auto form = [&]<int kTiles>(int i, int c0) {
    float big[kTiles][4], small[kTiles][4];
    GramStrip<kPlainTf32, kTiles, sn, sn>(sc, 16 * i, sb, c0, lay.nc, big, small);
    const FragmentDecays<kTiles> decay(cs, 16 * i, c0);
#pragma unroll
    for (int q = 0; q < kTiles; ++q) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 16 * i + g + 8 * (e / 2), j = c0 + 8 * q + 2 * t4 + e % 2;
        const float m = decay(q, e, a2) * vdt[j] * (big[q][e] + small[q][e]);
        sm[k * sq + j] = k >= j ? m : 0.f;
      }
    }
  };
  // A strip per warp (its A fragments split once for both tiles), then the last two strips' four tiles on warps
  // 0..3: no warp forms more than a strip and a tile.
  static_assert(kLowerStrips > kWarps && kLowerStrips <= 2 * kWarps);
  form.template operator()<2>(StripRowBlock(warp), 16 * StripColumnBlock(warp, StripRowBlock(warp)));
  if (warp < 2 * (kLowerStrips - kWarps)) {
    const int strip = kWarps + warp / 2, i = StripRowBlock(strip);
    form.template operator()<1>(i, 16 * StripColumnBlock(strip, i) + 8 * (warp % 2));
  }
  __syncthreads();

  // y = M·x (over j ≤ k) + D·x.
  RowBlockPasses(
      lay.pc, T, P, y + row0 * E + h * P, E,
      [&](int i, int q, float (&big)[2][4], float (&small)[2][4]) {
        MmaStrip<kPlainTf32, 2, 8, sp>(MmaOperand<sq, 1>{sm}, 16 * i, sx, 16 * q, 0, 16 * (i + 1), big, small);
      },
      [&](int k, int p, float mx) { return fmaf(Dh, sx[k * sp + Swizzled(k, p)], mx); });
}

// For the chunked backward: the state at the end of every chunk but the last, S_c = Λ·S_{c−1} +
// Σ_j L(end,j)·dt_j·x_j ⊗ B_j, into states [chunk][batch, heads, P, N]; one block per (head, sequence), a 4×4 tile of
// the state per thread (headdim, d_state ≤ 64).
__global__ void __launch_bounds__(kTileThreads) SsmChunkStatesKernel(SsmInput in, float* states) {
  extern __shared__ double2 shared_tile[];
  const int T = in.window, P = in.headdim, N = in.d_state, E = in.heads * P;
  const int pc = (P + 3) / 4 * 4, nc = (N + 3) / 4 * 4, sp = pc + 4, sn = nc + 4;
  float2* cs = reinterpret_cast<float2*>(shared_tile);
  float *const sx = reinterpret_cast<float*>(shared_tile) + 2 * kTile, *const sb = sx + kTile * sp;
  float *const vdt = sb + kTile * sn, *const vcoef = vdt + kTile;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const float a2 = -expf(in.a_log[h]) * 1.44269504f;
  const size_t per_chunk = static_cast<size_t>(in.batch) * in.heads * P * N;
  const bool active = tid < (pc / 4) * (nc / 4);
  const int p0 = 4 * (tid % (pc / 4)), n0 = 4 * (tid / (pc / 4));
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int p = p0 + i, n = n0 + c;
      acc[i][c] = (active && in.state_in && p < P && n < N) ? in.state_in[StateOffset(in, b, h, p) + n] : 0.f;
    }
  }
  for (int chunk = 0; (chunk + 1) * kTile < T; ++chunk) {
    const size_t row0 = static_cast<size_t>(b) * T + chunk * kTile;
    if (chunk > 0) __syncthreads();  // the previous chunk's stage is consumed
    if (tid < kWarpSize) StageSteps(in, row0, kTile, h, cs, vdt, nullptr);
    StageRows(in.xbc + row0 * in.ld_xbc + h * P, in.ld_xbc, kTile, P, pc, sx, sp);
    StageRows(in.xbc + row0 * in.ld_xbc + E, in.ld_xbc, kTile, N, nc, sb, sn);
    StagingDone();
    if (tid < kTile) vcoef[tid] = DecayBetween(cs, kTile - 1, tid, a2) * vdt[tid];
    __syncthreads();
    if (!active) continue;
    const float lam = DecayFromStart(cs, kTile - 1, a2);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][c] *= lam;
    }
    for (int j = 0; j < kTile; ++j) {
      const float coef = vcoef[j];
      const float4 xv = *reinterpret_cast<const float4*>(sx + j * sp + p0);
      const float4 bv = *reinterpret_cast<const float4*>(sb + j * sn + n0);
      const float xs[4] = {coef * xv.x, coef * xv.y, coef * xv.z, coef * xv.w}, bn[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(xs[i], bn[c], acc[i][c]);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int p = p0 + i, n = n0 + c;
        if (p < P && n < N) states[chunk * per_chunk + StateOffset(in, b, h, p) + n] = acc[i][c];
      }
    }
  }
}

// The forward of a window of up to kTile steps in the same form: y_k = Σ_{j≤k} L(k,j)·dt_j·CB[k,j]·x_j + D·x_k
// (+ Λ_k·S·C_k), and the final state Σ_j L(T−1,j)·dt_j·x_j ⊗ B_j (+ Λ_{T−1}·S).
struct ForwardTileLayout {
  int pc, nc, sp, sn, sq;
  int x, m, y, b, c, st, vec, floats;  // offsets in floats; st: Sᵀ [n][p]
  __host__ __device__ explicit ForwardTileLayout(const SsmInput& in, bool with_state) {
    pc = (in.headdim + 3) / 4 * 4;
    nc = (in.d_state + 3) / 4 * 4;
    sp = pc + 4;
    sn = nc + 4;
    sq = kTile + 4;
    x = 2 * kTile;  // after cs (float pairs)
    m = x + kTile * sp;
    y = m + kTile * sq;
    b = y + kTile * sp;
    c = b + kTile * sn;
    st = c + kTile * sn;
    vec = st + (with_state ? nc * sp : 0);
    floats = vec + 2 * kTile;  // dt, then L(T−1,j)·dt_j
  }
};

__global__ void __launch_bounds__(kTileThreads, 3) SsmTileForwardKernel(SsmInput in, float* y, float* state_out) {
  WaitForPriorKernels();  // the forward's chain (engine/cuda_model.cc): the kernel ahead wrote its input
  LetNextKernelLaunch();
  extern __shared__ double2 shared_tile[];
  const bool with_state = in.state_in != nullptr;
  const ForwardTileLayout lay(in, with_state);
  float2* cs = reinterpret_cast<float2*>(shared_tile);
  float* const base = reinterpret_cast<float*>(shared_tile);
  float *const sx = base + lay.x, *const sm = base + lay.m, *const sy = base + lay.y, *const sb = base + lay.b;
  float *const sc = base + lay.c, *const sst = base + lay.st, *const vdt = base + lay.vec, *const vcoef = vdt + kTile;
  const int T = in.window, P = in.headdim, N = in.d_state, E = in.heads * P;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const float A = -expf(in.a_log[h]), Dh = in.d_skip[h], a2 = A * 1.44269504f;
  const size_t row0 = static_cast<size_t>(b) * T;

  if (tid < kWarpSize) StageSteps(in, row0, T, h, cs, vdt, nullptr);
  StageRows(in.xbc + row0 * in.ld_xbc + h * P, in.ld_xbc, T, P, lay.pc, sx, lay.sp);
  StageRows(in.xbc + row0 * in.ld_xbc + E, in.ld_xbc, T, N, lay.nc, sb, lay.sn);
  StageRows(in.xbc + row0 * in.ld_xbc + E + N, in.ld_xbc, T, N, lay.nc, sc, lay.sn);
  if (with_state) StageTransposed(in.state_in + StateOffset(in, b, h, 0), N, P, N, lay.pc, lay.nc, sst, lay.sp);
  StagingDone();
  {
    const int r = tid % 16, col = tid / 16;
    float cb[4][4];
    Zero(cb);
    GramTile<true>(sc, lay.sn, sb, lay.sn, lay.nc, r, col, cb);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int k = r + 16 * i, j = col + 16 * c;
        float m = 0.f;
        if (i >= c && k >= j) m = DecayBetween(cs, k, j, a2) * vdt[j] * cb[i][c];
        sm[k * lay.sq + j] = m;
      }
    }
  }
  if (tid < kTile) vcoef[tid] = DecayBetween(cs, kTile - 1, tid, a2) * vdt[tid];
  __syncthreads();
  for (int slot = tid; slot < 4 * lay.pc; slot += kTileThreads) {
    const int r = slot % 16, col4 = slot / 16 * 4;
    float acc[4][4];
    Zero(acc);
    RowTile<Band::kLower>(sm, lay.sq, sx, lay.sp, kTile, r, col4, acc);
    if (with_state) {
      float st[4][4];
      Zero(st);
      RowTile<Band::kFull>(sc, lay.sn, sst, lay.sp, lay.nc, r, col4, st);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float lam = DecayFromStart(cs, r + 16 * i, a2);
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(lam, st[i][c], acc[i][c]);
      }
    }
    StoreTile(sy, lay.sp, r, col4, acc);
  }
  __syncthreads();
  float* const y0 = y + row0 * E + h * P;
  if (P % 4 == 0 && reinterpret_cast<uintptr_t>(y0) % 16 == 0) {
    const int chunks = P / 4;
    for (int i = tid; i < T * chunks; i += kTileThreads) {
      const int t = i / chunks, p = (i - t * chunks) * 4;
      const float4 xv = *reinterpret_cast<const float4*>(sx + t * lay.sp + p);
      const float4 yv = *reinterpret_cast<const float4*>(sy + t * lay.sp + p);
      *reinterpret_cast<float4*>(y0 + static_cast<size_t>(t) * E + p) =
          make_float4(fmaf(Dh, xv.x, yv.x), fmaf(Dh, xv.y, yv.y), fmaf(Dh, xv.z, yv.z), fmaf(Dh, xv.w, yv.w));
    }
  } else {
    for (int i = tid; i < T * P; i += kTileThreads) {
      const int t = i / P, p = i % P;
      y0[static_cast<size_t>(t) * E + p] = fmaf(Dh, sx[t * lay.sp + p], sy[t * lay.sp + p]);
    }
  }
  if (state_out) {
    const float lam = DecayFromStart(cs, kTile - 1, a2);
    for (int i = tid; i < P * N; i += kTileThreads) {
      const int p = i / N, n = i % N;
      float v = with_state ? lam * sst[n * lay.sp + p] : 0.f;
      for (int j = 0; j < T; ++j) v = fmaf(vcoef[j] * sx[j * lay.sp + p], sb[j * lay.sn + n], v);
      state_out[StateOffset(in, b, h, p) + n] = v;
    }
  }
}

template <int kN>
cudaError_t LaunchForward(const SsmInput& in, float* y, float* state_out, cudaStream_t stream, bool programmatic) {
  const size_t bytes = Stage<kN, kForwardStageSteps>::Bytes();
  if (const cudaError_t e = AllowSharedMemory(SsmScanForwardKernel<kN>, bytes); e != cudaSuccess) return e;
  return LaunchKernel(SsmScanForwardKernel<kN>, dim3(in.heads, in.batch), RoundUpToWarp(in.headdim), bytes, stream,
                      programmatic, in, y, state_out);
}

// Runs `launch.template operator()<kN>()` with the smallest compiled state width that holds d_state.
template <typename Launch>
cudaError_t WithStateWidth(int d_state, Launch launch) {
  if (d_state <= 4) return launch.template operator()<4>();
  if (d_state <= 8) return launch.template operator()<8>();
  if (d_state <= 16) return launch.template operator()<16>();
  if (d_state <= 32) return launch.template operator()<32>();
  if (d_state <= kMaxSsmState) return launch.template operator()<kMaxSsmState>();
  return cudaErrorInvalidValue;
}

// Runs `launch.template operator()<kNc>()` with the tensor-core kernels' d_state capacity (32 or 64) that holds d_state.
template <typename Launch>
cudaError_t WithMmaStateWidth(int d_state, Launch launch) {
  return d_state <= 32 ? launch.template operator()<32>() : launch.template operator()<64>();
}

bool ValidShape(const SsmInput& in) {
  return in.batch > 0 && in.window > 0 && in.heads > 0 && in.headdim > 0 && in.headdim <= 1024 && in.d_state > 0 &&
         in.d_state <= kMaxSsmState;
}

// Windows the one-tile kernels take (their shared memory stays within a block's 227 KB for headdim ≤ 128 and
// d_state ≤ 64).
bool FitsTile(const SsmInput& in) { return in.window <= kTile && in.headdim <= 2 * kTile; }

// Whether the tensor-core kernels' instance for one whole tile takes `in` (TileShape; small's layers).
bool TakesWholeTile(const SsmInput& in, int nc) {
  return in.window == kTile && in.headdim == kTile && in.d_state == nc;
}

}  // namespace

cudaError_t LaunchSsmScanForward(const SsmInput& in, float* y, float* state_out, cudaStream_t stream,
                                 bool programmatic) {
  if (!ValidShape(in)) return cudaErrorInvalidValue;
  if (FitsTile(in) && in.state_in == nullptr && state_out == nullptr && in.headdim <= kTile) {
    return WithMmaStateWidth(in.d_state, [&]<int kNc>() {
      constexpr size_t bytes = MmaLayout<kNc>::kForwardFloats * sizeof(float);
      auto* const kernel = WithFlags(in.tf32_products, TakesWholeTile(in, kNc), [&]<bool kTf32, bool kWhole>() {
        return SsmMmaForwardKernel<kNc, kTf32, kWhole>;
      });
      if (const cudaError_t e = AllowSharedMemory(kernel, bytes); e != cudaSuccess) return e;
      return LaunchKernel(kernel, dim3(in.heads, in.batch), kTileThreads, bytes, stream, programmatic, in, y);
    });
  }
  if (FitsTile(in)) {
    const size_t bytes = ForwardTileLayout(in, in.state_in != nullptr).floats * sizeof(float);
    if (const cudaError_t e = AllowSharedMemory(SsmTileForwardKernel, bytes); e != cudaSuccess) return e;
    return LaunchKernel(SsmTileForwardKernel, dim3(in.heads, in.batch), kTileThreads, bytes, stream, programmatic, in,
                        y, state_out);
  }
  return WithStateWidth(in.d_state,
                        [&]<int kN>() { return LaunchForward<kN>(in, y, state_out, stream, programmatic); });
}

cudaError_t LaunchSsmScanBackward(const SsmInput& in, const float* dy, const SsmGrad& grad, cudaStream_t stream) {
  if (!ValidShape(in)) return cudaErrorInvalidValue;
  const dim3 grid(in.heads, in.batch);
  if (FitsTile(in) && in.state_in == nullptr && in.headdim <= kTile) {
    return WithMmaStateWidth(in.d_state, [&]<int kNc>() {
      constexpr size_t bytes = MmaLayout<kNc>::kBackwardFloats * sizeof(float);
      auto* const kernel = WithFlags(in.tf32_products, TakesWholeTile(in, kNc), [&]<bool kTf32, bool kWhole>() {
        return SsmMmaBackwardKernel<kNc, kTf32, kWhole>;
      });
      if (const cudaError_t e = AllowSharedMemory(kernel, bytes); e != cudaSuccess) return e;
      kernel<<<grid, kTileThreads, bytes, stream>>>(in, dy, grad);
      return cudaGetLastError();
    });
  }
  if (FitsTile(in)) {
    const TileChunk whole{0, in.state_in, nullptr, nullptr};
    const size_t bytes = TileLayout(in, whole, false).floats * sizeof(float);
    if (const cudaError_t e = AllowSharedMemory(SsmTileBackwardKernel<false>, bytes); e != cudaSuccess) return e;
    SsmTileBackwardKernel<false><<<grid, kTileThreads, bytes, stream>>>(in, dy, grad, whole);
    return cudaGetLastError();
  }
  if (in.headdim > kMaxSsmHeaddim || grad.scratch == nullptr) return cudaErrorInvalidValue;
  // The states at the chunk boundaries first, then the chunks from the last to the first, each handing the adjoint
  // of its start state to the one before through two alternating buffers.
  const int chunks = CeilDiv(in.window, kTile);
  const size_t per_chunk = static_cast<size_t>(in.batch) * in.heads * in.headdim * in.d_state;
  float* const states = grad.scratch;
  float* const adjoints[2] = {states + (chunks - 1) * per_chunk, states + chunks * per_chunk};
  const int pc = (in.headdim + 3) / 4 * 4, nc = (in.d_state + 3) / 4 * 4;
  const size_t state_bytes = (2 * kTile + kTile * (pc + 4) + kTile * (nc + 4) + 2 * kTile) * sizeof(float);
  if (const cudaError_t e = AllowSharedMemory(SsmChunkStatesKernel, state_bytes); e != cudaSuccess) return e;
  SsmChunkStatesKernel<<<grid, kTileThreads, state_bytes, stream>>>(in, states);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const TileChunk largest{0, states, states, adjoints[0]};
  if (const cudaError_t e = AllowSharedMemory(SsmTileBackwardKernel<true>, TileLayout(in, largest, true).floats * 4);
      e != cudaSuccess) {
    return e;
  }
  for (int c = chunks - 1; c >= 0; --c) {
    const TileChunk chunk{c * kTile, c == 0 ? in.state_in : states + (c - 1) * per_chunk,
                          c == chunks - 1 ? nullptr : adjoints[(c + 1) % 2], c == 0 ? nullptr : adjoints[c % 2]};
    const size_t bytes = TileLayout(in, chunk, true).floats * sizeof(float);
    SsmTileBackwardKernel<true><<<grid, kTileThreads, bytes, stream>>>(in, dy, grad, chunk);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

size_t SsmBackwardScratchFloats(int batch, int window, int heads, int headdim, int d_state) {
  if (window <= kTile) return 0;
  return static_cast<size_t>(CeilDiv(window, kTile) + 1) * batch * heads * headdim * d_state;
}

}  // namespace perception::kernels
