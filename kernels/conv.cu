// Causal depthwise conv + SiLU, instantiated per width W. Each thread takes one channel of a chunk of consecutive
// steps of one sequence and loads the chunk's history rows (and the W−1 past its end) into registers up front, so
// all of its loads are in flight together; a warp spans 32 adjacent channels, so every row access is coalesced.
// The backward recomputes each pre-activation from that history rather than reading a stored one, and its blocks
// hold one sequence each, adding their warps' weight partials in a fixed order (deterministic, no atomics).
#include "kernels/common.cuh"
#include "kernels/conv.h"

namespace perception::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kForwardChunk = 16;  // steps per forward thread
constexpr int kBackwardChunk = 8;  // steps per backward thread: a block's 8 warps cover a 64-step window at once

// Row r of sequence b's history [state (width−1 rows) ; window rows], channel c; zero past the history's end.
template <int W>
__device__ __forceinline__ float History(const ConvInput& in, int b, int r, int c) {
  if (r < W - 1) return in.state_in ? in.state_in[(static_cast<size_t>(b) * (W - 1) + r) * in.channels + c] : 0.f;
  if (r >= in.window + W - 1) return 0.f;
  return in.x[static_cast<size_t>(b * in.window + r - (W - 1)) * in.ldx + c];
}

// pre = bias + Σ_k w[k]·hist[k], in the order of engine/cpu_reference.cc (forward and backward agree bit for bit).
template <int W>
__device__ __forceinline__ float Pre(float bias, const float (&w)[W], const float* hist) {
  float acc = bias;
#pragma unroll
  for (int k = 0; k < W; ++k) acc += w[k] * hist[k];
  return acc;
}

template <int W>
__global__ void __launch_bounds__(kThreads) ConvForwardKernel(ConvInput in, float* out, float* state_out) {
  const int c = blockIdx.x * kWarpSize + threadIdx.x % kWarpSize;
  const int chunks_per_sequence = CeilDiv(in.window, kForwardChunk);
  const int chunk = blockIdx.y * kWarps + threadIdx.x / kWarpSize;
  if (c >= in.channels || chunk >= in.batch * chunks_per_sequence) return;  // no barrier below
  const int b = chunk / chunks_per_sequence, t0 = (chunk % chunks_per_sequence) * kForwardChunk;
  float w[W];
#pragma unroll
  for (int k = 0; k < W; ++k) w[k] = in.weight[c * W + k];
  const float bias = in.bias[c];
  float hist[kForwardChunk + W - 1];  // history rows t0 ..
#pragma unroll
  for (int j = 0; j < kForwardChunk + W - 1; ++j) hist[j] = History<W>(in, b, t0 + j, c);
#pragma unroll
  for (int i = 0; i < kForwardChunk; ++i) {
    if (t0 + i >= in.window) break;
    out[static_cast<size_t>(b * in.window + t0 + i) * in.channels + c] = Silu(Pre<W>(bias, w, hist + i));
  }
  if (state_out) {  // the last W−1 history rows, window .. window + W − 2, from the chunk that holds them
#pragma unroll
    for (int j = 0; j < kForwardChunk + W - 1; ++j) {
      const int k = t0 + j - in.window;
      if (k >= 0 && k < W - 1) state_out[(static_cast<size_t>(b) * (W - 1) + k) * in.channels + c] = hist[j];
    }
  }
}

__device__ __forceinline__ float OutputGrad(const ConvOutputGrad& g, int channels, int row, int c) {
  if (c < g.inner) return g.dxs[static_cast<size_t>(row) * g.inner + c];
  const int width = channels - g.inner;
  const float* parts = g.dbc + static_cast<size_t>(row) * g.heads * width + (c - g.inner);
  float sum = 0.f;
  for (int h = 0; h < g.heads; ++h) sum += parts[h * width];
  return sum;
}

template <int W>
__global__ void __launch_bounds__(kThreads)
    ConvBackwardKernel(ConvInput in, ConvOutputGrad grad, float* dx, int lddx, float* partials) {
  __shared__ float sums[W + 1][kWarps][kWarpSize];  // per warp: d weight taps, then d bias
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int c = blockIdx.x * kWarpSize + lane, b = blockIdx.y, T = in.window;
  float dw[W] = {}, db = 0.f;
  if (c < in.channels) {
    float w[W];
#pragma unroll
    for (int k = 0; k < W; ++k) w[k] = in.weight[c * W + k];
    const float bias = in.bias[c];
    // Raw inputs t0 .. t0 + kBackwardChunk − 1 feed outputs up to W − 1 steps later, whose pre-activations read
    // history rows up to 2W − 2 past the chunk.
    constexpr int kOutputs = kBackwardChunk + W - 1, kRows = kBackwardChunk + 2 * W - 2;
    for (int t0 = warp * kBackwardChunk; t0 < T; t0 += kWarps * kBackwardChunk) {
      float hist[kRows], dpre[kOutputs];
#pragma unroll
      for (int j = 0; j < kRows; ++j) hist[j] = History<W>(in, b, t0 + j, c);
#pragma unroll
      for (int i = 0; i < kOutputs; ++i) dpre[i] = t0 + i < T ? OutputGrad(grad, in.channels, b * T + t0 + i, c) : 0.f;
#pragma unroll
      for (int i = 0; i < kOutputs; ++i) dpre[i] *= SiluGrad(Pre<W>(bias, w, hist + i));
#pragma unroll
      for (int i = 0; i < kBackwardChunk; ++i) {
        if (t0 + i >= T) break;
        db += dpre[i];
#pragma unroll
        for (int k = 0; k < W; ++k) dw[k] += dpre[i] * hist[i + k];
        // Raw input t0 + i is history row t0 + i + W − 1: output t0 + i + k read it through tap W − 1 − k.
        float d_input = 0.f;
#pragma unroll
        for (int k = 0; k < W; ++k) d_input += w[W - 1 - k] * dpre[i + k];
        dx[static_cast<size_t>(b * T + t0 + i) * lddx + c] = d_input;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < W; ++k) sums[k][warp][lane] = dw[k];
  sums[W][warp][lane] = db;
  __syncthreads();
  if (c >= in.channels) return;
  float* part = partials + static_cast<size_t>(b) * (in.channels * W + in.channels);
  for (int k = warp; k <= W; k += kWarps) {
    float total = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) total += sums[k][v][lane];
    part[k < W ? c * W + k : in.channels * W + c] = total;
  }
}

template <int W>
cudaError_t ForwardOfWidth(const ConvInput& in, float* out, float* state_out, cudaStream_t stream) {
  const int chunks = in.batch * CeilDiv(in.window, kForwardChunk);
  ConvForwardKernel<W><<<dim3(CeilDiv(in.channels, kWarpSize), CeilDiv(chunks, kWarps)), kThreads, 0, stream>>>(
      in, out, state_out);
  return cudaGetLastError();
}

template <int W>
cudaError_t BackwardOfWidth(const ConvInput& in, const ConvOutputGrad& grad, float* dx, int lddx, float* partials,
                            cudaStream_t stream) {
  ConvBackwardKernel<W><<<dim3(CeilDiv(in.channels, kWarpSize), in.batch), kThreads, 0, stream>>>(in, grad, dx, lddx,
                                                                                                 partials);
  return cudaGetLastError();
}

// Calls op.template operator()<W>() for the runtime width.
template <typename Op>
cudaError_t ForWidth(int width, Op&& op) {
  switch (width) {
    case 1: return op.template operator()<1>();
    case 2: return op.template operator()<2>();
    case 3: return op.template operator()<3>();
    case 4: return op.template operator()<4>();
    case 5: return op.template operator()<5>();
    case 6: return op.template operator()<6>();
    case 7: return op.template operator()<7>();
    case 8: return op.template operator()<8>();
    default: return cudaErrorInvalidValue;
  }
}
static_assert(kMaxConvWidth == 8, "ForWidth instantiates widths 1 .. kMaxConvWidth");

}  // namespace

cudaError_t LaunchConvForward(const ConvInput& in, float* out, float* state_out, cudaStream_t stream) {
  return ForWidth(in.width, [&]<int W>() { return ForwardOfWidth<W>(in, out, state_out, stream); });
}

cudaError_t LaunchConvBackward(const ConvInput& in, const ConvOutputGrad& grad, float* dx, int lddx, float* partials,
                               cudaStream_t stream) {
  return ForWidth(in.width, [&]<int W>() { return BackwardOfWidth<W>(in, grad, dx, lddx, partials, stream); });
}

}  // namespace perception::kernels
