// Deterministic column sums: launch 1 sums each (job, 32 columns, chunk of rows) tile with 8 row lanes per column,
// lanes added in order; launch 2 adds each column's chunk partials the same way (8 lanes, then the lanes in order).
#include "kernels/column_sum.h"
#include "kernels/common.cuh"

namespace perception::kernels {
namespace {

constexpr int kRowLanes = 8;
static_assert(kColumnSumFinishColumns == kWarpSize, "a finish block's lanes span its columns");

__global__ void __launch_bounds__(kWarpSize * kRowLanes)
    ColumnSumTilesKernel(const ColumnSumJob* jobs, const ColumnSumTile* tiles, float* partials) {
  __shared__ float lanes[kRowLanes][kWarpSize];
  const ColumnSumTile tile = tiles[blockIdx.x];
  const ColumnSumJob job = jobs[tile.job];
  const int tx = threadIdx.x % kWarpSize, ty = threadIdx.x / kWarpSize, col = tile.col0 + tx;
  float sum = 0.f;
  if (col < job.cols) {
    // Unrolled so that a thread's loads of several rows are in flight together (the loop has no stores).
#pragma unroll 8
    for (int r = tile.row_begin + ty; r < tile.row_end; r += kRowLanes) {
      float v = job.a[static_cast<size_t>(r) * job.lda + col];
      if (job.b) v *= job.b[static_cast<size_t>(r) * job.ldb + col];
      if (job.row_scale) v *= job.row_scale[r];
      sum += v;
    }
  }
  lanes[ty][tx] = sum;
  __syncthreads();
  if (ty == 0 && col < job.cols) {
    float total = 0.f;
    for (int i = 0; i < kRowLanes; ++i) total += lanes[i][tx];
    partials[tile.partial + tx] = total;
  }
}

__global__ void __launch_bounds__(kWarpSize * kRowLanes)
    ColumnSumFinishKernel(const ColumnSumJob* jobs, const ColumnSumFinish* finishes, const float* partials) {
  __shared__ float lanes[kRowLanes][kWarpSize];
  const ColumnSumFinish f = finishes[blockIdx.x];
  const ColumnSumJob& job = jobs[f.job];
  const int tx = threadIdx.x % kWarpSize, ty = threadIdx.x / kWarpSize, col = f.col0 + tx;
  float sum = 0.f;
  if (col < job.cols) {
#pragma unroll 8
    for (int chunk = ty; chunk < f.chunks; chunk += kRowLanes) {
      sum += partials[f.partial + static_cast<size_t>(chunk) * job.cols + col];
    }
  }
  lanes[ty][tx] = sum;
  __syncthreads();
  if (ty == 0 && col < job.cols) {
    float total = 0.f;
    for (int i = 0; i < kRowLanes; ++i) total += lanes[i][tx];
    job.out[col] = total;
  }
}

int Chunks(const ColumnSumJob& job) { return CeilDiv(job.rows, kColumnSumChunkRows); }

}  // namespace

ColumnSumPlan PlanColumnSums(const std::vector<ColumnSumJob>& jobs) {
  ColumnSumPlan plan;
  for (int j = 0; j < static_cast<int>(jobs.size()); ++j) {
    const ColumnSumJob& job = jobs[j];
    for (int chunk = 0; chunk < Chunks(job); ++chunk) {
      for (int col0 = 0; col0 < job.cols; col0 += kWarpSize) {
        const int row_begin = chunk * kColumnSumChunkRows;
        const int row_end = row_begin + kColumnSumChunkRows < job.rows ? row_begin + kColumnSumChunkRows : job.rows;
        plan.tiles.push_back({j, col0, row_begin, row_end,
                              plan.partial_floats + static_cast<size_t>(chunk) * job.cols + col0});
      }
    }
    for (int col0 = 0; col0 < job.cols; col0 += kColumnSumFinishColumns) {
      plan.finishes.push_back({j, col0, Chunks(job), plan.partial_floats});
    }
    plan.partial_floats += static_cast<size_t>(Chunks(job)) * job.cols;
  }
  return plan;
}

cudaError_t LaunchColumnSums(const ColumnSumBatch& batch, cudaStream_t stream) {
  if (batch.tile_count == 0) return cudaSuccess;
  ColumnSumTilesKernel<<<batch.tile_count, kWarpSize * kRowLanes, 0, stream>>>(batch.jobs, batch.tiles,
                                                                               batch.partials);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  ColumnSumFinishKernel<<<batch.finish_count, kWarpSize * kRowLanes, 0, stream>>>(batch.jobs, batch.finishes,
                                                                                  batch.partials);
  return cudaGetLastError();
}

}  // namespace perception::kernels
