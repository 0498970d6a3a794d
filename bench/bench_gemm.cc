// bench_gemm: each linear-layer product of the small (and large) training step timed in cuBLAS float32 (Blas, with
// its tuned table) and in the 3×TF32 kernels (kernels/gemm_tf32x3.h) at every tile and, for the weight gradient,
// several row splits (and the narrow kernel of kernels/skinny_grad.h, 3×TF32 and FFMA, at several), as Blas routes it in the 3×TF32
// precision, and, for the forward and backward data, from the weight's TF32 planes ("planes", split beforehand as
// the engine does once a step; "split" times that launch); then the `tf32` precision's: cuBLAS TF32 alone
// ("cublas_tf32", where Blas keeps its weight gradients), and for the forward and backward data as Blas routes it
// ("blas_tf32") and the kernels' one TF32 product ("plain", auto tile, from the planes); µs per product as one replayed CUDA graph of 20 launches (the median of 5), so that the engine's choice
// of kernel and tile per shape rests on measurements. An argument keeps only the products whose "name form"
// contains one of its comma-separated parts (e.g. `bench_gemm "s.in_proj fwd"`, to profile one product).
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "bench/graph_timing.h"
#include "engine/cuda_blas.h"
#include "engine/cuda_check.h"
#include "engine/cuda_memory.h"
#include "engine/status_macros.h"
#include "kernels/gemm_tf32x3.h"
#include "kernels/skinny_grad.h"

namespace perception {
namespace {

using kernels::GemmTile;

constexpr size_t kWorkspaceBytes = 32u << 20;  // CudaModel's per-stream Blas workspace
constexpr int kLaunches = 20, kRepeats = 5;

enum class Form { kForward, kBackwardData, kBackwardWeight };
const char* FormName(Form f) {
  return f == Form::kForward ? "fwd" : f == Form::kBackwardData ? "bwd_data" : "bwd_weight";
}

struct Product {
  const char* name;
  Form form;
  int rows, in, out, count = 1;
};

// µs per call of `enqueue` on `stream`, after one eager call (plans, attributes): kLaunches calls as one replayed
// graph, the median of kRepeats.
absl::StatusOr<double> Time(cudaStream_t stream, const std::function<absl::Status()>& enqueue) {
  RETURN_IF_ERROR(enqueue());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return MedianGraphMicroseconds(stream, kLaunches, kRepeats, enqueue);
}

// Whether `only` is empty or one of its comma-separated parts occurs in `label`.
bool Selected(const std::string& only, const std::string& label) {
  if (only.empty()) return true;
  for (size_t start = 0; start <= only.size();) {
    const size_t end = std::min(only.find(',', start), only.size());
    if (end > start && label.find(only.substr(start, end - start)) != std::string::npos) return true;
    start = end + 1;
  }
  return false;
}

int Run(const std::string& only) {
  constexpr int R = 16384;
  const Product products[] = {
      {"s.embed", Form::kForward, R, 40, 128},
      {"s.in_proj", Form::kForward, R, 128, 580},
      {"s.out_proj", Form::kForward, R, 256, 128},
      {"s.cfc_backbone", Form::kForward, R, 128, 128},
      {"s.grn_192x64", Form::kForward, R, 192, 64},
      {"s.grn_64x64", Form::kForward, R, 64, 64},
      {"s.gate_value", Form::kForward, R, 64, 64, 2},
      {"s.head_out", Form::kForward, R, 64, 5},
      {"s.in_proj", Form::kBackwardData, R, 128, 580},
      {"s.out_proj", Form::kBackwardData, R, 256, 128},
      {"s.cfc_backbone", Form::kBackwardData, R, 128, 128},
      {"s.grn_192x64", Form::kBackwardData, R, 192, 64},
      {"s.grn_64x64", Form::kBackwardData, R, 64, 64},
      {"s.in_proj", Form::kBackwardWeight, R, 128, 580},
      {"s.out_proj", Form::kBackwardWeight, R, 256, 128},
      {"s.embed", Form::kBackwardWeight, R, 40, 128},
      {"s.cfc_heads", Form::kBackwardWeight, R, 128, 256},
      {"s.cfc_backbone", Form::kBackwardWeight, R, 128, 128},
      {"s.cfc_c", Form::kBackwardWeight, R, 64, 128},
      {"s.grn_192x64", Form::kBackwardWeight, R, 192, 64},
      {"s.grn_64x64", Form::kBackwardWeight, R, 64, 64},
      {"s.head_out", Form::kBackwardWeight, R, 64, 5},
      {"l.in_proj", Form::kForward, R, 512, 2192},
      {"l.out_proj", Form::kForward, R, 1024, 512},
      {"l.in_proj", Form::kBackwardData, R, 512, 2192},
      {"l.out_proj", Form::kBackwardData, R, 1024, 512},
      {"l.in_proj", Form::kBackwardWeight, R, 512, 2192},
      {"l.out_proj", Form::kBackwardWeight, R, 1024, 512},
  };
  cudaStream_t stream;
  if (cudaStreamCreate(&stream) != cudaSuccess) return 1;
  auto workspace = AllocateCuda(MemoryKind::kDevice, kWorkspaceBytes);
  auto a = AllocateCuda(MemoryKind::kDevice, size_t{R} * 2192 * sizeof(float));
  auto b = AllocateCuda(MemoryKind::kDevice, size_t{R} * 2192 * sizeof(float));
  auto c = AllocateCuda(MemoryKind::kDevice, size_t{R} * 2192 * sizeof(float));
  // The weight's four TF32 planes (kernels::Tf32x3Planes), up to two weights of the largest product, and their job.
  constexpr size_t kPlaneFloats = size_t{2} * 2192 * 1024;
  auto planes = AllocateCuda(MemoryKind::kDevice, 4 * kPlaneFloats * sizeof(float));
  auto split_job = AllocateCuda(MemoryKind::kDevice, sizeof(kernels::Tf32x3SplitJob));
  if (!workspace.ok() || !a.ok() || !b.ok() || !c.ok() || !planes.ok() || !split_job.ok()) return 1;
  // Inputs of ones/8: finite throughout; the values do not change the time.
  for (const CudaAllocation* buffer : {&*a, &*b, &*c}) {
    std::vector<float> ones(size_t{R} * 2192, 0.125f);
    if (cudaMemcpy(buffer->get(), ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) {
      return 1;
    }
  }
  auto blas = Blas::Create(stream, workspace->get(), kWorkspaceBytes, Precision::kFloat32);
  // The engine's choice per product: the 3×TF32 kernels where Blas routes them, cuBLAS float32 elsewhere.
  auto blas3x = Blas::Create(stream, workspace->get(), kWorkspaceBytes, Precision::kFloat32Tf32x3);
  auto cublas_tf32 = Blas::Create(stream, workspace->get(), kWorkspaceBytes, Precision::kTf32, /*own_kernels=*/false);
  auto blas_tf32 = Blas::Create(stream, workspace->get(), kWorkspaceBytes, Precision::kTf32);
  if (!blas.ok() || !blas3x.ok() || !cublas_tf32.ok() || !blas_tf32.ok()) return 1;
  const float* x = static_cast<const float*>(a->get());
  const float* w = static_cast<const float*>(b->get());
  float* y = static_cast<float*>(c->get());
  float* ws = static_cast<float*>(workspace->get());
  const GemmTile tiles[] = {GemmTile::kAuto, GemmTile::k128x128, GemmTile::k128x64};
  const char* tile_names[] = {"auto", "128x128", "128x64"};
  constexpr int kTiles = 3;
  std::printf("[bench_gemm] µs per product (graph of %d, median of %d); cuBLAS fp32 vs 3xTF32 tiles\n", kLaunches,
              kRepeats);
  for (const Product& p : products) {
    if (!Selected(only, std::string(p.name) + " " + FormName(p.form))) continue;
    const bool supported = p.out % 4 == 0 || p.form == Form::kForward;
    std::string line;
    auto add = [&](const char* label, const std::function<absl::Status()>& enqueue) {
      const auto us = Time(stream, enqueue);
      char buffer[64];
      std::snprintf(buffer, sizeof(buffer), " %s %.1f", label, us.ok() ? *us : -1.0);
      line += buffer;
      if (!us.ok()) std::fprintf(stderr, "%s %s %s: %s\n", p.name, FormName(p.form), label, us.status().ToString().c_str());
    };
    const int64_t sw = int64_t{p.out} * p.in, sy = int64_t{p.rows} * p.out;
    // The weight(s) split into planes once, as the engine does once a step; "split" times that launch.
    float* plane = static_cast<float*>(planes->get());
    const kernels::Tf32x3SplitJob job{w, p.count * p.out, p.in, plane, plane + kPlaneFloats, plane + 2 * kPlaneFloats,
                                      plane + 3 * kPlaneFloats};
    const kernels::Tf32x3Planes parts{job.big, job.small, job.big_t, job.small_t, job.rows, job.cols};
    if (cudaMemcpy(split_job->get(), &job, sizeof(job), cudaMemcpyHostToDevice) != cudaSuccess) return 1;
    const auto* device_job = static_cast<const kernels::Tf32x3SplitJob*>(split_job->get());
    if (p.form != Form::kBackwardWeight) {
      add("split", [&] {
        CUDA_RETURN_IF_ERROR(kernels::LaunchTf32x3SplitWeights(device_job, 1, job.rows, job.cols, stream));
        return absl::OkStatus();
      });
    }
    switch (p.form) {
      case Form::kForward:
        for (Blas* b : {blas->get(), blas3x->get()}) {
          add(b == blas->get() ? "cublas" : "blas3x", [&] {
            return b->Forward(p.rows, p.in, p.out, x, p.in, w, p.in, nullptr, 0.f, y, p.out,
                              {.count = p.count, .w = p.count > 1 ? sw : 0, .y = p.count > 1 ? sy : 0});
          });
        }
        for (int t = 0; t < kTiles && supported; ++t) {
          add(tile_names[t], [&] {
            CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3Forward(p.rows, p.in, p.out, x, p.in, 0, w, p.in,
                                                                  p.count > 1 ? sw : 0, nullptr, 0, 0.f, y, p.out,
                                                                  p.count > 1 ? sy : 0, p.count, stream, tiles[t]));
            return absl::OkStatus();
          });
        }
        if (supported) {
          add("planes", [&] {
            CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3Forward(
                p.rows, p.in, p.out, x, p.in, 0, w, p.in, p.count > 1 ? sw : 0, nullptr, 0, 0.f, y, p.out,
                p.count > 1 ? sy : 0, p.count, stream, GemmTile::kAuto, &parts));
            return absl::OkStatus();
          });
        }
        for (Blas* b : {cublas_tf32->get(), blas_tf32->get()}) {
          add(b == cublas_tf32->get() ? "cublas_tf32" : "blas_tf32", [&] {
            return b->Forward(p.rows, p.in, p.out, x, p.in, w, p.in, nullptr, 0.f, y, p.out,
                              {.count = p.count, .w = p.count > 1 ? sw : 0, .y = p.count > 1 ? sy : 0});
          });
        }
        if (supported) {
          add("plain", [&] {
            CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3Forward(
                p.rows, p.in, p.out, x, p.in, 0, w, p.in, p.count > 1 ? sw : 0, nullptr, 0, 0.f, y, p.out,
                p.count > 1 ? sy : 0, p.count, stream, GemmTile::kAuto, &parts, false, /*plain_tf32=*/true));
            return absl::OkStatus();
          });
        }
        break;
      case Form::kBackwardData:
        for (Blas* b : {blas->get(), blas3x->get()}) {
          add(b == blas->get() ? "cublas" : "blas3x",
              [&] { return b->BackwardData(p.rows, p.in, p.out, x, p.out, w, p.in, 0.f, y, p.in); });
        }
        for (int t = 0; t < kTiles && supported; ++t) {
          add(tile_names[t], [&] {
            CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3BackwardData(p.rows, p.in, p.out, x, p.out, w, p.in, 0.f, y,
                                                                       p.in, stream, tiles[t]));
            return absl::OkStatus();
          });
        }
        if (supported) {
          add("planes", [&] {
            CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3BackwardData(p.rows, p.in, p.out, x, p.out, w, p.in, 0.f, y,
                                                                       p.in, stream, GemmTile::kAuto, &parts));
            return absl::OkStatus();
          });
        }
        for (Blas* b : {cublas_tf32->get(), blas_tf32->get()}) {
          add(b == cublas_tf32->get() ? "cublas_tf32" : "blas_tf32",
              [&] { return b->BackwardData(p.rows, p.in, p.out, x, p.out, w, p.in, 0.f, y, p.in); });
        }
        if (supported) {
          add("plain", [&] {
            CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3BackwardData(p.rows, p.in, p.out, x, p.out, w, p.in, 0.f, y,
                                                                       p.in, stream, GemmTile::kAuto, &parts, true));
            return absl::OkStatus();
          });
        }
        break;
      case Form::kBackwardWeight:
        for (Blas* b : {blas->get(), blas3x->get()}) {
          add(b == blas->get() ? "cublas" : "blas3x",
              [&] { return b->BackwardWeight(p.rows, p.in, p.out, x, p.out, w, p.in, y, p.in); });
        }
        for (int t = 1; t < kTiles && supported; ++t) {
          for (const int splits : {0, 4, 7, 8, 26, 52, 64}) {
            const std::string label = std::string(tile_names[t]) + "/" + (splits ? std::to_string(splits) : "auto");
            add(label.c_str(), [&] {
              CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3BackwardWeight(p.rows, p.in, p.out, x, p.out, w, p.in, y,
                                                                           p.in, ws, kWorkspaceBytes, stream, tiles[t],
                                                                           splits));
              return absl::OkStatus();
            });
          }
        }
        if (supported) {
          add("auto", [&] {
            CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3BackwardWeight(p.rows, p.in, p.out, x, p.out, w, p.in, y,
                                                                         p.in, ws, kWorkspaceBytes, stream));
            return absl::OkStatus();
          });
        }
        add("cublas_tf32", [&] {
          return cublas_tf32->get()->BackwardWeight(p.rows, p.in, p.out, x, p.out, w, p.in, y, p.in);
        });
        for (const auto math : {kernels::SkinnyMath::kTf32x3, kernels::SkinnyMath::kFfma}) {
          for (const int slices : {0, 44, 66, 88, 132, 264}) {
            const std::string label = std::string(math == kernels::SkinnyMath::kFfma ? "ffma/" : "mma/") +
                                      (slices ? std::to_string(slices) : std::string("auto"));
            add(label.c_str(), [&] {
              CUDA_RETURN_IF_ERROR(kernels::LaunchSkinnyWeightGrad(p.rows, p.in, p.out, x, p.out, w, p.in, y, p.in,
                                                                   ws, kWorkspaceBytes, stream, slices, math));
              return absl::OkStatus();
            });
          }
        }
        break;
    }
    std::printf("[bench_gemm] %-15s %-10s %5dx%4dx%4d%s:%s\n", p.name, FormName(p.form), p.rows, p.in, p.out,
                p.count > 1 ? " x2" : "", line.c_str());
  }
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace
}  // namespace perception

int main(int argc, char** argv) { return perception::Run(argc > 1 ? argv[1] : ""); }
