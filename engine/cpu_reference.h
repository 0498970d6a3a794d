// The CPU reference of PerceptionNet v1: plain loops, templated on float and double; the oracle for every other runtime.
#pragma once

#include <span>
#include <vector>

#include "engine/config.h"
#include "engine/param_layout.h"

namespace perception {

// A training batch laid out as MODEL.md §1: x[B,T,F], dt[B,T], labels[B,T,H], mask[B,T,H].
template <typename T>
struct BatchView {
  int batch = 0, window = 0;
  std::span<const T> x, dt, labels, mask;
};

// The carried state of one stream (MODEL.md §3). conv holds, per layer, the last W-1 raw xBC inputs,
// oldest first; ssm holds, per layer, s[Hh,P,N]; cfc holds c[C].
template <typename T>
struct StreamState {
  std::vector<T> conv;  // [L, W-1, E+2N]
  std::vector<T> ssm;   // [L, Hh, P, N]
  std::vector<T> cfc;   // [C]

  static StreamState Zero(const ModelConfig& config);
};

template <typename T>
class CpuReference {
 public:
  // `threads` workers split the batch; 0 means one per hardware core. LossAndGradients uses at most kGradientGroups.
  explicit CpuReference(const ParamLayout& layout, int threads = 0);

  const ParamLayout& layout() const { return layout_; }

  // Sequence path: logits[B,T,H]. `states` is empty (every window starts from zero) or has B entries,
  // read as the initial states and overwritten with the final states.
  void Forward(std::span<const T> params, const BatchView<T>& batch, std::span<T> logits,
               std::span<StreamState<T>> states = {}) const;

  // Forward, masked BCE (MODEL.md §2.7) and the full backward. Writes d loss / d params into `grads`
  // (layout.total_size(), zero for the normalizer buffers and padding) and, when non-empty, d loss / d x
  // into `dx` [B,T,F]. States as in Forward; no gradient flows into the initial state. Returns the loss.
  // The same bits on any number of threads (see kGradientGroups).
  T LossAndGradients(std::span<const T> params, const BatchView<T>& batch, std::span<T> grads,
                     std::span<T> dx = {}, std::span<StreamState<T>> states = {}) const;
  // LossAndGradients sums the batch in this many fixed groups of sequences, whatever the thread count, so that a
  // training run gives the same bits on every machine; a step uses at most this many threads.
  static constexpr int kGradientGroups = 16;

  // Masked BCE of given logits, the loss of MODEL.md §2.7.
  static T MaskedBce(std::span<const T> logits, std::span<const T> labels, std::span<const T> mask);

  // Step path: one event u[F] with its Δt through one stream; logits[H]; `state` is updated in place.
  void Step(std::span<const T> params, std::span<const T> u, T dt, StreamState<T>& state,
            std::span<T> logits) const;

  // One event for each of n distinct streams (x [n,F], dt [n], logits [n,H]), split over the workers.
  void StepMany(std::span<const T> params, std::span<const T> x, std::span<const T> dt,
                std::span<StreamState<T>* const> states, std::span<T> logits) const;

 private:
  const ParamLayout& layout_;
  int threads_;
};

// The signed conviction of one event (MODEL.md §2.8) from its logits: 2·p_k* − 1, k* the horizon of the largest
// |logit| (the largest |p − ½|), the lowest on ties.
template <typename T>
T Conviction(std::span<const T> logits);

extern template class CpuReference<float>;
extern template class CpuReference<double>;

}  // namespace perception
