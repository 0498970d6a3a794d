// Order statistics of the benchmarks' timings: one definition of a median and a percentile for every bench program.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace perception {

// The q-quantile of `samples` (not empty) by nearest rank: rank q·(n − 1) rounded. q = 0.5 gives samples[n / 2] of
// the sorted samples, the upper median when n is even.
inline double Percentile(std::vector<double> samples, double q) {
  std::sort(samples.begin(), samples.end());
  const size_t rank = static_cast<size_t>(q * static_cast<double>(samples.size() - 1) + 0.5);
  return samples[std::min(samples.size() - 1, rank)];
}

inline double Median(std::vector<double> samples) { return Percentile(std::move(samples), 0.5); }

}  // namespace perception
