// Causal depthwise conv + SiLU, instantiated per width W. A warp spans 32 adjacent channels of one sequence, a lane
// per channel, so every row access is coalesced. A forward thread (and a backward one for long windows) takes a chunk
// of consecutive steps and loads its history rows (and those past its end that it needs) into registers up front, so
// all of its loads are in flight together; for short windows a backward warp walks its whole sequence in order. The
// backward recomputes each pre-activation from the history rather than reading a stored one, and sums its weight
// partials in a fixed order (deterministic, no atomics).
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
  WaitForPriorKernels();  // the forward's chain (engine/cuda_model.cc): the kernel ahead wrote x (not the weights)
  LetNextKernelLaunch();
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

// The backward for long windows or many heads: a block holds one sequence and 32 channels, its warps take chunks of
// kBackwardChunk steps each, every thread loading its chunk's rows (and those its outputs' gradients reach) up front.
template <int W>
__global__ void __launch_bounds__(kThreads)
    ConvBackwardChunkKernel(ConvInput in, ConvOutputGrad grad, float* dx, int lddx, float* partials) {
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

// The backward walk, for windows up to kWalkMaxWindow steps: a warp takes one sequence and 32 adjacent channels and
// walks the steps in order, the rows of its next chunk of steps in flight while it works through the current one.
// Every row is read once, each pre-activation and its gradient computed once, and the warps are few enough that an
// SM holds all of `small`'s at once: kWalkMinBlocks blocks of kWalkWarps (≤ 102 registers a thread). An output
// gradient of a B/C channel is the sum over heads of its partials, of at most kHeadGroup heads here: they are held
// raw and added when their chunk comes up.
constexpr int kWalkWarps = 4;
constexpr int kWalkThreads = kWalkWarps * kWarpSize;
constexpr int kWalkMinBlocks = 5;
constexpr int kWalkMaxWindow = 64;
constexpr int kHeadGroup = 4;

template <int W, int K, int HG>
__device__ __forceinline__ void ConvBackwardWarp(const ConvInput& in, const ConvOutputGrad& grad, int b, int c,
                                                 float* dx, int lddx, float* partials) {
  const int T = in.window;
  float w[W];
#pragma unroll
  for (int k = 0; k < W; ++k) w[k] = in.weight[c * W + k];
  const float bias = in.bias[c];
  // Lane c's output gradients: dxs for c < inner, else the heads' partials (head h at + h·width).
  const bool partial_sum = c >= grad.inner;
  const int width = in.channels - grad.inner;
  const float* g_col = partial_sum ? grad.dbc + static_cast<size_t>(b) * T * grad.heads * width + (c - grad.inner)
                                   : grad.dxs + static_cast<size_t>(b) * T * grad.inner + c;
  const int g_ld = partial_sum ? grad.heads * width : grad.inner;  // offsets within one sequence fit an int
  const int heads = partial_sum ? grad.heads : 1;
  const float* x_col = in.x + static_cast<size_t>(b) * T * in.ldx + c;
  float* dx_col = dx + static_cast<size_t>(b) * T * lddx + c;

  float x_next[K], g_next[K][HG];  // the next chunk's rows, in flight
  const auto load = [&](int s0) {
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const bool valid = s0 + i < T;
      x_next[i] = valid ? x_col[(s0 + i) * in.ldx] : 0.f;
#pragma unroll
      for (int h = 0; h < HG; ++h) g_next[i][h] = valid && h < heads ? g_col[(s0 + i) * g_ld + h * width] : 0.f;
    }
  };
  // hist: history rows s .. s + W − 1 for output s (the last, raw input s, filled in its step); dp: d pre-activation
  // of outputs s − W + 1 .. s.
  float hist[W], dp[W] = {}, dw[W] = {}, db = 0.f;
#pragma unroll
  for (int k = 0; k < W - 1; ++k) hist[k] = History<W>(in, b, k, c);
  // Raw input t = s − (W − 1) is history row s: outputs t .. s read it through taps W − 1 .. 0, so its gradient is
  // complete once output s's is known.
  const auto emit = [&](int s) {
    if (s < W - 1) return;
    float d_input = 0.f;
#pragma unroll
    for (int k = 0; k < W; ++k) d_input += w[W - 1 - k] * dp[k];
    dx_col[(s - (W - 1)) * lddx] = d_input;
  };
  load(0);
  for (int s0 = 0; s0 < T; s0 += K) {
    float x_now[K], g_now[K];
#pragma unroll
    for (int i = 0; i < K; ++i) {
      x_now[i] = x_next[i];
      g_now[i] = 0.f;
#pragma unroll
      for (int h = 0; h < HG; ++h) g_now[i] += g_next[i][h];  // heads in order
    }
    if (s0 + K < T) load(s0 + K);
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const int s = s0 + i;
      if (s >= T) break;
      hist[W - 1] = x_now[i];
      const float d = g_now[i] * SiluGrad(Pre<W>(bias, w, hist));
      db += d;
#pragma unroll
      for (int k = 0; k < W; ++k) {
        dw[k] += d * hist[k];
        dp[k] = k + 1 < W ? dp[k + 1] : d;
      }
      emit(s);
#pragma unroll
      for (int k = 0; k + 1 < W; ++k) hist[k] = hist[k + 1];
    }
  }
  // Outputs past the window have no gradient: the last W − 1 raw inputs' sums end with zeros.
#pragma unroll
  for (int j = 0; j < W - 1; ++j) {
#pragma unroll
    for (int k = 0; k < W; ++k) dp[k] = k + 1 < W ? dp[k + 1] : 0.f;
    emit(T + j);
  }
  float* part = partials + static_cast<size_t>(b) * (in.channels * W + in.channels);
#pragma unroll
  for (int k = 0; k < W; ++k) part[c * W + k] = dw[k];
  part[in.channels * W + c] = db;
}

// Warps whose channels are all of the first `inner` read one row a step and have 8 steps in flight; those with B/C
// channels read kHeadGroup partials a step and have 4, so both fit kWalkMinBlocks' registers.
template <int W>
__global__ void __launch_bounds__(kWalkThreads, kWalkMinBlocks)
    ConvBackwardWalkKernel(ConvInput in, ConvOutputGrad grad, float* dx, int lddx, float* partials) {
  const int tiles = CeilDiv(in.channels, kWarpSize);
  const int item = blockIdx.x * kWalkWarps + threadIdx.x / kWarpSize;
  const int c0 = item % tiles * kWarpSize, c = c0 + threadIdx.x % kWarpSize;
  if (item >= in.batch * tiles || c >= in.channels) return;  // no barrier or shuffle in this kernel
  if (c0 + kWarpSize <= grad.inner) {
    ConvBackwardWarp<W, 8, 1>(in, grad, item / tiles, c, dx, lddx, partials);
  } else {
    ConvBackwardWarp<W, 4, kHeadGroup>(in, grad, item / tiles, c, dx, lddx, partials);
  }
}

template <int W>
cudaError_t ForwardOfWidth(const ConvInput& in, float* out, float* state_out, cudaStream_t stream,
                           bool programmatic) {
  const int chunks = in.batch * CeilDiv(in.window, kForwardChunk);
  return LaunchKernel(ConvForwardKernel<W>, dim3(CeilDiv(in.channels, kWarpSize), CeilDiv(chunks, kWarps)), kThreads,
                      0, stream, programmatic, in, out, state_out);
}

// Measured on the H200 (ncu, one launch), walking takes `small`'s backward (64 steps, 4 heads) from 36.4 to 25.9 µs
// but `large`'s (256 steps, 16 heads; a version whose B/C warps loaded the heads past kHeadGroup chunk by chunk) from
// 170.8 to 210 µs: windows up to kWalkMaxWindow steps with at most kHeadGroup heads walk, the others take chunks.

template <int W>
cudaError_t BackwardOfWidth(const ConvInput& in, const ConvOutputGrad& grad, float* dx, int lddx, float* partials,
                            cudaStream_t stream) {
  if (in.window <= kWalkMaxWindow && grad.heads <= kHeadGroup) {
    const int warps = in.batch * CeilDiv(in.channels, kWarpSize);
    ConvBackwardWalkKernel<W><<<CeilDiv(warps, kWalkWarps), kWalkThreads, 0, stream>>>(in, grad, dx, lddx,
                                                                                               partials);
  } else {
    ConvBackwardChunkKernel<W><<<dim3(CeilDiv(in.channels, kWarpSize), in.batch), kThreads, 0, stream>>>(
        in, grad, dx, lddx, partials);
  }
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

cudaError_t LaunchConvForward(const ConvInput& in, float* out, float* state_out, cudaStream_t stream,
                              bool programmatic) {
  return ForWidth(in.width, [&]<int W>() { return ForwardOfWidth<W>(in, out, state_out, stream, programmatic); });
}

cudaError_t LaunchConvBackward(const ConvInput& in, const ConvOutputGrad& grad, float* dx, int lddx, float* partials,
                               cudaStream_t stream) {
  return ForWidth(in.width, [&]<int W>() { return BackwardOfWidth<W>(in, grad, dx, lddx, partials, stream); });
}

}  // namespace perception::kernels
