// The streaming step (forward_step_into) of PerceptionNet as one kernel: one event per listed slot through every
// layer, the CfC and the head, states updated in place, probabilities and convictions written to device buffers.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace perception::kernels {

constexpr int kStreamMaxLayers = 8;

struct StreamLayerWeights {
  const float *norm, *in_proj, *conv_weight, *conv_bias, *dt_bias, *a_log, *d, *mixer_norm, *out_proj;
};

// Device pointers into the flat parameter buffer (the published copy) and the model's dimensions.
struct StreamWeights {
  int F, D, L, E, P, Hh, N, W, C, K, G, H;
  const float *norm_mean, *norm_inv_std, *embed_w, *embed_b;
  StreamLayerWeights layers[kStreamMaxLayers];
  const float* norm_f;
  const float *backbone_w, *backbone_b, *ff1_w, *ff1_b, *ff2_w, *ff2_b, *time_a_w, *time_a_b, *time_b_w, *time_b_b;
  const float *fc2_w, *fc2_b, *fc1_w, *fc1_b, *gate_w, *gate_b, *value_w, *value_b, *skip_w, *ln_w, *ln_b;
  const float *out_w, *out_b;
};

// Per-slot device state and outputs. Slot s owns conv[s] = [L][W−1][E+2N] (oldest first), ssm[s] = [L][Hh][P][N],
// cfc[s] = [C], probs[s] = [H] and a log ring of `log_entries` convictions and [log_entries][H] probabilities.
struct StreamSlots {
  float *conv, *ssm, *cfc, *probs, *log_convictions, *log_probs;
  int64_t log_entries;
};

// One tick: n events, distinct slots (a negative slot marks a padding event: nothing is read or written for it);
// x [n,F] raw features, dt [n], slot ids, log ring positions (null: only the states advance, nothing is written to
// the probabilities or the logs — how a stream is seeded).
struct StreamTickInput {
  int n;
  const float* x;
  const float* dt;
  const int32_t* slots;
  const int64_t* log_indices;
};

// Shared-memory bytes the step kernel needs per block; 0 when the model does not fit (caller reports it).
size_t StreamStepSharedBytes(const StreamWeights& w, int events_per_group);

// Largest events-per-group (1, 2, 4 or 8) whose shared memory fits `max_shared_bytes`; 0 if even 1 does not.
int StreamStepMaxGroup(const StreamWeights& w, size_t max_shared_bytes);

// Launches ceil(n / events_per_group) thread-block clusters of `cluster_size` blocks (1..8): each cluster carries
// `events_per_group` events through the whole step; the blocks of a cluster split every matrix product by rows and
// exchange results through distributed shared memory. Call PrepareStreamStep once first (it raises the kernels'
// shared-memory limits; not capturable).
cudaError_t PrepareStreamStep(const StreamWeights& w, int events_per_group);
cudaError_t LaunchStreamStep(const StreamWeights& w, const StreamSlots& slots, const StreamTickInput& tick,
                             int events_per_group, int cluster_size, cudaStream_t stream);

}  // namespace perception::kernels
