// What one training or evaluation step reports back to the host; the kernels write it, the host reads it once.
#pragma once

#include <cstdint>

namespace perception::kernels {

struct StepReport {
  double loss = 0;        // masked BCE: loss_sum / max(mask_count, 1)
  double loss_sum = 0;    // Σ m·bce
  double mask_count = 0;  // Σ m
  double grad_norm = 0;   // global gradient norm before clipping
  int64_t step = 0;       // optimizer steps taken, this one included
  int32_t applied = 0;    // 1 where the optimizer applied the step, 0 where it refused it (StepApplies)
};

}  // namespace perception::kernels
