// The GRN head of MODEL.md §2.5 between fc2's and skip's outputs and the products back into the head's input, in one
// launch: ELU, fc1, gate and value, the gated LayerNorm, the output layer, the masked BCE's gradient, the LayerNorm's
// backward and the backward through gate, value, fc1 and the ELU. Every row is independent of the others, so a warp
// carries its rows through all of it in registers and shared memory instead of eight launches passing [rows, G]
// arrays through memory.
#pragma once

#include <cuda_runtime.h>

#include "kernels/norms.h"

namespace perception::kernels {

// The widest G and the most outputs the launch takes (each lane holds two of a row's G columns, and a warp's rows'
// logits fill its lanes once).
constexpr int kMaxGrnHeadWidth = 64;
constexpr int kMaxGrnHeadOutputs = 8;
inline bool GrnHeadSupports(int width, int outputs) {
  return width >= 1 && width <= kMaxGrnHeadWidth && outputs >= 1 && outputs <= kMaxGrnHeadOutputs;
}

// The head's weights as the parameter layout holds them: fc1, gate and value [G, G] with their biases [G]; the
// LayerNorm's weight and bias [G]; the output layer [H, G] and [H]. fc2_b, where set, is fc2's bias [G], which the
// kernel adds to pre2 as it reads it (pre2 then comes from a product without it: the same one float32 addition as in
// the product's epilogue, so the same bits).
struct GrnHeadWeights {
  const float *fc1_w, *fc1_b, *gate_w, *gate_b, *value_w, *value_b, *norm_w, *norm_b;
  NormOutputLayer out;
  const float* fc2_b = nullptr;
};

// The forward's arrays, [rows, G] dense but logits [rows, H]: pre2 = fc2(a) and skip = skip(a) are read (at leading
// dimension ld_in, or G where 0: side by side in one [rows, 2G] product's output, ld_in 2G); e2 = elu(pre2), e1 =
// fc1(e2) and g = layernorm(skip + σ(gate(e1)) ⊙ value(e1)) are written for the weight gradients.
struct GrnHeadForward {
  const float* pre2 = nullptr;
  const float* skip = nullptr;
  float *e2 = nullptr, *e1 = nullptr, *g = nullptr, *logits = nullptr;
  int ld_in = 0;
};

// The backward's arrays, written where `grad.dlogits` is set: d pre_ln (= d skip), d gate_pre, d value and d pre2 at
// leading dimension `ldd`; d e1 [rows, G] dense; `partials` [NormPartialRows(rows), 4·G] as
// LaunchGrnGateLayerNormBackward writes them (Σ dg ⊙ nhat, Σ dg, Σ d gate_pre, Σ d value over each block of rows);
// `out_partials` (may be null) [GrnHeadOutputPartialRows(rows), H·G]: the output layer's weight gradient
// Σ d logits ⊗ g over each kGrnHeadWarpRows rows, laid out as the weight [H, G].
struct GrnHeadBackward {
  float *d_pre_ln = nullptr, *d_gate_pre = nullptr, *d_value = nullptr, *d_pre2 = nullptr;
  int ldd = 0;
  float* de1 = nullptr;
  float* partials = nullptr;
  float* out_partials = nullptr;
};

// The rows a warp carries, and so the rows of each of `out_partials`' partial sums.
constexpr int kGrnHeadWarpRows = 8;
inline int GrnHeadOutputPartialRows(int rows) { return (rows + kGrnHeadWarpRows - 1) / kGrnHeadWarpRows; }

// The forward, and where grad.dlogits is set, the loss's gradient (written there, [rows, H]) and the backward.
// The G×G products run on the TF32 tensor cores: float32-accurate 3×TF32, or where `tf32_products` one product of
// the operands rounded to TF32 (the `tf32` precision). `programmatic`: launched as the programmatic dependent of the
// kernel ahead on the stream (which writes pre2 and skip); the weights are read before the wait.
cudaError_t LaunchGrnHead(int rows, int width, const GrnHeadWeights& weights, const GrnHeadForward& forward,
                          const LogitGradient& grad, const GrnHeadBackward& backward, bool tf32_products,
                          cudaStream_t stream, bool programmatic = false);

}  // namespace perception::kernels
