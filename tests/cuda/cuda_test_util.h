// Helpers for the CUDA tests: skipping without a device, device arrays, random inputs, a product reference, models.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "engine/cuda_backend.h"
#include "engine/cuda_memory.h"
#include "engine/cuda_model.h"
#include "engine/optimizer.h"
#include "engine/param_layout.h"
#include "tests/test_util.h"

namespace perception {

// Reaches into CudaModel for the one thing a test cannot do through its interface: point an input slot's staging
// elsewhere, as a model that reallocated its buffers would, to check that a graph captured over the old one is not
// replayed.
class CudaModelTestPeer {
 public:
  static float*& x_staging(CudaModel& model, int slot) { return model.slots_[slot].x_host; }
};

}  // namespace perception

namespace perception::testing {

// MODEL.md §8: float32 against a float64 evaluation of the model.
constexpr double kLogitsTolerance = 1e-5;    // logits and loss
constexpr double kGradientTolerance = 1e-4;  // every gradient
constexpr double kParamsTolerance = 1e-4;    // parameters after 10 AdamW steps

// GPU tests call this first: without a usable device they skip, saying why.
#define SKIP_WITHOUT_CUDA_DEVICE()                                                         \
  do {                                                                                     \
    if (const absl::Status _available = ::perception::CudaDeviceAvailable(); !_available.ok()) { \
      GTEST_SKIP() << "needs a CUDA device: " << _available.message();                      \
    }                                                                                      \
  } while (0)

// The product kernels' tests: CudaModel's per-stream Blas workspace, and their bar. Float32 level: a 3×TF32 product
// keeps 21 of 24 mantissa bits per operand and accumulates in float32. Over the 16,384-row weight gradients float32
// accumulation itself loses more, so cuBLAS float32's own error (times 2) is the bar where it is higher.
constexpr size_t kBlasWorkspaceBytes = 32u << 20;
constexpr double kFloat32ProductError = 2e-6;

inline bool Contains(const absl::Status& status, const std::string& part) {
  return std::string(status.message()).find(part) != std::string::npos;
}

// A device copy of a host vector (or zeros), downloaded on demand. Allocated through the counted allocator.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count), allocation_(Allocate(count)) {}
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    EXPECT_EQ(cudaMemcpy(get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  T* get() const { return static_cast<T*>(allocation_.get()); }
  std::vector<T> Download() const {
    std::vector<T> host(count_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), get(), count_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  static CudaAllocation Allocate(size_t count) {
    auto allocation = AllocateCuda(MemoryKind::kDevice, std::max<size_t>(count, 1) * sizeof(T));
    EXPECT_TRUE(allocation.ok()) << allocation.status();
    return allocation.ok() ? *std::move(allocation) : CudaAllocation();
  }
  size_t count_;
  CudaAllocation allocation_;
};

// A parameterized test of the product kernels: a stream of its own and a Blas-sized workspace (skipped without a
// device; a derived SetUp returns at once when IsSkipped()).
template <typename Param>
class ProductTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_CUDA_DEVICE();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    workspace_.emplace(kBlasWorkspaceBytes / sizeof(float));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  cudaStream_t stream_ = nullptr;
  std::optional<DeviceArray<float>> workspace_;
};

// `count` floats uniform in [lo, hi), fixed by `seed`.
inline std::vector<float> RandomFloats(size_t count, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  Rng rng(seed);
  std::vector<float> v(count);
  for (float& x : v) x = static_cast<float>(rng.Uniform(lo, hi));
  return v;
}

// Linear warmup over 5 steps, then cosine down to 1e-4 at `total_steps`: a learning rate that moves every step.
inline OptimizerConfig WarmupCosine(int64_t total_steps) {
  OptimizerConfig optimizer;
  optimizer.schedule = LrSchedule::kWarmupCosine;
  optimizer.warmup_steps = 5;
  optimizer.total_steps = total_steps;
  optimizer.min_lr = 1e-4;
  return optimizer;
}

// The weight-gradient products' reference: dw[out, in] = dy[rows, out]ᵀ · x[rows, in] in double, dy and x at leading
// dimensions lddy and ldx, dw dense.
inline std::vector<double> WeightGradientReference(int rows, int in, int out, const std::vector<float>& dy, int lddy,
                                                   const std::vector<float>& x, int ldx) {
  std::vector<double> dw(static_cast<size_t>(out) * in);
  for (int r = 0; r < rows; ++r) {
    const float* xrow = &x[static_cast<size_t>(r) * ldx];
    for (int o = 0; o < out; ++o) {
      const double v = dy[static_cast<size_t>(r) * lddy + o];
      double* row = &dw[static_cast<size_t>(o) * in];
      for (int i = 0; i < in; ++i) row[i] += v * xrow[i];
    }
  }
  return dw;
}

// A model from InitialParams(config, seed); null, with the failure recorded, where it cannot be created.
inline std::unique_ptr<CudaModel> MakeModel(const ModelConfig& config, const OptimizerConfig& optimizer, bool graphs,
                                            uint64_t seed, Precision precision = Precision::kFloat32) {
  CudaModelOptions options;
  options.graphs = graphs;
  options.precision = precision;
  auto model = CudaModel::Create(config, optimizer, InitialParams(config, seed), options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

// Parameters, both moments and the step counter bit for bit: two models that trained alike.
inline void ExpectSameState(CudaModel& a, CudaModel& b) {
  EXPECT_TRUE(BitIdentical(*a.DownloadParams(), *b.DownloadParams())) << "parameters";
  EXPECT_TRUE(BitIdentical(*a.DownloadExpAvg(), *b.DownloadExpAvg())) << "first moments";
  EXPECT_TRUE(BitIdentical(*a.DownloadExpAvgSq(), *b.DownloadExpAvgSq())) << "second moments";
  EXPECT_EQ(*a.DownloadStep(), *b.DownloadStep());
}

// One training step of `model` on `batch`, waited for.
inline absl::StatusOr<kernels::StepReport> Step(CudaModel& model, const BatchView<float>& batch) {
  if (absl::Status staged = model.StageBatch(batch); !staged.ok()) return staged;
  if (absl::Status enqueued = model.EnqueueTrainStep(); !enqueued.ok()) return enqueued;
  return model.Wait();
}

}  // namespace perception::testing
