// Row normalizations, one warp per row, instantiated per V = values per lane: lane l keeps V columns of its row in
// registers (runs of four consecutive columns, read and written as float4, where the rows allow), so a row is read
// from memory once, with all of a lane's loads in flight together. Row sums are warp butterflies; the backward blocks
// own a fixed range of rows and add their warps' weight-gradient sums in warp order, so every result is
// deterministic. The formulas follow engine/cpu_reference.cc term by term.
#include <cstdint>
#include <initializer_list>

#include "kernels/common.cuh"
#include "kernels/loss.cuh"
#include "kernels/norms.h"

namespace perception::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kRowsPerWarp = 4;  // backward only: rows whose weight gradients a lane sums before the block adds them
constexpr int kBlockRows = kWarps * kRowsPerWarp;
static_assert(kBlockRows == kNormPartialBlockRows);

__device__ __forceinline__ int Warp() { return threadIdx.x / kWarpSize; }

// A lane's V values of a row come in runs of VW consecutive columns: value j sits in column Column<VW>(j), so a warp
// reads each run as one coalesced vector load per lane (VW = 4: float4), a quarter of the load instructions of
// scalar columns. VW > 1 needs cols % 4 == 0 and every row start on a 16-byte boundary (the launchers check).
template <int VW>
__device__ __forceinline__ int Column(int j) {
  return j / VW * (kWarpSize * VW) + Lane() * VW + j % VW;
}

// The forward kernels: one row per warp.
__device__ __forceinline__ int ForwardRow() { return blockIdx.x * kWarps + Warp(); }
dim3 ForwardGrid(int rows) { return dim3(CeilDiv(rows, kWarps)); }
// The backward kernels: rows blockIdx.x·kBlockRows + warp + kWarps·k for k < kRowsPerWarp.
__device__ __forceinline__ int BackwardRow(int k) { return blockIdx.x * kBlockRows + Warp() + kWarps * k; }

// Columns past `cols` read as 0.
template <int V, int VW>
__device__ __forceinline__ void LoadRow(const float* row, int cols, float (&out)[V]) {
  static_assert(V % VW == 0 && (VW == 1 || VW == 2 || VW == 4));
#pragma unroll
  for (int j = 0; j < V; j += VW) {
    const int i = Column<VW>(j);
    if constexpr (VW == 4) {
      const float4 q = i < cols ? *reinterpret_cast<const float4*>(row + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      out[j] = q.x;
      out[j + 1] = q.y;
      out[j + 2] = q.z;
      out[j + 3] = q.w;
    } else if constexpr (VW == 2) {
      const float2 q = i < cols ? *reinterpret_cast<const float2*>(row + i) : make_float2(0.f, 0.f);
      out[j] = q.x;
      out[j + 1] = q.y;
    } else {
      out[j] = i < cols ? row[i] : 0.f;
    }
  }
}

// Weight (or bias) of a lane's value j, 0 past cols: a parameter tensor, aligned to a float only, read by scalar
// loads where it is used (held in registers across rows it would crowd out the rows of the widest instances).
template <int VW>
__device__ __forceinline__ float WeightAt(const float* w, int j, int cols) {
  const int i = Column<VW>(j);
  return i < cols ? w[i] : 0.f;
}

template <int V, int VW>
__device__ __forceinline__ void StoreRow(float* row, int cols, const float (&v)[V]) {
#pragma unroll
  for (int j = 0; j < V; j += VW) {
    const int i = Column<VW>(j);
    if (i >= cols) break;
    if constexpr (VW == 4) {
      *reinterpret_cast<float4*>(row + i) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
    } else if constexpr (VW == 2) {
      *reinterpret_cast<float2*>(row + i) = make_float2(v[j], v[j + 1]);
    } else {
      row[i] = v[j];
    }
  }
}

// Blocks of an RMSNorm backward an SM must hold: two at 16 values a lane (at most 128 registers a thread), where the
// compiler would otherwise take a few more and drop `large`'s 512-wide rows to one block an SM.
template <int V>
constexpr int kBackwardMinBlocks = V == 16 ? 2 : 1;

__device__ __forceinline__ float RowRstd(float sum_squares, int cols) {
  return 1.f / sqrtf(sum_squares / static_cast<float>(cols) + kNormEps);
}

// Adds every warp's per-lane sums `acc` (column Column<VW>(j) in acc[j]) in warp order and writes the totals of the
// first `cols` columns to out. Every thread of the block must call it.
template <int V, int VW>
__device__ void WriteBlockSums(const float (&acc)[V], int cols, float* out) {
  __shared__ float scratch[kWarps][V][kWarpSize];
#pragma unroll
  for (int j = 0; j < V; ++j) scratch[Warp()][j][Lane()] = acc[j];
  __syncthreads();
  for (int i = threadIdx.x; i < cols; i += kThreads) {
    const int j = i / (kWarpSize * VW) * VW + i % VW, lane = i % (kWarpSize * VW) / VW;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += scratch[w][j][lane];
    out[i] = total;
  }
  __syncthreads();  // scratch may be reused by a following call
}

template <int V, int VW>
__global__ void __launch_bounds__(kThreads) RmsNormForwardKernel(const float* v, int ldv, const float* w, int rows,
                                                                 int cols, float* y, int ldy, float* rstd,
                                                                 float* residual) {
  WaitForPriorKernels();  // the forward's chain (engine/cuda_model.cc): the kernel ahead wrote the rows
  LetNextKernelLaunch();
  const int row = ForwardRow();
  if (row >= rows) return;  // whole warps leave together
  float vr[V];
  LoadRow<V, VW>(v + static_cast<size_t>(row) * ldv, cols, vr);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) ss += vr[j] * vr[j];
  const float r = RowRstd(WarpSum(ss), cols);
  float out[V];
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = vr[j] * r * WeightAt<VW>(w, j, cols);
  StoreRow<V, VW>(y + static_cast<size_t>(row) * ldy, cols, out);
  if (residual) StoreRow<V, VW>(residual + static_cast<size_t>(row) * cols, cols, vr);
  if (Lane() == 0) rstd[row] = r;
}

template <int V, int VW>
__global__ void __launch_bounds__(kThreads, kBackwardMinBlocks<V>)
    RmsNormBackwardKernel(const float* v, int ldv, const float* w, const float* rstd, const float* dy, int lddy,
                          int rows, int cols, bool accumulate, float* dv, int lddv, float* dw_partials,
                          float* dv_partials) {
  float dw[V] = {}, dv_sum[V] = {};
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int row = BackwardRow(k);
    if (row >= rows) break;
    float vr[V], dyr[V], old[V];
    LoadRow<V, VW>(v + static_cast<size_t>(row) * ldv, cols, vr);
    LoadRow<V, VW>(dy + static_cast<size_t>(row) * lddy, cols, dyr);
    if (accumulate) LoadRow<V, VW>(dv + static_cast<size_t>(row) * lddv, cols, old);
    const float r = rstd[row];
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) dot += dyr[j] * WeightAt<VW>(w, j, cols) * vr[j];
    dot = WarpSum(dot);
    const float coef = r * r * r * dot / static_cast<float>(cols);
    float out[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = r * dyr[j] * WeightAt<VW>(w, j, cols) - vr[j] * coef;
      out[j] = accumulate ? old[j] + g : g;
      dw[j] += dyr[j] * vr[j] * r;
      dv_sum[j] += out[j];
    }
    StoreRow<V, VW>(dv + static_cast<size_t>(row) * lddv, cols, out);
  }
  WriteBlockSums<V, VW>(dw, cols, dw_partials + static_cast<size_t>(blockIdx.x) * cols);
  if (dv_partials) WriteBlockSums<V, VW>(dv_sum, cols, dv_partials + static_cast<size_t>(blockIdx.x) * cols);
}

template <int V, int VW>
__global__ void __launch_bounds__(kThreads) GatedRmsNormForwardKernel(const float* y, const float* z, int ldz,
                                                                      const float* w, int rows, int cols, float* yn,
                                                                      float* rstd) {
  WaitForPriorKernels();  // the forward's chain (engine/cuda_model.cc): the kernel ahead wrote the rows
  LetNextKernelLaunch();
  const int row = ForwardRow();
  if (row >= rows) return;
  const size_t base = static_cast<size_t>(row) * cols;
  float q[V], zr[V];
  LoadRow<V, VW>(y + base, cols, q);
  LoadRow<V, VW>(z + static_cast<size_t>(row) * ldz, cols, zr);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    q[j] *= Silu(zr[j]);
    ss += q[j] * q[j];
  }
  const float r = RowRstd(WarpSum(ss), cols);
#pragma unroll
  for (int j = 0; j < V; ++j) q[j] = q[j] * r * WeightAt<VW>(w, j, cols);
  StoreRow<V, VW>(yn + base, cols, q);
  if (Lane() == 0) rstd[row] = r;
}

template <int V, int VW>
__global__ void __launch_bounds__(kThreads)
    GatedRmsNormBackwardKernel(const float* dyn, const float* rstd, const float* w, const float* y, const float* z,
                               int ldz, int rows, int cols, float* dy, float* dz, int lddz, float* dw_partials) {
  float dw[V] = {};
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int row = BackwardRow(k);
    if (row >= rows) break;
    const size_t base = static_cast<size_t>(row) * cols;
    float g[V], yr[V], zr[V];
    LoadRow<V, VW>(dyn + base, cols, g);
    LoadRow<V, VW>(y + base, cols, yr);
    LoadRow<V, VW>(z + static_cast<size_t>(row) * ldz, cols, zr);
    const float r = rstd[row];
    float q[V], sz[V], dot = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sz[j] = Silu(zr[j]);
      q[j] = yr[j] * sz[j];
      dot += g[j] * WeightAt<VW>(w, j, cols) * q[j];
    }
    dot = WarpSum(dot);
    const float coef = r * r * r * dot / static_cast<float>(cols);
    float dyo[V], dzo[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float dq = r * g[j] * WeightAt<VW>(w, j, cols) - q[j] * coef;
      dyo[j] = dq * sz[j];
      dzo[j] = dq * yr[j] * SiluGrad(zr[j]);
      dw[j] += g[j] * q[j] * r;
    }
    StoreRow<V, VW>(dy + static_cast<size_t>(row) * cols, cols, dyo);
    StoreRow<V, VW>(dz + static_cast<size_t>(row) * lddz, cols, dzo);
  }
  WriteBlockSums<V, VW>(dw, cols, dw_partials + static_cast<size_t>(blockIdx.x) * cols);
}

// Logits a warp sums at once: their butterflies interleave, one shuffle's latency covering the others'.
constexpr int kLogitsPerPass = 8;

template <int V, int VW>
__global__ void __launch_bounds__(kThreads)
    GrnGateLayerNormForwardKernel(const float* pre_ln, const float* gate_pre, const float* value, const float* w,
                                  const float* b, NormOutputLayer layer, LogitGradient grad, int rows, int cols,
                                  float* nhat, float* g, float* rstd, float* logits) {
  WaitForPriorKernels();  // the forward's chain (engine/cuda_model.cc): the kernel ahead wrote the rows
  LetNextKernelLaunch();
  const int row = ForwardRow();
  if (row >= rows) return;  // whole warps leave together
  // The count, and this lane's label and mask of the first pass of logits below, loaded before the row: their
  // latency hides behind the row's instead of following it.
  float label = 0.f, mask = 0.f;
  if (grad.dlogits && Lane() < kLogitsPerPass && Lane() < layer.outs) {
    label = grad.labels[static_cast<size_t>(row) * layer.outs + Lane()];
    mask = grad.mask[static_cast<size_t>(row) * layer.outs + Lane()];
  }
  const float denom = grad.dlogits ? static_cast<float>(fmax(*grad.mask_count, 1.0)) : 1.f;
  const size_t base = static_cast<size_t>(row) * cols;
  float x[V], gate[V], val[V];
  LoadRow<V, VW>(pre_ln + base, cols, x);
  LoadRow<V, VW>(gate_pre + base, cols, gate);
  LoadRow<V, VW>(value + base, cols, val);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    x[j] += Sigmoid(gate[j]) * val[j];
    sum += x[j];
  }
  const float mean = WarpSum(sum) / static_cast<float>(cols);
  float var = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float d = x[j] - mean;
    var += Column<VW>(j) < cols ? d * d : 0.f;
  }
  const float r = 1.f / sqrtf(WarpSum(var) / static_cast<float>(cols) + kNormEps);
  float n[V], out[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    n[j] = (x[j] - mean) * r;
    out[j] = n[j] * WeightAt<VW>(w, j, cols) + WeightAt<VW>(b, j, cols);
  }
  StoreRow<V, VW>(nhat + base, cols, n);
  StoreRow<V, VW>(g + base, cols, out);
  if (Lane() == 0) rstd[row] = r;
  // The output layer from the g in registers (padded columns of g are 0): each logit a warp sum in WarpSum's order,
  // kLogitsPerPass of them at once; lane o then holds logit k0 + o and stores it and its gradient.
  for (int k0 = 0; k0 < layer.outs; k0 += kLogitsPerPass) {
    float dot[kLogitsPerPass];
#pragma unroll
    for (int o = 0; o < kLogitsPerPass; ++o) {
      dot[o] = 0.f;
      if (k0 + o < layer.outs) {
        const float* w_out = layer.w + static_cast<size_t>(k0 + o) * cols;
#pragma unroll
        for (int j = 0; j < V; ++j) dot[o] += out[j] * WeightAt<VW>(w_out, j, cols);
      }
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int o = 0; o < kLogitsPerPass; ++o) {
        if (k0 + o < layer.outs) dot[o] += __shfl_xor_sync(0xffffffffu, dot[o], offset);  // warp-uniform test
      }
    }
    float mine = 0.f;
#pragma unroll
    for (int o = 0; o < kLogitsPerPass; ++o) mine = Lane() == o ? dot[o] : mine;
    const int k = k0 + Lane();
    if (Lane() < kLogitsPerPass && k < layer.outs) {
      const size_t i = static_cast<size_t>(row) * layer.outs + k;
      const float logit = mine + layer.b[k];
      logits[i] = logit;
      if (grad.dlogits) {
        if (k0 > 0) {
          label = grad.labels[i];
          mask = grad.mask[i];
        }
        grad.dlogits[i] = MaskedBceGradient(logit, label, mask, denom);
      }
    }
  }
}

template <int V, int VW>
__global__ void __launch_bounds__(kThreads)
    GrnGateLayerNormBackwardKernel(const float* dlogits, NormOutputLayer layer, const float* nhat, const float* rstd,
                                   const float* w, const float* gate_pre, const float* value, int rows, int cols,
                                   float* d_pre_ln, float* d_gate_pre, float* d_value, int ldd, float* partials) {
  float dw[V] = {}, db[V] = {}, dgate[V] = {}, dval[V] = {};
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int row = BackwardRow(k);
    if (row >= rows) break;
    const size_t base = static_cast<size_t>(row) * cols;
    float dgr[V] = {}, n[V], gate[V], val[V];
    LoadRow<V, VW>(nhat + base, cols, n);
    LoadRow<V, VW>(gate_pre + base, cols, gate);
    LoadRow<V, VW>(value + base, cols, val);
    // dg = d logits · w_out, the output layer's input gradient (0 in padded columns), logits in order, a pass's
    // loads first.
    for (int k0 = 0; k0 < layer.outs; k0 += kLogitsPerPass) {
      float dl[kLogitsPerPass];
#pragma unroll
      for (int o = 0; o < kLogitsPerPass; ++o) {
        dl[o] = k0 + o < layer.outs ? dlogits[static_cast<size_t>(row) * layer.outs + k0 + o] : 0.f;
      }
#pragma unroll
      for (int o = 0; o < kLogitsPerPass; ++o) {
        if (k0 + o < layer.outs) {
          const float* w_out = layer.w + static_cast<size_t>(k0 + o) * cols;
#pragma unroll
          for (int j = 0; j < V; ++j) dgr[j] += dl[o] * WeightAt<VW>(w_out, j, cols);
        }
      }
    }
    const float r = rstd[row];
    float mean_dn = 0.f, mean_dn_n = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float dn = dgr[j] * WeightAt<VW>(w, j, cols);
      mean_dn += dn;
      mean_dn_n += dn * n[j];
    }
    mean_dn = WarpSum(mean_dn) / static_cast<float>(cols);
    mean_dn_n = WarpSum(mean_dn_n) / static_cast<float>(cols);
    float dpre[V], dv[V], dgt[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      dpre[j] = r * (dgr[j] * WeightAt<VW>(w, j, cols) - mean_dn - n[j] * mean_dn_n);
      const float sg = Sigmoid(gate[j]);
      dv[j] = dpre[j] * sg;
      dgt[j] = dpre[j] * val[j] * sg * (1.f - sg);
      // Padded columns hold 0 in every input but dpre (−r·mean_dn): keep them out of the sums.
      if (Column<VW>(j) < cols) {
        dw[j] += dgr[j] * n[j];
        db[j] += dgr[j];
        dgate[j] += dgt[j];
        dval[j] += dv[j];
      }
    }
    const size_t out_base = static_cast<size_t>(row) * ldd;
    StoreRow<V, VW>(d_pre_ln + out_base, cols, dpre);
    StoreRow<V, VW>(d_value + out_base, cols, dv);
    StoreRow<V, VW>(d_gate_pre + out_base, cols, dgt);
  }
  float* out = partials + static_cast<size_t>(blockIdx.x) * 4 * cols;
  WriteBlockSums<V, VW>(dw, cols, out);
  WriteBlockSums<V, VW>(db, cols, out + cols);
  WriteBlockSums<V, VW>(dgate, cols, out + 2 * cols);
  WriteBlockSums<V, VW>(dval, cols, out + 3 * cols);
}

// Whether every row of the given matrices starts on a 16-byte boundary and the rows are whole float4s: then the
// kernels read and write them as vectors.
bool Vectorizable(int cols, std::initializer_list<const float*> bases, std::initializer_list<int> strides) {
  if (cols % 4 != 0) return false;
  for (const float* p : bases) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  for (const int ld : strides) {
    if (ld % 4 != 0) return false;
  }
  return true;
}

// Calls op.template operator()<V, VW>() with the fewest values per lane V that hold `cols`, in runs of
// VW = min(4, V) columns when `vectorizable`, else of single columns.
template <typename Op>
cudaError_t ForRowWidth(int cols, bool vectorizable, Op&& op) {
  if (cols < 1) return cudaErrorInvalidValue;
  auto run = [&]<int V>() {
    constexpr int kVector = V < 4 ? V : 4;
    return vectorizable ? op.template operator()<V, kVector>() : op.template operator()<V, 1>();
  };
  if (cols <= 2 * kWarpSize) return run.template operator()<2>();
  if (cols <= 4 * kWarpSize) return run.template operator()<4>();
  if (cols <= 8 * kWarpSize) return run.template operator()<8>();
  if (cols <= 16 * kWarpSize) return run.template operator()<16>();
  if (cols <= 32 * kWarpSize) return run.template operator()<32>();
  return cudaErrorInvalidValue;
}
static_assert(kMaxNormWidth == 32 * kWarpSize, "ForRowWidth's widest instance is kMaxNormWidth");

}  // namespace

int NormPartialRows(int rows) { return CeilDiv(rows, kBlockRows); }

cudaError_t LaunchRmsNormForward(const float* v, int ldv, const float* w, int rows, int cols, float* y, int ldy,
                                 float* rstd, float* residual, cudaStream_t stream, bool programmatic) {
  const bool vec = Vectorizable(cols, {v, y, residual}, {ldv, ldy});
  return ForRowWidth(cols, vec, [&]<int V, int VW>() {
    return LaunchKernel(RmsNormForwardKernel<V, VW>, ForwardGrid(rows), kThreads, 0, stream, programmatic, v, ldv, w,
                        rows, cols, y, ldy, rstd, residual);
  });
}

cudaError_t LaunchRmsNormBackward(const float* v, int ldv, const float* w, const float* rstd, const float* dy,
                                  int lddy, int rows, int cols, bool accumulate, float* dv, int lddv,
                                  float* dw_partials, float* dv_partials, cudaStream_t stream) {
  const bool vec = Vectorizable(cols, {v, dy, dv}, {ldv, lddy, lddv});
  return ForRowWidth(cols, vec, [&]<int V, int VW>() {
    RmsNormBackwardKernel<V, VW><<<NormPartialRows(rows), kThreads, 0, stream>>>(
        v, ldv, w, rstd, dy, lddy, rows, cols, accumulate, dv, lddv, dw_partials, dv_partials);
    return cudaGetLastError();
  });
}

cudaError_t LaunchGatedRmsNormForward(const float* y, const float* z, int ldz, const float* w, int rows, int cols,
                                      float* yn, float* rstd, cudaStream_t stream, bool programmatic) {
  const bool vec = Vectorizable(cols, {y, z, yn}, {ldz});
  return ForRowWidth(cols, vec, [&]<int V, int VW>() {
    return LaunchKernel(GatedRmsNormForwardKernel<V, VW>, ForwardGrid(rows), kThreads, 0, stream, programmatic, y, z,
                        ldz, w, rows, cols, yn, rstd);
  });
}

cudaError_t LaunchGatedRmsNormBackward(const float* dyn, const float* rstd, const float* w, const float* y,
                                       const float* z, int ldz, int rows, int cols, float* dy, float* dz, int lddz,
                                       float* dw_partials, cudaStream_t stream) {
  const bool vec = Vectorizable(cols, {dyn, y, z, dy, dz}, {ldz, lddz});
  return ForRowWidth(cols, vec, [&]<int V, int VW>() {
    GatedRmsNormBackwardKernel<V, VW><<<NormPartialRows(rows), kThreads, 0, stream>>>(
        dyn, rstd, w, y, z, ldz, rows, cols, dy, dz, lddz, dw_partials);
    return cudaGetLastError();
  });
}

cudaError_t LaunchGrnGateLayerNormForward(const float* pre_ln, const float* gate_pre, const float* value,
                                          const float* w, const float* b, const NormOutputLayer& out,
                                          const LogitGradient& grad, int rows, int cols, float* nhat, float* g,
                                          float* rstd, float* logits, cudaStream_t stream, bool programmatic) {
  const bool vec = Vectorizable(cols, {pre_ln, gate_pre, value, nhat, g}, {});
  return ForRowWidth(cols, vec, [&]<int V, int VW>() {
    return LaunchKernel(GrnGateLayerNormForwardKernel<V, VW>, ForwardGrid(rows), kThreads, 0, stream, programmatic,
                        pre_ln, gate_pre, value, w, b, out, grad, rows, cols, nhat, g, rstd, logits);
  });
}

cudaError_t LaunchGrnGateLayerNormBackward(const float* dlogits, const NormOutputLayer& out, const float* nhat,
                                           const float* rstd, const float* w, const float* gate_pre,
                                           const float* value, int rows, int cols, float* d_pre_ln,
                                           float* d_gate_pre, float* d_value, int ldd, float* partials,
                                           cudaStream_t stream) {
  if (ldd < cols) return cudaErrorInvalidValue;
  const bool vec = Vectorizable(cols, {nhat, gate_pre, value, d_pre_ln, d_gate_pre, d_value}, {ldd});
  return ForRowWidth(cols, vec, [&]<int V, int VW>() {
    GrnGateLayerNormBackwardKernel<V, VW><<<NormPartialRows(rows), kThreads, 0, stream>>>(
        dlogits, out, nhat, rstd, w, gate_pre, value, rows, cols, d_pre_ln, d_gate_pre, d_value, ldd, partials);
    return cudaGetLastError();
  });
}

}  // namespace perception::kernels
