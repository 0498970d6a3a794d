// The Mamba2 selective scan of MODEL.md §2.2.4–5 for one layer: dt = softplus(dt_raw + dt_bias), A = −exp(A_log)
// (recomputed from the parameters at every launch), s_t = exp(dt·A)·s_{t−1} + dt·xs_t ⊗ B_t,
// y_t = s_t·C_t + D·xs_t; forward, and the reverse-time backward.
#pragma once

#include <cuda_runtime.h>

namespace perception::kernels {

// The largest d_state the scan supports (the recurrence keeps a row of the state, d_state values, per thread in
// registers; the tile kernels stage [64][d_state] blocks in shared memory).
constexpr int kMaxSsmState = 64;
// The largest headdim the backward supports for windows longer than 64 steps (up to 128 for shorter ones).
constexpr int kMaxSsmHeaddim = 64;

// Rows are r = b·window + t. E = heads·headdim.
struct SsmInput {
  int batch = 0, window = 0, heads = 0, headdim = 0, d_state = 0;  // B, T, Hh, P, N
  const float* xbc = nullptr;  // conv output: xs [0,E), B [E,E+N), C [E+N,E+2N) of row r at xbc[r·ld_xbc + ·]
  int ld_xbc = 0;
  const float* dt_raw = nullptr;  // head h of row r at dt_raw[r·ld_dt_raw + h]
  int ld_dt_raw = 0;
  const float* dt_bias = nullptr;   // [heads]
  const float* a_log = nullptr;     // [heads]
  const float* d_skip = nullptr;    // [heads], MODEL.md's D
  const float* state_in = nullptr;  // [batch, heads, headdim, d_state], or null for a zero state
  // Training windows' tensor-core products in plain TF32 (one mma, the `tf32` precision's rounding) instead of
  // float32-accurate 3×TF32.
  bool tf32_products = false;
};

// y [rows, E] dense; `state_out` (may be null) receives the final state, laid out as state_in. `programmatic`: launched
// as the programmatic dependent of the kernel ahead on the stream (kernels/common.cuh, LaunchKernel).
cudaError_t LaunchSsmScanForward(const SsmInput& in, float* y, float* state_out, cudaStream_t stream,
                                 bool programmatic = false);

// Gradients of the scan, from dy [rows, E].
struct SsmGrad {
  float* dxs = nullptr;       // [rows, E]: d xs, the D skip included
  float* dbc = nullptr;       // [rows, heads, 2N]: each head's share of d B (first N) and d C; they sum over heads
  float* d_dt_raw = nullptr;  // head h of row r at d_dt_raw[r·ld_d_dt_raw + h]
  int ld_d_dt_raw = 0;
  float* param_partials = nullptr;  // [rows, 2·heads]: each row's term of d A_log (first heads) and of d D
  float* scratch = nullptr;         // SsmBackwardScratchFloats(...) floats; windows of up to 64 steps need none
};

// No gradient flows into state_in (it is read, when given, to recompute the states).
cudaError_t LaunchSsmScanBackward(const SsmInput& in, const float* dy, const SsmGrad& grad, cudaStream_t stream);

// Windows longer than 64 steps run the backward in chunks of 64: the state at each chunk boundary, and the adjoint
// handed from one chunk to the one before, live in this scratch.
size_t SsmBackwardScratchFloats(int batch, int window, int heads, int headdim, int d_state);

}  // namespace perception::kernels
