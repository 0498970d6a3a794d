// The masked BCE's gradient per logit, for the kernel that forms the logits (kernels/norms.cu).
#pragma once

#include "kernels/common.cuh"

namespace perception::kernels {

// d loss / d logit of the masked mean over the batch: m·(σ(l) − y)/denom, denom = max(Σm, 1).
__device__ __forceinline__ float MaskedBceGradient(float logit, float label, float mask, float denom) {
  return mask * (Sigmoid(logit) - label) / denom;
}

}  // namespace perception::kernels
