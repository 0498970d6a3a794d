// The streaming step (forward_step_into) of PerceptionNet as one kernel: one event per listed slot through every
// layer, the CfC and the head, states updated in place, probabilities and convictions written to device buffers.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace perception::kernels {

constexpr int kStreamMaxLayers = 8;
constexpr int kStreamMaxCluster = 16;
constexpr int kStreamMaxConvTaps = 8;

struct StreamLayerWeights {
  const float *norm, *in_proj, *conv_weight, *conv_bias, *dt_bias, *a_log, *d, *mixer_norm, *out_proj;
};

// Device pointers into a flat parameter buffer and the model's dimensions. The step kernel does not read these
// tensors: it reads the stream pack that PackStreamWeights builds from them.
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
// cfc[s] = [C], probs[s] = [H] and a log ring of `log_entries` convictions and [log_entries][H] probabilities; an
// event's entry number n goes to ring position n mod log_entries. A logged event whose logits are not finite (float32
// overflowed inside the model, and the slot's state with it) writes n + 1 to first_nonfinite[s] where that is 0 (none
// since the host last zeroed it) and sets *nonfinite_seen, a word of mapped host memory, so that the host learns of it
// without a copy.
struct StreamSlots {
  float *conv, *ssm, *cfc, *probs, *log_convictions, *log_probs;
  int64_t log_entries;
  uint64_t log_reciprocal;  // StreamLogReciprocal(log_entries)
  int64_t* first_nonfinite;
  int* nonfinite_seen;
};

// ⌊(2⁶⁴ − 1) / log_entries⌋: the ticks find an entry number's ring position with a multiply instead of a 64-bit
// division (a subroutine in the chain of every logged event).
constexpr uint64_t StreamLogReciprocal(int64_t log_entries) { return UINT64_MAX / static_cast<uint64_t>(log_entries); }

// Entry number n's position (n mod L) in a ring of L entries, given r = StreamLogReciprocal(L), for 0 ≤ n < 2⁶³:
// n·r / 2⁶⁴ lies in (n/L − n(L + 1)/(L·2⁶⁴), n/L], so its floor is ⌊n/L⌋ or one less, and one correction is enough.
__host__ __device__ inline int64_t StreamLogPosition(int64_t n, int64_t L, uint64_t r) {
  const auto un = static_cast<uint64_t>(n), uL = static_cast<uint64_t>(L);
#ifdef __CUDA_ARCH__
  const uint64_t quotient = __umul64hi(un, r);
#else
  const auto quotient = static_cast<uint64_t>((static_cast<unsigned __int128>(un) * r) >> 64);
#endif
  uint64_t position = un - quotient * uL;
  if (position >= uL) position -= uL;
  return static_cast<int64_t>(position);
}

// A tick of at most kStreamInlineEvents events whose raw features fit kStreamInlineFloats travels inside the launch's
// parameters: the kernel finds it in device memory when it starts, where a staged tick needs a copy first (which
// CudaStreamer queues beside the tick before it).
constexpr int kStreamInlineEvents = 8;
constexpr int kStreamInlineFloats = 384;

// One tick: n events, distinct slots (a negative slot marks a padding event: nothing is read or written for it);
// x [n,F] raw features, dt [n], slot ids, log entry numbers. `logged` false: only the states advance, nothing is
// written to the probabilities or the logs (how a stream is seeded). x null: the events are the inline copies.
struct StreamTickInput {
  int n;
  bool logged;
  const float* x;
  const float* dt;
  const int32_t* slots;
  const int64_t* log_indices;
  float inline_x[kStreamInlineFloats];
  float inline_dt[kStreamInlineEvents];
  int32_t inline_slots[kStreamInlineEvents];
  int64_t inline_log[kStreamInlineEvents];
};

// The stream pack: every weight the step reads, rearranged once per published parameter set so that each block of
// a cluster finds its rows of every product in one 16-byte-aligned run (padded rows, biases and per-row constants
// next to their rows). Its size in floats; 0 if the model is outside what the kernel supports.
size_t StreamPackSize(const StreamWeights& w);
// Fills `pack` (StreamPackSize floats of device memory) from the tensors `w` points at, on `stream`.
cudaError_t PackStreamWeights(const StreamWeights& w, float* pack, cudaStream_t stream);

// Raises the kernels' shared-memory limits (the wide path's too) to `max_shared_bytes` and allows clusters of 16
// (once, not capturable).
cudaError_t PrepareStreamStep(size_t max_shared_bytes);

// How a launch shape (events per group, blocks per cluster) fits this device within `max_shared_bytes` of shared
// memory per block: how many of its clusters can be resident at once (0: it cannot launch) and whether every weight
// the step reads has room in shared memory (else some products read the pack in global memory).
struct StreamShapeFit {
  int max_clusters = 0;
  bool weights_resident = false;
};
cudaError_t FitStreamStep(const StreamWeights& w, int events_per_group, int cluster_size, size_t max_shared_bytes,
                          StreamShapeFit* fit);

// Launches min(ceil(n / events_per_group), max_clusters) thread-block clusters of `cluster_size` blocks (1..16);
// each cluster loads its blocks' share of the pack into shared memory once (asynchronously, in stage order, so the
// loads overlap the dependent chain) and carries groups of `events_per_group` events (1, 2, 4 or 8) through the
// whole step. The blocks of a cluster split every product by rows and exchange results through distributed shared
// memory. Each row is summed in one fixed order whatever the shape, so every shape gives the same bits.
cudaError_t LaunchStreamStep(const StreamWeights& w, const float* pack, const StreamSlots& slots,
                             const StreamTickInput& tick, int events_per_group, int cluster_size, int max_clusters,
                             size_t max_shared_bytes, cudaStream_t stream);
// The wide path, for ticks of many events: 1 + 2·layers grid-wide kernels per tick (standardization, embedding and
// layer 0's B, C and Δt; per layer z, x, the conv, the SSM update and the gate, then out_proj with the next layer's
// B, C and Δt or the CfC and the head), each over tiles of 8 events, activations between them in `scratch`, every
// row summed in the cluster kernel's order (the same bits as LaunchStreamStep). Scratch holds, per event of the
// largest tick: h [D], bcdt [2N + Hh], y [E], the slot, Δt and log entry number. The tick's features, slots, Δt and
// log entry numbers are read where `tick` points.
struct StreamWideScratch {
  float *h, *bcdt, *y;
  int32_t* slots;
  float* dt;
  int64_t* log;
};
// Whether the wide path's kernels fit `max_shared_bytes` of shared memory per block.
bool StreamWideFits(const StreamWeights& w, size_t max_shared_bytes);
// `sm_count`: the device's multiprocessors (ticks of more tiles than that run the per-tile kernels two blocks an SM);
// `l2_bytes`: its L2 cache (ticks whose states outgrow it mark their traffic first out of it).
cudaError_t LaunchStreamWide(const StreamWeights& w, const float* pack, const StreamSlots& slots,
                             const StreamWideScratch& scratch, const StreamTickInput& tick, size_t max_shared_bytes,
                             int sm_count, size_t l2_bytes, cudaStream_t stream);

// ---- The resident step: the streamer's path for lone events where the model has one (CudaStreamer), also timed
// and tested on its own (bench_stream --resident, StreamResidentTest) ----
// One cluster of a fixed plan's launch shape (small's one-event tick) stays on the device: it loads its weights into
// shared memory once, then carries events one at a time as the host posts them into a ring in mapped pinned memory,
// through the same code as a launched one-event tick (so with the same bits), and counts the events it has answered.
constexpr int kStreamResidentWords = 56;  // an event: slot, Δt, logged, log entry number (two words), the features
// Each word carries the event's sequence number (its index + 1, modulo 2³²) in its high half and a payload word in its
// low half: the kernel reads an entry in 8-byte words, each whole, and takes it once every word is the event's.
// Events are numbered across launches over one ring (a launch starts at `first`), so an entry an earlier launch left
// is never taken for a new event.
struct StreamResidentEntry {
  uint64_t words[kStreamResidentWords];
};
// One event through the resident step on the device's own clocks, read by rank 0's thread 0: the multiprocessor's
// cycle counter (clock64) when the kernel found the event's ring entry whole (`seen`) and just before it stored its
// answer (`done`), and the global nanosecond timer just after each (after the mailbox's stores and the answer's). A
// launched tick's device time is timed by CUDA events around its launch; the resident step has no launch per event,
// and these are its counterpart: the daemon's device time an event (seen → done by the timer), and bench_stream
// --resident's finer figures (the cycles, converted to time at their rate against the timer).
struct StreamResidentStamp {
  uint64_t event;  // the event's index (events are numbered over the ring)
  uint64_t seen_cycles, seen_ns;
  uint64_t done_cycles, done_ns;  // done_cycles 0 until the answer is stored
};
struct StreamResidentQueue {
  const StreamResidentEntry* ring;  // device address of ring_size entries (mapped pinned memory); a power of two
  int ring_size;
  uint32_t* done;    // device address (mapped pinned memory): after event k, k + 1 (the events answered, modulo 2³²)
  uint64_t idle_ns;  // without an event for this long the kernel leaves (as at a stop)
  uint32_t first = 0;  // the index of the first event this launch reads
  // Where set (device memory or mapped pinned memory of stamp_slots entries, a power of two), event k's stamps go to
  // stamps[k % stamp_slots].
  StreamResidentStamp* stamps = nullptr;
  uint32_t stamp_slots = 0;
};
// Whether this model has a resident step within `max_shared_bytes` of shared memory per block.
bool StreamResidentFits(const StreamWeights& w, size_t max_shared_bytes);
// Launches the resident cluster on `stream`; it runs until it reads a stop (or idles for queue.idle_ns), and it holds
// its multiprocessors meanwhile. Not capturable.
cudaError_t LaunchStreamResident(const StreamWeights& w, const float* pack, const StreamSlots& slots,
                                 const StreamResidentQueue& queue, size_t max_shared_bytes, cudaStream_t stream);
// A ring entry with this slot makes the kernel execute `trap`: the tests' fault inside the running kernel
// (Backend::InjectDeviceLoss), a sticky cudaErrorLaunchFailure.
constexpr int32_t kStreamResidentTrapSlot = -2;
// Host side: writes event `index` (F features at x) into its ring entry. The entry must not be rewritten before the
// event ring_size earlier has been answered. A negative slot stops the kernel, which answers events up to it
// (kStreamResidentTrapSlot: faults it).
void PostStreamResidentEvent(StreamResidentEntry* ring, int ring_size, uint32_t index, int32_t slot, float dt,
                             bool logged, int64_t log_index, const float* x, int F);

// Sets *not_finite (mapped host memory) to 1 where a value of `slot`'s state (its conv, SSM and CfC states: `conv`,
// `ssm` and `cfc` floats a slot) is not finite; leaves it alone otherwise. A seed's check (CudaStreamer::SeedSlot).
cudaError_t CheckStreamSlotFinite(const StreamSlots& slots, int slot, size_t conv, size_t ssm, size_t cfc,
                                  int* not_finite, cudaStream_t stream);

// Replaces the tick of a captured step (`node`, the kernel node of the graph `exec` was instantiated from): the next
// launch of `exec` reads `tick` (copied now); launches already queued keep theirs. The tick's event count and the
// launch shape must be the captured ones.
cudaError_t SetStreamStepTick(cudaGraphExec_t exec, cudaGraphNode_t node, const StreamTickInput& tick);

}  // namespace perception::kernels
