// Row normalizations of PerceptionNet, forward and backward, one warp per row: the pre-norm and final RMSNorm
// (MODEL.md §2.2.1, §2.3), the gated RMSNorm of the Mamba2 block (§2.2.6) and the GRN's gate + LayerNorm (§2.5).
// The backward launches also sum their weight (and bias) gradients over each block's rows: `partials` of
// NormPartialRows(rows) rows, whose column sums (kernels/column_sum.h) are the gradients.
#pragma once

#include <cuda_runtime.h>

namespace perception::kernels {

// The forward launches take `programmatic`: launched as the programmatic dependent of the kernel ahead on the stream
// (kernels/common.cuh, LaunchKernel); each forward kernel waits for that kernel before it reads anything.

// The widest row supported: each lane keeps its share of a row in registers.
constexpr int kMaxNormWidth = 1024;

// Rows of the weight-gradient partials a backward launch over `rows` rows writes: one for each kNormPartialBlockRows
// rows.
constexpr int kNormPartialBlockRows = 32;
int NormPartialRows(int rows);

// y = v / sqrt(mean(v²) + eps) ⊙ w for each of `rows` rows of `cols`; rstd[row] = 1/sqrt(mean(v²) + eps).
// `residual` (may be null) receives a copy of v, [rows, cols] dense: the residual stream the block's output adds to.
cudaError_t LaunchRmsNormForward(const float* v, int ldv, const float* w, int rows, int cols, float* y, int ldy,
                                 float* rstd, float* residual, cudaStream_t stream, bool programmatic = false);

// The input gradient of RmsNorm: g = rstd·dy⊙w − v·rstd³·Σ(dy⊙w⊙v)/cols; dv = g, or dv += g when `accumulate`
// (a pre-norm's gradient joins the residual stream's). dw_partials [NormPartialRows(rows), cols]: Σ dy⊙v·rstd.
// dv_partials (may be null), the same shape: Σ dv as written, for a bias gradient that sums the result over rows.
cudaError_t LaunchRmsNormBackward(const float* v, int ldv, const float* w, const float* rstd, const float* dy,
                                  int lddy, int rows, int cols, bool accumulate, float* dv, int lddv,
                                  float* dw_partials, float* dv_partials, cudaStream_t stream);

// yn = rmsnorm(y ⊙ silu(z), w); rstd per row. y, yn are [rows, cols] dense; z has row stride ldz. The gated
// q = y ⊙ silu(z) is not stored: the backward recomputes it from the y and z it reads anyway.
cudaError_t LaunchGatedRmsNormForward(const float* y, const float* z, int ldz, const float* w, int rows, int cols,
                                      float* yn, float* rstd, cudaStream_t stream, bool programmatic = false);

// From d yn: dq by the RmsNorm backward, then dy = dq ⊙ silu(z) (dense) and dz = dq ⊙ y ⊙ silu'(z) (stride lddz).
// dw_partials [NormPartialRows(rows), cols]: Σ d yn ⊙ q · rstd.
cudaError_t LaunchGatedRmsNormBackward(const float* dyn, const float* rstd, const float* w, const float* y,
                                       const float* z, int ldz, int rows, int cols, float* dy, float* dz, int lddz,
                                       float* dw_partials, cudaStream_t stream);

// The GRN's output layer, folded into its LayerNorm's kernels: logits = g·wᵀ + b, w [outs, cols], b [outs].
struct NormOutputLayer {
  const float* w = nullptr;
  const float* b = nullptr;
  int outs = 0;
};

// The masked BCE's gradient with respect to the output layer's logits (MODEL.md §2.7), formed where the logits are:
// dlogits = m·(σ(l) − y)/max(*mask_count, 1), all [rows, outs] but the count.
struct LogitGradient {
  const float* labels = nullptr;
  const float* mask = nullptr;
  const double* mask_count = nullptr;  // Σ mask over the whole batch (every rank's)
  float* dlogits = nullptr;
};

// The GRN's gate and LayerNorm: x = pre_ln + σ(gate_pre) ⊙ value (not stored: the backward needs only nhat); then
// nhat = (x − mean)·rstd and g = nhat ⊙ w + b, the output layer's logits [rows, out.outs] from g, and their gradient
// when grad.dlogits is non-null. All [rows, cols] dense; rstd per row.
cudaError_t LaunchGrnGateLayerNormForward(const float* pre_ln, const float* gate_pre, const float* value,
                                          const float* w, const float* b, const NormOutputLayer& out,
                                          const LogitGradient& grad, int rows, int cols, float* nhat, float* g,
                                          float* rstd, float* logits, cudaStream_t stream,
                                          bool programmatic = false);

// From d logits [rows, out.outs]: dg = d logits · out.w (not stored), then d pre_ln = rstd·(dg⊙w − mean(dg⊙w) −
// nhat·mean(dg⊙w⊙nhat)), and the gate's d value = d pre_ln ⊙ σ(gate_pre) and d gate_pre = d pre_ln ⊙ value ⊙
// σ'(gate_pre). The inputs dense; d pre_ln, d gate_pre and d value with leading dimension ldd (at least cols: e.g.
// d gate_pre and d value side by side in one [rows, 2·cols] matrix, for one product over both). partials
// [NormPartialRows(rows), 4·cols]: Σ dg ⊙ nhat (d w), Σ dg (d b), Σ d gate_pre and Σ d value (the gate's and the
// value's bias gradients).
cudaError_t LaunchGrnGateLayerNormBackward(const float* dlogits, const NormOutputLayer& out, const float* nhat,
                                           const float* rstd, const float* w, const float* gate_pre,
                                           const float* value, int rows, int cols, float* d_pre_ln,
                                           float* d_gate_pre, float* d_value, int ldd, float* partials,
                                           cudaStream_t stream);

}  // namespace perception::kernels
