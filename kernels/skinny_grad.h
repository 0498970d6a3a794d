// The weight gradient of a narrow linear layer (dw[out, in] = dy[rows, out]ᵀ · x[rows, in] with out and in in the
// tens, rows in the ten thousands), float32-accurate: deterministic (a fixed-order sum of row slices, no atomics), no
// allocation, capturable in a CUDA graph, any alignment and leading dimension.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace perception::kernels {

// The output tile of one block (out × in); a block accumulates one tile over one slice of rows.
constexpr int kSkinnyTile = 64;

// kTf32x3: the 3×TF32 split of kernels/tf32x3.cuh on mma.sync (float32 accuracy, the precision kFloat32Tf32x3's);
// kFfma: plain float32 FFMA (exact float32 products; for measuring).
enum class SkinnyMath { kTf32x3, kFfma };

// dw[out, in] = dy[rows, out]ᵀ · x[rows, in] (row-major, leading dimensions lddy, ldx, lddw in floats). The rows are
// split into slices (as many as fill the device once and `workspace_bytes` holds; the split depends only on the
// shape, the device's SM count and the workspace size, so reruns are bit-identical) whose partial tiles go to
// `workspace` and are then summed slice by slice in order. `slices` > 0 asks for that many (for measuring; still
// capped by the workspace and by one 32-row chunk per slice).
cudaError_t LaunchSkinnyWeightGrad(int rows, int in, int out, const float* dy, int lddy, const float* x, int ldx,
                                   float* dw, int lddw, float* workspace, size_t workspace_bytes, cudaStream_t stream,
                                   int slices = 0, SkinnyMath math = SkinnyMath::kTf32x3);

}  // namespace perception::kernels
