// The masked binary cross-entropy of MODEL.md §2.7 and its gradient with respect to the logits.
#pragma once

#include <cuda_runtime.h>

#include "kernels/step_report.h"

namespace perception::kernels {

// Blocks of the loss launches; `partials` holds 2 doubles per block.
constexpr int kMaskedBceBlocks = 256;

// Over n values: report->loss_sum = Σ m·bce(l, y), report->mask_count = Σ m, report->loss = sum / max(count, 1),
// summed in double in a fixed order. When `dlogits` is non-null it receives m·(σ(l) − y)/max(Σm, 1). Two launches:
// per-block sums into `partials` [2·kMaskedBceBlocks], then every block adds them in the same order.
cudaError_t LaunchMaskedBce(const float* logits, const float* labels, const float* mask, int n, float* dlogits,
                            double* partials, StepReport* report, cudaStream_t stream);

// LaunchMaskedBce's two launches, for data-parallel training, which sums `partials` across ranks in between: then
// the count and the loss are the global batch's, and each rank's d logits its share of the global mean's gradient.
cudaError_t LaunchMaskedBcePartials(const float* logits, const float* labels, const float* mask, int n,
                                    double* partials, cudaStream_t stream);
cudaError_t LaunchMaskedBceFinish(const float* logits, const float* labels, const float* mask, int n,
                                  const double* partials, float* dlogits, StepReport* report, cudaStream_t stream);

}  // namespace perception::kernels
