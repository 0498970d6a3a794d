// The main() of the bench/ probes: one probe run on the first CUDA device, its error printed under the probe's name.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#include "absl/status/status.h"

// Returns main()'s exit status: 0 when `probe` succeeded, 1 when it failed or no CUDA device exists.
inline int RunProbe(const char* name, absl::Status (*probe)()) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "%s: no CUDA device\n", name);
    return 1;
  }
  const absl::Status status = probe();
  if (!status.ok()) std::fprintf(stderr, "%s: %s\n", name, status.ToString().c_str());
  return status.ok() ? 0 : 1;
}
