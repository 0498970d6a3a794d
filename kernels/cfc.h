// The closed-form continuous-time cell over a whole window (MODEL.md §2.4). The backbone input is [s_t ; c_{t−1}]:
// the s_t half does not depend on the recurrence, so the caller computes u = s·W_sᵀ + b_backbone for all steps with
// one GEMM, and the kernels here run only the recurrent part — W_c (K×C) and the four C×K heads — with the whole time
// loop inside ONE launch forward and ONE launch backward, the weights held in registers (over a cluster of blocks for
// `large`) up to C = 128, K = 256, and in shared memory or read through the cache beyond.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace perception::kernels {

// The heads in their packed order.
enum CfcHead { kCfcFf1 = 0, kCfcFf2 = 1, kCfcTimeA = 2, kCfcTimeB = 3, kCfcHeads = 4 };

struct CfcWeights {
  const float* backbone_weight = nullptr;  // [K, D + C]; its last C columns are W_c
  const float* head_weight[kCfcHeads] = {};  // [C, K] each
  const float* head_bias[kCfcHeads] = {};    // [C] each
};

struct CfcShape {
  int batch = 0, window = 0;  // B, T; rows are r = b·window + t
  int d_model = 0, units = 0, backbone = 0;  // D, C, K
  // The recurrences' products in plain TF32 on the tensor cores (the `tf32` precision) where C ≤ 64 and K ≤ 128;
  // float32 FMAs otherwise. The packed weights' layout follows it.
  bool tf32_products = false;
};

// Floats of the packed weights written by LaunchCfcPackWeights.
size_t CfcPackedFloats(const CfcShape& shape);

// Lays the recurrent weights out for the two kernels (each thread's register slice, or transposed for the forward
// and as stored for the backward beyond the register tiles), so that consecutive threads read consecutive addresses.
// Run whenever the parameters change (once per step).
cudaError_t LaunchCfcPackWeights(const CfcWeights& weights, const CfcShape& shape, float* packed, cudaStream_t stream);

// What the forward keeps for the backward and the head.
struct CfcActivations {
  float* bb_pre = nullptr;  // [rows, K]: backbone pre-activation
  float* bb = nullptr;      // [rows, K]: lecun_tanh(bb_pre)
  float* gates = nullptr;   // [rows, 3C]: f1, f2, τ
  float* c = nullptr;       // c_t of row r at c[r·ldc + ·] (the head input's CfC half)
  int ldc = 0;
  float* c_prev = nullptr;  // [rows, C]: c_{t−1}, the input of W_c
};

// u [rows, K] = s·W_sᵀ + b_backbone; dt [rows]; state_in [batch, C] or null (zero); state_out may be null.
cudaError_t LaunchCfcForward(const CfcShape& shape, const float* packed, const float* u, const float* dt,
                             const float* state_in, const CfcActivations& act, float* state_out, cudaStream_t stream);

// Backward through time from dc_head (d loss / d c_t from the head, row r at dc_head[r·ld_dc_head + ·]).
// Writes dp [rows, 4C] (d of the four heads' pre-activations, packed order) and dbb_pre [rows, K]; the weight
// gradients and d s follow from them with GEMMs. No gradient flows into state_in. bias_sums (may be null): each
// sequence's sums over its steps (latest first) of dp's columns, then of dbb_pre's ([batch, 4C + K]), so that the
// biases' gradients are sums over the batch instead of over every row.
cudaError_t LaunchCfcBackward(const CfcShape& shape, const float* packed, const float* dt, const float* gates,
                              const float* bb_pre, const float* dc_head, int ld_dc_head, float* dp, float* dbb_pre,
                              cudaStream_t stream, float* bias_sums = nullptr);

}  // namespace perception::kernels
