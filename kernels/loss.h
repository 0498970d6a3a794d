// The masked binary cross-entropy of MODEL.md §2.7: the batch's mask count, which the logits' gradient divides by
// (so the kernel that forms the logits also forms their gradient: kernels/norms.h), and the report's loss from the
// per-block loss sums that kernel leaves.
#pragma once

#include <cuda_runtime.h>

#include "kernels/step_report.h"

namespace perception::kernels {

// *count = Σ mask over n values, in double, in a fixed order (one block).
cudaError_t LaunchMaskCount(const float* mask, int n, double* count, cudaStream_t stream);

// report->loss_sum = Σ partials[0 .. blocks) in a fixed order, report->mask_count = *count and report->loss =
// loss_sum / max(count, 1) (one block).
cudaError_t LaunchMaskedBceReport(const double* partials, int blocks, const double* count, StepReport* report,
                                  cudaStream_t stream);

}  // namespace perception::kernels
