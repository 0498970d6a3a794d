// The per-element binary cross-entropy on logits of MODEL.md §2.7, shared by the model and the baselines.
#pragma once

#include <algorithm>
#include <cmath>

namespace perception {

// bce(l, y) = max(l, 0) − l·y + log(1 + exp(−|l|)): stable for any logit.
template <typename T>
T Bce(T logit, T label) {
  return std::max(logit, T(0)) - logit * label + std::log1p(std::exp(-std::abs(logit)));
}

}  // namespace perception
