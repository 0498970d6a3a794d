// The weight gradient of a narrow linear layer (dw[out, in] = dy[rows, out]ᵀ · x[rows, in] with out and in in the
// tens, rows in the ten thousands), float32-accurate: deterministic (a fixed-order sum of row slices; an atomic counter
// only elects the block that sums), no allocation, capturable in a CUDA graph, any alignment and leading dimension.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace perception::kernels {

// The output tile of one block (out × in); a block accumulates one tile over one slice of rows.
constexpr int kSkinnyTile = 64;
// The counters (unsigned) one launch may use to elect the block that sums a tile's partials.
constexpr int kSkinnyCounters = 256;

// kTf32x3: the 3×TF32 split of kernels/tf32x3.cuh on mma.sync (float32 accuracy, the precision kFloat32Tf32x3's);
// kFfma: plain float32 FFMA (exact float32 products; for measuring).
enum class SkinnyMath { kTf32x3, kFfma };

// dw[out, in] = dy[rows, out]ᵀ · x[rows, in] (row-major, leading dimensions lddy, ldx, lddw in floats), in one
// launch (sm_90: thread-block clusters). The rows are split into slices (about one block per SM, fewer where
// `workspace_bytes` holds fewer partials; the split depends only on the shape, the device's SM count and the
// workspace size, so reruns are bit-identical). Each cluster of 8 slices adds its tiles in rank order in distributed
// shared memory; with more than one cluster, each cluster's partial goes to `workspace` and the last cluster to
// finish a tile (elected through `counters`) adds them in cluster order. `counters` holds kSkinnyCounters zeros
// before the first launch and every launch leaves them zero; launches that may run at the same time need their own.
// Null counters: one cluster. `slices` > 0 asks for about that many (for measuring: rounded down to whole clusters,
// capped by the workspace and by one 32-row chunk per slice).
cudaError_t LaunchSkinnyWeightGrad(int rows, int in, int out, const float* dy, int lddy, const float* x, int ldx,
                                   float* dw, int lddw, float* workspace, size_t workspace_bytes, unsigned* counters,
                                   cudaStream_t stream, int slices = 0, SkinnyMath math = SkinnyMath::kTf32x3);

}  // namespace perception::kernels
