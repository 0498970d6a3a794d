// The arithmetic of the CUDA backend's linear-layer products (engine/cuda_blas.h), chosen per model: a CUDA-free
// header, so flags and the backend factory can name it in a build without CUDA.
#pragma once

#include <optional>
#include <string_view>

#include "absl/status/statusor.h"

namespace perception {

// kFloat32: cuBLAS float32 (SIMT), the CPU backend's arithmetic. kFloat32Tf32x3: float32 accuracy on the TF32
// tensor cores — the 3×TF32 kernels for the products they take and run faster (measured on the H200), cuBLAS float32
// for the rest and on devices other than Hopper (compute capability 9.0). kTf32: inputs rounded to TF32 on the tensor cores (a looser
// tolerance): on Hopper the same kernels' one-product form where they take a product, cuBLAS TF32 for the rest; the
// recurrences (the scan, the CfC) on the tensor cores too. The CPU backend computes in float32 and knows only kFloat32.
enum class Precision { kFloat32, kFloat32Tf32x3, kTf32 };
// "fp32", "3xtf32", "tf32".
absl::StatusOr<Precision> ParsePrecision(std::string_view name);
const char* PrecisionName(Precision precision);

// A precision as the programs' --precision names it: one of the three, or "auto" (nullopt), the device's
// float32-accurate default (DefaultPrecision).
absl::StatusOr<std::optional<Precision>> ParsePrecisionChoice(std::string_view name);
std::string_view PrecisionChoiceName(std::optional<Precision> choice);

// What "auto" resolves to: float32 accuracy at the device's best speed, 3xtf32 on CUDA (held to the same MODEL.md §8
// bars as fp32 and faster: H200, small, 943-953 against 1,321-1,333 µs a training step), fp32 on the CPU.
Precision DefaultPrecision(bool cuda);

}  // namespace perception
