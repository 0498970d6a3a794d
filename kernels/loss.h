// The masked binary cross-entropy of MODEL.md §2.7 over the batch: the mask count, which d logits divides by (the
// kernel that forms the logits forms d logits too: kernels/norms.h), and the loss the step reports.
#pragma once

#include <cuda_runtime.h>

#include "kernels/step_report.h"

namespace perception::kernels {

// Blocks of the loss's first launch; its `partials` hold one double per block.
constexpr int kMaskedBceBlocks = 256;

// *count = Σ mask over n values, in double, in a fixed order (one block).
cudaError_t LaunchMaskCount(const float* mask, int n, double* count, cudaStream_t stream);

// partials[b] = Σ m·bce(l, y) over block b's fixed range of the n values, in double from the float logits.
cudaError_t LaunchMaskedBcePartials(const float* logits, const float* labels, const float* mask, int n,
                                    double* partials, cudaStream_t stream);

// report->loss_sum = Σ partials in a fixed order, report->mask_count = *count, report->loss = loss_sum / max(count,
// 1) (one block). Data parallel: the partials and the count summed over the ranks in between give the global ones.
cudaError_t LaunchMaskedBceReport(const double* partials, const double* count, StepReport* report,
                                  cudaStream_t stream);

}  // namespace perception::kernels
