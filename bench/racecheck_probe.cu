// racecheck_probe: does compute-sanitizer's racecheck order shared memory through bar.arrive → bar.sync? A correct
// two-stage producer/consumer handoff (the pattern of kernels/gemm_tf32x3.cu); run it under `--tool racecheck`.
#include <cstdio>

namespace {

constexpr int kRounds = 64;

__device__ __forceinline__ void BarSync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void BarArrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
__device__ constexpr int Full(int stage) { return 1 + stage; }
__device__ constexpr int Empty(int stage) { return 3 + stage; }

// Threads 0–127 write stage it % 2 and arrive on FULL; threads 128–255 wait on FULL, read a value another thread
// wrote, and arrive on EMPTY, which the writers wait on before they reuse the stage.
__global__ void Handoff(float* out) {
  __shared__ float stage[2][128];
  const int t = threadIdx.x % 128;
  if (threadIdx.x < 128) {
    for (int it = 0; it < kRounds; ++it) {
      stage[it % 2][t] = it * 1000.f + t;
      BarArrive(Full(it % 2));
      if (it >= 1) BarSync(Empty((it - 1) % 2));
    }
    BarSync(Empty((kRounds - 1) % 2));
    return;
  }
  float sum = 0.f;
  for (int it = 0; it < kRounds; ++it) {
    BarSync(Full(it % 2));
    sum += stage[it % 2][(t + 37) % 128];
    BarArrive(Empty(it % 2));
  }
  out[t] = sum;
}

}  // namespace

int main() {
  float* out = nullptr;
  if (cudaMalloc(&out, 128 * sizeof(float)) != cudaSuccess) {
    std::fprintf(stderr, "racecheck_probe: no CUDA device\n");
    return 2;
  }
  Handoff<<<1, 256>>>(out);
  float first = 0.f;
  const cudaError_t copied = cudaMemcpy(&first, out, sizeof(first), cudaMemcpyDeviceToHost);
  double expected = 0;
  for (int it = 0; it < kRounds; ++it) expected += it * 1000.0 + 37;
  std::printf("racecheck_probe: %s, first sum %.1f, expected %.1f: %s\n", cudaGetErrorString(copied), first, expected,
              copied == cudaSuccess && first == expected ? "ok" : "WRONG");
  return copied == cudaSuccess && first == expected ? 0 : 1;
}
