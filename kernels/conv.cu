// Causal depthwise conv + SiLU, instantiated per width W. Each thread takes one channel of a chunk of consecutive
// steps of one sequence; a warp spans 32 adjacent channels, so every row access is coalesced. The forward loads its
// chunk's history rows (and the W−1 past its end) into registers up front, so all of its loads are in flight
// together; the backward's block first stages a window of history rows and output gradients in shared memory (each
// element read once, four channels a load where the rows allow), recomputes each pre-activation from that history
// rather than reading a stored one, and holds one sequence, adding its warps' weight partials in a fixed order
// (deterministic, no atomics).
#include <cstdint>

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

// VW consecutive floats from p, as one vector load where VW = 4 (p then on a 16-byte boundary).
template <int VW>
__device__ __forceinline__ void LoadVector(const float* p, float (&v)[VW]) {
  if constexpr (VW == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
  } else {
    static_assert(VW == 1);
    v[0] = *p;
  }
}

// The backward's block: one sequence, kWarpSize channels, windows of kBackwardSteps steps. Its threads first copy a
// window's history rows and output gradients into shared memory together (VW channels a load, every global element
// read once), then each warp takes kBackwardChunk steps of it, a lane per channel, as the forward does.
constexpr int kBackwardSteps = kWarps * kBackwardChunk;

template <int W, int VW>
__global__ void __launch_bounds__(kThreads)
    ConvBackwardKernel(ConvInput in, ConvOutputGrad grad, float* dx, int lddx, float* partials) {
  // Raw inputs t0 .. t0 + kBackwardSteps − 1 feed outputs up to W − 1 steps later, whose pre-activations read
  // history rows up to 2W − 2 past the window.
  constexpr int kOutputs = kBackwardSteps + W - 1, kRows = kBackwardSteps + 2 * W - 2;
  constexpr int kRowVectors = kWarpSize / VW;
  constexpr int kRowLoads = CeilDiv(kRows * kRowVectors, kThreads);
  constexpr int kOutputLoads = CeilDiv(kOutputs * kRowVectors, kThreads);
  __shared__ float hist[kRows][kWarpSize], dpre[kOutputs][kWarpSize];
  __shared__ float sums[W + 1][kWarps][kWarpSize];  // per warp: d weight taps, then d bias
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int c0 = blockIdx.x * kWarpSize, c = c0 + lane, b = blockIdx.y, T = in.window;
  float w[W], bias = 0.f;
#pragma unroll
  for (int k = 0; k < W; ++k) w[k] = c < in.channels ? in.weight[c * W + k] : 0.f;
  if (c < in.channels) bias = in.bias[c];
  float dw[W] = {}, db = 0.f;
  for (int t0 = 0; t0 < T; t0 += kBackwardSteps) {
    // Every load of the window is issued before the first store to shared memory.
    float rows[kRowLoads][VW], outs[kOutputLoads][VW];
#pragma unroll
    for (int l = 0; l < kRowLoads; ++l) {
      const int e = threadIdx.x + l * kThreads, j = e / kRowVectors, ch = c0 + e % kRowVectors * VW, r = t0 + j;
#pragma unroll
      for (int v = 0; v < VW; ++v) rows[l][v] = 0.f;
      if (j >= kRows || ch >= in.channels) continue;
      if (r < W - 1) {
        if (in.state_in) {
          LoadVector<VW>(in.state_in + (static_cast<size_t>(b) * (W - 1) + r) * in.channels + ch, rows[l]);
        }
      } else if (r < T + W - 1) {
        LoadVector<VW>(in.x + static_cast<size_t>(b * T + r - (W - 1)) * in.ldx + ch, rows[l]);
      }
    }
#pragma unroll
    for (int l = 0; l < kOutputLoads; ++l) {
      const int e = threadIdx.x + l * kThreads, i = e / kRowVectors, ch = c0 + e % kRowVectors * VW;
#pragma unroll
      for (int v = 0; v < VW; ++v) outs[l][v] = 0.f;
      if (i >= kOutputs || ch >= in.channels || t0 + i >= T) continue;
      const size_t row = static_cast<size_t>(b) * T + t0 + i;
      if (ch < grad.inner) {
        LoadVector<VW>(grad.dxs + row * grad.inner + ch, outs[l]);
      } else {  // the sum over heads of the B/C partials, heads in order
        const int width = in.channels - grad.inner;
        const float* parts = grad.dbc + row * grad.heads * width + (ch - grad.inner);
#pragma unroll 4
        for (int h = 0; h < grad.heads; ++h) {
          float p[VW];
          LoadVector<VW>(parts + h * width, p);
#pragma unroll
          for (int v = 0; v < VW; ++v) outs[l][v] += p[v];
        }
      }
    }
#pragma unroll
    for (int l = 0; l < kRowLoads; ++l) {
      const int e = threadIdx.x + l * kThreads;
      if (e < kRows * kRowVectors) {
#pragma unroll
        for (int v = 0; v < VW; ++v) hist[e / kRowVectors][e % kRowVectors * VW + v] = rows[l][v];
      }
    }
#pragma unroll
    for (int l = 0; l < kOutputLoads; ++l) {
      const int e = threadIdx.x + l * kThreads;
      if (e < kOutputs * kRowVectors) {
#pragma unroll
        for (int v = 0; v < VW; ++v) dpre[e / kRowVectors][e % kRowVectors * VW + v] = outs[l][v];
      }
    }
    __syncthreads();
    const int s0 = warp * kBackwardChunk;  // this warp's first step in the window
    if (c < in.channels && t0 + s0 < T) {
      float h[kBackwardChunk + 2 * W - 2], d[kBackwardChunk + W - 1];
#pragma unroll
      for (int j = 0; j < kBackwardChunk + 2 * W - 2; ++j) h[j] = hist[s0 + j][lane];
#pragma unroll
      for (int i = 0; i < kBackwardChunk + W - 1; ++i) d[i] = dpre[s0 + i][lane] * SiluGrad(Pre<W>(bias, w, h + i));
#pragma unroll
      for (int i = 0; i < kBackwardChunk; ++i) {
        if (t0 + s0 + i >= T) break;
        db += d[i];
#pragma unroll
        for (int k = 0; k < W; ++k) dw[k] += d[i] * h[i + k];
        // Raw input t0 + s0 + i is history row t0 + s0 + i + W − 1: output t0 + s0 + i + k read it through tap
        // W − 1 − k.
        float d_input = 0.f;
#pragma unroll
        for (int k = 0; k < W; ++k) d_input += w[W - 1 - k] * d[i + k];
        dx[static_cast<size_t>(b * T + t0 + s0 + i) * lddx + c] = d_input;
      }
    }
    __syncthreads();  // the next window overwrites hist and dpre
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

// Whether the backward may read its inputs VW = 4 channels at a time: every row of x, state_in, dxs and dbc starts on
// a 16-byte boundary and the B/C channels split into whole vectors.
bool BackwardVectorizable(const ConvInput& in, const ConvOutputGrad& grad) {
  const auto aligned = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return in.ldx % 4 == 0 && in.channels % 4 == 0 && grad.inner % 4 == 0 && aligned(in.x) && aligned(in.state_in) &&
         aligned(grad.dxs) && aligned(grad.dbc);
}

template <int W>
cudaError_t BackwardOfWidth(const ConvInput& in, const ConvOutputGrad& grad, float* dx, int lddx, float* partials,
                            cudaStream_t stream) {
  const dim3 grid(CeilDiv(in.channels, kWarpSize), in.batch);
  if (BackwardVectorizable(in, grad)) {
    ConvBackwardKernel<W, 4><<<grid, kThreads, 0, stream>>>(in, grad, dx, lddx, partials);
  } else {
    ConvBackwardKernel<W, 1><<<grid, kThreads, 0, stream>>>(in, grad, dx, lddx, partials);
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

cudaError_t LaunchConvForward(const ConvInput& in, float* out, float* state_out, cudaStream_t stream) {
  return ForWidth(in.width, [&]<int W>() { return ForwardOfWidth<W>(in, out, state_out, stream); });
}

cudaError_t LaunchConvBackward(const ConvInput& in, const ConvOutputGrad& grad, float* dx, int lddx, float* partials,
                               cudaStream_t stream) {
  return ForWidth(in.width, [&]<int W>() { return BackwardOfWidth<W>(in, grad, dx, lddx, partials, stream); });
}

}  // namespace perception::kernels
