// Row-major linear-layer products on column-major cuBLASLt: a row-major [r, c] matrix is a column-major [c, r] one,
// so each product is issued transposed (Yᵀ = W·Xᵀ and so on).
#include "engine/cuda_blas.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "engine/cuda_check.h"
#include "engine/status_macros.h"
#include "kernels/gemm_tf32x3.h"
#include "kernels/skinny_grad.h"

namespace perception {
namespace {

// Split-K schemes whose partial sums meet in a fixed order without atomics: NONE (no split), and a separate reduce
// over partials kept in the workspace. INPLACE is left out: it orders the partial sums through counters in the
// workspace, i.e. atomics.
constexpr uint32_t kDeterministicReductions =
    CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;

// One tuned product: the shape (as in Blas::Shape, bias and alignments aside) and the cuBLASLt algorithm
// configuration that was fastest for it among the deterministic ones, timed offline on an H200 (132 SMs) with
// cuBLASLt `kTunedVersion` as a CUDA graph of ten launches (bench/gemm_sweep.cc); a bias epilogue runs on the same
// kernel. A different device or library, or a configuration the library refuses, falls back to the heuristic.
struct Tuned {
  bool tf32;
  cublasOperation_t op_a, op_b;
  int m, n, k, lda, ldb, ldc, count;
  int algo, tile, stages, split_k, reduction, swizzle, custom, inner, cluster;
};
constexpr size_t kTunedVersion = 130100;
constexpr int kTunedSms = 132;
// Columns: tf32; op_a, op_b, m, n, k, lda, ldb, ldc, count (the `small` config's products, rows = 16384); algo, tile,
// stages, split-K (-1: the kernel picks its split, still reduced by the separate kernel), reduction scheme, swizzle,
// custom option, inner shape, cluster shape.
constexpr Tuned kTuned[] = {
    {false, CUBLAS_OP_T, CUBLAS_OP_N, 128, 16384, 40, 40, 40, 128, 1, 55, 14, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_T, CUBLAS_OP_N, 580, 16384, 128, 128, 128, 580, 1, 55, 18, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_T, CUBLAS_OP_N, 128, 16384, 256, 256, 256, 128, 1, 55, 14, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_T, CUBLAS_OP_N, 128, 16384, 128, 192, 192, 128, 1, 55, 17, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_T, CUBLAS_OP_N, 64, 16384, 192, 192, 192, 64, 1, 55, 15, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_T, CUBLAS_OP_N, 64, 16384, 64, 64, 64, 64, 1, 55, 15, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_T, CUBLAS_OP_N, 64, 16384, 64, 64, 64, 64, 2, 55, 15, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_T, CUBLAS_OP_N, 5, 16384, 64, 64, 64, 5, 1, 55, 14, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_N, 64, 16384, 5, 64, 5, 64, 1, 55, 14, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_N, 192, 16384, 64, 192, 64, 192, 1, 55, 15, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_N, 64, 16384, 64, 64, 64, 64, 1, 55, 15, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_N, 128, 16384, 128, 192, 128, 192, 1, 55, 15, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_N, 256, 16384, 128, 256, 128, 256, 1, 20, 24, 26, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_N, 128, 16384, 580, 128, 580, 128, 1, 55, 17, 31, 1, 0, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_T, 64, 5, 16384, 64, 5, 64, 1, 20, 15, 28, 132, 2, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_T, 192, 64, 16384, 192, 64, 192, 1, 20, 18, 28, 64, 4, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_T, 64, 64, 16384, 64, 64, 64, 1, 20, 15, 28, 132, 2, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_T, 128, 256, 16384, 128, 256, 128, 1, 20, 20, 26, 64, 4, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_T, 128, 128, 16384, 192, 128, 192, 1, 20, 18, 28, 64, 4, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_T, 64, 128, 16384, 64, 128, 192, 1, 20, 15, 28, 64, 2, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_T, 256, 128, 16384, 256, 128, 256, 1, 20, 18, 28, 32, 4, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_T, 128, 580, 16384, 128, 580, 128, 1, 20, 20, 26, 26, 2, 0, 0, 0, 0},
    {false, CUBLAS_OP_N, CUBLAS_OP_T, 40, 128, 16384, 40, 128, 40, 1, 20, 15, 28, 64, 4, 0, 0, 0, 0},
    {true, CUBLAS_OP_T, CUBLAS_OP_N, 128, 16384, 40, 40, 40, 128, 1, 43, 20, 34, 1, 0, 0, 0, 0, 5},
    {true, CUBLAS_OP_T, CUBLAS_OP_N, 128, 16384, 256, 256, 256, 128, 1, 43, 20, 34, -1, 2, 0, 0, 0, 5},
    {true, CUBLAS_OP_T, CUBLAS_OP_N, 128, 16384, 128, 192, 192, 128, 1, 43, 20, 34, 1, 0, 0, 0, 0, 5},
    {true, CUBLAS_OP_T, CUBLAS_OP_N, 64, 16384, 64, 64, 64, 64, 2, 21, 19, 4, 1, 0, 0, 0, 0, 0},
    {true, CUBLAS_OP_N, CUBLAS_OP_N, 192, 16384, 64, 192, 64, 192, 1, 21, 20, 4, 1, 0, 0, 0, 0, 0},
    {true, CUBLAS_OP_N, CUBLAS_OP_N, 64, 16384, 64, 64, 64, 64, 1, 43, 18, 34, 1, 0, 0, 0, 0, 3},
    {true, CUBLAS_OP_N, CUBLAS_OP_N, 128, 16384, 128, 192, 128, 192, 1, 43, 20, 34, -1, 2, 0, 0, 0, 3},
    {true, CUBLAS_OP_N, CUBLAS_OP_N, 256, 16384, 128, 256, 128, 256, 1, 43, 20, 34, -1, 2, 0, 0, 0, 5},
    {true, CUBLAS_OP_N, CUBLAS_OP_T, 64, 5, 16384, 64, 5, 64, 1, 23, 15, 6, 64, 2, 0, 0, 0, 0},
    {true, CUBLAS_OP_N, CUBLAS_OP_T, 192, 64, 16384, 192, 64, 192, 1, 21, 15, 12, 32, 2, 0, 0, 0, 0},
    {true, CUBLAS_OP_N, CUBLAS_OP_T, 64, 64, 16384, 64, 64, 64, 1, 21, 15, 6, 64, 2, 0, 0, 0, 0},
    {true, CUBLAS_OP_N, CUBLAS_OP_T, 128, 256, 16384, 128, 256, 128, 1, 21, 17, 9, 32, 4, 0, 0, 0, 0},
    {true, CUBLAS_OP_N, CUBLAS_OP_T, 128, 128, 16384, 192, 128, 192, 1, 21, 15, 12, 32, 2, 0, 0, 0, 0},
    {true, CUBLAS_OP_N, CUBLAS_OP_T, 64, 128, 16384, 64, 128, 192, 1, 21, 15, 6, 64, 4, 0, 0, 0, 0},
    {true, CUBLAS_OP_N, CUBLAS_OP_T, 256, 128, 16384, 256, 128, 256, 1, 21, 17, 9, 32, 4, 0, 0, 0, 0},
    {true, CUBLAS_OP_N, CUBLAS_OP_T, 40, 128, 16384, 40, 128, 40, 1, 21, 15, 6, 64, 2, 0, 0, 0, 0},
};

// The largest power of two up to 256 dividing the address and every stride in bytes: the alignment the algorithm
// may assume for this operand.
int Alignment(const void* pointer, int ld, int64_t stride) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(pointer) | (static_cast<uint64_t>(ld) * sizeof(float)) |
                        (static_cast<uint64_t>(stride) * sizeof(float)) | 256;
  return static_cast<int>(bits & (~bits + 1));
}

// Where the 3×TF32 kernel (wgmma) beats cuBLAS float32 (its tuned table included), measured with bench_gemm on the
// H200 at 16,384 rows (session 5, helper gemm5's round 4 on the kernel at 61cf14e; µs, kernel against cuBLAS).
// Forward and BackwardData: in at least 40 and out at least 64 (small's in_proj 36.0 against 76.0
// forward, 29.0 against 54.7 backward; out_proj 14.5 against 33.5, 16.1 against 28.0; CfC backbone 9.6 against
// 18.5, 9.5 against 16.5; the GRN's 192→64 8.2 against 14.0, 10.9 against 14.6, 64→64 5.1 against 6.8, 5.1 against
// 6.5; the embedding's sum over 40 7.3 against 8.0; large's in_proj 390 against 798, 358 against 777, out_proj 171
// against 353, 178 against 354); not head_out's 5 outputs (5.3 against 4.6). BackwardWeight, whose row split pays a
// partial product per slice: weights of at least 128×128 (small's in_proj 36.4 against 60.4, out_proj 23.0 against
// 30.4, CfC heads 22.9 against 30.2, CfC backbone 18.5 against 22.1; large's in_proj 416 against 759, out_proj 180
// against 342), not the narrower embedding, GRN and CfC weights (e.g. the embedding's 18.0 against 13.5, the GRN's
// 64×64 17.7 against 12.0). Over at least 1,024 rows, so that the parity tests' small batch takes the kernel too.
bool Tf32x3ForwardOrBackwardDataPays(int in, int out) { return in >= 40 && out >= 64; }
bool Tf32x3BackwardWeightPays(int rows, int in, int out) {
  return rows >= 1024 && in >= 128 && out >= 128;
}
// The `tf32` precision's forward and backward-data products in one TF32 product on the wgmma kernels, against cuBLAS
// TF32: they launch as programmatic dependents along the chain and without cuBLAS's memset node and the idle gap
// behind it, but cuBLAS runs the long sums of wide products at the tensor cores' rate, so only where a side is at
// most 256 (H200: small's step 921–924 -> 874–875 µs with all of its products, including its weight gradients, on
// the kernels; large's 12,930 -> 14,090 µs with all of its). Its weight gradients stay on cuBLAS TF32, which runs
// them on the whole device beside the chain (small's step 874–875 -> 859–860 µs).
bool PlainTf32Pays(int in, int out) { return std::min(in, out) <= 256; }
// The narrow weight gradients, which neither the wgmma kernel nor cuBLAS's SIMT sgemm (plus its split-K reduce) fill:
// kernels/skinny_grad.h in 3×TF32 (H200, 16,384 rows, µs, against cuBLAS float32: embedding 12.8 against 13.4, CfC
// c part 12.9 against 14.0, GRN 192 → 64 16.9 against 18.8, 64 → 64 9.6 against 11.9, head_out 9.3 against 11.2; the
// small 3xtf32 step 1,264.4 / 1,258.7 against main's 1,335.4 / 1,339.6, where the FFMA path gave 1,268.3 / 1,261.0).
// 3×TF32 rather than FFMA: as fast in the step, and its chunks summed on the tensor cores lose less over a long slice
// than one FFMA chain (one slice of small's 16,384 rows: 4.3e-7 against 1.2e-6 relative error).
bool SkinnyBackwardWeightPays(int in, int out) { return std::min(in, out) <= 64 && std::max(in, out) <= 192; }

template <typename T>
cublasStatus_t SetConfig(cublasLtMatmulAlgo_t* algo, cublasLtMatmulAlgoConfigAttributes_t attribute, T value) {
  return cublasLtMatmulAlgoConfigSetAttribute(algo, attribute, &value, sizeof(value));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Blas>> Blas::Create(cudaStream_t stream, void* workspace, size_t workspace_bytes,
                                                   Precision precision, bool own_kernels) {
  cublasLtHandle_t handle = nullptr;
  CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&handle));
  std::unique_ptr<Blas> blas(new Blas(handle, stream, workspace, workspace_bytes, precision));
  int device = 0, sms = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  blas->tf32x3_ = own_kernels && UsesTf32x3Kernels(precision, prop);
  blas->skinny_ = own_kernels && precision == Precision::kFloat32Tf32x3;
  blas->tuned_device_ = sms == kTunedSms && std::strstr(prop.name, "H200") != nullptr &&
                        cublasLtGetVersion() == kTunedVersion;
  return blas;
}

Blas::~Blas() {
  for (auto& [shape, plan] : plans_) DestroyPlan(plan);
  cublasLtDestroy(handle_);
}

void Blas::DestroyPlan(Plan& plan) {
  for (cublasLtMatrixLayout_t layout : {plan.a, plan.b, plan.c}) {
    if (layout) cublasLtMatrixLayoutDestroy(layout);
  }
  if (plan.op) cublasLtMatmulDescDestroy(plan.op);
  plan = Plan{};
}

bool Blas::TunedAlgo(const Shape& shape, const Plan& plan, cublasLtMatmulAlgo_t* algo) const {
  if (!tuned_device_) return false;
  for (const Tuned& t : kTuned) {
    if (t.tf32 != tf32_ || t.op_a != shape.op_a || t.op_b != shape.op_b || t.m != shape.m || t.n != shape.n ||
        t.k != shape.k || t.lda != shape.lda || t.ldb != shape.ldb || t.ldc != shape.ldc || t.count != shape.count) {
      continue;
    }
    const cublasComputeType_t compute = tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    if (cublasLtMatmulAlgoInit(handle_, compute, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, t.algo,
                               algo) != CUBLAS_STATUS_SUCCESS ||
        SetConfig<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, t.tile) != CUBLAS_STATUS_SUCCESS ||
        SetConfig<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, t.stages) != CUBLAS_STATUS_SUCCESS ||
        SetConfig<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, t.split_k) != CUBLAS_STATUS_SUCCESS ||
        SetConfig<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, t.reduction) != CUBLAS_STATUS_SUCCESS ||
        SetConfig<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, t.swizzle) != CUBLAS_STATUS_SUCCESS ||
        SetConfig<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, t.custom) != CUBLAS_STATUS_SUCCESS ||
        SetConfig<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, t.inner) != CUBLAS_STATUS_SUCCESS ||
        SetConfig<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, t.cluster) != CUBLAS_STATUS_SUCCESS) {
      return false;
    }
    if (t.split_k != 1 && (t.reduction & kDeterministicReductions) == 0) return false;
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(handle_, plan.op, plan.a, plan.b, plan.c, plan.c, algo, &check) !=
            CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > workspace_bytes_) {
      return false;
    }
    // The kernel's alignment needs against what this call's operands give.
    const std::pair<cublasLtMatmulAlgoCapAttributes_t, int> needs[] = {
        {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES, shape.align_a},
        {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES, shape.align_b},
        {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES, shape.align_c},
        {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES, shape.align_c}};
    for (const auto& [cap, have] : needs) {
      uint32_t need = 0;
      size_t written = 0;
      if (cublasLtMatmulAlgoCapGetAttribute(algo, cap, &need, sizeof(need), &written) != CUBLAS_STATUS_SUCCESS ||
          need > static_cast<uint32_t>(have)) {
        return false;
      }
    }
    return true;
  }
  return false;
}

absl::StatusOr<Blas::Plan> Blas::MakePlan(const Shape& shape) {
  Plan plan;
  const absl::Status made = FillPlan(shape, plan);
  if (made.ok()) return plan;
  DestroyPlan(plan);  // the descriptors created before the failure
  return made;
}

absl::Status Blas::FillPlan(const Shape& shape, Plan& plan) {
  const cublasComputeType_t compute = tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&plan.op, compute, CUDA_R_32F));
  const auto ta = static_cast<cublasOperation_t>(shape.op_a), tb = static_cast<cublasOperation_t>(shape.op_b);
  CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (shape.bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                                                          &shape.stride_bias, sizeof(shape.stride_bias)));
  }
  const int m = shape.m, n = shape.n, k = shape.k, count = shape.count;
  const bool a_n = ta == CUBLAS_OP_N, b_n = tb == CUBLAS_OP_N;
  CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_32F, a_n ? m : k, a_n ? k : m, shape.lda));
  CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_32F, b_n ? k : n, b_n ? n : k, shape.ldb));
  CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan.c, CUDA_R_32F, m, n, shape.ldc));
  if (count > 1) {
    const std::pair<cublasLtMatrixLayout_t, int64_t> strided[] = {
        {plan.a, shape.stride_a}, {plan.b, shape.stride_b}, {plan.c, shape.stride_c}};
    for (const auto& [layout, stride] : strided) {
      CUBLAS_RETURN_IF_ERROR(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                              &stride, sizeof(stride)));
    }
  }
  if (TunedAlgo(shape, plan, &plan.algo)) return absl::OkStatus();

  cublasLtMatmulPreference_t raw = nullptr;
  CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&raw));
  const std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)> preference(
      raw, &cublasLtMatmulPreferenceDestroy);
  auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attribute, auto value) {
    return cublasLtMatmulPreferenceSetAttribute(preference.get(), attribute, &value, sizeof(value));
  };
  CUBLAS_RETURN_IF_ERROR(prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{workspace_bytes_}));
  CUBLAS_RETURN_IF_ERROR(prefer(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, kDeterministicReductions));
  CUBLAS_RETURN_IF_ERROR(prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, static_cast<uint32_t>(shape.align_a)));
  CUBLAS_RETURN_IF_ERROR(prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, static_cast<uint32_t>(shape.align_b)));
  CUBLAS_RETURN_IF_ERROR(prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, static_cast<uint32_t>(shape.align_c)));
  CUBLAS_RETURN_IF_ERROR(prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, static_cast<uint32_t>(shape.align_c)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(handle_, plan.op, plan.a, plan.b, plan.c, plan.c,
                                                        preference.get(), 1, &result, &found));
  if (found == 0) {
    return absl::InternalError(absl::StrCat("cuBLASLt has no deterministic algorithm for a ", m, "x", n, "x", k,
                                            " product (batch ", count, ")"));
  }
  plan.algo = result.algo;
  return absl::OkStatus();
}

absl::StatusOr<const Blas::Plan*> Blas::PlanOf(const Shape& shape) {
  auto it = plans_.find(shape);
  if (it == plans_.end()) {
    ASSIGN_OR_RETURN(Plan plan, MakePlan(shape));
    ++plans_made_;
    if (plans_.size() >= kMaxPlans) {
      auto oldest = std::ranges::min_element(plans_, {}, [](const auto& entry) { return entry.second.last_use; });
      DestroyPlan(oldest->second);
      plans_.erase(oldest);
    }
    it = plans_.emplace(shape, plan).first;
  }
  it->second.last_use = ++plan_uses_;
  return &it->second;
}

absl::Status Blas::Gemm(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, const float* a, int lda,
                        int64_t stride_a, const float* b, int ldb, int64_t stride_b, const float* bias,
                        int64_t stride_bias, float beta, float* c, int ldc, int64_t stride_c, int count) {
  const Shape shape{op_a,     op_b,     m,        n,           k,
                    lda,      ldb,      ldc,      count,       stride_a,
                    stride_b, stride_c, stride_bias, bias != nullptr, Alignment(a, lda, stride_a),
                    Alignment(b, ldb, stride_b), Alignment(c, ldc, stride_c)};
  ASSIGN_OR_RETURN(const Plan* found, PlanOf(shape));
  const Plan& plan = *found;
  if (bias != nullptr) {  // the descriptor is the shape's; the bias is this call's
    CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  const float one = 1.f;
  CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(handle_, plan.op, &one, a, plan.a, b, plan.b, &beta, c, plan.c, c, plan.c,
                                        &plan.algo, workspace_, workspace_bytes_, stream_));
  flops_ += 2.0 * m * n * k * count;
  return absl::OkStatus();
}

bool Blas::UsesTf32x3Kernels(Precision precision, const cudaDeviceProp& device) {
  return (precision == Precision::kFloat32Tf32x3 || precision == Precision::kTf32) && device.major == 9 &&
         device.minor == 0;
}

bool Blas::ForwardOnTf32x3Kernels(int in, int out, const float* x, int ldx, const float* w, int ldw,
                                  BlasBatch batch) const {
  return tf32x3_ && Tf32x3ForwardOrBackwardDataPays(in, out) && (!tf32_ || PlainTf32Pays(in, out)) &&
         kernels::GemmTf32x3Supports(std::min(Alignment(x, ldx, batch.x), Alignment(w, ldw, batch.w)), in, in);
}

absl::Status Blas::Forward(int rows, int in, int out, const float* x, int ldx, const float* w, int ldw,
                           const float* bias, float beta, float* y, int ldy, BlasBatch batch,
                           const kernels::Tf32x3Planes* planes, bool programmatic) {
  if (ForwardOnTf32x3Kernels(in, out, x, ldx, w, ldw, batch)) {
    CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3Forward(rows, in, out, x, ldx, batch.x, w, ldw, batch.w, bias,
                                                          batch.bias, beta, y, ldy, batch.y, batch.count, stream_,
                                                          kernels::GemmTile::kAuto, planes, programmatic, tf32_));
    flops_ += 2.0 * rows * in * out * batch.count;
    return absl::OkStatus();
  }
  return Gemm(CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, w, ldw, batch.w, x, ldx, batch.x, bias, batch.bias, beta, y,
              ldy, batch.y, batch.count);
}

bool Blas::Tf32x3KernelsTakeBackwardData(int in, int out) {
  return Tf32x3ForwardOrBackwardDataPays(in, out) && kernels::GemmTf32x3Supports(16, out, in);
}

bool Blas::BackwardDataOnTf32x3Kernels(int in, int out, const float* dy, int lddy, const float* w, int ldw) const {
  return tf32x3_ && Tf32x3ForwardOrBackwardDataPays(in, out) && (!tf32_ || PlainTf32Pays(in, out)) &&
         kernels::GemmTf32x3Supports(std::min(Alignment(dy, lddy, 0), Alignment(w, ldw, 0)), out, in);
}

absl::Status Blas::BackwardData(int rows, int in, int out, const float* dy, int lddy, const float* w, int ldw,
                                float beta, float* dx, int lddx, const kernels::Tf32x3Planes* planes) {
  if (BackwardDataOnTf32x3Kernels(in, out, dy, lddy, w, ldw)) {
    CUDA_RETURN_IF_ERROR(
        kernels::LaunchGemmTf32x3BackwardData(rows, in, out, dy, lddy, w, ldw, beta, dx, lddx, stream_,
                                              kernels::GemmTile::kAuto, planes, tf32_));
    flops_ += 2.0 * rows * in * out;
    return absl::OkStatus();
  }
  if (planes != nullptr && planes->big == nullptr && planes->big_t != nullptr) {
    // A stack's planes (kernels::Tf32x3Planes): the product is the planes', w alone is not the stacked weight.
    return absl::InternalError(absl::StrCat("a stacked ", rows, "x", in, "x", out,
                                            " backward-data product without the 3xTF32 kernels"));
  }
  return Gemm(CUBLAS_OP_N, CUBLAS_OP_N, in, rows, out, w, ldw, 0, dy, lddy, 0, nullptr, 0, beta, dx, lddx, 0, 1);
}

absl::Status Blas::BackwardWeight(int rows, int in, int out, const float* dy, int lddy, const float* x, int ldx,
                                  float* dw, int lddw) {
  if (tf32x3_ && !tf32_ && Tf32x3BackwardWeightPays(rows, in, out) &&
      kernels::GemmTf32x3Supports(std::min(Alignment(dy, lddy, 0), Alignment(x, ldx, 0)), out, in)) {
    CUDA_RETURN_IF_ERROR(kernels::LaunchGemmTf32x3BackwardWeight(rows, in, out, dy, lddy, x, ldx, dw, lddw,
                                                                 static_cast<float*>(workspace_), workspace_bytes_,
                                                                 stream_, kernels::GemmTile::kAuto, /*splits=*/0,
                                                                 /*shares_device=*/true));
    flops_ += 2.0 * rows * in * out;
    return absl::OkStatus();
  }
  if (skinny_ && SkinnyBackwardWeightPays(in, out)) {
    CUDA_RETURN_IF_ERROR(kernels::LaunchSkinnyWeightGrad(rows, in, out, dy, lddy, x, ldx, dw, lddw,
                                                         static_cast<float*>(workspace_), workspace_bytes_, stream_));
    flops_ += 2.0 * rows * in * out;
    return absl::OkStatus();
  }
  return Gemm(CUBLAS_OP_N, CUBLAS_OP_T, in, out, rows, x, ldx, 0, dy, lddy, 0, nullptr, 0, 0.f, dw, lddw, 0, 1);
}

}  // namespace perception
