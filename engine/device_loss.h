// The process's one record of a lost device: after a sticky CUDA error (an illegal address, a trap, an uncorrectable
// ECC error) every later CUDA call of the process fails, so the daemon must stop taking work and be restarted.
#pragma once

#include <functional>
#include <mutex>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace perception {
namespace device_loss_internal {

struct DeviceLoss {
  std::mutex mu;
  absl::Status first_failure;    // OK while the device works
  std::function<void()> on_lost;  // run once, by the thread that notes the loss
};

// Header-only (one instance per process by the rules of inline functions) so that the probes, which use the CUDA
// checks without the engine library, link.
inline DeviceLoss& ProcessDeviceLoss() {
  static DeviceLoss loss;
  return loss;
}

}  // namespace device_loss_internal

// Records `failure`, the first call that found the device lost; later notes change nothing. The first note runs the
// handler given to OnDeviceLost, if any.
inline void NoteDeviceLost(const absl::Status& failure) {
  auto& loss = device_loss_internal::ProcessDeviceLoss();
  std::function<void()> on_lost;
  {
    const std::lock_guard lock(loss.mu);
    if (!loss.first_failure.ok()) return;
    loss.first_failure = failure;
    on_lost = std::move(loss.on_lost);
  }
  if (on_lost) on_lost();
}

// OK while the device works; afterwards UNAVAILABLE naming the failure that lost it.
inline absl::Status DeviceLostStatus() {
  auto& loss = device_loss_internal::ProcessDeviceLoss();
  const std::lock_guard lock(loss.mu);
  if (loss.first_failure.ok()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("the CUDA device is lost (", loss.first_failure.message(),
                                             "): no further device work is possible; restart perceptiond"));
}

// What to do once the device is lost (the daemon: drain and exit non-zero); set before any device work.
inline void OnDeviceLost(std::function<void()> handler) {
  auto& loss = device_loss_internal::ProcessDeviceLoss();
  const std::lock_guard lock(loss.mu);
  loss.on_lost = std::move(handler);
}

}  // namespace perception
