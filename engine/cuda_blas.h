// The products of a linear layer for the CUDA backend, in the model's row-major layout: cuBLASLt (one handle on one
// stream, its workspace set once, an algorithm fixed per product shape — a table tuned offline on the H200, else the
// first deterministic heuristic — no atomics) in float32 or TF32, or float32-accurate on the TF32 tensor cores through
// the 3×TF32 kernels of kernels/gemm_tf32x3.h and, for the narrow weight gradients, kernels/skinny_grad.h.
#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "engine/precision.h"

namespace perception {
namespace kernels {
struct Tf32x3Planes;
}  // namespace kernels

// `count` Forward products of one shape in one launch: the i-th reads and writes each operand at its pointer +
// i·stride (in floats; stride 0 shares the operand, e.g. one x under several weights).
struct BlasBatch {
  int count = 1;
  int64_t x = 0, w = 0, y = 0, bias = 0;
};

// Matrices are row-major with a leading dimension (row stride, in floats): activations [rows, features],
// weights [out, in]. A product's beta scales what its output held (beta = 1 accumulates, e.g. onto a residual
// stream).
class Blas {
 public:
  // own_kernels = false keeps every product on cuBLAS in the precision's arithmetic (for measuring against it).
  static absl::StatusOr<std::unique_ptr<Blas>> Create(cudaStream_t stream, void* workspace, size_t workspace_bytes,
                                                      Precision precision, bool own_kernels = true);
  // Whether Blas runs products on the wgmma kernels of kernels/gemm_tf32x3.h on this device (3×TF32, or one TF32
  // product for the `tf32` precision).
  static bool UsesTf32x3Kernels(Precision precision, const cudaDeviceProp& device);
  // Whether a BackwardData of this shape goes to those kernels where they are used and its operands are aligned
  // (BackwardDataOnTf32x3Kernels says for given operands): a stack's planes (kernels::Tf32x3Planes) need them.
  static bool Tf32x3KernelsTakeBackwardData(int in, int out);
  bool BackwardDataOnTf32x3Kernels(int in, int out, const float* dy, int lddy, const float* w, int ldw) const;
  // Whether a Forward of this shape and these operands runs on those kernels: a stack's planes (big and small of
  // weights stacked along out, not adjacent in memory) need them.
  bool ForwardOnTf32x3Kernels(int in, int out, const float* x, int ldx, const float* w, int ldw,
                              BlasBatch batch = {}) const;
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // y[rows, out] = x[rows, in] · w[out, in]ᵀ + bias[out] + beta·y; bias may be null (none). The bias is the
  // product's epilogue, so a layer's output needs no broadcast of its bias first. `planes` (may be null): w's TF32
  // parts, current, for the 3×TF32 kernels (kernels::Tf32x3Planes). `programmatic`: the 3×TF32 kernel launched as the
  // programmatic dependent of the kernel ahead on the stream (kernels/common.cuh; cuBLAS launches as it always does).
  absl::Status Forward(int rows, int in, int out, const float* x, int ldx, const float* w, int ldw, const float* bias,
                       float beta, float* y, int ldy, BlasBatch batch = {},
                       const kernels::Tf32x3Planes* planes = nullptr, bool programmatic = false);
  // dx[rows, in] = dy[rows, out] · w[out, in] + beta·dx. With a stack's planes (big and small null) only where
  // BackwardDataOnTf32x3Kernels; INTERNAL otherwise.
  absl::Status BackwardData(int rows, int in, int out, const float* dy, int lddy, const float* w, int ldw, float beta,
                            float* dx, int lddx, const kernels::Tf32x3Planes* planes = nullptr);
  // dw[out, in] = dy[rows, out]ᵀ · x[rows, in], planned to run beside other work (the training step's weight
  // gradients run beside its chain of data gradients; kernels/gemm_tf32x3.h's `shares_device`).
  absl::Status BackwardWeight(int rows, int in, int out, const float* dy, int lddy, const float* x, int ldx, float* dw,
                              int lddw);

  // 2·m·n·k summed over every product issued so far.
  double flops() const { return flops_; }
  // The shapes planned and kept (at most kMaxPlans).
  size_t plan_count() const { return plans_.size(); }
  // The plans made so far, evicted ones included: a shape used again counts once while its plan is kept.
  uint64_t plans_made() const { return plans_made_; }

  // Plans kept: a training step's shapes and those of the last few Evaluate shapes, where every (batch, window) an
  // Evaluate takes brings shapes of its own and a daemon lives for weeks.
  static constexpr size_t kMaxPlans = 1024;

 private:
  // A column-major product as cuBLASLt sees it: ops, m, n, k, leading dimensions, batch count and strides, whether a
  // bias epilogue runs, and the byte alignment of each operand (which rules algorithms in or out).
  struct Shape {
    int op_a, op_b, m, n, k, lda, ldb, ldc, count;
    int64_t stride_a, stride_b, stride_c, stride_bias;
    bool bias;
    int align_a, align_b, align_c;
    auto operator<=>(const Shape&) const = default;
  };
  // Descriptors and the algorithm of one shape, fixed when the shape is first seen (an eager step; a capture only
  // where kMaxPlans newer shapes came between its warmup step and it: planning is host work, as PyTorch's cuBLASLt
  // products plan inside captures). `last_use` orders the plans for eviction.
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    uint64_t last_use = 0;
  };

  Blas(cublasLtHandle_t handle, cudaStream_t stream, void* workspace, size_t workspace_bytes, Precision precision)
      : handle_(handle),
        stream_(stream),
        workspace_(workspace),
        workspace_bytes_(workspace_bytes),
        tf32_(precision == Precision::kTf32) {}
  // c = op_a(a) · op_b(b) + bias + beta·c, column-major (bias: one per row of c, may be null), `count` times with
  // the strides of a, b, c and bias.
  absl::Status Gemm(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, const float* a, int lda,
                    int64_t stride_a, const float* b, int ldb, int64_t stride_b, const float* bias,
                    int64_t stride_bias, float beta, float* c, int ldc, int64_t stride_c, int count);
  absl::StatusOr<Plan> MakePlan(const Shape& shape);
  absl::Status FillPlan(const Shape& shape, Plan& plan);  // MakePlan's work; `plan` keeps what it created
  static void DestroyPlan(Plan& plan);
  // The plan of `shape`, made where there is none; at kMaxPlans the least recently used goes first.
  absl::StatusOr<const Plan*> PlanOf(const Shape& shape);
  // The tuned algorithm of `shape` on this device and library, if the table has one that the library accepts.
  bool TunedAlgo(const Shape& shape, const Plan& plan, cublasLtMatmulAlgo_t* algo) const;

  cublasLtHandle_t handle_;
  cudaStream_t stream_;
  void* workspace_;
  size_t workspace_bytes_;
  bool tf32_;  // cuBLAS on TF32 tensor cores
  // The wgmma kernels of kernels/gemm_tf32x3.h for the products they take, on a compute capability 9.0 device (they
  // are built for sm_90a alone): 3×TF32 for precision kFloat32Tf32x3, one TF32 product for kTf32 (tf32_; forward and
  // backward data only); cuBLAS otherwise.
  bool tf32x3_ = false;
  // The narrow weight gradients on kernels/skinny_grad.h: precision kFloat32Tf32x3 on any device (its mma.sync is
  // sm_80 on). kFloat32 keeps cuBLAS and its tuned table, the baseline the 3×TF32 kernels are measured against.
  bool skinny_ = false;
  bool tuned_device_ = false;  // the device and cuBLASLt version the table was tuned on
  std::map<Shape, Plan> plans_;
  uint64_t plan_uses_ = 0;  // PlanOf's calls, the clock of Plan::last_use
  uint64_t plans_made_ = 0;
  double flops_ = 0;
};

}  // namespace perception
