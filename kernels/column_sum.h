// Column sums over rows, for every gradient that is a sum over the batch's events: biases, norm weights, conv
// weights, dt_bias, A_log, D. Many sums run in two launches (per-chunk partials, then the chunks added in order), so
// the results are deterministic without atomics. The plan is built once; its tables live in device memory.
#pragma once

#include <cstddef>
#include <vector>

#include <cuda_runtime.h>

namespace perception::kernels {

// out[c] = Σ_r a[r·lda + c] · (b ? b[r·ldb + c] : 1) · (row_scale ? row_scale[r] : 1), for c < cols.
struct ColumnSumJob {
  const float* a = nullptr;
  int lda = 0;
  const float* b = nullptr;
  int ldb = 0;
  const float* row_scale = nullptr;
  int rows = 0, cols = 0;
  float* out = nullptr;
};

// Rows summed by one block of the first launch.
constexpr int kColumnSumChunkRows = 256;

// One block of the first launch: 32 columns of one job over one chunk of rows. Its sums go to
// partials[partial + i] for column col0 + i.
struct ColumnSumTile {
  int job, col0, row_begin, row_end;
  size_t partial;
};
// One block of the second launch: up to kColumnSumFinishColumns columns of one job, summed over its chunks,
// whose partials are the [chunks][cols] block at partials[partial].
struct ColumnSumFinish {
  int job, col0, chunks;
  size_t partial;
};

// The tiles and finishes of `jobs`, and the floats of partials they need.
struct ColumnSumPlan {
  std::vector<ColumnSumTile> tiles;
  std::vector<ColumnSumFinish> finishes;
  size_t partial_floats = 0;
};
ColumnSumPlan PlanColumnSums(const std::vector<ColumnSumJob>& jobs);

// A plan's tables in device memory, as the launch reads them, and the partials' scratch.
struct ColumnSumBatch {
  const ColumnSumJob* jobs = nullptr;
  const ColumnSumTile* tiles = nullptr;
  int tile_count = 0;
  const ColumnSumFinish* finishes = nullptr;
  int finish_count = 0;
  float* partials = nullptr;
};

// 32 columns per finish block, each column's chunks split over 8 lanes: the chunk partials are read in parallel.
constexpr int kColumnSumFinishColumns = 32;

cudaError_t LaunchColumnSums(const ColumnSumBatch& batch, cudaStream_t stream);

}  // namespace perception::kernels
