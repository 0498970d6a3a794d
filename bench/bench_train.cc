// bench_train: the CUDA training step of tiny, small and large. Per config: µs per step eager (kernel by kernel),
// replayed (one cudaGraphLaunch of the captured step, which copies its batch in first) and replayed with the next batch
// staged before each launch (the step finds its batch on the device, copied in beside the step before, and copies the
// next one in beside its own compute: a loader's steady state), each the median over --steps steps after --warmup,
// over two batches in turn, timed by the model's own CUDA events around each step's launch
// (TrainingCounters::last_step_seconds); kernel launches per
// step (one step captured into a graph, its kernel nodes counted); device allocations per step; and a roofline
// estimate — FLOPs and bytes per step over ceilings measured in the same run (a 1 GiB device-to-device copy, an
// 8192³ SGEMM: float32 under --precision=fp32, TF32 under tf32; under 3xtf32 a third of TF32's where its 3×TF32
// kernels run, Hopper, an upper bound on the mix of those and cuBLAS float32 products, float32's elsewhere).
// Prints one table; --json writes the same numbers.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_model.h"
#include "bench/percentile.h"
#include "engine/cuda_backend.h"
#include "engine/cuda_blas.h"
#include "engine/cuda_check.h"
#include "engine/cuda_memory.h"
#include "engine/cuda_model.h"
#include "engine/status_macros.h"

ABSL_FLAG(std::vector<std::string>, configs, std::vector<std::string>({"tiny", "small", "large"}), "model configs");
ABSL_FLAG(int, steps, 60, "timed steps per config and mode (eager, replayed), after the warmup");
ABSL_FLAG(int, warmup, 5, "untimed steps first (cuBLAS heuristics, caches)");
ABSL_FLAG(std::string, precision, "3xtf32",
          "the products: 3xtf32 (float32-accurate on the TF32 tensor cores; perceptiond's default on CUDA), fp32 "
          "(cuBLAS) or tf32; the SGEMM ceiling follows (fp32: float32, tf32: TF32, 3xtf32: a third of TF32's on "
          "Hopper)");
ABSL_FLAG(std::string, json, "", "also write the results here as JSON");

namespace perception {
namespace {

struct Ceilings {
  double copy_bytes_per_s = 0;   // device-to-device copy, bytes read + written
  double sgemm_flops_per_s = 0;  // cublasSgemm 8192³: float32, TF32, or TF32's over three (SgemmCeiling)
};

struct Launches {
  int kernels = 0, copies = 0, other = 0;  // graph nodes of one captured step
};

struct Result {
  std::string config;
  int batch = 0, window = 0;
  double median_us = 0, min_us = 0;                // eager
  double replay_median_us = 0, replay_min_us = 0;  // replayed graph
  double prefetch_median_us = 0, prefetch_min_us = 0;  // replayed, each step's batch copied in beside the step before
  Launches launches;
  int64_t allocations = 0;  // AllocateCuda's (device or pinned) over the eager, replayed and prefetching timed steps
  double gemm_flops = 0, other_flops = 0, bytes = 0;  // per step
  double roofline_us = 0;
};

// Milliseconds between two events recorded around `enqueue` on `stream`, after it finishes.
template <typename Enqueue>
absl::StatusOr<float> TimeOnStream(cudaStream_t stream, Enqueue enqueue) {
  cudaEvent_t start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
  const absl::Status enqueued = enqueue();
  CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
  float ms = 0;
  CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
  CUDA_RETURN_IF_ERROR(cudaEventDestroy(start));
  CUDA_RETURN_IF_ERROR(cudaEventDestroy(stop));
  if (!enqueued.ok()) return enqueued;
  return ms;
}

// What the 8192³ SGEMM ceiling stands for: a 3×TF32 product is three TF32 products, so where 3xtf32 runs them its
// ceiling is a third of TF32's. That bounds a step whose other products run on cuBLAS float32 from above.
enum class SgemmCeiling { kFloat32, kTf32, kTf32Over3 };
SgemmCeiling CeilingOf(Precision precision, const cudaDeviceProp& device) {
  if (precision == Precision::kTf32) return SgemmCeiling::kTf32;
  const bool tf32x3 = precision == Precision::kFloat32Tf32x3 && Blas::UsesTf32x3Kernels(precision, device);
  return tf32x3 ? SgemmCeiling::kTf32Over3 : SgemmCeiling::kFloat32;
}

absl::StatusOr<Ceilings> MeasureCeilings(SgemmCeiling kind) {
  const bool tf32 = kind != SgemmCeiling::kFloat32;
  Ceilings ceilings;
  cudaStream_t stream;
  CUDA_RETURN_IF_ERROR(cudaStreamCreate(&stream));
  {
    constexpr size_t kBytes = size_t{1} << 30;
    ASSIGN_OR_RETURN(CudaAllocation a, AllocateCuda(MemoryKind::kDevice, kBytes));
    ASSIGN_OR_RETURN(CudaAllocation b, AllocateCuda(MemoryKind::kDevice, kBytes));
    auto copies = [&](int n) -> absl::Status {
      for (int i = 0; i < n; ++i) {
        CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.get(), a.get(), kBytes, cudaMemcpyDeviceToDevice, stream));
      }
      return absl::OkStatus();
    };
    RETURN_IF_ERROR(TimeOnStream(stream, [&] { return copies(2); }).status());
    ASSIGN_OR_RETURN(const float ms, TimeOnStream(stream, [&] { return copies(10); }));
    ceilings.copy_bytes_per_s = 2.0 * kBytes * 10 / (ms * 1e-3);
  }
  {
    constexpr int n = 8192;
    const size_t bytes = size_t{n} * n * sizeof(float);
    ASSIGN_OR_RETURN(CudaAllocation a, AllocateCuda(MemoryKind::kDevice, bytes));
    ASSIGN_OR_RETURN(CudaAllocation b, AllocateCuda(MemoryKind::kDevice, bytes));
    ASSIGN_OR_RETURN(CudaAllocation c, AllocateCuda(MemoryKind::kDevice, bytes));
    cublasHandle_t handle;
    CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
    CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, stream));
    CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(handle, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    const float one = 1.f, zero = 0.f;
    auto products = [&](int count) -> absl::Status {
      for (int i = 0; i < count; ++i) {
        CUBLAS_RETURN_IF_ERROR(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one,
                                           static_cast<const float*>(a.get()), n, static_cast<const float*>(b.get()),
                                           n, &zero, static_cast<float*>(c.get()), n));
      }
      return absl::OkStatus();
    };
    RETURN_IF_ERROR(TimeOnStream(stream, [&] { return products(2); }).status());
    ASSIGN_OR_RETURN(const float ms, TimeOnStream(stream, [&] { return products(10); }));
    CUBLAS_RETURN_IF_ERROR(cublasDestroy(handle));
    ceilings.sgemm_flops_per_s =
        2.0 * n * n * n * 10 / (ms * 1e-3) / (kind == SgemmCeiling::kTf32Over3 ? 3.0 : 1.0);
  }
  CUDA_RETURN_IF_ERROR(cudaStreamDestroy(stream));
  return ceilings;
}

// Captures one training step into a graph (global mode: any synchronization or allocation inside the step would fail
// the capture) and counts its nodes; the capture runs nothing. Also returns the GEMM FLOPs the step issues.
absl::StatusOr<Launches> CountLaunches(CudaModel& model, double* gemm_flops) {
  const double flops_before = model.gemm_flops();
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(model.stream(), cudaStreamCaptureModeGlobal));
  const absl::Status enqueued = model.EnqueueTrainStepEagerly();
  cudaGraph_t graph = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(model.stream(), &graph));
  RETURN_IF_ERROR(enqueued);
  *gemm_flops = model.gemm_flops() - flops_before;
  size_t count = 0;
  CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nodes.data(), &count));
  Launches launches;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    CUDA_RETURN_IF_ERROR(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeKernel) {
      ++launches.kernels;
    } else if (type == cudaGraphNodeTypeMemcpy || type == cudaGraphNodeTypeMemset) {
      ++launches.copies;
    } else {
      ++launches.other;
    }
  }
  CUDA_RETURN_IF_ERROR(cudaGraphDestroy(graph));
  return launches;
}

// FLOPs outside cuBLAS, counted from the kernels' loops: the scan (forward 2 FMAs per state element and step; the
// backward recomputes the states and carries the adjoint, ~15 FLOPs, in double), the CfC recurrences (the W_c and
// heads mat-vecs, forward and backward) and the conv. Elementwise work and norms are left out (a few % at most).
double NonGemmFlops(const ModelConfig& c) {
  const double M = static_cast<double>(c.batch) * c.window, E = c.d_inner(), N = c.d_state, W = c.d_conv;
  const double C = c.cfc_units, K = c.cfc_backbone, cd = c.conv_dim();
  const double scan = (4 + 15) * M * E * N, conv = (2 + 4) * W * M * cd;
  const double cfc = 2 * (2 * M * (K * C + 4 * C * K));
  return c.n_layers * (scan + conv) + cfc;
}

// The two batches the steps alternate over; the model holds the next one staged, not yet taken, between steps.
struct Batches {
  testing::RandomBatch batch[2];
  int next = 0;  // the staged one
  absl::Status StageFollowing(CudaModel& model) {
    next ^= 1;
    return model.StageBatch(batch[next].view());
  }
};

// `steps` training steps, each waited for; the device time of each from the model's events, in µs, sorted. Plain:
// the next batch staged after each step, so each copies its batch in first. Prefetching: the one after it staged
// before each step, which then copies that one in beside its compute for the next step.
absl::StatusOr<std::vector<double>> TimeSteps(CudaModel& model, int steps, Batches& batches, bool prefetch) {
  std::vector<double> us;
  for (int i = 0; i < steps; ++i) {
    const int64_t timed = model.training_counters().timed_steps;
    if (prefetch) RETURN_IF_ERROR(batches.StageFollowing(model));
    RETURN_IF_ERROR(model.EnqueueTrainStep());
    RETURN_IF_ERROR(model.Wait().status());
    if (!prefetch) RETURN_IF_ERROR(batches.StageFollowing(model));
    if (model.training_counters().timed_steps != timed + 1) return absl::InternalError("a step was not timed");
    us.push_back(model.training_counters().last_step_seconds * 1e6);
  }
  std::sort(us.begin(), us.end());
  return us;
}

absl::StatusOr<Result> Measure(const std::string& name, const Ceilings& ceilings, Precision precision, int warmup,
                               int steps) {
  ASSIGN_OR_RETURN(const ModelConfig config, NamedConfig(name));
  // Eager first; the same model then captures and replays.
  ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model, MakeBenchModel(config, precision, /*graphs=*/false));
  Batches batches{{BenchBatch(config, 0), BenchBatch(config, 1)}};  // MakeBenchModel staged the first
  RETURN_IF_ERROR(TimeSteps(*model, warmup, batches, /*prefetch=*/false).status());

  Result r;
  r.config = name;
  r.batch = config.batch;
  r.window = config.window;
  ASSIGN_OR_RETURN(r.launches, CountLaunches(*model, &r.gemm_flops));
  int64_t allocations = CudaAllocationCount();
  ASSIGN_OR_RETURN(const std::vector<double> eager, TimeSteps(*model, steps, batches, /*prefetch=*/false));
  int64_t allocated = CudaAllocationCount() - allocations;
  r.median_us = Median(eager);
  r.min_us = eager.front();

  model->set_use_graphs(true);  // the next step captures (the shape has had its eager steps), later ones replay
  RETURN_IF_ERROR(TimeSteps(*model, std::max(warmup, 1), batches, /*prefetch=*/false).status());
  allocations = CudaAllocationCount();
  ASSIGN_OR_RETURN(const std::vector<double> replayed, TimeSteps(*model, steps, batches, /*prefetch=*/false));
  allocated += CudaAllocationCount() - allocations;
  // Prefetching: the first step copies its own batch and the next, then each slot's graph trains on a batch copied in
  // beforehand: three more captures.
  RETURN_IF_ERROR(TimeSteps(*model, std::max(warmup, 3), batches, /*prefetch=*/true).status());
  allocations = CudaAllocationCount();
  ASSIGN_OR_RETURN(const std::vector<double> prefetched, TimeSteps(*model, steps, batches, /*prefetch=*/true));
  allocated += CudaAllocationCount() - allocations;
  const TrainingCounters counters = model->training_counters();
  const int64_t replays = std::max(warmup, 1) + std::max(warmup, 3) + 2 * steps;
  if (counters.graph_captures != 4 || counters.graph_replays != replays) {
    return absl::InternalError(absl::StrCat("expected 4 captures and ", replays, " replays, got ",
                                            counters.graph_captures, " and ", counters.graph_replays));
  }
  r.replay_median_us = Median(replayed);
  r.replay_min_us = replayed.front();
  r.prefetch_median_us = Median(prefetched);
  r.prefetch_min_us = prefetched.front();
  r.allocations = allocated;
  if (allocated != 0) {
    return absl::InternalError(absl::StrCat(allocated, " allocations (device or pinned) over the ", 3 * steps,
                                            " timed steps (eager, replayed, prefetching): a step must allocate none"));
  }
  r.other_flops = NonGemmFlops(config);
  // Every buffer of the step written once and read once: an estimate of the traffic, not a measurement.
  r.bytes = 2.0 * model->device_bytes();
  r.roofline_us = 1e6 * std::max((r.gemm_flops + r.other_flops) / ceilings.sgemm_flops_per_s,
                                 r.bytes / ceilings.copy_bytes_per_s);
  return r;
}

int Run() {
  const auto precision = ParsePrecision(absl::GetFlag(FLAGS_precision));
  if (!precision.ok()) {
    std::fprintf(stderr, "%s\n", std::string(precision.status().message()).c_str());
    return 1;
  }
  int device = 0;
  cudaDeviceProp properties{};
  cudaGetDevice(&device);
  cudaGetDeviceProperties(&properties, device);
  const SgemmCeiling ceiling = CeilingOf(*precision, properties);
  auto ceilings = MeasureCeilings(ceiling);
  if (!ceilings.ok()) {
    std::fprintf(stderr, "ceilings: %s\n", std::string(ceilings.status().message()).c_str());
    return 1;
  }
  const char* const sgemm_kind = ceiling == SgemmCeiling::kFloat32 ? ""
                                 : ceiling == SgemmCeiling::kTf32  ? " (TF32)"
                                                                   : " (TF32 / 3)";
  std::printf("device %s; products %s; ceilings: copy %.0f GB/s, SGEMM%s %.1f TFLOP/s\n", properties.name,
              PrecisionName(*precision), ceilings->copy_bytes_per_s / 1e9, sgemm_kind,
              ceilings->sgemm_flops_per_s / 1e12);
  std::printf("%-6s %5s %4s %13s %14s %16s %7s %9s %10s %12s %8s %8s %10s %9s %11s %11s\n", "config", "B", "T",
              "eager_us/step", "replay_us/step", "prefetch_us/step", "ratio", "eager_min", "replay_min",
              "prefetch_min", "kernels", "memcpys", "allocs", "GFLOP/st", "GB/st(est)", "roofline_us");
  nlohmann::ordered_json json;
  json["device"] = properties.name;
  json["precision"] = PrecisionName(*precision);
  json["copy_GBps"] = ceilings->copy_bytes_per_s / 1e9;
  json["sgemm_TFLOPs"] = ceilings->sgemm_flops_per_s / 1e12;
  int status = 0;
  for (const std::string& name : absl::GetFlag(FLAGS_configs)) {
    const auto r = Measure(name, *ceilings, *precision, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_steps));
    if (!r.ok()) {
      std::printf("%-6s error: %s\n", name.c_str(), std::string(r.status().message()).c_str());
      json["configs"][name]["error"] = std::string(r.status().message());
      status = 1;
      continue;
    }
    std::printf("%-6s %5d %4d %13.1f %14.1f %16.1f %7.2f %9.1f %10.1f %12.1f %8d %8d %10lld %9.2f %11.2f %11.1f\n",
                name.c_str(), r->batch, r->window, r->median_us, r->replay_median_us, r->prefetch_median_us,
                r->median_us / r->replay_median_us, r->min_us, r->replay_min_us, r->prefetch_min_us,
                r->launches.kernels, r->launches.copies, static_cast<long long>(r->allocations),
                (r->gemm_flops + r->other_flops) / 1e9, r->bytes / 1e9, r->roofline_us);
    json["configs"][name] = {{"batch", r->batch},
                             {"window", r->window},
                             {"eager_us_per_step_median", r->median_us},
                             {"eager_us_per_step_min", r->min_us},
                             {"replayed_us_per_step_median", r->replay_median_us},
                             {"replayed_us_per_step_min", r->replay_min_us},
                             {"replayed_prefetch_us_per_step_median", r->prefetch_median_us},
                             {"replayed_prefetch_us_per_step_min", r->prefetch_min_us},
                             {"eager_over_replayed", r->median_us / r->replay_median_us},
                             {"kernel_launches_per_step", r->launches.kernels},
                             {"memcpy_nodes_per_step", r->launches.copies},
                             {"other_nodes_per_step", r->launches.other},
                             {"allocations_in_timed_steps", r->allocations},
                             {"gemm_gflop_per_step", r->gemm_flops / 1e9},
                             {"other_gflop_per_step", r->other_flops / 1e9},
                             {"gbytes_per_step_estimate", r->bytes / 1e9},
                             {"roofline_us", r->roofline_us}};
  }
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) std::ofstream(path) << json.dump(2) << "\n";
  return status;
}

}  // namespace
}  // namespace perception

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (const absl::Status available = perception::CudaDeviceAvailable(); !available.ok()) {
    std::fprintf(stderr, "bench_train: %s\n", std::string(available.message()).c_str());
    return 1;
  }
  return perception::Run();
}
