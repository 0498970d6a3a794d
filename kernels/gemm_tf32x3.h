// Float32-accurate products of a linear layer on the TF32 tensor cores (the 3×TF32 split of kernels/tf32x3.cuh):
// the Forward, BackwardData and BackwardWeight of engine/cuda_blas.h, row-major, deterministic (the weight gradient's
// split over rows sums its partials in a fixed order, no atomics), no allocation, capturable in a CUDA graph.
// `plain_tf32` (forward and backward data): one product of the operands rounded to TF32 instead of the three of the
// split, for the `tf32` precision; with planes, only their big parts are read.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace perception::kernels {

// The block tile (rows × columns of the output). kAuto picks by the product's shape; the others are for measuring.
enum class GemmTile { kAuto, k128x128, k128x64 };

// Whether the kernels take these operands: every input pointer 16-byte aligned, every input leading dimension and
// batch stride and each input's contiguous extent a multiple of 4 floats (the 16-byte asynchronous copies). `aligned`
// is the smallest byte alignment of the inputs' pointers, leading dimensions and strides; `contiguous` the extents
// that the inputs are contiguous along (Forward: in; BackwardData: out and in; BackwardWeight: out and in).
inline bool GemmTf32x3Supports(int aligned, int contiguous_a, int contiguous_b) {
  return aligned % 16 == 0 && contiguous_a % 4 == 0 && contiguous_b % 4 == 0;
}

// A weight's TF32 big and small parts as LaunchTf32x3SplitWeights stores them: as the weight is, [out, in] with its
// leading dimension and batch stride (big, small), and transposed, [in, out] with leading dimension ld_t (out where
// 0; big_t, small_t; one weight, no batch). Given to Forward (big, small) or BackwardData (big_t, small_t), the kernel
// copies B's parts into shared memory as they are instead of splitting the weight in every block: the same product,
// bit for bit. Every pointer 16-byte aligned, and out and ld_t multiples of 4 for the transposed parts.
// Transposed parts only (big and small null): weights stacked along out whose transposed parts sit side by side in
// one [cols, rows] matrix (each weight's split with ld_t = the stack's rows), for a BackwardData of the stack,
// dx = [dy_1 | dy_2] · [w_1; w_2], which runs on the planes alone (the weights need not be adjacent in memory).
struct Tf32x3Planes {
  const float* big = nullptr;
  const float* small = nullptr;
  const float* big_t = nullptr;
  const float* small_t = nullptr;
  int rows = 0, cols = 0;  // w's shape: big and small are [rows, cols], big_t and small_t [cols, rows]
  int ld_t = 0;            // big_t's and small_t's leading dimension; 0: rows
  int TransposedLd() const { return ld_t > 0 ? ld_t : rows; }
};

// One weight to split: w [rows, cols], contiguous, into big and small [rows, cols] and big_t and small_t [cols, rows]
// with leading dimension ld_t (rows where 0; at least rows).
struct Tf32x3SplitJob {
  const float* w;
  int rows, cols;
  float *big, *small, *big_t, *small_t;
  int ld_t = 0;
};

// Every job of the device array `jobs` (`count` of them, none more than max_rows × max_cols) in one launch.
cudaError_t LaunchTf32x3SplitWeights(const Tf32x3SplitJob* jobs, int count, int max_rows, int max_cols,
                                     cudaStream_t stream);

// y[rows, out] = x[rows, in] · w[out, in]ᵀ + bias[out] + beta·y, `count` times (the i-th at each pointer + i·stride;
// bias may be null). beta = 0 never reads y. `planes` (may be null): w's parts, current. `programmatic`: launched as
// the programmatic dependent of the kernel ahead on the stream (kernels/common.cuh, LaunchKernel).
cudaError_t LaunchGemmTf32x3Forward(int rows, int in, int out, const float* x, int ldx, int64_t stride_x,
                                    const float* w, int ldw, int64_t stride_w, const float* bias, int64_t stride_bias,
                                    float beta, float* y, int ldy, int64_t stride_y, int count, cudaStream_t stream,
                                    GemmTile tile = GemmTile::kAuto, const Tf32x3Planes* planes = nullptr,
                                    bool programmatic = false, bool plain_tf32 = false);

// dx[rows, in] = dy[rows, out] · w[out, in] + beta·dx. `planes` (may be null): w's parts, current.
cudaError_t LaunchGemmTf32x3BackwardData(int rows, int in, int out, const float* dy, int lddy, const float* w, int ldw,
                                         float beta, float* dx, int lddx, cudaStream_t stream,
                                         GemmTile tile = GemmTile::kAuto, const Tf32x3Planes* planes = nullptr,
                                         bool plain_tf32 = false);

// dw[out, in] = dy[rows, out]ᵀ · x[rows, in]. The rows are split into slices whose partial products go to
// `workspace` (as many slices as the block count wants and `workspace_bytes` holds; the split depends only on the
// shape, the workspace size, the device's multiprocessor count and `shares_device`, so reruns are bit-identical) and
// are then summed slice by slice in order.
// `splits` > 0 forces that many slices (for measuring; still capped by the workspace). `shares_device`: the product
// runs beside other work, so one that would fill the device in one wave is planned for half of it.
cudaError_t LaunchGemmTf32x3BackwardWeight(int rows, int in, int out, const float* dy, int lddy, const float* x,
                                           int ldx, float* dw, int lddw, float* workspace, size_t workspace_bytes,
                                           cudaStream_t stream, GemmTile tile = GemmTile::kAuto, int splits = 0,
                                           bool shares_device = false);

}  // namespace perception::kernels
