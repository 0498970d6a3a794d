// Row normalizations, one warp per row: each lane walks the row with a stride of 32, the row's sums are warp
// butterflies (deterministic), and the formulas follow engine/cpu_reference.cc term by term.
#include "kernels/common.cuh"
#include "kernels/norms.h"

namespace perception::kernels {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr int kThreads = kRowsPerBlock * kWarpSize;

__device__ __forceinline__ int WarpRow() { return blockIdx.x * kRowsPerBlock + threadIdx.x / kWarpSize; }
__device__ __forceinline__ int Lane() { return threadIdx.x % kWarpSize; }
dim3 RowGrid(int rows) { return dim3(CeilDiv(rows, kRowsPerBlock)); }

__device__ __forceinline__ float RowRstd(float sum_squares, int cols) {
  return 1.f / sqrtf(sum_squares / static_cast<float>(cols) + kNormEps);
}

__global__ void RmsNormForwardKernel(const float* v, int ldv, const float* w, int rows, int cols, float* y, int ldy,
                                     float* rstd, float* residual) {
  const int row = WarpRow();
  if (row >= rows) return;  // whole warps leave together
  const float* vr = v + static_cast<size_t>(row) * ldv;
  float ss = 0.f;
  for (int i = Lane(); i < cols; i += kWarpSize) ss += vr[i] * vr[i];
  const float r = RowRstd(WarpSum(ss), cols);
  float* yr = y + static_cast<size_t>(row) * ldy;
  for (int i = Lane(); i < cols; i += kWarpSize) {
    yr[i] = vr[i] * r * w[i];
    if (residual) residual[static_cast<size_t>(row) * cols + i] = vr[i];
  }
  if (Lane() == 0) rstd[row] = r;
}

__global__ void RmsNormBackwardKernel(const float* v, int ldv, const float* w, const float* rstd, const float* dy,
                                      int lddy, int rows, int cols, bool accumulate, float* dv, int lddv) {
  const int row = WarpRow();
  if (row >= rows) return;
  const float* vr = v + static_cast<size_t>(row) * ldv;
  const float* dyr = dy + static_cast<size_t>(row) * lddy;
  float dot = 0.f;
  for (int i = Lane(); i < cols; i += kWarpSize) dot += dyr[i] * w[i] * vr[i];
  dot = WarpSum(dot);
  const float r = rstd[row];
  const float coef = r * r * r * dot / static_cast<float>(cols);
  float* dvr = dv + static_cast<size_t>(row) * lddv;
  for (int i = Lane(); i < cols; i += kWarpSize) {
    const float g = r * dyr[i] * w[i] - vr[i] * coef;
    dvr[i] = accumulate ? dvr[i] + g : g;
  }
}

__global__ void GatedRmsNormForwardKernel(const float* y, const float* z, int ldz, const float* w, int rows, int cols,
                                          float* q, float* yn, float* rstd) {
  const int row = WarpRow();
  if (row >= rows) return;
  const size_t base = static_cast<size_t>(row) * cols;
  const float* zr = z + static_cast<size_t>(row) * ldz;
  float ss = 0.f;
  for (int i = Lane(); i < cols; i += kWarpSize) {
    const float qi = y[base + i] * Silu(zr[i]);
    q[base + i] = qi;
    ss += qi * qi;
  }
  const float r = RowRstd(WarpSum(ss), cols);
  for (int i = Lane(); i < cols; i += kWarpSize) yn[base + i] = q[base + i] * r * w[i];
  if (Lane() == 0) rstd[row] = r;
}

__global__ void GatedRmsNormBackwardKernel(const float* dyn, const float* q, const float* rstd, const float* w,
                                           const float* y, const float* z, int ldz, int rows, int cols, float* dy,
                                           float* dz, int lddz) {
  const int row = WarpRow();
  if (row >= rows) return;
  const size_t base = static_cast<size_t>(row) * cols;
  const float* zr = z + static_cast<size_t>(row) * ldz;
  float* dzr = dz + static_cast<size_t>(row) * lddz;
  float dot = 0.f;
  for (int i = Lane(); i < cols; i += kWarpSize) dot += dyn[base + i] * w[i] * q[base + i];
  dot = WarpSum(dot);
  const float r = rstd[row];
  const float coef = r * r * r * dot / static_cast<float>(cols);
  for (int i = Lane(); i < cols; i += kWarpSize) {
    const float dq = r * dyn[base + i] * w[i] - q[base + i] * coef;
    dy[base + i] = dq * Silu(zr[i]);
    dzr[i] = dq * y[base + i] * SiluGrad(zr[i]);
  }
}

__global__ void GrnGateLayerNormForwardKernel(float* pre_ln, const float* gate_pre, const float* value,
                                              const float* w, const float* b, int rows, int cols, float* nhat,
                                              float* g, float* rstd) {
  const int row = WarpRow();
  if (row >= rows) return;
  const size_t base = static_cast<size_t>(row) * cols;
  float sum = 0.f;
  for (int i = Lane(); i < cols; i += kWarpSize) {
    const float x = pre_ln[base + i] + Sigmoid(gate_pre[base + i]) * value[base + i];
    pre_ln[base + i] = x;
    sum += x;
  }
  const float mean = WarpSum(sum) / static_cast<float>(cols);
  float var = 0.f;
  for (int i = Lane(); i < cols; i += kWarpSize) {
    const float d = pre_ln[base + i] - mean;
    var += d * d;
  }
  const float r = 1.f / sqrtf(WarpSum(var) / static_cast<float>(cols) + kNormEps);
  for (int i = Lane(); i < cols; i += kWarpSize) {
    const float n = (pre_ln[base + i] - mean) * r;
    nhat[base + i] = n;
    g[base + i] = n * w[i] + b[i];
  }
  if (Lane() == 0) rstd[row] = r;
}

__global__ void GrnGateLayerNormBackwardKernel(const float* dg, const float* nhat, const float* rstd, const float* w,
                                               const float* gate_pre, const float* value, int rows, int cols,
                                               float* d_pre_ln, float* d_gate_pre, float* d_value) {
  const int row = WarpRow();
  if (row >= rows) return;
  const size_t base = static_cast<size_t>(row) * cols;
  float mean_dn = 0.f, mean_dn_n = 0.f;
  for (int i = Lane(); i < cols; i += kWarpSize) {
    const float dn = dg[base + i] * w[i];
    mean_dn += dn;
    mean_dn_n += dn * nhat[base + i];
  }
  mean_dn = WarpSum(mean_dn) / static_cast<float>(cols);
  mean_dn_n = WarpSum(mean_dn_n) / static_cast<float>(cols);
  const float r = rstd[row];
  for (int i = Lane(); i < cols; i += kWarpSize) {
    const float dpre = r * (dg[base + i] * w[i] - mean_dn - nhat[base + i] * mean_dn_n);
    const float sg = Sigmoid(gate_pre[base + i]);
    d_pre_ln[base + i] = dpre;
    d_value[base + i] = dpre * sg;
    d_gate_pre[base + i] = dpre * value[base + i] * sg * (1.f - sg);
  }
}

}  // namespace

cudaError_t LaunchRmsNormForward(const float* v, int ldv, const float* w, int rows, int cols, float* y, int ldy,
                                 float* rstd, float* residual, cudaStream_t stream) {
  RmsNormForwardKernel<<<RowGrid(rows), kThreads, 0, stream>>>(v, ldv, w, rows, cols, y, ldy, rstd, residual);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNormBackward(const float* v, int ldv, const float* w, const float* rstd, const float* dy,
                                  int lddy, int rows, int cols, bool accumulate, float* dv, int lddv,
                                  cudaStream_t stream) {
  RmsNormBackwardKernel<<<RowGrid(rows), kThreads, 0, stream>>>(v, ldv, w, rstd, dy, lddy, rows, cols, accumulate,
                                                                 dv, lddv);
  return cudaGetLastError();
}

cudaError_t LaunchGatedRmsNormForward(const float* y, const float* z, int ldz, const float* w, int rows, int cols,
                                      float* q, float* yn, float* rstd, cudaStream_t stream) {
  GatedRmsNormForwardKernel<<<RowGrid(rows), kThreads, 0, stream>>>(y, z, ldz, w, rows, cols, q, yn, rstd);
  return cudaGetLastError();
}

cudaError_t LaunchGatedRmsNormBackward(const float* dyn, const float* q, const float* rstd, const float* w,
                                       const float* y, const float* z, int ldz, int rows, int cols, float* dy,
                                       float* dz, int lddz, cudaStream_t stream) {
  GatedRmsNormBackwardKernel<<<RowGrid(rows), kThreads, 0, stream>>>(dyn, q, rstd, w, y, z, ldz, rows, cols, dy, dz,
                                                                      lddz);
  return cudaGetLastError();
}

cudaError_t LaunchGrnGateLayerNormForward(float* pre_ln, const float* gate_pre, const float* value, const float* w,
                                          const float* b, int rows, int cols, float* nhat, float* g, float* rstd,
                                          cudaStream_t stream) {
  GrnGateLayerNormForwardKernel<<<RowGrid(rows), kThreads, 0, stream>>>(pre_ln, gate_pre, value, w, b, rows, cols,
                                                                         nhat, g, rstd);
  return cudaGetLastError();
}

cudaError_t LaunchGrnGateLayerNormBackward(const float* dg, const float* nhat, const float* rstd, const float* w,
                                           const float* gate_pre, const float* value, int rows, int cols,
                                           float* d_pre_ln, float* d_gate_pre, float* d_value, cudaStream_t stream) {
  GrnGateLayerNormBackwardKernel<<<RowGrid(rows), kThreads, 0, stream>>>(dg, nhat, rstd, w, gate_pre, value, rows,
                                                                          cols, d_pre_ln, d_gate_pre, d_value);
  return cudaGetLastError();
}

}  // namespace perception::kernels
