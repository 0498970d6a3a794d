// The weight gradient of a narrow linear layer (dw[out, in] = dy[rows, out]ᵀ · x[rows, in] with out and in in the
// tens, rows in the ten thousands) in plain float32 FFMA: exact float32 products, deterministic (a fixed-order sum of
// row slices, no atomics), no allocation, capturable in a CUDA graph, any alignment and leading dimension.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace perception::kernels {

// The output tile of one block (out × in); a block accumulates one tile over one slice of rows.
constexpr int kSkinnyTile = 64;

// dw[out, in] = dy[rows, out]ᵀ · x[rows, in] (row-major, leading dimensions lddy, ldx, lddw in floats). The rows are
// split into slices (as many as fill the device once and `workspace_bytes` holds; the split depends only on the
// shape, the device's SM count and the workspace size, so reruns are bit-identical) whose partial tiles go to
// `workspace` and are then summed slice by slice in order. `slices` > 0 asks for that many (for measuring; still
// capped by the workspace and by one 32-row chunk per slice).
cudaError_t LaunchSkinnyWeightGrad(int rows, int in, int out, const float* dy, int lddy, const float* x, int ldx,
                                   float* dw, int lddw, float* workspace, size_t workspace_bytes, cudaStream_t stream,
                                   int slices = 0);

}  // namespace perception::kernels
