// Row normalizations, one warp per row, instantiated per V = values per lane: lane l keeps columns l + 32j (j < V)
// of its row in registers, so a row is read from memory once, with all of a lane's loads in flight together. Row
// sums are warp butterflies; the backward blocks own a fixed range of rows and add their warps' weight-gradient
// sums in warp order, so every result is deterministic. The formulas follow engine/cpu_reference.cc term by term.
#include "kernels/common.cuh"
#include "kernels/norms.h"

namespace perception::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kRowsPerWarp = 4;  // backward only: rows whose weight gradients a lane sums before the block adds them
constexpr int kBlockRows = kWarps * kRowsPerWarp;

__device__ __forceinline__ int Warp() { return threadIdx.x / kWarpSize; }
__device__ __forceinline__ int Lane() { return threadIdx.x % kWarpSize; }
__device__ __forceinline__ int Column(int j) { return Lane() + j * kWarpSize; }

// The forward kernels: one row per warp.
__device__ __forceinline__ int ForwardRow() { return blockIdx.x * kWarps + Warp(); }
dim3 ForwardGrid(int rows) { return dim3(CeilDiv(rows, kWarps)); }
// The backward kernels: rows blockIdx.x·kBlockRows + warp + kWarps·k for k < kRowsPerWarp.
__device__ __forceinline__ int BackwardRow(int k) { return blockIdx.x * kBlockRows + Warp() + kWarps * k; }

template <int V>
__device__ __forceinline__ void LoadRow(const float* row, int cols, float (&out)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = Column(j) < cols ? row[Column(j)] : 0.f;
}

__device__ __forceinline__ float RowRstd(float sum_squares, int cols) {
  return 1.f / sqrtf(sum_squares / static_cast<float>(cols) + kNormEps);
}

// Adds every warp's per-lane sums `acc` (column Column(j) in acc[j]) in warp order and writes the totals of the
// first `cols` columns to out. Every thread of the block must call it.
template <int V>
__device__ void WriteBlockSums(const float (&acc)[V], int cols, float* out) {
  __shared__ float scratch[kWarps][V][kWarpSize];
#pragma unroll
  for (int j = 0; j < V; ++j) scratch[Warp()][j][Lane()] = acc[j];
  __syncthreads();
  for (int i = threadIdx.x; i < cols; i += kThreads) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += scratch[w][i / kWarpSize][i % kWarpSize];
    out[i] = total;
  }
  __syncthreads();  // scratch may be reused by a following call
}

template <int V>
__global__ void __launch_bounds__(kThreads) RmsNormForwardKernel(const float* v, int ldv, const float* w, int rows,
                                                                 int cols, float* y, int ldy, float* rstd,
                                                                 float* residual) {
  const int row = ForwardRow();
  if (row >= rows) return;  // whole warps leave together
  float vr[V];
  LoadRow(v + static_cast<size_t>(row) * ldv, cols, vr);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) ss += vr[j] * vr[j];
  const float r = RowRstd(WarpSum(ss), cols);
  float* yr = y + static_cast<size_t>(row) * ldy;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = Column(j);
    if (i >= cols) break;
    yr[i] = vr[j] * r * w[i];
    if (residual) residual[static_cast<size_t>(row) * cols + i] = vr[j];
  }
  if (Lane() == 0) rstd[row] = r;
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    RmsNormBackwardKernel(const float* v, int ldv, const float* w, const float* rstd, const float* dy, int lddy,
                          int rows, int cols, bool accumulate, float* dv, int lddv, float* dw_partials) {
  float dw[V] = {};
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int row = BackwardRow(k);
    if (row >= rows) break;
    float vr[V], dyr[V];
    LoadRow(v + static_cast<size_t>(row) * ldv, cols, vr);
    LoadRow(dy + static_cast<size_t>(row) * lddy, cols, dyr);
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) dot += Column(j) < cols ? dyr[j] * w[Column(j)] * vr[j] : 0.f;
    dot = WarpSum(dot);
    const float r = rstd[row];
    const float coef = r * r * r * dot / static_cast<float>(cols);
    float* dvr = dv + static_cast<size_t>(row) * lddv;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = Column(j);
      if (i >= cols) break;
      const float g = r * dyr[j] * w[i] - vr[j] * coef;
      dvr[i] = accumulate ? dvr[i] + g : g;
      dw[j] += dyr[j] * vr[j] * r;
    }
  }
  WriteBlockSums(dw, cols, dw_partials + static_cast<size_t>(blockIdx.x) * cols);
}

template <int V>
__global__ void __launch_bounds__(kThreads) GatedRmsNormForwardKernel(const float* y, const float* z, int ldz,
                                                                      const float* w, int rows, int cols, float* yn,
                                                                      float* rstd) {
  const int row = ForwardRow();
  if (row >= rows) return;
  const size_t base = static_cast<size_t>(row) * cols;
  float q[V], zr[V];
  LoadRow(y + base, cols, q);
  LoadRow(z + static_cast<size_t>(row) * ldz, cols, zr);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    q[j] *= Silu(zr[j]);
    ss += q[j] * q[j];
  }
  const float r = RowRstd(WarpSum(ss), cols);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = Column(j);
    if (i >= cols) break;
    yn[base + i] = q[j] * r * w[i];
  }
  if (Lane() == 0) rstd[row] = r;
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    GatedRmsNormBackwardKernel(const float* dyn, const float* rstd, const float* w, const float* y, const float* z,
                               int ldz, int rows, int cols, float* dy, float* dz, int lddz, float* dw_partials) {
  float dw[V] = {};
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int row = BackwardRow(k);
    if (row >= rows) break;
    const size_t base = static_cast<size_t>(row) * cols;
    float g[V], yr[V], zr[V], q[V];
    LoadRow(dyn + base, cols, g);
    LoadRow(y + base, cols, yr);
    LoadRow(z + static_cast<size_t>(row) * ldz, cols, zr);
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      q[j] = yr[j] * Silu(zr[j]);
      dot += Column(j) < cols ? g[j] * w[Column(j)] * q[j] : 0.f;
    }
    dot = WarpSum(dot);
    const float r = rstd[row];
    const float coef = r * r * r * dot / static_cast<float>(cols);
    float* dzr = dz + static_cast<size_t>(row) * lddz;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = Column(j);
      if (i >= cols) break;
      const float dq = r * g[j] * w[i] - q[j] * coef;
      dy[base + i] = dq * Silu(zr[j]);
      dzr[i] = dq * yr[j] * SiluGrad(zr[j]);
      dw[j] += g[j] * q[j] * r;
    }
  }
  WriteBlockSums(dw, cols, dw_partials + static_cast<size_t>(blockIdx.x) * cols);
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    GrnGateLayerNormForwardKernel(float* pre_ln, const float* gate_pre, const float* value, const float* w,
                                  const float* b, int rows, int cols, float* nhat, float* g, float* rstd) {
  const int row = ForwardRow();
  if (row >= rows) return;
  const size_t base = static_cast<size_t>(row) * cols;
  float x[V], gate[V], val[V];
  LoadRow(pre_ln + base, cols, x);
  LoadRow(gate_pre + base, cols, gate);
  LoadRow(value + base, cols, val);
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
    var += Column(j) < cols ? d * d : 0.f;
  }
  const float r = 1.f / sqrtf(WarpSum(var) / static_cast<float>(cols) + kNormEps);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = Column(j);
    if (i >= cols) break;
    const float n = (x[j] - mean) * r;
    pre_ln[base + i] = x[j];
    nhat[base + i] = n;
    g[base + i] = n * w[i] + b[i];
  }
  if (Lane() == 0) rstd[row] = r;
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    GrnGateLayerNormBackwardKernel(const float* dg, const float* nhat, const float* rstd, const float* w,
                                   const float* gate_pre, const float* value, int rows, int cols, float* d_pre_ln,
                                   float* d_gate_pre, float* d_value, float* partials) {
  float dw[V] = {}, db[V] = {}, dgate[V] = {}, dval[V] = {};
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int row = BackwardRow(k);
    if (row >= rows) break;
    const size_t base = static_cast<size_t>(row) * cols;
    float dgr[V], n[V], gate[V], val[V];
    LoadRow(dg + base, cols, dgr);
    LoadRow(nhat + base, cols, n);
    LoadRow(gate_pre + base, cols, gate);
    LoadRow(value + base, cols, val);
    float mean_dn = 0.f, mean_dn_n = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float dn = Column(j) < cols ? dgr[j] * w[Column(j)] : 0.f;
      mean_dn += dn;
      mean_dn_n += dn * n[j];
    }
    mean_dn = WarpSum(mean_dn) / static_cast<float>(cols);
    mean_dn_n = WarpSum(mean_dn_n) / static_cast<float>(cols);
    const float r = rstd[row];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = Column(j);
      if (i >= cols) break;
      const float dpre = r * (dgr[j] * w[i] - mean_dn - n[j] * mean_dn_n);
      const float sg = Sigmoid(gate[j]);
      const float dv = dpre * sg, dgt = dpre * val[j] * sg * (1.f - sg);
      d_pre_ln[base + i] = dpre;
      d_value[base + i] = dv;
      d_gate_pre[base + i] = dgt;
      dw[j] += dgr[j] * n[j];
      db[j] += dgr[j];
      dgate[j] += dgt;
      dval[j] += dv;
    }
  }
  float* out = partials + static_cast<size_t>(blockIdx.x) * 4 * cols;
  WriteBlockSums(dw, cols, out);
  WriteBlockSums(db, cols, out + cols);
  WriteBlockSums(dgate, cols, out + 2 * cols);
  WriteBlockSums(dval, cols, out + 3 * cols);
}

// Calls op.template operator()<V>() with the fewest values per lane that hold `cols`.
template <typename Op>
cudaError_t ForRowWidth(int cols, Op&& op) {
  if (cols < 1) return cudaErrorInvalidValue;
  if (cols <= 2 * kWarpSize) return op.template operator()<2>();
  if (cols <= 4 * kWarpSize) return op.template operator()<4>();
  if (cols <= 8 * kWarpSize) return op.template operator()<8>();
  if (cols <= 16 * kWarpSize) return op.template operator()<16>();
  if (cols <= 32 * kWarpSize) return op.template operator()<32>();
  return cudaErrorInvalidValue;
}
static_assert(kMaxNormWidth == 32 * kWarpSize, "ForRowWidth's widest instance is kMaxNormWidth");

}  // namespace

int NormPartialRows(int rows) { return CeilDiv(rows, kBlockRows); }

cudaError_t LaunchRmsNormForward(const float* v, int ldv, const float* w, int rows, int cols, float* y, int ldy,
                                 float* rstd, float* residual, cudaStream_t stream) {
  return ForRowWidth(cols, [&]<int V>() {
    RmsNormForwardKernel<V><<<ForwardGrid(rows), kThreads, 0, stream>>>(v, ldv, w, rows, cols, y, ldy, rstd,
                                                                         residual);
    return cudaGetLastError();
  });
}

cudaError_t LaunchRmsNormBackward(const float* v, int ldv, const float* w, const float* rstd, const float* dy,
                                  int lddy, int rows, int cols, bool accumulate, float* dv, int lddv,
                                  float* dw_partials, cudaStream_t stream) {
  return ForRowWidth(cols, [&]<int V>() {
    RmsNormBackwardKernel<V><<<NormPartialRows(rows), kThreads, 0, stream>>>(v, ldv, w, rstd, dy, lddy, rows, cols,
                                                                              accumulate, dv, lddv, dw_partials);
    return cudaGetLastError();
  });
}

cudaError_t LaunchGatedRmsNormForward(const float* y, const float* z, int ldz, const float* w, int rows, int cols,
                                      float* yn, float* rstd, cudaStream_t stream) {
  return ForRowWidth(cols, [&]<int V>() {
    GatedRmsNormForwardKernel<V><<<ForwardGrid(rows), kThreads, 0, stream>>>(y, z, ldz, w, rows, cols, yn, rstd);
    return cudaGetLastError();
  });
}

cudaError_t LaunchGatedRmsNormBackward(const float* dyn, const float* rstd, const float* w, const float* y,
                                       const float* z, int ldz, int rows, int cols, float* dy, float* dz, int lddz,
                                       float* dw_partials, cudaStream_t stream) {
  return ForRowWidth(cols, [&]<int V>() {
    GatedRmsNormBackwardKernel<V><<<NormPartialRows(rows), kThreads, 0, stream>>>(dyn, rstd, w, y, z, ldz, rows, cols,
                                                                                   dy, dz, lddz, dw_partials);
    return cudaGetLastError();
  });
}

cudaError_t LaunchGrnGateLayerNormForward(float* pre_ln, const float* gate_pre, const float* value, const float* w,
                                          const float* b, int rows, int cols, float* nhat, float* g, float* rstd,
                                          cudaStream_t stream) {
  return ForRowWidth(cols, [&]<int V>() {
    GrnGateLayerNormForwardKernel<V><<<ForwardGrid(rows), kThreads, 0, stream>>>(pre_ln, gate_pre, value, w, b, rows,
                                                                                  cols, nhat, g, rstd);
    return cudaGetLastError();
  });
}

cudaError_t LaunchGrnGateLayerNormBackward(const float* dg, const float* nhat, const float* rstd, const float* w,
                                           const float* gate_pre, const float* value, int rows, int cols,
                                           float* d_pre_ln, float* d_gate_pre, float* d_value, float* partials,
                                           cudaStream_t stream) {
  return ForRowWidth(cols, [&]<int V>() {
    GrnGateLayerNormBackwardKernel<V><<<NormPartialRows(rows), kThreads, 0, stream>>>(
        dg, nhat, rstd, w, gate_pre, value, rows, cols, d_pre_ln, d_gate_pre, d_value, partials);
    return cudaGetLastError();
  });
}

}  // namespace perception::kernels
