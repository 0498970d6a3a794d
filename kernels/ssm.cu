// The selective scan, two ways.
//
// Windows of up to kTile (64) steps — the training step of `small` — take the quadratic ("SSD") form below: one
// block per (head, sequence) stages the whole window in shared memory and forms the time × time products on the
// FMA pipes, with no sequential dependence at all; its backward computes w_t = a_t·⟨gs_t, s_{t−1}⟩ (for d dt and
// d A_log) as a sum of terms that all carry a_t, so float32 holds it for any decay.
//
// Longer windows take the recurrence: one thread per row p of the head's state s[p, 0..N), which it keeps in
// registers; B, C, dt and the decay of the next steps are staged in shared memory. Its backward needs, at each step
// t walking back in time, the adjoint gs_t = ds_t + dy_t ⊗ C_t (registers again) and w_t. Storing every s_t would
// cost B·T·E·N floats per layer, so instead the exact identity
//     ⟨gs_t, s_t⟩ = a_t·⟨gs_t, s_{t−1}⟩ + ⟨gs_t, u_t⟩,  u_t = dt_t·xs_t ⊗ B_t,  and  ⟨gs_t, s_t⟩ = yC_t + w_{t+1}
// with yC_t = Σ_p dy_t[p]·(s_t[p]·C_t) gives w_t = yC_t + w_{t+1} − dt_t·Σ_p xs_t[p]·(gs_t[p]·B_t): a forward pass
// recomputes the states for yC_t (and d C), a reverse pass carries gs. The subtraction cancels when a_t is tiny,
// and float32 would lose w_t's digits then (relative error ~ε/a_t); both passes therefore run in double, which
// keeps w_t to ~1e-12 for any decay. Per-step sums over p go through shared memory in index order (deterministic).
#include <cuda_pipeline.h>

#include "kernels/common.cuh"
#include "kernels/ssm.h"

namespace perception::kernels {
namespace {

constexpr int kForwardStageSteps = 32, kBackwardStageSteps = 16;

// Per-step inputs of up to kSteps steps, staged for the whole block: B and C as [step][B: kN | C: kN] in type T
// (zero past d_state, so the state loops need no bounds and load 16 bytes at a time), and dt, exp(dt·A), softplus'.
// The backward stages B and C in double, converted once here instead of once per state element.
template <typename T, int kN, int kSteps>
struct Stage {
  T* bc;
  float* dt;
  float* decay;
  float* dt_grad;

  __host__ __device__ static constexpr size_t Bytes() { return kSteps * (2 * kN * sizeof(T) + 3 * sizeof(float)); }
  __device__ static Stage At(void* base) {
    Stage s;
    s.bc = static_cast<T*>(base);
    s.dt = reinterpret_cast<float*>(s.bc + kSteps * 2 * kN);
    s.decay = s.dt + kSteps;
    s.dt_grad = s.decay + kSteps;
    return s;
  }

  // Fills the stage; callers put a __syncthreads before (the previous stage is consumed) and after.
  __device__ void Load(const SsmInput& in, int b, int h, int t0, int len, float A) const {
    const int N = in.d_state, inner = in.heads * in.headdim;
    for (int i = threadIdx.x; i < len * 2 * kN; i += blockDim.x) {
      const int step = i / (2 * kN), half = (i / kN) % 2, n = i % kN;  // half 0: B, 1: C
      const size_t row = static_cast<size_t>(b) * in.window + t0 + step;
      bc[i] = n < N ? static_cast<T>(in.xbc[row * in.ld_xbc + inner + half * N + n]) : T(0);
    }
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
      const size_t row = static_cast<size_t>(b) * in.window + t0 + i;
      const float pre = in.dt_raw[row * in.ld_dt_raw + h] + in.dt_bias[h];
      const float d = Softplus(pre);
      dt[i] = d;
      decay[i] = expf(d * A);
      dt_grad[i] = SoftplusGrad(pre);
    }
  }
};

__device__ __forceinline__ size_t StateOffset(const SsmInput& in, int b, int h, int p) {
  return ((static_cast<size_t>(b) * in.heads + h) * in.headdim + p) * in.d_state;
}

template <int kN>
__global__ void SsmScanForwardKernel(SsmInput in, float* y, float* state_out) {
  extern __shared__ float4 shared_f4[];
  using ForwardStage = Stage<float, kN, kForwardStageSteps>;
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

// Shared memory of the backward: the stage, yC per step, per-warp partial sums (double buffered), and the [N][P+1]
// table whose columns are summed over p (double buffered, padded against bank conflicts).
template <int kN>
struct BackwardShared {
  using BackwardStage = Stage<double, kN, kBackwardStageSteps>;
  BackwardStage stage;
  double* yc;         // [window]
  double* warp_sums;  // [2][warps][3]
  float* columns;     // [2][N][P+1]

  static size_t Bytes(const SsmInput& in, int warps) {
    return BackwardStage::Bytes() + sizeof(double) * (in.window + 2 * warps * 3) +
           sizeof(float) * 2 * in.d_state * (in.headdim + 1);
  }
  __device__ static BackwardShared At(void* base, const SsmInput& in, int warps) {
    BackwardShared s;
    s.stage = BackwardStage::At(base);
    s.yc = reinterpret_cast<double*>(static_cast<char*>(base) + BackwardStage::Bytes());
    s.warp_sums = s.yc + in.window;
    s.columns = reinterpret_cast<float*>(s.warp_sums + 2 * warps * 3);
    return s;
  }
};

// Column n of `columns` summed over p in order, for n = thread, thread + blockDim, ...; out[n] receives it.
__device__ __forceinline__ void SumColumns(const float* columns, int N, int P, float* out) {
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    float sum = 0.f;
    for (int q = 0; q < P; ++q) sum += columns[n * (P + 1) + q];
    out[n] = sum;
  }
}

template <int kN>
__global__ void SsmScanBackwardKernel(SsmInput in, const float* dy, SsmGrad grad) {
  extern __shared__ double2 shared_d2[];
  const int warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const BackwardShared<kN> sh = BackwardShared<kN>::At(shared_d2, in, warps);
  const auto& stage = sh.stage;
  const int N = in.d_state, P = in.headdim, H = in.heads, E = H * P;
  const int h = blockIdx.x, b = blockIdx.y, p = threadIdx.x;
  const bool active = p < P;
  const float A = -expf(in.a_log[h]), Dh = in.d_skip[h];
  int buf = 0;

  // Forward in time: recompute s_t, emit d C_t = Σ_p dy_t[p]·s_t[p], keep yC_t.
  double s[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    s[n] = (active && n < N && in.state_in) ? in.state_in[StateOffset(in, b, h, p) + n] : 0.0;
  }
  for (int t0 = 0; t0 < in.window; t0 += kBackwardStageSteps) {
    const int len = min(kBackwardStageSteps, in.window - t0);
    __syncthreads();
    stage.Load(in, b, h, t0, len, A);
    __syncthreads();
    for (int i = 0; i < len; ++i) {
      const size_t row = static_cast<size_t>(b) * in.window + t0 + i;
      const double x = active ? in.xbc[row * in.ld_xbc + h * P + p] : 0.f;
      const double dyv = active ? dy[row * E + h * P + p] : 0.f;
      const double xv = x * stage.dt[i], decay = stage.decay[i];
      const double2* B2 = reinterpret_cast<const double2*>(stage.bc + i * 2 * kN);
      const double2* C2 = B2 + kN / 2;
      float* columns = sh.columns + buf * N * (P + 1);
      double cs = 0.0;
#pragma unroll
      for (int q = 0; q < kN / 2; ++q) {
        const double2 bq = B2[q], cq = C2[q];
        const double bn[2] = {bq.x, bq.y}, cn[2] = {cq.x, cq.y};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = 2 * q + r;
          s[n] = decay * s[n] + xv * bn[r];
          cs += cn[r] * s[n];
          if (active && n < N) columns[n * (P + 1) + p] = static_cast<float>(dyv * s[n]);
        }
      }
      const double yc = WarpSum(dyv * cs);
      if (lane == 0) sh.warp_sums[(buf * warps + warp) * 3] = yc;
      __syncthreads();
      SumColumns(columns, N, P, grad.dbc + (row * H + h) * 2 * N + N);
      if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < warps; ++w) total += sh.warp_sums[(buf * warps + w) * 3];
        sh.yc[t0 + i] = total;
      }
      buf ^= 1;
    }
  }

  // Backward in time: carry the adjoint, emit d xs, d B, d dt_raw and the A_log / D terms.
  double ds[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) ds[n] = 0.0;
  double w_next = 0.0;  // w_{t+1}, kept by thread 0
  for (int t0 = (in.window - 1) / kBackwardStageSteps * kBackwardStageSteps; t0 >= 0; t0 -= kBackwardStageSteps) {
    const int len = min(kBackwardStageSteps, in.window - t0);
    __syncthreads();
    stage.Load(in, b, h, t0, len, A);
    __syncthreads();
    for (int i = len - 1; i >= 0; --i) {
      const size_t row = static_cast<size_t>(b) * in.window + t0 + i;
      const double x = active ? in.xbc[row * in.ld_xbc + h * P + p] : 0.f;
      const double dyv = active ? dy[row * E + h * P + p] : 0.f;
      const double dt = stage.dt[i], decay = stage.decay[i], xdt = x * dt;
      const double2* B2 = reinterpret_cast<const double2*>(stage.bc + i * 2 * kN);
      const double2* C2 = B2 + kN / 2;
      float* columns = sh.columns + buf * N * (P + 1);
      double dxb = 0.0;  // Σ_n gs[p,n]·B[n]
#pragma unroll
      for (int q = 0; q < kN / 2; ++q) {
        const double2 bq = B2[q], cq = C2[q];
        const double bn[2] = {bq.x, bq.y}, cn[2] = {cq.x, cq.y};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = 2 * q + r;
          const double gs = ds[n] + dyv * cn[r];
          dxb += gs * bn[r];
          if (active && n < N) columns[n * (P + 1) + p] = static_cast<float>(gs * xdt);
          ds[n] = gs * decay;
        }
      }
      if (active) grad.dxs[row * E + h * P + p] = static_cast<float>(dyv * Dh + dxb * dt);
      const double gu = WarpSum(xdt * dxb), dt_direct = WarpSum(dxb * x), d_skip = WarpSum(dyv * x);
      if (lane == 0) {
        double* slot = sh.warp_sums + (buf * warps + warp) * 3;
        slot[0] = gu;
        slot[1] = dt_direct;
        slot[2] = d_skip;
      }
      __syncthreads();
      SumColumns(columns, N, P, grad.dbc + (row * H + h) * 2 * N);
      if (threadIdx.x == 0) {
        double gu_total = 0.0, dt_total = 0.0, d_total = 0.0;
        for (int w = 0; w < warps; ++w) {
          const double* slot = sh.warp_sums + (buf * warps + w) * 3;
          gu_total += slot[0];
          dt_total += slot[1];
          d_total += slot[2];
        }
        const double w_t = w_next + sh.yc[t0 + i] - gu_total;  // a_t·⟨gs_t, s_{t−1}⟩
        w_next = w_t;
        const double d_dt = dt_total + w_t * A;
        grad.d_dt_raw[row * grad.ld_d_dt_raw + h] = static_cast<float>(d_dt * stage.dt_grad[i]);
        grad.param_partials[row * 2 * H + h] = static_cast<float>(w_t * dt * A);
        grad.param_partials[row * 2 * H + H + h] = static_cast<float>(d_total);
      }
      buf ^= 1;
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

// Shared-memory plan of one block, the same on the host and the device. Strides are ≡ 4 (mod 32) floats so that
// 16-byte loads of 8 consecutive rows hit distinct banks.
struct TileLayout {
  int pc, nc;          // headdim and d_state padded to multiples of 4
  int sp, sn, sq, sbc;  // row strides of [t][p], [t][n], [t][t] and the [t][d B | d C] output
  int dy, xg, m1, m1t, m2t, b, c, s, vec, floats;  // offsets in floats (xg: x, then G, then the d B | d C output)

  __host__ __device__ explicit TileLayout(const SsmInput& in, bool with_state) {
    pc = (in.headdim + 3) / 4 * 4;
    nc = (in.d_state + 3) / 4 * 4;
    sp = pc + 4;
    sn = nc + 4;
    sq = kTile + 4;
    sbc = 2 * nc + 4;
    const int rows_tt = kTile * sq, rows_p = kTile * sp;
    dy = 2 * kTile;  // after cs, kTile doubles
    xg = dy + rows_p;
    m1 = xg + Max(Max(rows_p, rows_tt), kTile * sbc);
    m1t = m1 + Max(rows_tt, rows_p);
    m2t = m1t + Max(rows_tt, rows_p);
    b = m2t + rows_tt;
    c = b + kTile * sn;
    s = c + kTile * sn;
    vec = s + (with_state ? pc * sn : 0);
    floats = vec + kTileVectors * kTile + (nc / 4) * kTile;
  }
  // Per-step vectors after `vec`: dt, softplus', w, d D, and 4 partial column sums of w.
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

// Warp 0 of a block: dt and softplus' of the window's steps (zero past T) and cs, the running sum of dt in double.
__device__ void StageSteps(const SsmInput& in, int b, int h, double* cs, float* vdt, float* vdtg) {
  const int lane = threadIdx.x % kWarpSize;
  const size_t row0 = static_cast<size_t>(b) * in.window;
  double run = 0.0;
  for (int t0 = 0; t0 < kTile; t0 += kWarpSize) {
    const int t = t0 + lane;
    float d = 0.f, g = 0.f;
    if (t < in.window) {
      const float pre = in.dt_raw[(row0 + t) * in.ld_dt_raw + h] + in.dt_bias[h];
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
    cs[t] = run + v;
    run += __shfl_sync(0xffffffffu, v, kWarpSize - 1);
  }
}

// dst[t·stride + c] = src[t·ld + c] for t < rows, c < cols, and zero up to padded_rows × padded (by the whole block).
// The copies are asynchronous (all of a thread's loads in flight at once): callers end the staging with StagingDone().
__device__ void StageRows(const float* src, size_t ld, int rows, int cols, int padded, float* dst, int stride,
                          int padded_rows = kTile) {
  for (int i = threadIdx.x; i < padded_rows * padded; i += blockDim.x) {
    const int t = i / padded, c = i % padded;
    if (t < rows && c < cols) {
      __pipeline_memcpy_async(dst + t * stride + c, src + t * ld + c, sizeof(float));
    } else {
      dst[t * stride + c] = 0.f;
    }
  }
}

__device__ __forceinline__ void StagingDone() {
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
}

__global__ void __launch_bounds__(kTileThreads, 2) SsmTileBackwardKernel(SsmInput in, const float* dy, SsmGrad grad) {
  extern __shared__ double2 shared_tile[];
  const bool with_state = in.state_in != nullptr;
  const TileLayout lay(in, with_state);
  double* cs = reinterpret_cast<double*>(shared_tile);
  float* const base = reinterpret_cast<float*>(shared_tile);
  float *const sdy = base + lay.dy, *const sx = base + lay.xg, *const sm1 = base + lay.m1;
  float *const sm1t = base + lay.m1t, *const sm2t = base + lay.m2t, *const sb = base + lay.b, *const sc = base + lay.c;
  float *const ss = base + lay.s, *const vdt = base + lay.vec, *const vdtg = vdt + kTile, *const vw = vdtg + kTile;
  float *const vdiag = vw + kTile, *const vwpart = vdiag + kTile, *const vzpart = vwpart + 4 * kTile;
  float* const sg = sx;    // G once x is consumed, then the d B | d C tile
  float* const sbc = sx;
  float* const sdxb = sm1;  // dxb once M1 is consumed
  float* const sxf = sm1t;  // x again once M1ᵀ is consumed

  const int T = in.window, P = in.headdim, N = in.d_state, H = in.heads, E = H * P;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const float A = -expf(in.a_log[h]), Dh = in.d_skip[h];
  const size_t row0 = static_cast<size_t>(b) * T;

  // Stage the window, zero past T, headdim and d_state, so that the products need no bounds.
  if (warp == 0) StageSteps(in, b, h, cs, vdt, vdtg);
  StageRows(dy + row0 * E + h * P, E, T, P, lay.pc, sdy, lay.sp);
  StageRows(in.xbc + row0 * in.ld_xbc + h * P, in.ld_xbc, T, P, lay.pc, sx, lay.sp);
  StageRows(in.xbc + row0 * in.ld_xbc + E, in.ld_xbc, T, N, lay.nc, sb, lay.sn);
  StageRows(in.xbc + row0 * in.ld_xbc + E + N, in.ld_xbc, T, N, lay.nc, sc, lay.sn);
  if (with_state) StageRows(in.state_in + StateOffset(in, b, h, 0), N, P, N, lay.nc, ss, lay.sn, lay.pc);
  StagingDone();

  // XD and CB on the lower triangle, then M1, M1ᵀ, M2ᵀ and G = M1·CB strictly below the diagonal.
  {
    const int r = tid % 16, col = tid / 16;
    float xd[4][4], cb[4][4];
    Zero(xd);
    Zero(cb);
    GramTile<true>(sdy, lay.sp, sx, lay.sp, lay.pc, r, col, xd);
    GramTile<true>(sc, lay.sn, sb, lay.sn, lay.nc, r, col, cb);
    __syncthreads();  // x is read by all; G takes its place
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int k = r + 16 * i, j = col + 16 * c;
        float m1 = 0.f, m2 = 0.f, g = 0.f;
        if (i >= c && k >= j) {
          const float L = expf(static_cast<float>(static_cast<double>(A) * (cs[k] - cs[j])));
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

  // w_t = Σ_{k≥t} R[k,t] with R[k,t] = Σ_{j<t} G[k,j]: exclusive scans along the rows (a warp per row), then
  // partial column sums over k ≡ part (mod 4), added in order.
  for (int k = warp; k < kTile; k += kTileThreads / kWarpSize) {
    float* row = sg + k * lay.sq;
    float v0 = row[lane], v1 = row[lane + kWarpSize];
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const float u0 = __shfl_up_sync(0xffffffffu, v0, offset), u1 = __shfl_up_sync(0xffffffffu, v1, offset);
      if (lane >= offset) {
        v0 += u0;
        v1 += u1;
      }
    }
    const float total0 = __shfl_sync(0xffffffffu, v0, kWarpSize - 1);
    const float e0 = __shfl_up_sync(0xffffffffu, v0, 1), e1 = __shfl_up_sync(0xffffffffu, v1, 1);
    row[lane] = lane == 0 ? 0.f : e0;
    row[lane + kWarpSize] = lane == 0 ? total0 : total0 + e1;
  }
  __syncthreads();
  {
    const int t = tid % kTile, part = tid / kTile;
    float sum = 0.f;
    for (int k = t + (part - t % 4 + 4) % 4; k < kTile; k += 4) sum += sg[k * lay.sq + t];
    vwpart[part * kTile + t] = sum;
  }
  __syncthreads();
  if (tid < kTile) vw[tid] = ((vwpart[tid] + vwpart[kTile + tid]) + vwpart[2 * kTile + tid]) + vwpart[3 * kTile + tid];
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
          const float lam = expf(static_cast<float>(static_cast<double>(A) * cs[k]));
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
    }
    StoreTile(sbc, lay.sbc, r, col4 + (is_dc ? lay.nc : 0), acc);
  }
  __syncthreads();
  if (with_state && tid == 0) {  // w_t += Σ_{k≥t} z_k, z_k = Λ_k·dy_k·S·C_k
    float suffix = 0.f;
    for (int k = kTile - 1; k >= 0; --k) {
      float z = 0.f;
      for (int q = 0; q < lay.nc / 4; ++q) z += vzpart[q * kTile + k];
      suffix += z;
      vw[k] += suffix;
    }
  }

  // dxb (rows j) where M1 was, while x comes back for the last phase where M1ᵀ was.
  StageRows(in.xbc + row0 * in.ld_xbc + h * P, in.ld_xbc, T, P, lay.pc, sxf, lay.sp);
  __pipeline_commit();
  for (int slot = tid; slot < 4 * lay.pc; slot += kTileThreads) {
    const int r = slot % 16, col4 = slot / 16 * 4;
    float acc[4][4];
    Zero(acc);
    RowTile<Band::kUpper>(sm2t, lay.sq, sdy, lay.sp, kTile, r, col4, acc);
    StoreTile(sdxb, lay.sp, r, col4, acc);
  }
  StagingDone();

  // One warp per step: d xs, d B | d C, d dt_raw and the A_log / D terms.
  for (int t = warp; t < T; t += kTileThreads / kWarpSize) {
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
    x = 2 * kTile;  // after cs
    m = x + kTile * sp;
    y = m + kTile * sq;
    b = y + kTile * sp;
    c = b + kTile * sn;
    st = c + kTile * sn;
    vec = st + (with_state ? nc * sp : 0);
    floats = vec + 2 * kTile;  // dt, then L(T−1,j)·dt_j
  }
};

__global__ void __launch_bounds__(kTileThreads, 2) SsmTileForwardKernel(SsmInput in, float* y, float* state_out) {
  extern __shared__ double2 shared_tile[];
  const bool with_state = in.state_in != nullptr;
  const ForwardTileLayout lay(in, with_state);
  double* cs = reinterpret_cast<double*>(shared_tile);
  float* const base = reinterpret_cast<float*>(shared_tile);
  float *const sx = base + lay.x, *const sm = base + lay.m, *const sy = base + lay.y, *const sb = base + lay.b;
  float *const sc = base + lay.c, *const sst = base + lay.st, *const vdt = base + lay.vec, *const vcoef = vdt + kTile;
  const int T = in.window, P = in.headdim, N = in.d_state, E = in.heads * P;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const float A = -expf(in.a_log[h]), Dh = in.d_skip[h];
  const size_t row0 = static_cast<size_t>(b) * T;

  if (tid < kWarpSize) StageSteps(in, b, h, cs, vdt, nullptr);
  StageRows(in.xbc + row0 * in.ld_xbc + h * P, in.ld_xbc, T, P, lay.pc, sx, lay.sp);
  StageRows(in.xbc + row0 * in.ld_xbc + E, in.ld_xbc, T, N, lay.nc, sb, lay.sn);
  StageRows(in.xbc + row0 * in.ld_xbc + E + N, in.ld_xbc, T, N, lay.nc, sc, lay.sn);
  if (with_state) {
    for (int i = tid; i < lay.nc * lay.pc; i += kTileThreads) {
      const int n = i / lay.pc, p = i % lay.pc;
      sst[n * lay.sp + p] = (p < P && n < N) ? in.state_in[StateOffset(in, b, h, p) + n] : 0.f;
    }
  }
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
        if (i >= c && k >= j) m = expf(static_cast<float>(static_cast<double>(A) * (cs[k] - cs[j]))) * vdt[j] * cb[i][c];
        sm[k * lay.sq + j] = m;
      }
    }
  }
  if (tid < kTile) vcoef[tid] = expf(static_cast<float>(static_cast<double>(A) * (cs[kTile - 1] - cs[tid]))) * vdt[tid];
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
        const float lam = expf(static_cast<float>(static_cast<double>(A) * cs[r + 16 * i]));
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(lam, st[i][c], acc[i][c]);
      }
    }
    StoreTile(sy, lay.sp, r, col4, acc);
  }
  __syncthreads();
  for (int i = tid; i < T * P; i += kTileThreads) {
    const int t = i / P, p = i % P;
    y[(row0 + t) * E + h * P + p] = fmaf(Dh, sx[t * lay.sp + p], sy[t * lay.sp + p]);
  }
  if (state_out) {
    const float lam = expf(static_cast<float>(static_cast<double>(A) * cs[kTile - 1]));
    for (int i = tid; i < P * N; i += kTileThreads) {
      const int p = i / N, n = i % N;
      float v = with_state ? lam * sst[n * lay.sp + p] : 0.f;
      for (int j = 0; j < T; ++j) v = fmaf(vcoef[j] * sx[j * lay.sp + p], sb[j * lay.sn + n], v);
      state_out[StateOffset(in, b, h, p) + n] = v;
    }
  }
}

template <int kN>
cudaError_t LaunchForward(const SsmInput& in, float* y, float* state_out, cudaStream_t stream) {
  const size_t bytes = Stage<float, kN, kForwardStageSteps>::Bytes();
  if (const cudaError_t e = AllowSharedMemory(SsmScanForwardKernel<kN>, bytes); e != cudaSuccess) return e;
  SsmScanForwardKernel<kN><<<dim3(in.heads, in.batch), RoundUpToWarp(in.headdim), bytes, stream>>>(in, y, state_out);
  return cudaGetLastError();
}

template <int kN>
cudaError_t LaunchBackward(const SsmInput& in, const float* dy, const SsmGrad& grad, cudaStream_t stream) {
  const int threads = RoundUpToWarp(in.headdim);
  const size_t bytes = BackwardShared<kN>::Bytes(in, threads / kWarpSize);
  if (const cudaError_t e = AllowSharedMemory(SsmScanBackwardKernel<kN>, bytes); e != cudaSuccess) return e;
  SsmScanBackwardKernel<kN><<<dim3(in.heads, in.batch), threads, bytes, stream>>>(in, dy, grad);
  return cudaGetLastError();
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

bool ValidShape(const SsmInput& in) {
  return in.batch > 0 && in.window > 0 && in.heads > 0 && in.headdim > 0 && in.headdim <= 1024 && in.d_state > 0;
}

// Windows the one-tile kernels take (their shared memory stays within a block's 227 KB for headdim ≤ 128).
bool FitsTile(const SsmInput& in) { return in.window <= kTile && in.headdim <= 2 * kTile; }

}  // namespace

cudaError_t LaunchSsmScanForward(const SsmInput& in, float* y, float* state_out, cudaStream_t stream) {
  if (!ValidShape(in)) return cudaErrorInvalidValue;
  if (FitsTile(in)) {
    const size_t bytes = ForwardTileLayout(in, in.state_in != nullptr).floats * sizeof(float);
    if (const cudaError_t e = AllowSharedMemory(SsmTileForwardKernel, bytes); e != cudaSuccess) return e;
    SsmTileForwardKernel<<<dim3(in.heads, in.batch), kTileThreads, bytes, stream>>>(in, y, state_out);
    return cudaGetLastError();
  }
  return WithStateWidth(in.d_state, [&]<int kN>() { return LaunchForward<kN>(in, y, state_out, stream); });
}

cudaError_t LaunchSsmScanBackward(const SsmInput& in, const float* dy, const SsmGrad& grad, cudaStream_t stream) {
  if (!ValidShape(in)) return cudaErrorInvalidValue;
  if (FitsTile(in)) {
    const size_t bytes = TileLayout(in, in.state_in != nullptr).floats * sizeof(float);
    if (const cudaError_t e = AllowSharedMemory(SsmTileBackwardKernel, bytes); e != cudaSuccess) return e;
    SsmTileBackwardKernel<<<dim3(in.heads, in.batch), kTileThreads, bytes, stream>>>(in, dy, grad);
    return cudaGetLastError();
  }
  return WithStateWidth(in.d_state, [&]<int kN>() { return LaunchBackward<kN>(in, dy, grad, stream); });
}

}  // namespace perception::kernels
