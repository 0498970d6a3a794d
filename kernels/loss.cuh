// The masked BCE of MODEL.md §2.7 per element, for the kernels that form the logits (kernels/norms.cu).
#pragma once

#include "kernels/common.cuh"

namespace perception::kernels {

// m·bce(l, y), evaluated in double from the float logit.
__device__ __forceinline__ double MaskedBce(float logit, float label, float mask) {
  const double l = logit, y = label, m = mask;
  return m * (fmax(l, 0.0) - l * y + log1p(exp(-fabs(l))));
}

// d loss / d logit of the mean over the batch: m·(σ(l) − y)/denom, denom = max(Σm, 1).
__device__ __forceinline__ float MaskedBceGradient(float logit, float label, float mask, float denom) {
  return mask * (Sigmoid(logit) - label) / denom;
}

}  // namespace perception::kernels
