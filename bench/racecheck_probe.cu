// racecheck_probe: which parts of kernels/gemm_tf32x3.cu's stage handoff make compute-sanitizer's racecheck report
// hazards. Each variant is a correct two-stage producer/consumer handoff (but the control, whose producers store once
// more after the handoff) that adds one feature of the GEMM to the one before; run each under `--tool racecheck`:
// `racecheck_probe VARIANT` (0–7; `racecheck_probe` alone lists them). On the H200 (two calls, session 5) every
// variant computed the exact sums; racecheck reported 3–8 hazards for each named-barrier variant (1–5, the plain
// 256-thread bar.arrive → bar.sync handoff already), as many as for the control's real race (7), and none for the
// mbarrier variants (6, 7): it does not follow bar.arrive → bar.sync, which PTX orders ("the barrier{.cta}.sync or
// barrier{.cta}.arrive instruction guarantees that when the barrier completes, prior memory accesses requested by
// this thread are performed relative to all threads participating in the barrier").
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/mbarrier.cuh"

namespace {

using perception::kernels::MbarrierArrive;
using perception::kernels::MbarrierInit;
using perception::kernels::MbarrierWait;

constexpr int kRounds = 64;

template <int kCount>
__device__ __forceinline__ void BarSync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kCount) : "memory");
}
template <int kCount>
__device__ __forceinline__ void BarArrive(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(kCount) : "memory");
}
__device__ constexpr int Full(int stage) { return 1 + stage; }
__device__ constexpr int Empty(int stage) { return 3 + stage; }
constexpr int kProducerBarrier = 5;

struct Features {
  bool race;            // the control: the producers store the value once more after arriving on FULL
  int groups;           // producer warpgroups = consumer warpgroups (1: 256 threads, 2: 512 as in the GEMM)
  bool producer_bar;    // the producers' own bar.sync over their threads before each store
  bool setmaxnreg;      // setmaxnreg.dec / .inc in the producers / consumers
  bool fence;           // fence.proxy.async after the stores
  bool mbarriers;       // FULL and EMPTY as mbarriers (every thread arrives; waits with try_wait.parity)
  bool copy;            // the stage is filled by cp.async, handed over by cp.async.mbarrier.arrive (mbarriers only)
};
constexpr Features kVariants[] = {
    {true, 2, false, false, false, false, false},   // 0: control, a real race
    {false, 1, false, false, false, false, false},  // 1: the probe of RESULTS.md (256 threads)
    {false, 2, false, false, false, false, false},  // 2: 512 threads, two warpgroups each side
    {false, 2, true, false, false, false, false},   // 3: + the producers' own barrier
    {false, 2, true, true, false, false, false},    // 4: + setmaxnreg
    {false, 2, true, true, true, false, false},     // 5: + fence.proxy.async: the GEMM's handoff
    {false, 2, true, true, true, true, false},      // 6: 5 on mbarriers
    {false, 2, false, true, false, true, true},     // 7: mbarriers, the stage copied by cp.async
};
constexpr int kVariantCount = sizeof(kVariants) / sizeof(kVariants[0]);

// Producers write stage it % 2 (16 bytes per thread, as the GEMM's split stores) and hand it over on FULL; consumers
// read values other threads wrote (of the other producer warpgroup too) and hand it back on EMPTY.
template <int kVariant>
__global__ void __launch_bounds__(256 * kVariants[kVariant].groups, 1) Handoff(const float* source, float* out) {
  constexpr Features f = kVariants[kVariant];
  constexpr int kProducers = f.groups * 128, kThreads = 2 * kProducers, kFloats = 4 * kProducers;
  __shared__ __align__(16) float stage[2][kFloats];
  __shared__ __align__(8) unsigned long long bars[4];
  const uint32_t full0 = static_cast<uint32_t>(__cvta_generic_to_shared(&bars[0]));
  const uint32_t empty0 = full0 + 16;
  if (f.mbarriers && threadIdx.x < 2) {
    MbarrierInit(full0 + 8 * threadIdx.x, kProducers);
    MbarrierInit(empty0 + 8 * threadIdx.x, kProducers);
  }
  __syncthreads();
  if (threadIdx.x < kProducers) {
    if (f.setmaxnreg) asm volatile("setmaxnreg.dec.sync.aligned.u32 48;");
    const int t = threadIdx.x;
    for (int it = 0; it < kRounds; ++it) {
      const int s = it % 2;
      if (f.mbarriers && it >= 2) MbarrierWait(empty0 + 8 * s, (it / 2 + 1) % 2);
      if (f.producer_bar) BarSync<kProducers>(kProducerBarrier);
      if (f.copy) {
        const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(&stage[s][4 * t]));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(source + 4 * (it * kProducers + t))
                     : "memory");
        asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(full0 + 8 * s) : "memory");
      } else {
        const float v = it * 1000.f + t;
        *reinterpret_cast<float4*>(&stage[s][4 * t]) = make_float4(v, v, v, v);
      }
      if (f.fence) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      if (f.mbarriers) {
        MbarrierArrive(full0 + 8 * s);
      } else {
        BarArrive<kThreads>(Full(s));
        // The same value again, but unordered with the consumers' reads: a real race.
        if (f.race) reinterpret_cast<volatile float*>(stage[s])[4 * t] = it * 1000.f + t;
        if (it >= 1) BarSync<kThreads>(Empty((it - 1) % 2));
      }
    }
    if (!f.mbarriers) BarSync<kThreads>(Empty((kRounds - 1) % 2));
    if (f.copy) asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }
  if (f.setmaxnreg) asm volatile("setmaxnreg.inc.sync.aligned.u32 208;");
  const int t = threadIdx.x - kProducers;
  float sum = 0.f;
  for (int it = 0; it < kRounds; ++it) {
    const int s = it % 2;
    if (f.mbarriers) {
      MbarrierWait(full0 + 8 * s, (it / 2) % 2);
    } else {
      BarSync<kThreads>(Full(s));
    }
    // Another warp's value, of the other producer warpgroup where there are two.
    sum += stage[s][4 * ((t + 37 + kProducers / 2) % kProducers)];
    if (f.mbarriers) {
      MbarrierArrive(empty0 + 8 * s);
    } else {
      BarArrive<kThreads>(Empty(s));
    }
  }
  out[t] = sum;
}

template <int kVariant>
void Launch(int variant, const float* source, float* out) {
  if (variant == kVariant) Handoff<kVariant><<<1, 2 * 128 * kVariants[kVariant].groups>>>(source, out);
  if constexpr (kVariant + 1 < kVariantCount) Launch<kVariant + 1>(variant, source, out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: racecheck_probe VARIANT (0..%d; 0 is the control with a real race)\n",
                 kVariantCount - 1);
    return 2;
  }
  const int variant = std::atoi(argv[1]);
  if (variant < 0 || variant >= kVariantCount) return 2;
  const int producers = kVariants[variant].groups * 128;
  float *source = nullptr, *out = nullptr;
  if (cudaMalloc(&source, sizeof(float) * 4 * producers * kRounds) != cudaSuccess ||
      cudaMalloc(&out, producers * sizeof(float)) != cudaSuccess) {
    std::fprintf(stderr, "racecheck_probe: no CUDA device\n");
    return 2;
  }
  // What the storing variants store, for the copying one: it · 1000 + t at every float of thread t's 16 bytes.
  std::vector<float> host(4 * producers * kRounds);
  for (int it = 0; it < kRounds; ++it) {
    for (int t = 0; t < producers; ++t) {
      for (int e = 0; e < 4; ++e) host[4 * (it * producers + t) + e] = it * 1000.f + t;
    }
  }
  float first = 0.f;
  cudaError_t e = cudaMemcpy(source, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
  if (e == cudaSuccess) {
    Launch<0>(variant, source, out);
    e = cudaMemcpy(&first, out, sizeof(first), cudaMemcpyDeviceToHost);
  }
  double expected = 0;
  for (int it = 0; it < kRounds; ++it) expected += it * 1000.0 + (37 + producers / 2) % producers;
  const bool ok = e == cudaSuccess && first == expected;
  std::printf("racecheck_probe variant %d (%d threads): %s, first sum %.1f, expected %.1f: %s\n", variant,
              2 * producers, cudaGetErrorString(e), first, expected, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
