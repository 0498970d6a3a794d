// The CPU backend refuses a training step whose gradient norm is not finite, or too large once clipped, and changes
// nothing (tests/step_not_taken.h; the CUDA backend's in tests/cuda/backend_behavior_test.cc).
#include "tests/step_not_taken.h"

namespace perception {
namespace {

TEST(CpuBackend, AStepWithANonFiniteGradientIsRefusedAndChangesNothing) {
  testing::ExpectAStepWithANonFiniteGradientChangesNothing("cpu");
}

TEST(CpuBackend, AStepWhoseGradientSquaresOverflowIsRefusedAndChangesNothing) {
  testing::ExpectAStepWhoseGradientSquaresOverflowChangesNothing("cpu");
}

}  // namespace
}  // namespace perception
