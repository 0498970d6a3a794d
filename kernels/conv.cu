// Causal depthwise conv + SiLU. Forward: one thread per (row, channel). Backward: one thread per (sequence, channel)
// walking time backwards with the last W pre-activation gradients and history values in registers, so each input
// gradient and the per-sequence weight partials come out of a single pass without atomics.
#include "kernels/common.cuh"
#include "kernels/conv.h"

namespace perception::kernels {
namespace {

constexpr int kThreads = 256;

// Row r of sequence b's history [state (width−1 rows) ; window rows], channel c.
__device__ __forceinline__ float History(const ConvInput& in, int b, int r, int c) {
  const int carried = in.width - 1;
  if (r < carried) {
    return in.state_in ? in.state_in[(static_cast<size_t>(b) * carried + r) * in.channels + c] : 0.f;
  }
  return in.x[static_cast<size_t>(b * in.window + r - carried) * in.ldx + c];
}

__global__ void ConvForwardKernel(ConvInput in, float* pre, float* out, float* state_out) {
  const long long outputs = static_cast<long long>(in.batch) * in.window * in.channels;
  const long long carried = state_out ? static_cast<long long>(in.batch) * (in.width - 1) * in.channels : 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < outputs + carried;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    if (i < outputs) {
      const int c = static_cast<int>(i % in.channels);
      const int row = static_cast<int>(i / in.channels);
      const int b = row / in.window, t = row % in.window;
      float acc = in.bias[c];
      for (int k = 0; k < in.width; ++k) acc += in.weight[c * in.width + k] * History(in, b, t + k, c);
      pre[i] = acc;
      out[i] = Silu(acc);
    } else {
      const long long j = i - outputs;  // [b, k, c] of the final state: history row window + k
      const int c = static_cast<int>(j % in.channels);
      const int k = static_cast<int>((j / in.channels) % (in.width - 1));
      const int b = static_cast<int>(j / (static_cast<long long>(in.channels) * (in.width - 1)));
      state_out[j] = History(in, b, in.window + k, c);
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

__global__ void ConvBackwardKernel(ConvInput in, const float* pre, ConvOutputGrad grad, float* dx, int lddx,
                                   float* partials) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= in.batch * in.channels) return;
  const int b = i / in.channels, c = i % in.channels, W = in.width;
  // Register windows at time t: hist[k] = history row t + k, dpre[k] = d pre at time t + k (0 past the window).
  // Before the first step, hist holds rows window .. window + W − 2 so that the shift below lines it up.
  float w_reversed[kMaxConvWidth], hist[kMaxConvWidth], dpre[kMaxConvWidth], dw[kMaxConvWidth];
#pragma unroll
  for (int k = 0; k < kMaxConvWidth; ++k) {
    w_reversed[k] = k < W ? in.weight[c * W + W - 1 - k] : 0.f;
    hist[k] = k < W - 1 ? History(in, b, in.window + k, c) : 0.f;
    dpre[k] = 0.f;
    dw[k] = 0.f;
  }
  float db = 0.f;
  for (int t = in.window - 1; t >= 0; --t) {
#pragma unroll
    for (int k = kMaxConvWidth - 1; k > 0; --k) {
      hist[k] = hist[k - 1];
      dpre[k] = dpre[k - 1];
    }
    const int row = b * in.window + t;
    hist[0] = History(in, b, t, c);
    dpre[0] = OutputGrad(grad, in.channels, row, c) * SiluGrad(pre[static_cast<size_t>(row) * in.channels + c]);
    db += dpre[0];
    float d_input = 0.f;  // raw input t is history row t + W − 1: it fed outputs t .. t + W − 1 through taps W−1 .. 0
#pragma unroll
    for (int k = 0; k < kMaxConvWidth; ++k) {
      dw[k] += dpre[0] * hist[k];
      d_input += w_reversed[k] * dpre[k];
    }
    dx[static_cast<size_t>(row) * lddx + c] = d_input;
  }
  float* part = partials + static_cast<size_t>(b) * (in.channels * W + in.channels);
#pragma unroll
  for (int k = 0; k < kMaxConvWidth; ++k) {
    if (k < W) part[c * W + k] = dw[k];
  }
  part[in.channels * W + c] = db;
}

}  // namespace

cudaError_t LaunchConvForward(const ConvInput& in, float* pre, float* out, float* state_out, cudaStream_t stream) {
  if (in.width < 1) return cudaErrorInvalidValue;
  const long long n = static_cast<long long>(in.batch) * (in.window + (state_out ? in.width - 1 : 0)) * in.channels;
  ConvForwardKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(in, pre, out, state_out);
  return cudaGetLastError();
}

cudaError_t LaunchConvBackward(const ConvInput& in, const float* pre, const ConvOutputGrad& grad, float* dx,
                               int lddx, float* partials, cudaStream_t stream) {
  if (in.width < 1 || in.width > kMaxConvWidth) return cudaErrorInvalidValue;
  ConvBackwardKernel<<<CeilDiv(in.batch * in.channels, kThreads), kThreads, 0, stream>>>(in, pre, grad, dx, lddx,
                                                                                         partials);
  return cudaGetLastError();
}

}  // namespace perception::kernels
