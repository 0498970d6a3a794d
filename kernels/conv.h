// The Mamba2 block's causal depthwise convolution over time followed by SiLU (MODEL.md §2.2.3), forward and backward,
// with the carried conv state (the last W−1 raw inputs of each sequence, oldest first; MODEL.md §3).
#pragma once

#include <cuda_runtime.h>

namespace perception::kernels {

// The widest kernel supported (both directions are instantiated per width, W taps in registers).
constexpr int kMaxConvWidth = 8;

// Shapes and inputs common to both directions. Rows are r = b·window + t.
struct ConvInput {
  int batch = 0, window = 0, channels = 0, width = 0;  // B, T, E+2N, W
  const float* x = nullptr;  // raw xBC, channel c of row r at x[r·ldx + c]
  int ldx = 0;
  const float* weight = nullptr;    // [channels, 1, width]
  const float* bias = nullptr;      // [channels]
  const float* state_in = nullptr;  // [batch, width−1, channels], or null for a zero history
};

// out[r,c] = silu(bias[c] + Σ_k weight[c,k]·hist[t+k, c]) over the history [state ; window], [rows, channels] dense.
// `state_out` (may be null) receives each sequence's last width−1 history rows. The pre-activation is not stored:
// the backward recomputes it from the history it reads anyway.
// `programmatic`: launched as the programmatic dependent of the kernel ahead on the stream (kernels/common.cuh,
// LaunchKernel).
cudaError_t LaunchConvForward(const ConvInput& in, float* out, float* state_out, cudaStream_t stream,
                              bool programmatic = false);

// Where the gradient of the conv output comes from: the SSM's dxs for the first `inner` channels, and for the
// remaining 2N channels (B then C) the sum over heads of its per-head partials.
struct ConvOutputGrad {
  const float* dxs = nullptr;  // [rows, inner]
  int inner = 0;               // E
  const float* dbc = nullptr;  // [rows, heads, channels − inner]
  int heads = 0;
};

// dx[r,c] (row stride lddx) = d loss / d raw input; per-sequence parameter partials `partials`
// [batch, channels·width + channels]: first d weight in the weight's layout, then d bias. Their sum over the batch
// is the gradient (a column sum). No gradient flows into state_in.
cudaError_t LaunchConvBackward(const ConvInput& in, const ConvOutputGrad& grad, float* dx, int lddx, float* partials,
                               cudaStream_t stream);

}  // namespace perception::kernels
