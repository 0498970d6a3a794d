// Causal depthwise conv + SiLU, instantiated per width W. A warp spans 32 adjacent channels of one sequence, a lane
// per channel, so every row access is coalesced. A forward thread takes a chunk of consecutive steps and loads its
// history rows (and the W−1 past its end) into registers up front, so all of its loads are in flight together; a
// backward warp walks its whole sequence, recomputing each pre-activation from the history rather than reading a
// stored one, and sums its weight partials over the steps in order (deterministic, no atomics).
#include "kernels/common.cuh"
#include "kernels/conv.h"

namespace perception::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kForwardChunk = 16;  // steps per forward thread

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

// The backward: one warp per sequence and 32 adjacent channels, a lane per channel, walking the sequence's steps in
// order, so every row is read once and each pre-activation and its gradient are computed once. The rows of the next
// K steps are loaded while the current K are worked through (the only latency a warp waits on is the first chunk's).
// An output gradient of a B/C channel is the sum over heads of its partials: those of the first kHeadGroup heads are
// held raw and added when their chunk comes up; any further heads are added then, loaded in groups.
constexpr int kBackwardWarps = 4;
constexpr int kBackwardThreads = kBackwardWarps * kWarpSize;
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
  for (int k = 0; k < W - 1; ++k) {
    hist[k] = in.state_in ? in.state_in[(static_cast<size_t>(b) * (W - 1) + k) * in.channels + c] : 0.f;
  }
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
#pragma unroll 4
    for (int h = HG; h < heads; ++h) {
#pragma unroll
      for (int i = 0; i < K; ++i) g_now[i] += s0 + i < T ? g_col[(s0 + i) * g_ld + h * width] : 0.f;
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
// channels read kHeadGroup partials a step and have 4, so both fit the registers that keep every warp of `small`
// resident at once (≤ 96 a thread).
template <int W>
__global__ void __launch_bounds__(kBackwardThreads)
    ConvBackwardKernel(ConvInput in, ConvOutputGrad grad, float* dx, int lddx, float* partials) {
  const int tiles = CeilDiv(in.channels, kWarpSize);
  const int item = blockIdx.x * kBackwardWarps + threadIdx.x / kWarpSize;
  const int c0 = item % tiles * kWarpSize, c = c0 + threadIdx.x % kWarpSize;
  if (item >= in.batch * tiles || c >= in.channels) return;  // no barrier or shuffle in this kernel
  if (c0 + kWarpSize <= grad.inner) {
    ConvBackwardWarp<W, 8, 1>(in, grad, item / tiles, c, dx, lddx, partials);
  } else {
    ConvBackwardWarp<W, 4, kHeadGroup>(in, grad, item / tiles, c, dx, lddx, partials);
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
  const int warps = in.batch * CeilDiv(in.channels, kWarpSize);
  ConvBackwardKernel<W><<<CeilDiv(warps, kBackwardWarps), kBackwardThreads, 0, stream>>>(in, grad, dx, lddx, partials);
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
