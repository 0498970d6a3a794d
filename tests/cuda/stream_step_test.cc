// The CUDA streaming step against the CPU reference's step path: random states and events, many instruments
// interleaved, seeding, every launch shape, and no allocation per tick.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "bench/resident_stamps.h"
#include "engine/backend.h"
#include "engine/cpu_reference.h"
#include "engine/cuda_streamer.h"
#include "tests/check_ticks_util.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/test_util.h"

namespace perception {
namespace {

using testing::DeviceArray;
using testing::MakeRandomBatch;
using testing::RandomParams;
using testing::RelativeError;

// A named config, or "NAME-L<levels>": the preset with the features of that many LOBSTER book levels (small-L1: the
// AMZN day's 12, which has a compiled one-event plan of its own as the preset's 40 have).
ModelConfig TestConfig(const std::string& name) {
  const size_t at = name.find("-L");
  ModelConfig config = *NamedConfig(name.substr(0, at));
  if (at != std::string::npos) config.n_features = LobsterFeatureCount(std::stoi(name.substr(at + 2)));
  return config;
}

// Shuffles slots in place (Fisher–Yates), so that the order of a tick's slots differs from the order of its events.
void Shuffle(std::vector<int32_t>& slots, Rng& rng) {
  for (size_t i = slots.size(); i > 1; --i) std::swap(slots[i - 1], slots[rng.Below(i)]);
}
// Slots 0 … n − 1, shuffled.
std::vector<int32_t> ShuffledSlots(int n, Rng& rng) {
  std::vector<int32_t> slots(n);
  for (int s = 0; s < n; ++s) slots[s] = s;
  Shuffle(slots, rng);
  return slots;
}

// A streamer over `layout` (which must outlive it) of `slots` slots and `log_entries` log entries a slot, publishing
// RandomParams(layout, seed); null, with the failure recorded, where it cannot be made or publish.
std::unique_ptr<CudaStreamer> PublishedStreamer(const ParamLayout& layout, int slots, int64_t log_entries,
                                                uint64_t seed) {
  absl::StatusOr<std::unique_ptr<CudaStreamer>> created = CudaStreamer::Create(layout, slots, log_entries);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return nullptr;
  const absl::Status published = (*created)->PublishFromHost(RandomParams(layout, seed));
  EXPECT_TRUE(published.ok()) << published;
  return published.ok() ? *std::move(created) : nullptr;
}

// Runs the same ticks through CpuReference::Step (one state per slot) and the CUDA streamer, and compares every
// event's probabilities and conviction.
class StreamStepParity {
 public:
  // `large_dt_bias`: RandomParamsWithLargeDtBias's, heads whose Δt argument passes 20.
  StreamStepParity(const std::string& config_name, int slots, int64_t log_entries, bool large_dt_bias = false)
      : config_(TestConfig(config_name)),
        layout_(config_),
        params_(large_dt_bias ? testing::RandomParamsWithLargeDtBias(layout_, 101) : RandomParams(layout_, 101)),
        cpu_(layout_, 2),
        cpu_states_(slots, StreamState<float>::Zero(config_)),
        log_counts_(slots, 0) {
    auto streamer = CudaStreamer::Create(layout_, slots, log_entries);
    EXPECT_TRUE(streamer.ok()) << streamer.status();
    streamer_ = *std::move(streamer);
    EXPECT_TRUE(streamer_->PublishFromHost(params_).ok());
  }

  // One tick of random events for `slots`, on both sides.
  void Tick(const std::vector<int32_t>& slots, uint64_t seed, std::optional<StreamLaunchShape> shape = {}) {
    const int F = config_.n_features, H = config_.n_horizons, n = static_cast<int>(slots.size());
    const testing::RandomBatch events = MakeRandomBatch(config_, 1, n, seed);
    std::vector<int64_t> log_indices;
    for (int32_t slot : slots) log_indices.push_back(log_counts_[slot]++);
    const StreamTick tick{events.x, events.dt, slots, log_indices};
    const absl::Status status = shape ? streamer_->Step(tick, *shape) : streamer_->Step(tick);
    ASSERT_TRUE(status.ok()) << status;
    for (int i = 0; i < n; ++i) {
      std::vector<float> logits(H);
      cpu_.Step(params_, std::span<const float>(events.x).subspan(i * F, F), events.dt[i], cpu_states_[slots[i]],
                logits);
      expected_[slots[i]].push_back(logits);
    }
  }

  void Seed(int32_t slot, int events, uint64_t seed) {
    const testing::RandomBatch window = MakeRandomBatch(config_, 1, events, seed);
    // In two parts, as the daemon steps a long window: the second carries on from the state the first left.
    const int first = events / 2, F = config_.n_features;
    ASSERT_TRUE(streamer_->ResetSlot(slot).ok());
    if (first > 0) {
      ASSERT_TRUE(streamer_->AdvanceSlot(slot, std::span<const float>(window.x).first(first * F),
                                         std::span<const float>(window.dt).first(first)).ok());
    }
    ASSERT_TRUE(streamer_->AdvanceSlot(slot, std::span<const float>(window.x).subspan(first * F),
                                       std::span<const float>(window.dt).subspan(first)).ok());
    cpu_states_[slot] = StreamState<float>::Zero(config_);
    std::vector<float> logits(config_.n_horizons);
    for (int i = 0; i < events; ++i) {
      cpu_.Step(params_, std::span<const float>(window.x).subspan(i * config_.n_features, config_.n_features),
                window.dt[i], cpu_states_[slot], logits);
    }
  }

  // Reads every slot's log back and compares with the CPU: each event's probabilities within 1e-5 relative (the
  // logits' bar of MODEL.md §8, carried through the sigmoid) and its conviction within 1e-5.
  void ExpectLogsMatch() {
    const int H = config_.n_horizons;
    for (auto& [slot, per_event] : expected_) {
      const int64_t count = static_cast<int64_t>(per_event.size());
      std::vector<float> convictions(count), probs(count * H);
      ASSERT_TRUE(streamer_->ReadLog(slot, 0, count, convictions, probs).ok());
      for (int64_t i = 0; i < count; ++i) {
        std::vector<double> expected_probs(H);
        for (int h = 0; h < H; ++h) expected_probs[h] = 1.0 / (1.0 + std::exp(-static_cast<double>(per_event[i][h])));
        ASSERT_LE(RelativeError(std::span<const float>(probs).subspan(i * H, H), std::span<const double>(expected_probs)),
                  1e-5)
            << "slot " << slot << " event " << i;
        ASSERT_NEAR(convictions[i], Conviction<float>(per_event[i]), 1e-5) << "slot " << slot << " event " << i;
      }
      std::vector<float> latest(H);
      ASSERT_TRUE(streamer_->ReadSlotProbabilities(slot, latest).ok());
      EXPECT_EQ(latest, std::vector<float>(probs.end() - H, probs.end())) << "slot " << slot;
    }
  }

  // Every logged event's conviction is 2·σ(l) − 1 of the CPU's logit l of `horizon`, within 1e-5 (in double, so that
  // the expectation takes no float32 rounding of σ).
  void ExpectConvictionsOfHorizon(int horizon) {
    for (auto& [slot, per_event] : expected_) {
      const int64_t count = static_cast<int64_t>(per_event.size());
      std::vector<float> convictions(count);
      ASSERT_TRUE(streamer_->ReadLog(slot, 0, count, convictions, {}).ok());
      for (int64_t i = 0; i < count; ++i) {
        const double logit = per_event[i][horizon];
        ASSERT_NEAR(convictions[i], 2.0 / (1.0 + std::exp(-logit)) - 1.0, 1e-5)
            << "slot " << slot << " event " << i << " logit " << logit;
      }
    }
  }

  // Every logged slot's convictions and probabilities, in slot order, as read back.
  std::vector<float> Logs() {
    const int H = config_.n_horizons;
    std::vector<float> all;
    for (auto& [slot, per_event] : expected_) {
      const int64_t count = static_cast<int64_t>(per_event.size());
      std::vector<float> convictions(count), probs(count * H);
      EXPECT_TRUE(streamer_->ReadLog(slot, 0, count, convictions, probs).ok());
      all.insert(all.end(), convictions.begin(), convictions.end());
      all.insert(all.end(), probs.begin(), probs.end());
    }
    return all;
  }

  // The same kind of events through the resident step (kernels/stream_step.h), on a stream of its own: StartResident
  // launches it over this streamer's weights and states (a ring of `ring_size` entries in mapped pinned memory),
  // ResidentTick posts one event (waiting while its entry's previous event is unanswered) and steps the CPU, and
  // StopResident waits for every answer, posts the stop and waits for the kernel to leave.
  void StartResident(int ring_size, uint64_t idle_ns = 2'000'000'000) {
    ASSERT_TRUE(streamer_->Synchronize().ok());
    ASSERT_EQ(cudaStreamCreateWithFlags(&resident_stream_, cudaStreamNonBlocking), cudaSuccess);
    const size_t ring_bytes = ring_size * sizeof(kernels::StreamResidentEntry);
    ASSERT_EQ(cudaHostAlloc(&ring_, ring_bytes, cudaHostAllocMapped), cudaSuccess);
    ASSERT_EQ(cudaHostAlloc(&done_, sizeof(uint32_t), cudaHostAllocMapped), cudaSuccess);
    std::fill_n(reinterpret_cast<char*>(ring_), ring_bytes, 0);
    *done_ = 0;
    ring_size_ = ring_size;
    kernels::StreamResidentQueue queue{nullptr, ring_size, nullptr, idle_ns};
    ASSERT_EQ(cudaHostGetDevicePointer(const_cast<kernels::StreamResidentEntry**>(&queue.ring), ring_, 0), cudaSuccess);
    ASSERT_EQ(cudaHostGetDevicePointer(&queue.done, done_, 0), cudaSuccess);
    ASSERT_EQ(kernels::LaunchStreamResident(streamer_->weights(), streamer_->pack(), streamer_->slot_states(), queue,
                                            streamer_->max_shared_bytes(), resident_stream_),
              cudaSuccess);
  }

  uint32_t Answered() const { return std::atomic_ref<uint32_t>(*done_).load(std::memory_order_acquire); }

  // Until `count` events are answered, or false after 5 s.
  bool WaitAnswered(uint32_t count) const {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (Answered() < count) {
      if (std::chrono::steady_clock::now() > give_up) return false;
    }
    return true;
  }

  void ResidentTick(int32_t slot, uint64_t seed) {
    const int F = config_.n_features, H = config_.n_horizons;
    const testing::RandomBatch event = MakeRandomBatch(config_, 1, 1, seed);
    if (posted_ >= static_cast<uint32_t>(ring_size_)) {
      ASSERT_TRUE(WaitAnswered(posted_ + 1 - ring_size_)) << "event " << posted_ + 1 - ring_size_ << " unanswered";
    }
    kernels::PostStreamResidentEvent(ring_, ring_size_, posted_++, slot, event.dt[0], true, log_counts_[slot]++,
                                     event.x.data(), F);
    std::vector<float> logits(H);
    cpu_.Step(params_, event.x, event.dt[0], cpu_states_[slot], logits);
    expected_[slot].push_back(logits);
  }

  void StopResident() {
    EXPECT_TRUE(WaitAnswered(posted_)) << Answered() << " of " << posted_ << " events answered";
    kernels::PostStreamResidentEvent(ring_, ring_size_, posted_, -1, 0.f, false, 0, nullptr, 0);
    EXPECT_EQ(cudaStreamSynchronize(resident_stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(resident_stream_), cudaSuccess);
    EXPECT_EQ(cudaFreeHost(ring_), cudaSuccess);
    EXPECT_EQ(cudaFreeHost(done_), cudaSuccess);
    resident_stream_ = nullptr;
  }

  cudaStream_t resident_stream() const { return resident_stream_; }
  CudaStreamer& streamer() { return *streamer_; }
  const std::vector<float>& params() const { return params_; }
  // The CPU steps with `params` from now on (once the streamer has published them too).
  void UseParams(std::vector<float> params) { params_ = std::move(params); }
  const ModelConfig& config() const { return config_; }

 private:
  ModelConfig config_;
  ParamLayout layout_;
  std::vector<float> params_;
  CpuReference<float> cpu_;
  std::vector<StreamState<float>> cpu_states_;
  std::vector<int64_t> log_counts_;
  std::map<int32_t, std::vector<std::vector<float>>> expected_;
  std::unique_ptr<CudaStreamer> streamer_;
  cudaStream_t resident_stream_ = nullptr;
  kernels::StreamResidentEntry* ring_ = nullptr;
  uint32_t* done_ = nullptr;
  int ring_size_ = 0;
  uint32_t posted_ = 0;
};

class StreamStepTest : public ::testing::TestWithParam<std::string> {};

TEST_P(StreamStepTest, TicksOfEverySizeMatchTheCpuStepPath) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity parity(GetParam(), 40, 256);
  parity.Seed(7, 23, 5);   // a slot with a warm state, from a seeded window
  parity.Seed(12, 1, 6);
  uint64_t seed = 1000;
  for (int round = 0; round < 12; ++round) {
    std::vector<int32_t> slots;
    for (int s = 0; s < 40; ++s) {
      if ((s * 7 + round) % (round % 4 + 1) == 0) slots.push_back(s);  // ticks of 10 to 40 events
    }
    if (round % 3 == 0) std::reverse(slots.begin(), slots.end());
    parity.Tick(slots, ++seed);
    parity.Tick({7}, ++seed);  // single-instrument ticks in between
  }
  parity.ExpectLogsMatch();
}

TEST_P(StreamStepTest, EveryLaunchShapeGivesTheSameBits) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // Each row of every product is summed in one order whatever the shape (and whether its weights come from shared or
  // global memory), so results are bit-identical.
  const std::vector<int32_t> slots = {3, 0, 9, 4, 8, 1, 2};
  std::vector<StreamLaunchShape> shapes;
  for (int group : kStreamGroupSizes) {
    for (int cluster : kStreamClusterSizes) shapes.push_back({group, cluster});
  }
  shapes.push_back(kStreamWideShape);
  std::vector<std::vector<float>> results;
  for (const StreamLaunchShape shape : shapes) {
    StreamStepParity parity(GetParam(), 10, 4);
    if (!parity.streamer().Supports(shape)) continue;
    parity.Tick(slots, 77, shape);
    parity.Tick(slots, 78, shape);
    std::vector<float> convictions(2), all;
    for (int32_t slot : slots) {
      ASSERT_TRUE(parity.streamer().ReadLog(slot, 0, 2, convictions, {}).ok());
      all.insert(all.end(), convictions.begin(), convictions.end());
    }
    results.push_back(all);
    parity.ExpectLogsMatch();
  }
  ASSERT_TRUE(StreamStepParity(GetParam(), 10, 4).streamer().Supports(kStreamWideShape));
  // (Unsupported shapes are skipped: without a cluster shape run, the wide path would be compared with itself.)
  std::printf("[shapes] %s: %zu of %zu launch shapes supported\n", GetParam().c_str(), results.size(), shapes.size());
  EXPECT_GE(results.size(), 2u) << "the wide path and at least one cluster shape";
  for (const auto& r : results) EXPECT_EQ(r, results.front());
}

TEST_P(StreamStepTest, TwoWideTicksMatchTheCpuStepPath) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // The wide path alone, small enough for compute-sanitizer's racecheck (about a second an event there): a tick of 9
  // events (a second tile with one event, seven lanes past the tick's end) over a seeded slot, then 3 of them again.
  StreamStepParity parity(GetParam(), 12, 4);
  ASSERT_TRUE(parity.streamer().Supports(kStreamWideShape));
  parity.Seed(5, 3, 9);
  parity.Tick({5, 0, 11, 3, 7, 1, 10, 2, 8}, 41, kStreamWideShape);
  parity.Tick({8, 5, 0}, 42, kStreamWideShape);
  parity.ExpectLogsMatch();
}

// Heads whose Δt argument passes 20, where softplus is the argument itself (log1pf(expf(100)) overflows): the tick
// kernels' convictions stay those of the CPU step path, on the cluster kernels and the wide path.
TEST_P(StreamStepTest, SoftplusPastTwentyIsItsArgument) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity parity(GetParam(), 12, 8, /*large_dt_bias=*/true);
  parity.Seed(5, 3, 9);
  parity.Tick({5, 0, 11}, 41);
  parity.Tick({5}, 42);
  if (parity.streamer().Supports(kStreamWideShape)) parity.Tick({8, 5, 0, 1, 2, 3, 4, 6, 7}, 43, kStreamWideShape);
  parity.ExpectLogsMatch();
}

TEST_P(StreamStepTest, TheWidePathGivesTheClusterKernelsBits) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // Staged ticks of 9 to 40 events (tiles with events past the tick's end) over warm states, seeded and random, on
  // the wide path and on single-block clusters of 8-event groups: every log entry and probability bit-identical.
  StreamStepParity cluster(GetParam(), 40, 64), wide(GetParam(), 40, 64);
  const StreamLaunchShape cluster_shape{8, 1};
  ASSERT_TRUE(cluster.streamer().Supports(cluster_shape));
  ASSERT_TRUE(wide.streamer().Supports(kStreamWideShape));
  for (StreamStepParity* parity : {&cluster, &wide}) {
    parity->Seed(7, 23, 5);
    parity->Seed(12, 2, 6);
  }
  Rng rng(3);
  uint64_t seed = 500;
  for (int round = 0; round < 10; ++round) {
    std::vector<int32_t> slots;
    for (int s = 0; s < 40; ++s) {
      if (rng.Uniform() < 0.25 + 0.07 * round) slots.push_back(s);
    }
    Shuffle(slots, rng);
    if (slots.size() < 9) slots = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11};
    ++seed;
    cluster.Tick(slots, seed, cluster_shape);
    wide.Tick(slots, seed, kStreamWideShape);
  }
  EXPECT_EQ(cluster.Logs(), wide.Logs());
  cluster.ExpectLogsMatch();
  wide.ExpectLogsMatch();
}

TEST_P(StreamStepTest, WideTicksInGraphsMatchTheCpuStepPath) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // Ticks of up to 444 events past the smallest power of two that takes the wide path on this device (`small`: 256;
  // `tiny`, whose cluster kernel holds its weights: past one wave of its groups) take the wide path (graphs; padded
  // to power-of-two buckets, the last one to the slot count, under the mask), between single-instrument ticks on the
  // cluster kernel, over seeded and random states.
  int wide_from = kStreamWideFrom;
  {
    StreamStepParity probe(GetParam(), 1, 1);
    while (wide_from <= (1 << 16) && !probe.streamer().ShapeFor(wide_from).wide) wide_from *= 2;
  }
  ASSERT_LE(wide_from, 1 << 16) << "no tick takes the wide path";
  const int slots_total = wide_from + 444;
  StreamStepParity parity(GetParam(), slots_total, 16);
  ASSERT_TRUE(parity.streamer().ShapeFor(wide_from + 1).wide);
  parity.Seed(20, 30, 5);
  parity.Seed(99, 3, 6);
  Rng rng(4);
  uint64_t seed = 900;
  for (int round = 0; round < 5; ++round) {
    std::vector<int32_t> slots = ShuffledSlots(slots_total, rng);
    slots.resize(wide_from + 1 + rng.Below(slots_total - wide_from));
    parity.Tick(slots, ++seed);
    parity.Tick({20}, ++seed);
  }
  parity.ExpectLogsMatch();
}

TEST_P(StreamStepTest, TicksOfMoreTilesThanMultiprocessorsGiveTheClusterKernelsBits) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // Ticks of 1,100 to 1,200 events (more tiles of 8 than the H200's 132 multiprocessors: the per-tile kernels at two
  // blocks an SM; for small, more SSM blocks than one wave, which hold their z/x weights in registers) on the wide
  // path through graphs, and on single-block clusters of 8-event groups: the same bits, and the CPU's results.
  constexpr int kSlots = 1200;
  StreamStepParity cluster(GetParam(), kSlots, 4), wide(GetParam(), kSlots, 4);
  ASSERT_TRUE(wide.streamer().ShapeFor(kSlots).wide);
  Rng rng(11);
  for (int tick = 0; tick < 3; ++tick) {
    std::vector<int32_t> slots = ShuffledSlots(kSlots, rng);
    slots.resize(1100 + rng.Below(101));
    cluster.Tick(slots, 40 + tick, StreamLaunchShape{8, 1});
    wide.Tick(slots, 40 + tick);
  }
  EXPECT_EQ(cluster.Logs(), wide.Logs());
  cluster.ExpectLogsMatch();
  wide.ExpectLogsMatch();
}

// The output layer of `params` remade so that horizon 1's logit is exactly −(horizon 0's) (its row and bias negated:
// the same products in the same order) and the other horizons' are 0: every event ties horizons 0 and 1.
std::vector<float> HeadOfTies(const ParamLayout& layout, std::vector<float> params) {
  const TensorSpec& w = layout.tensor(layout.head_out.weight);
  const TensorSpec& b = layout.tensor(layout.head_out.bias);
  const size_t G = w.shape[1];
  for (size_t h = 1; h < static_cast<size_t>(w.shape[0]); ++h) {
    for (size_t g = 0; g < G; ++g) params[w.offset + h * G + g] = h == 1 ? -params[w.offset + g] : 0.f;
    params[b.offset + h] = h == 1 ? -params[b.offset] : 0.f;
  }
  return params;
}
// … so that horizons 0 and 1 take the random row 0 with biases −30 and +40 and the others are 0: both logits past
// float32's ~17 (where σ rounds to 0 or 1) with opposite signs, horizon 1's the stronger (the row's own output stays
// far below 5). (Offsets, not scaled rows: a scaled row would scale its rounding too, past MODEL.md §8's bar.)
std::vector<float> HeadOfSaturatedLogits(const ParamLayout& layout, std::vector<float> params) {
  const TensorSpec& w = layout.tensor(layout.head_out.weight);
  const TensorSpec& b = layout.tensor(layout.head_out.bias);
  const size_t G = w.shape[1];
  for (size_t h = 1; h < static_cast<size_t>(w.shape[0]); ++h) {
    for (size_t g = 0; g < G; ++g) params[w.offset + h * G + g] = h == 1 ? params[w.offset + g] : 0.f;
    params[b.offset + h] = 0.f;
  }
  params[b.offset] = -30.f;
  params[b.offset + 1] = 40.f;
  return params;
}

// MODEL.md §2.8 on every path that writes convictions (the cluster kernels, the wide path, small's lone events
// launched and through the resident step): the most confident horizon comes from the logits. Before, it came from
// float32 probabilities, which split exact ties by rounding (σ(−l) and σ(l) lie unequally far from ½) and tie every
// logit past ~17 at ½, so that the weaker horizon's sign could win.
TEST_P(StreamStepTest, ConvictionsTakeTheLowestOfTiedHorizonsAndTheStrongestSaturatedLogit) {
  SKIP_WITHOUT_CUDA_DEVICE();
  int wide_from = kStreamWideFrom;
  {
    StreamStepParity probe(GetParam(), 1, 1);
    while (wide_from <= (1 << 16) && !probe.streamer().ShapeFor(wide_from).wide) wide_from *= 2;
  }
  ASSERT_LE(wide_from, 1 << 16) << "no tick takes the wide path";
  for (const bool ties : {true, false}) {
    SCOPED_TRACE(ties ? "tied horizons 0 and 1" : "saturated horizons 0 and 1");
    for (const bool resident : {true, false}) {
      StreamStepParity parity(GetParam(), wide_from + 1, 8);
      parity.streamer().set_use_resident(resident);
      const ParamLayout layout(parity.config());
      std::vector<float> params = ties ? HeadOfTies(layout, parity.params())
                                       : HeadOfSaturatedLogits(layout, parity.params());
      ASSERT_TRUE(parity.streamer().PublishFromHost(params).ok());
      parity.UseParams(std::move(params));
      std::vector<int32_t> every_slot(wide_from + 1);
      std::iota(every_slot.begin(), every_slot.end(), 0);
      for (int i = 0; i < 4; ++i) parity.Tick({i}, 300 + i);  // lone events
      parity.Tick({4, 5, 6, 7, 8, 9, 10}, 310);                // a cluster kernel's tick
      parity.Tick(every_slot, 311);                            // the wide path
      ASSERT_TRUE(parity.streamer().ShapeFor(wide_from + 1).wide);
      parity.ExpectConvictionsOfHorizon(ties ? 0 : 1);
      parity.ExpectLogsMatch();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, StreamStepTest, ::testing::Values("tiny", "small", "small-L1", "small-L5", "small-L10"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// The estimate behind the shapes CudaStreamer times (no device needed): a tick takes one group's time for every wave
// of clusters its groups need; shapes with clusters come fastest first, ties in the order they are listed.
TEST(StreamStepManyTest, ClusterShapesComeInOrderOfGroupTimeTimesWaves) {
  PerClusterShape<kernels::StreamShapeFit> fits{};
  PerClusterShape<float> group_us{};
  auto set = [&](int group_index, int cluster_index, int max_clusters, float us) {
    fits[group_index][cluster_index].max_clusters = max_clusters;
    group_us[group_index][cluster_index] = us;
  };
  set(0, 3, 16, 13.f);  // single events in clusters of 8: 16 clusters at once
  set(1, 2, 32, 35.f);  // groups of 2 in clusters of 4
  set(0, 1, 66, 41.f);  // single events in clusters of 2
  set(2, 0, 0, 1.f);    // no clusters: never taken, however fast
  const StreamLaunchShape eights{1, 8}, twos_in_fours{2, 4}, twos{1, 2};
  using Shapes = std::vector<StreamLaunchShape>;
  EXPECT_EQ(ClusterShapesByEstimate(1, fits, group_us), (Shapes{eights, twos_in_fours, twos}));
  EXPECT_EQ(ClusterShapesByEstimate(16, fits, group_us).front(), eights);          // one wave: 13
  EXPECT_EQ(ClusterShapesByEstimate(32, fits, group_us).front(), eights);          // two waves, 26, against 35, 41
  EXPECT_EQ(ClusterShapesByEstimate(48, fits, group_us).front(), twos_in_fours);   // three waves, 39, against 35
  EXPECT_EQ(ClusterShapesByEstimate(100, fits, group_us), (Shapes{twos_in_fours, twos, eights}));  // 70, 82, 91
  set(0, 1, 66, 35.f);
  EXPECT_EQ(ClusterShapesByEstimate(100, fits, group_us), (Shapes{twos, twos_in_fours, eights}));  // 70 = 70: listed first
  EXPECT_TRUE(ClusterShapesByEstimate(100, PerClusterShape<kernels::StreamShapeFit>{}, group_us).empty());
}

// Every tick size up to the slot count gets a shape this device can launch, for every named config; `large`, whose
// groups of 8 events do not fit a block, runs ticks of 1, 64 and 1,024 instruments like the CPU step path.
TEST(StreamStepManyTest, EveryTickSizeGetsALaunchableShape) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const std::string name : {"tiny", "small", "large"}) {
    const ParamLayout layout(*NamedConfig(name));
    auto streamer = CudaStreamer::Create(layout, 1024, 2);
    ASSERT_TRUE(streamer.ok()) << name << ": " << streamer.status();
    for (int n = 1; n <= 1024; ++n) {
      const StreamLaunchShape shape = (*streamer)->ShapeFor(n);
      ASSERT_TRUE((*streamer)->Supports(shape))
          << name << ", " << n << " events: shape (" << shape.events_per_group << ", " << shape.cluster_size << ")";
    }
  }
  StreamStepParity parity("large", 1024, 4);
  ASSERT_TRUE(parity.streamer().ShapeFor(1024).wide) << "large's 1,024-event tick checks its long-row wide kernels";
  std::vector<int32_t> slots(1024);
  for (int s = 0; s < 1024; ++s) slots[s] = (s * 389) % 1024;  // every slot once, shuffled
  parity.Tick({5}, 1);
  parity.Tick(std::vector<int32_t>(slots.begin(), slots.begin() + 64), 2);
  parity.Tick(slots, 3);
  parity.ExpectLogsMatch();
}

TEST(StreamStepManyTest, AThousandInstrumentsInterleavedWithoutCrossTalkOrAllocation) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity parity("tiny", 1000, 160);
  Rng rng(9);
  uint64_t seed = 0;
  int64_t events = 0;
  const int64_t allocations_before = CudaAllocationCount();
  for (int tick = 0; tick < 150; ++tick) {
    std::vector<int32_t> slots;
    for (int s = 0; s < 1000; ++s) {
      if (rng.Uniform() < 0.7) slots.push_back(s);
    }
    Shuffle(slots, rng);
    events += static_cast<int64_t>(slots.size());
    parity.Tick(slots, ++seed);
  }
  EXPECT_EQ(CudaAllocationCount(), allocations_before) << "ticks must not allocate";
  EXPECT_GT(events, 100000);
  parity.ExpectLogsMatch();
}

// The resident step launched on a stream of its own: lone events for a few slots, most of them back to back for one slot and
// through a ring of 8 entries (reused while the kernel runs), give the launched kernel's bits, log entry for log
// entry, and the CPU's results.
TEST(StreamResidentTest, EventsGiveTheLaunchedTicksBits) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity launched("small", 6, 64), resident("small", 6, 64);
  if (!kernels::StreamResidentFits(resident.streamer().weights(), resident.streamer().max_shared_bytes())) {
    GTEST_SKIP() << "no resident step for small on this device";
  }
  launched.streamer().set_use_resident(false);
  launched.Seed(2, 9, 5);
  resident.Seed(2, 9, 5);
  resident.StartResident(8);
  Rng rng(5);
  for (int i = 0; i < 60; ++i) {
    const int32_t slot = i % 7 < 4 ? 2 : static_cast<int32_t>(rng.Below(6));
    launched.Tick({slot}, 300 + i);
    resident.ResidentTick(slot, 300 + i);
  }
  resident.StopResident();
  EXPECT_EQ(launched.Logs(), resident.Logs());
  launched.ExpectLogsMatch();
  resident.ExpectLogsMatch();
}

// The same for `small` with the features of every LOBSTER book level count from 1 to 10 (4·levels + 8: 12 … 48),
// whose one-event plans are compiled in too: the streamer takes the resident step for their lone events (48 features
// fill its ring entry to the last word), and their launched ticks the compiled plans' kernels. On a device with an
// H100's or H200's shared memory these models must have the resident step: without it a model's lone events quietly
// take the launched tick (as the shipped data's did before their plans were compiled in).
TEST(StreamResidentTest, LobsterLevelsEventsGiveTheLaunchedTicksBits) {
  SKIP_WITHOUT_CUDA_DEVICE();
  constexpr size_t kHopperSharedBytes = 227 * 1024;  // a block's opt-in shared memory on sm_90
  for (int levels = 1; levels <= 10; ++levels) {
    const std::string name = "small-L" + std::to_string(levels);
    SCOPED_TRACE(name);
    StreamStepParity launched(name, 4, 64), resident(name, 4, 64);
    if (resident.streamer().max_shared_bytes() < kHopperSharedBytes) {
      GTEST_SKIP() << "a block's shared memory is " << resident.streamer().max_shared_bytes()
                   << " bytes on this device, less than the resident step's plans are laid out for";
    }
    ASSERT_TRUE(resident.streamer().resident_available()) << "no resident step for " << name;
    launched.streamer().set_use_resident(false);
    launched.Seed(1, 9, 5);
    resident.Seed(1, 9, 5);
    Rng rng(6);
    for (int i = 0; i < 50; ++i) {
      const int32_t slot = i % 5 < 3 ? 1 : static_cast<int32_t>(rng.Below(4));
      launched.Tick({slot}, 500 + i);
      resident.Tick({slot}, 500 + i);
      if (i == 20) {
        EXPECT_TRUE(resident.streamer().resident_running());
      }
    }
    EXPECT_EQ(launched.Logs(), resident.Logs());
    launched.ExpectLogsMatch();
    resident.ExpectLogsMatch();
  }
}

// Takes the resident step's stamps into `stamps`: `count` of them, from event `first` to event `last`.
void TakeStamps(CudaStreamer& streamer, std::vector<kernels::StreamResidentStamp>& stamps, size_t count,
                uint64_t first, uint64_t last) {
  absl::StatusOr<std::vector<kernels::StreamResidentStamp>> taken = streamer.TakeResidentStamps();
  ASSERT_TRUE(taken.ok()) << taken.status();
  stamps = *std::move(taken);
  ASSERT_EQ(stamps.size(), count);
  EXPECT_EQ(stamps.front().event, first);
  EXPECT_EQ(stamps.back().event, last);
}

// The resident step's stamps on the device's clocks (bench_stream's device time an event): one for every answered
// event, in the ring's order, the last ring-full of them where more were posted, and the stamping leaves the bits
// alone.
TEST(StreamResidentTest, StampsEveryAnsweredEventOnTheDevicesClocks) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity resident("small", 4, 256);
  if (!resident.streamer().resident_available()) GTEST_SKIP() << "no resident step for small on this device";
  CudaStreamer& streamer = resident.streamer();
  EXPECT_EQ(streamer.SizeResidentStamps(48).code(), absl::StatusCode::kInvalidArgument);
  streamer.set_time_ticks(0);
  EXPECT_EQ(streamer.TakeResidentStamps().status().code(), absl::StatusCode::kFailedPrecondition);
  streamer.set_time_ticks(CudaStreamer::kTimedTickEvery);
  ASSERT_TRUE(streamer.SizeResidentStamps(64).ok());
  for (int i = 0; i < 40; ++i) resident.Tick({i % 4}, 700 + i);
  ASSERT_TRUE(streamer.resident_running());
  std::vector<kernels::StreamResidentStamp> stamps;
  ASSERT_NO_FATAL_FAILURE(TakeStamps(streamer, stamps, 40, 0, 39));
  absl::StatusOr<ResidentDeviceTimes> times = SummarizeResidentStamps(stamps, 4);
  ASSERT_TRUE(times.ok()) << times.status();
  EXPECT_EQ(times->events, 36);
  EXPECT_GT(times->busy_median_us, 0.5);
  EXPECT_LT(times->busy_median_us, 1000.0);
  EXPECT_NEAR(times->busy_timer_median_us, times->busy_median_us, 0.25 * times->busy_median_us + 1.0)
      << "the cycle counter at " << times->cycles_per_ns << " GHz against the global timer";
  // 10 more events (the stop after the first 40 took number 40): only they, not what the ring held before.
  for (int i = 0; i < 10; ++i) resident.Tick({i % 4}, 800 + i);
  ASSERT_NO_FATAL_FAILURE(TakeStamps(streamer, stamps, 10, 41, 50));
  // 100 more (51 was the stop), then a stop (152) and 30 (153–182): the ring of 64 keeps the last 64 posted, which
  // leaves out the stops' slots, including the leftover of event 88 that no later event overwrote.
  for (int i = 0; i < 100; ++i) resident.Tick({i % 4}, 900 + i);
  ASSERT_TRUE(streamer.StopResident().ok());
  for (int i = 0; i < 30; ++i) resident.Tick({i % 4}, 1000 + i);
  ASSERT_NO_FATAL_FAILURE(TakeStamps(streamer, stamps, 62, 120, 182));
  EXPECT_TRUE(SummarizeResidentStamps(std::vector(stamps.end() - 30, stamps.end()), 0).ok());
  streamer.set_time_ticks(0);
  EXPECT_EQ(streamer.TakeResidentStamps().status().code(), absl::StatusCode::kFailedPrecondition);
  resident.ExpectLogsMatch();
}

// Which stamps of a stopped resident run the host reads (no device needed): those the ring holds and no event posted
// can be rewriting, at most the ring's size back from the events posted, numbered modulo 2³² (here across the wrap).
TEST(StreamResidentTest, AStoppedRunsStampsAreReadWhileTheRingHoldsThem) {
  using Range = std::pair<uint32_t, uint32_t>;
  constexpr uint32_t kSlots = 64;
  for (const uint32_t base : {0u, 1000u, 0xffffffffu - 10, 0xffffffffu - 70}) {
    SCOPED_TRACE(base);
    // A run of 10 events [base, base + 10), its stop base + 10.
    EXPECT_EQ(ResidentStampsToRead(base, base + 10, base + 11, kSlots), Range(base, base + 10));
    // 53 more posted: event base is 64 back, still held; one more and its slot may be event base + 64's.
    EXPECT_EQ(ResidentStampsToRead(base, base + 10, base + 64, kSlots), Range(base, base + 10));
    EXPECT_EQ(ResidentStampsToRead(base, base + 10, base + 65, kSlots), Range(base + 1, base + 10));
    EXPECT_EQ(ResidentStampsToRead(base, base + 10, base + 73, kSlots), Range(base + 9, base + 10));
    const Range none = ResidentStampsToRead(base, base + 10, base + 74, kSlots);
    EXPECT_EQ(none.first, none.second) << "every slot may hold a later event";
    // A run longer than the ring: its last 63 events (the stop takes the 64th slot back).
    EXPECT_EQ(ResidentStampsToRead(base, base + 100, base + 101, kSlots), Range(base + 37, base + 100));
  }
}

// The summary of stamps (no device needed): 8 µs an event and 10 between answers at 2 GHz, converted by the rate over
// the run; stamps that skip an event, lack the timer or whose clocks disagree are refused.
TEST(StreamResidentTest, StampsSummarizeToTheDeviceTimeAnEvent) {
  std::vector<kernels::StreamResidentStamp> stamps;
  for (uint64_t k = 0; k < 50; ++k) {
    const uint64_t seen_ns = 1'000'000 + 10'000 * k + (k % 3);  // (events not evenly spaced)
    stamps.push_back({k + 7, 2 * seen_ns, seen_ns, 2 * seen_ns + 16'000, seen_ns + 8'000});
  }
  stamps[3].done_cycles += 100'000;  // a slow event among the skipped ones
  absl::StatusOr<ResidentDeviceTimes> times = SummarizeResidentStamps(stamps, 5);
  ASSERT_TRUE(times.ok()) << times.status();
  EXPECT_EQ(times->events, 45);
  EXPECT_NEAR(times->cycles_per_ns, 2.0, 1e-9);
  EXPECT_NEAR(times->busy_median_us, 8.0, 1e-9);
  EXPECT_NEAR(times->busy_p99_us, 8.0, 1e-9);
  EXPECT_NEAR(times->busy_timer_median_us, 8.0, 1e-9);
  EXPECT_NEAR(times->period_median_us, 10.0, 0.002);
  std::vector<kernels::StreamResidentStamp> gap = stamps;
  gap.erase(gap.begin() + 20);
  EXPECT_EQ(SummarizeResidentStamps(gap, 5).status().code(), absl::StatusCode::kFailedPrecondition);
  std::vector<kernels::StreamResidentStamp> answered_before_seen = stamps;
  answered_before_seen[5].done_cycles = answered_before_seen[5].seen_cycles - 1;
  EXPECT_EQ(SummarizeResidentStamps(answered_before_seen, 5).status().code(), absl::StatusCode::kFailedPrecondition);
  std::vector<kernels::StreamResidentStamp> two_clocks = stamps;
  for (auto& s : two_clocks) {  // a timer ten times the clock's rate
    s.seen_ns *= 10;
    s.done_ns *= 10;
  }
  EXPECT_EQ(SummarizeResidentStamps(two_clocks, 5).status().code(), absl::StatusCode::kFailedPrecondition);
  std::vector<kernels::StreamResidentStamp> untimed = stamps;
  untimed[30].seen_ns = untimed[30].done_ns = 0;
  EXPECT_EQ(SummarizeResidentStamps(untimed, 5).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SummarizeResidentStamps(stamps, 49).status().code(), absl::StatusCode::kFailedPrecondition)
      << "one event gives no rate";
  EXPECT_TRUE(SummarizeResidentStamps(stamps, 48).ok()) << "two do";
}

// A resident step that no event reaches leaves by itself (here after 50 ms), its first copies landed.
TEST(StreamResidentTest, LeavesWhenIdle) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity resident("small", 1, 4);
  if (!kernels::StreamResidentFits(resident.streamer().weights(), resident.streamer().max_shared_bytes())) {
    GTEST_SKIP() << "no resident step for small on this device";
  }
  resident.StartResident(4, 50'000'000);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(cudaStreamSynchronize(resident.resident_stream()), cudaSuccess);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(resident.Answered(), 0u);
  resident.StopResident();
}

// The streamer's own resident path (lone events posted to the resident step, anything else stopping it first) against
// the same requests with it switched off: the same bits, log entry for log entry, and the CPU's results, over more
// lone events back to back than its ring holds (360 through 64 entries), with a larger tick, a seed, a reset, a
// publish, reads and waits between them. The two streamers run one after the other, each stopped before the other
// waits on the device: under compute-sanitizer, which runs one kernel at a time, a running resident step would hold
// back the other's work.
TEST(StreamResidentTest, TheStreamersLoneEventsGiveTheLaunchedTicksBits) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity launched("small", 8, 2048), resident("small", 8, 2048);
  if (!resident.streamer().resident_available()) GTEST_SKIP() << "no resident step for small on this device";
  launched.streamer().set_use_resident(false);
  const int H = resident.config().n_horizons;
  auto run = [&](StreamStepParity& p, std::vector<float>& probs) {
    const bool resident_path = &p == &resident;
    Rng rng(11);
    for (int round = 0; round < 6; ++round) {
      for (int i = 0; i < 60; ++i) {
        const int32_t slot = i % 5 < 3 ? round : static_cast<int32_t>(rng.Below(8));
        p.Tick({slot}, 1000 * round + i);
      }
      ASSERT_EQ(p.streamer().resident_running(), resident_path) << "round " << round;
      switch (round) {
        case 0:
          p.Tick({1, 4, 6}, 77);
          break;
        case 1:
          p.Seed(3, 9, 88);  // (a reset, then unlogged lone events)
          break;
        case 2:
          ASSERT_TRUE(p.streamer().PublishFromHost(p.params()).ok());
          break;
        case 3:
          ASSERT_TRUE(p.streamer().ReadSlotProbabilities(3, probs).ok());
          break;
        case 4:  // waiting for the answers keeps the resident step running
          ASSERT_TRUE(p.streamer().Synchronize().ok());
          break;
        default:
          break;
      }
      EXPECT_EQ(p.streamer().resident_running(), resident_path && round >= 4) << "round " << round;
    }
  };
  std::vector<float> launched_probs(H), resident_probs(H);
  run(launched, launched_probs);
  const std::vector<float> launched_logs = launched.Logs();
  launched.ExpectLogsMatch();
  run(resident, resident_probs);
  EXPECT_EQ(launched_logs, resident.Logs());
  EXPECT_EQ(launched_probs, resident_probs);
  resident.ExpectLogsMatch();
}

// A launch of the resident step carries a bounded count of events (its kernel counts them in an int): past the bound
// the host stops it and the next lone event launches another, which carries the states on. Here the bound is 16 and
// the events are numbered from just before the wrap of their 32-bit count: 400 lone events give the launched ticks'
// bits and the CPU's results, each event's device time is reported once, and a larger tick and a seed between them
// keep their order. (The two streamers run one after the other, as above.)
TEST(StreamResidentTest, LaunchesAgainPastItsBoundAndNumbersEventsAcrossTheWrap) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity launched("small", 6, 512), resident("small", 6, 512);
  if (!resident.streamer().resident_available()) GTEST_SKIP() << "no resident step for small on this device";
  launched.streamer().set_use_resident(false);
  CudaStreamer& streamer = resident.streamer();
  streamer.set_resident_launch_events(16);
  ASSERT_TRUE(streamer.NumberResidentEventsFromForTest(0xffffffffu - 150).ok());
  size_t timed = 0;
  // Without a wait, so that the answered events are found by their numbers (modulo 2³²), after the answers are in:
  // every tick is then found finished.
  auto take_times = [&] {
    ASSERT_TRUE(streamer.Synchronize().ok());
    absl::StatusOr<TicksChecked> checked = streamer.CheckTicks(/*wait=*/false);
    ASSERT_TRUE(checked.ok()) << checked.status();
    EXPECT_EQ(checked->unfinished, 0);
    for (const double seconds : checked->resident_seconds) {
      EXPECT_GT(seconds, 1e-6);
      EXPECT_LT(seconds, 0.1) << "an event's time, not a span of many";
    }
    timed += checked->resident_seconds.size();
  };
  auto run = [&](StreamStepParity& p) {
    const bool resident_path = &p == &resident;
    Rng rng(29);
    for (int i = 0; i < 400; ++i) {
      p.Tick({static_cast<int32_t>(rng.Below(6))}, 3000 + i);
      ASSERT_EQ(p.streamer().resident_running(), resident_path) << "event " << i;
      if (resident_path && i % 50 == 49) {
        ASSERT_NO_FATAL_FAILURE(take_times());
      }
      if (i == 150) p.Tick({0, 2, 5}, 4000);
      if (i == 250) p.Seed(4, 7, 4100);
    }
    ASSERT_TRUE(p.streamer().StopResident().ok());
  };
  ASSERT_NO_FATAL_FAILURE(run(launched));
  const uint64_t launches_before = streamer.resident_launches();
  ASSERT_NO_FATAL_FAILURE(run(resident));
  // 400 events at 16 a launch, and one launch more after each of the larger tick and the seed.
  EXPECT_EQ(streamer.resident_launches() - launches_before, 25u + 2u);
  ASSERT_NO_FATAL_FAILURE(take_times());
  EXPECT_EQ(timed, 400u) << "each lone event's device time once, across the relaunches and the wrap";
  absl::StatusOr<std::vector<kernels::StreamResidentStamp>> stamps = streamer.TakeResidentStamps();
  ASSERT_TRUE(stamps.ok()) << stamps.status();
  const auto stamped = [&](uint64_t from, uint64_t to) {
    return std::ranges::any_of(*stamps, [&](const kernels::StreamResidentStamp& s) {
      return s.done_cycles != 0 && s.event >= from && s.event < to;
    });
  };
  EXPECT_TRUE(stamped(0xffffff00u, 0x100000000u) && stamped(0, 0x100)) << "events numbered on both sides of the wrap";
  EXPECT_EQ(launched.Logs(), resident.Logs());
  launched.ExpectLogsMatch();
  resident.ExpectLogsMatch();
}

// YieldTo stops a running resident step and orders the other stream behind its exit; the next lone event starts a
// new one, which carries the states on; Quiesce stops it and returns once it has left.
TEST(StreamResidentTest, YieldToAndQuiesceStopTheResidentStepAndTheNextLoneEventStartsAnother) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity resident("small", 2, 64);
  if (!resident.streamer().resident_available()) GTEST_SKIP() << "no resident step for small on this device";
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  resident.Tick({0}, 1);
  ASSERT_TRUE(resident.streamer().resident_running());
  ASSERT_TRUE(resident.streamer().YieldTo(other).ok());
  EXPECT_FALSE(resident.streamer().resident_running());
  EXPECT_EQ(cudaStreamSynchronize(other), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(resident.streamer().stream()), cudaSuccess) << "the other stream ran before the exit";
  resident.Tick({0}, 2);
  resident.Tick({1}, 3);
  EXPECT_TRUE(resident.streamer().resident_running());
  ASSERT_TRUE(resident.streamer().YieldTo(other).ok());
  ASSERT_TRUE(resident.streamer().YieldTo(other).ok());  // nothing running: nothing to wait for
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
  resident.Tick({1}, 4);
  ASSERT_TRUE(resident.streamer().Quiesce().ok());  // stopped, and left by the time it returns
  EXPECT_FALSE(resident.streamer().resident_running());
  EXPECT_EQ(cudaStreamQuery(resident.streamer().stream()), cudaSuccess);
  resident.ExpectLogsMatch();
}

// StopResident (the daemon's release of a quiet feed's resident step) returns at once; the cluster answers what was
// posted before the stop and leaves by itself; the next lone event starts another, which carries the states on.
TEST(StreamResidentTest, AStoppedResidentStepLeavesWithoutAWaitAndTheNextLoneEventStartsAnother) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity launched("small", 3, 64), resident("small", 3, 64);
  if (!resident.streamer().resident_available()) GTEST_SKIP() << "no resident step for small on this device";
  launched.streamer().set_use_resident(false);
  uint64_t seed = 40;
  auto lone_events = [&](int count) {
    for (int i = 0; i < count; ++i, ++seed) {
      const int32_t slot = static_cast<int32_t>(seed % 3);
      launched.Tick({slot}, seed);
      resident.Tick({slot}, seed);
    }
  };
  for (int pause = 0; pause < 3; ++pause) {
    lone_events(7);
    ASSERT_TRUE(resident.streamer().resident_running());
    ASSERT_TRUE(resident.streamer().StopResident().ok());
    EXPECT_FALSE(resident.streamer().resident_running());
    ASSERT_TRUE(resident.streamer().StopResident().ok());  // nothing running: nothing to stop
    // It leaves once it has answered the events before the stop: milliseconds, seconds under a sanitizer (an
    // event takes ~0.7 s under racecheck); a cluster that never left would hold the stream for good.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    cudaError_t state = cudaErrorNotReady;
    while (state == cudaErrorNotReady && std::chrono::steady_clock::now() < give_up) {
      state = cudaStreamQuery(resident.streamer().stream());
      if (state == cudaErrorNotReady) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(state, cudaSuccess) << "the stopped cluster left";
  }
  lone_events(5);
  ASSERT_TRUE(resident.streamer().Synchronize().ok());
  EXPECT_EQ(launched.Logs(), resident.Logs());
  resident.ExpectLogsMatch();
}

// Through the CUDA backend, lone events between training steps, publishes, evaluations and idle releases (each of
// which stops the resident step first) log the same bits with the resident step as without it.
TEST(StreamResidentTest, TheBackendsLoneEventsBetweenTrainingStepsMatchLaunchedTicks) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  const ParamLayout layout(config);
  const testing::RandomBatch train = MakeRandomBatch(config, config.batch, config.window, 21);
  auto run = [&](bool resident) -> std::vector<float> {
    absl::StatusOr<std::unique_ptr<Backend>> made = MakeBackend("cuda", config, OptimizerConfig{}, RandomParams(layout, 5));
    EXPECT_TRUE(made.ok()) << made.status();
    if (!made.ok()) return {};
    Backend& backend = **made;
    backend.set_stream_resident(resident);
    EXPECT_TRUE(backend.ConfigureStreaming(2, 256).ok());
    const int F = config.n_features;
    int64_t logged = 0;
    for (int round = 0; round < 3; ++round) {
      const testing::RandomBatch events = MakeRandomBatch(config, 1, 40, 30 + round);
      for (int i = 0; i < 40; ++i) {
        if (i == 25) {  // as the daemon's worker after a pause
          const absl::StatusOr<bool> released = backend.ReleaseIdleDevice();
          EXPECT_TRUE(released.ok()) << released.status();
          EXPECT_EQ(released.value_or(!resident), resident) << "a running resident step was stopped";
        }
        const int32_t slot = 0;
        const int64_t index = logged++;
        EXPECT_TRUE(backend.ForwardStepInto({std::span<const float>(events.x).subspan(i * F, F),
                                             std::span<const float>(events.dt).subspan(i, 1), {&slot, 1}, {&index, 1}})
                        .ok());
      }
      EXPECT_TRUE(backend.TrainStep(train.view()).ok());
      EXPECT_TRUE(backend.PublishWeights().ok());
      EXPECT_TRUE(backend.Evaluate(train.view(), {}).ok());
    }
    std::vector<float> convictions(logged);
    EXPECT_TRUE(backend.ReadLog(0, 0, logged, convictions, {}).ok());
    return convictions;
  };
  const std::vector<float> launched = run(false), resident = run(true);
  ASSERT_EQ(launched.size(), 120u);
  EXPECT_EQ(launched, resident);
}

TEST(StreamStepManyTest, MalformedTicksAreRefused) {
  SKIP_WITHOUT_CUDA_DEVICE();
  StreamStepParity parity("tiny", 4, 8);
  const int F = parity.config().n_features;
  const std::vector<float> x(2 * F, 0.25f), dt = {0.1f, 0.2f};
  const std::vector<int32_t> twice = {1, 1}, outside = {0, 4}, fine = {0, 1};
  const std::vector<int64_t> indices = {0, 1}, bad = {0, -1};
  EXPECT_EQ(parity.streamer().Step({x, dt, twice, indices}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(parity.streamer().Step({x, dt, outside, indices}).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(parity.streamer().Step({x, dt, fine, bad}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(parity.streamer().Step({x, dt, fine, indices}).ok());
}


// The ticks' ring position of an entry number (a multiply by a reciprocal, no division) is n mod L: around every
// multiple of small rings, and for rings up to 2³² entries at numbers up to 2⁶³ − 1. Host arithmetic, no device.
TEST(StreamStepManyTest, TheLogPositionOfAnEntryNumberIsItsRemainder) {
  Rng rng(17);
  std::vector<int64_t> rings = {1, 2, 3, 7, 8, 64, 1000, 4882, 5'000'000, (int64_t{1} << 31) - 1, int64_t{1} << 32};
  for (int i = 0; i < 200; ++i) rings.push_back(1 + static_cast<int64_t>(rng.Below(1u << 30)));
  for (const int64_t L : rings) {
    const uint64_t r = kernels::StreamLogReciprocal(L);
    std::vector<int64_t> numbers = {0, 1, L - 1, L, L + 1, 2 * L - 1, 2 * L, INT64_MAX, INT64_MAX - 1, INT64_MAX - L};
    for (int k = 0; k < 100; ++k) {
      const auto n = static_cast<int64_t>(rng.NextU64() >> 1);
      numbers.push_back(n);
      numbers.push_back(n - n % L);
      numbers.push_back(n - n % L - 1);
    }
    for (const int64_t n : numbers) {
      if (n < 0) continue;
      ASSERT_EQ(kernels::StreamLogPosition(n, L, r), n % L) << "n " << n << " L " << L;
    }
  }
}

// CheckTicks learns which Step(tick) calls have finished without waiting for the device: graph-launched ticks by an
// event behind each, lone events by the resident step's answer count. A tick of 8,192 events (about 0.7 ms of the
// H200's time) is still running when Step returns; a later look never counts more, and none once all have finished.
TEST(StreamStepManyTest, CheckTicksCountsTheStepsStillRunningWithoutWaiting) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  const ParamLayout layout(config);
  const int F = config.n_features, kSlots = 8192, kTicks = 4, kLone = 100;
  const std::unique_ptr<CudaStreamer> made = PublishedStreamer(layout, kSlots, 8, 103);
  ASSERT_NE(made, nullptr);
  CudaStreamer& streamer = *made;
  const testing::RandomBatch events = MakeRandomBatch(config, 1, kSlots, 77);
  std::vector<int32_t> slots(kSlots);
  std::iota(slots.begin(), slots.end(), 0);
  auto unfinished = [&](bool wait) { return testing::UnfinishedTicks(streamer, wait); };
  ASSERT_EQ(unfinished(/*wait=*/true), 0);
  for (int t = 0; t < kTicks; ++t) {
    const std::vector<int64_t> entries(kSlots, t);
    ASSERT_TRUE(streamer.Step({events.x, events.dt, slots, entries}).ok()) << "tick " << t;
  }
  const int64_t wide = unfinished(/*wait=*/false);
  EXPECT_GE(wide, 1) << "the last tick was queued a moment ago";
  EXPECT_LE(wide, kTicks);
  testing::ExpectTicksFinishWithoutAWait(streamer, wide);
  if (streamer.resident_available()) {
    for (int t = 0; t < kLone; ++t) {
      const int32_t slot = t % 7;
      const int64_t entry = kTicks + t / 7;
      ASSERT_TRUE(streamer
                      .Step({std::span<const float>(events.x).subspan(slot * F, F),
                             std::span<const float>(events.dt).subspan(slot, 1), {&slot, 1}, {&entry, 1}})
                      .ok())
          << "lone event " << t;
    }
    ASSERT_TRUE(streamer.resident_running());
    const int64_t lone = unfinished(/*wait=*/false);
    EXPECT_LE(lone, kLone);
    testing::ExpectTicksFinishWithoutAWait(streamer, lone);
  }
  const std::vector<int64_t> entries(kSlots, kTicks + kLone);
  ASSERT_TRUE(streamer.Step({events.x, events.dt, slots, entries}).ok());
  EXPECT_EQ(unfinished(/*wait=*/true), 0);
}

// Timing every tick, each launched tick's device time (CUDA events just before its work and just after it) reaches
// CheckTicks once, in order, nested within events recorded around its Step call: graph-launched ticks inline (4 events)
// and staged (64 events on a cluster shape, 1,024 on the wide path) and an eager one; by default one tick in
// kTimedTickEvery; none with timing off; a caller that never asks keeps the first kTickTimesKept. Lone events the
// resident step takes have no launch: their stamps' times come while their run goes on (each answered event but the
// latest) and once it has stopped (the rest, up to the last kResidentStamps of a longer run), none where timing was
// off when the run started.
TEST(StreamStepManyTest, CheckTicksReportsEachLaunchedTicksDeviceTime) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  const ParamLayout layout(config);
  const int F = config.n_features, kSlots = 1024;
  const std::unique_ptr<CudaStreamer> made = PublishedStreamer(layout, kSlots, 8, 107);
  ASSERT_NE(made, nullptr);
  CudaStreamer& streamer = *made;
  const testing::RandomBatch events = MakeRandomBatch(config, 1, kSlots, 79);
  std::vector<int32_t> slots(kSlots);
  std::iota(slots.begin(), slots.end(), 0);
  int64_t entry = 0;
  std::vector<int64_t> entries;
  auto step = [&](int n) {
    entries.assign(n, entry++);
    return streamer.Step({std::span<const float>(events.x).subspan(0, static_cast<size_t>(n) * F),
                          std::span<const float>(events.dt).subspan(0, n),
                          std::span<const int32_t>(slots).subspan(0, n), entries});
  };
  auto check = [&] {
    absl::StatusOr<TicksChecked> checked = streamer.CheckTicks(/*wait_for_ticks=*/true);
    EXPECT_TRUE(checked.ok()) << checked.status();
    return checked.ok() ? *std::move(checked) : TicksChecked{};
  };
  auto device_seconds = [&] { return check().device_seconds; };
  streamer.set_use_resident(false);
  streamer.set_time_ticks(1);
  const std::vector<std::pair<int, bool>> ticks = {{4, true}, {64, true}, {1024, true}, {64, false}, {1024, true}};
  for (const auto& [n, graphs] : ticks) {  // (captures each bucket's graph: timed too)
    streamer.set_use_graphs(graphs);
    ASSERT_TRUE(step(n).ok());
  }
  EXPECT_EQ(device_seconds().size(), ticks.size());

  std::vector<cudaEvent_t> around(2 * ticks.size());
  for (cudaEvent_t& event : around) ASSERT_EQ(cudaEventCreate(&event), cudaSuccess);
  for (size_t i = 0; i < ticks.size(); ++i) {
    streamer.set_use_graphs(ticks[i].second);
    ASSERT_EQ(cudaEventRecord(around[2 * i], streamer.stream()), cudaSuccess);
    ASSERT_TRUE(step(ticks[i].first).ok());
    ASSERT_EQ(cudaEventRecord(around[2 * i + 1], streamer.stream()), cudaSuccess);
  }
  streamer.set_use_graphs(true);
  const std::vector<double> timed = device_seconds();
  ASSERT_EQ(timed.size(), ticks.size());
  for (size_t i = 0; i < ticks.size(); ++i) {
    float outer_ms = 0;
    ASSERT_EQ(cudaEventElapsedTime(&outer_ms, around[2 * i], around[2 * i + 1]), cudaSuccess);
    const double us = timed[i] * 1e6, outer_us = outer_ms * 1e3;
    const std::string what = absl::StrCat("tick ", i, " of ", ticks[i].first, " events: ", us, " µs inside ", outer_us);
    EXPECT_GT(us, 0) << what;
    EXPECT_LE(us, outer_us + 1.0) << what << " (the events' resolution is about 0.5 µs)";
    if (ticks[i].first == 1024) {
      EXPECT_GE(us, 0.8 * outer_us) << what << ": a long tick is most of the span around it";
    }
  }
  for (cudaEvent_t event : around) cudaEventDestroy(event);
  EXPECT_TRUE(device_seconds().empty()) << "each time is reported once";

  if (streamer.resident_available()) {
    streamer.set_use_resident(true);
    for (int t = 0; t < 20; ++t) ASSERT_TRUE(step(1).ok());
    ASSERT_TRUE(streamer.resident_running());
    TicksChecked running = check();
    EXPECT_TRUE(running.device_seconds.empty()) << "the resident step's lone events have no launch to time";
    EXPECT_EQ(running.resident_seconds.size(), 19u) << "a running step's answered events but the latest";
    ASSERT_TRUE(step(64).ok());  // (stops the resident step)
    TicksChecked stopped = check();
    EXPECT_EQ(stopped.device_seconds.size(), 1u);
    EXPECT_EQ(stopped.resident_seconds.size(), 1u) << "the run's latest, once it has left";
    stopped.resident_seconds.insert(stopped.resident_seconds.end(), running.resident_seconds.begin(),
                                    running.resident_seconds.end());
    for (const double seconds : stopped.resident_seconds) {
      EXPECT_GT(seconds, 1e-6);
      EXPECT_LT(seconds, 1e-3);
    }
    const int kLongRun = CudaStreamer::kResidentStamps + 100;
    for (int t = 0; t < kLongRun; ++t) ASSERT_TRUE(step(1).ok());
    ASSERT_TRUE(streamer.StopResident().ok());
    EXPECT_EQ(check().resident_seconds.size(), CudaStreamer::kResidentStamps - 1)
        << "the ring's last kResidentStamps events posted, the stop among them";
    for (int t = 0; t < 5; ++t) ASSERT_TRUE(step(1).ok());
    streamer.set_time_ticks(0);  // (the running step keeps its stamped kernel)
    for (int t = 0; t < 5; ++t) ASSERT_TRUE(step(1).ok());
    ASSERT_TRUE(streamer.StopResident().ok());
    EXPECT_EQ(check().resident_seconds.size(), 10u);
    for (int t = 0; t < 5; ++t) ASSERT_TRUE(step(1).ok());
    ASSERT_TRUE(streamer.StopResident().ok());
    EXPECT_TRUE(check().resident_seconds.empty()) << "the unstamped kernel";
    streamer.set_time_ticks(1);
    streamer.set_use_resident(false);
  }
  streamer.set_time_ticks(0);
  for (int t = 0; t < 3; ++t) ASSERT_TRUE(step(64).ok());
  EXPECT_TRUE(device_seconds().empty()) << "timing off";
  streamer.set_time_ticks(CudaStreamer::kTimedTickEvery);
  for (int t = 0; t < 2 * CudaStreamer::kTimedTickEvery + 1; ++t) ASSERT_TRUE(step(64).ok());
  EXPECT_EQ(device_seconds().size(), 3u) << "the first of every kTimedTickEvery";
  streamer.set_time_ticks(1);
  for (size_t t = 0; t < CudaStreamer::kTickTimesKept + 10; ++t) ASSERT_TRUE(step(4).ok()) << "tick " << t;
  EXPECT_EQ(device_seconds().size(), CudaStreamer::kTickTimesKept) << "a caller that never asks keeps the first ones";
}

// A busy feed of lone events (a resident run that never stops while it is read) reports the device time of each of its
// events once, while it runs: 3,000 events, CheckTicks without waiting every 100, then the stop. A run stopped and not
// yet read when the next one starts (the stream held behind a host function, so that it cannot leave) keeps the next
// one from being read while it runs; the two are read together after the next stop, each event once.
TEST(StreamStepManyTest, ABusyResidentRunReportsItsEventsTimesWhileItRuns) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  const ParamLayout layout(config);
  const int F = config.n_features, kSlots = 16;
  const std::unique_ptr<CudaStreamer> made = PublishedStreamer(layout, kSlots, 8, 211);
  ASSERT_NE(made, nullptr);
  CudaStreamer& streamer = *made;
  if (!streamer.resident_available()) GTEST_SKIP() << "no resident step fits this device";
  const testing::RandomBatch events = MakeRandomBatch(config, 1, kSlots, 83);
  int64_t entry = 0;
  auto step = [&](int slot) {
    const std::array<int32_t, 1> slots = {slot};
    const std::array<int64_t, 1> entries = {entry++};
    return streamer.Step({std::span<const float>(events.x).subspan(static_cast<size_t>(slot) * F, F),
                          std::span<const float>(events.dt).subspan(slot, 1), slots, entries});
  };
  size_t reported = 0;
  auto take = [&](bool wait) {
    absl::StatusOr<TicksChecked> checked = streamer.CheckTicks(wait);
    EXPECT_TRUE(checked.ok()) << checked.status();
    if (!checked.ok()) return size_t{0};
    for (const double seconds : checked->resident_seconds) {
      EXPECT_GT(seconds, 1e-6);
      EXPECT_LT(seconds, 0.1) << "an event's time, not a span of many (a stamp seen torn)";
    }
    reported += checked->resident_seconds.size();
    return checked->resident_seconds.size();
  };
  constexpr int kEvents = 3000, kEvery = 100;
  size_t while_running = 0;
  for (int t = 1; t <= kEvents; ++t) {
    ASSERT_TRUE(step(t % kSlots).ok());
    if (t % kEvery == 0) while_running += take(/*wait=*/false);
  }
  ASSERT_TRUE(streamer.resident_running()) << "one run took every event";
  EXPECT_GE(while_running, static_cast<size_t>(kEvents - 2 * kEvery))
      << "all but the events of the last reads' lag came in while the run went on";
  ASSERT_TRUE(streamer.StopResident().ok());
  take(/*wait=*/true);
  EXPECT_EQ(reported, static_cast<size_t>(kEvents)) << "each event once, none lost past the stamp ring's 1,024";

  reported = 0;
  std::atomic<bool> released = false;
  struct Release {  // (also where an assertion returns early: the stream must not stay held)
    std::atomic<bool>& flag;
    ~Release() { flag = true; }
  } release{released};
  const cudaHostFn_t hold = [](void* flag) {
    while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
  };
  ASSERT_EQ(cudaLaunchHostFunc(streamer.stream(), hold, &released), cudaSuccess);
  for (int t = 0; t < 7; ++t) ASSERT_TRUE(step(t).ok());
  ASSERT_TRUE(streamer.StopResident().ok());
  for (int t = 0; t < 5; ++t) ASSERT_TRUE(step(t).ok());
  ASSERT_TRUE(streamer.resident_running());
  EXPECT_EQ(take(/*wait=*/false), 0u) << "neither run has started";
  ASSERT_TRUE(streamer.StopResident().ok());
  released = true;
  take(/*wait=*/true);
  EXPECT_EQ(reported, 12u) << "two runs read together, each event once";
}

// Every way a tick runs (each cluster shape and the wide path launched eagerly; graph-launched ticks inline and staged;
// the resident step's lone events) flags the slot whose logits came out not finite, with its entry number, past the
// ring: an event of features 3e38 (infinite once standardized) amid finite ones. The mapped word alone tells the host
// (CheckTicks without waiting, polled); the slot's next event is its first since then; a reset clears it.
TEST(StreamStepManyTest, EveryPathFlagsTheSlotsWhoseLogitsAreNotFinite) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const ModelConfig config = *NamedConfig("small");
  const ParamLayout layout(config);
  const int F = config.n_features, kSlots = 300;
  const int64_t kLog = 8, first_entry = 20;
  const std::unique_ptr<CudaStreamer> made = PublishedStreamer(layout, kSlots, kLog, 101);
  ASSERT_NE(made, nullptr);
  CudaStreamer& streamer = *made;
  struct Path {
    std::string name;
    std::optional<StreamLaunchShape> shape;  // eager with this shape; none: Step's choice, graph-launched
    int slots, tick_events;
  };
  std::vector<Path> paths;
  for (int group : kStreamGroupSizes) {
    for (int cluster : kStreamClusterSizes) {
      const StreamLaunchShape shape{group, cluster};
      if (streamer.Supports(shape)) paths.push_back({absl::StrCat(group, "x", cluster), shape, 10, 10});
    }
  }
  EXPECT_FALSE(paths.empty()) << "no cluster shape supported: only the wide and graphed paths would be checked";
  paths.push_back({"wide", kStreamWideShape, 10, 10});
  paths.push_back({"wide, 38 tiles", kStreamWideShape, kSlots, kSlots});
  paths.push_back({"graphs, inline", std::nullopt, 6, 6});
  paths.push_back({"graphs, staged (wide)", std::nullopt, kSlots, kSlots});
  if (streamer.resident_available()) paths.push_back({"resident", std::nullopt, 3, 1});
  auto take = [&](bool wait) {
    absl::StatusOr<TicksChecked> checked = streamer.CheckTicks(wait);
    EXPECT_TRUE(checked.ok()) << checked.status();
    return checked.ok() ? checked->nonfinite : std::vector<NonFiniteOutput>{};
  };
  uint64_t seed = 900;
  for (const Path& path : paths) {
    SCOPED_TRACE(path.name);
    const int overflowing = path.slots / 2;
    for (int slot = 0; slot < path.slots; ++slot) ASSERT_TRUE(streamer.ResetSlot(slot).ok());
    ASSERT_TRUE(take(/*wait=*/true).empty());
    // Round r: one event for each of the path's slots, entry number first_entry + r, in ticks of tick_events.
    auto round = [&](int r, bool overflow) {
      const testing::RandomBatch events = MakeRandomBatch(config, 1, path.slots, ++seed);
      std::vector<float> x = events.x;
      if (overflow) std::fill_n(x.begin() + overflowing * F, F, 3e38f);
      for (int first = 0; first < path.slots; first += path.tick_events) {
        const int n = std::min(path.tick_events, path.slots - first);
        std::vector<int32_t> slots(n);
        std::iota(slots.begin(), slots.end(), first);
        const std::vector<int64_t> entries(n, first_entry + r);
        const StreamTick tick{std::span<const float>(x).subspan(first * F, n * F),
                              std::span<const float>(events.dt).subspan(first, n), slots, entries};
        const absl::Status stepped = path.shape ? streamer.Step(tick, *path.shape) : streamer.Step(tick);
        ASSERT_TRUE(stepped.ok()) << stepped;
      }
    };
    round(0, /*overflow=*/true);
    std::vector<NonFiniteOutput> found;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (found.empty() && std::chrono::steady_clock::now() < give_up) found = take(/*wait=*/false);
    EXPECT_EQ(found, (std::vector<NonFiniteOutput>{{overflowing, first_entry}}));
    round(1, /*overflow=*/false);
    EXPECT_EQ(take(/*wait=*/true), (std::vector<NonFiniteOutput>{{overflowing, first_entry + 1}}));
    EXPECT_TRUE(take(/*wait=*/true).empty()) << "reported once";
    ASSERT_TRUE(streamer.ResetSlot(overflowing).ok());
    round(2, /*overflow=*/false);
    EXPECT_TRUE(take(/*wait=*/true).empty()) << "finite again after the reset";
    for (const int slot : {0, overflowing}) {
      std::vector<float> conviction(1);
      ASSERT_TRUE(streamer.ReadLog(slot, (first_entry + 2) % kLog, 1, conviction, {}).ok());
      EXPECT_TRUE(std::isfinite(conviction[0])) << "slot " << slot;
    }
  }
}

TEST(StreamStepManyTest, TheStreamerIsReadyWhileTheLegacyStreamIsHeldBack) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // The streamer's buffers are zeroed when they are allocated and its stream is non-blocking, so the zeros must have
  // landed when Create returns, not whenever the legacy default stream (held back here by a host function, as
  // another process's work on the GPU can hold it) gets to them and wipes the published weights.
  const cudaHostFn_t hold = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, hold, nullptr), cudaSuccess);
  StreamStepParity parity("tiny", 10, 4);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  parity.Tick({3, 0, 9, 4}, 77);
  parity.Tick({3, 0, 9, 4}, 78);
  parity.ExpectLogsMatch();
}

// A staged tick read from the device is copied there on a stream of its own, beside the ticks queued before it, into
// one of two device buffers: the copy of a third tick must wait until the first has finished reading the buffer they
// share. Here the streamer's stream is held (a host function) while ticks of the given sizes, graph-launched and
// eager, are queued behind it, each read forced in turn, then left to the streamer's choice; every logged event is
// compared with the CPU step path.
void ExpectStagedReadsMatchTheCpu(const std::string& config, const std::vector<int>& tick_sizes) {
  using Read = CudaStreamer::StagedRead;
  const cudaHostFn_t hold = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };
  StreamStepParity parity(config, 300, 64);
  Rng rng(31);
  uint64_t seed = 500;
  for (std::optional<Read> read : {std::optional<Read>(Read::kDevice), std::optional<Read>(Read::kPinned),
                                   std::optional<Read>()}) {
    parity.streamer().force_staged_read(read);
    for (bool graphs : {true, false}) {
      parity.streamer().set_use_graphs(graphs);
      ASSERT_EQ(cudaLaunchHostFunc(parity.streamer().stream(), hold, nullptr), cudaSuccess);
      for (int n : tick_sizes) {
        std::vector<int32_t> slots = ShuffledSlots(300, rng);
        slots.resize(n);
        parity.Tick(slots, ++seed);
      }
    }
  }
  parity.ExpectLogsMatch();
}

TEST(StreamStepManyTest, StagedTicksReadInPlaceOrCopiedAheadGiveTheCpusResultsTiny) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectStagedReadsMatchTheCpu("tiny", {9, 16, 40, 100, 9, 33, 64});  // cluster kernels
}

TEST(StreamStepManyTest, StagedTicksReadInPlaceOrCopiedAheadGiveTheCpusResultsSmall) {
  SKIP_WITHOUT_CUDA_DEVICE();
  ExpectStagedReadsMatchTheCpu("small", {16, 300, 20, 257, 40});  // cluster kernels and the wide path
}

TEST(StreamStepManyTest, APublishBehindBusyTicksServesThePublishedStepsWeights) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // Publish copies the trainer's parameters on the streamer's stream, behind whatever ticks are queued there (a host
  // function holds it here); the trainer's next update, queued right after, must not land before that copy has read
  // them, or the streamer would serve the next step's weights (or a mix) as this step's.
  StreamStepParity parity("tiny", 10, 4);
  const DeviceArray<float> trainer_params(parity.params());
  cudaStream_t trainer = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&trainer, cudaStreamNonBlocking), cudaSuccess);
  const cudaHostFn_t hold = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };
  ASSERT_EQ(cudaLaunchHostFunc(parity.streamer().stream(), hold, nullptr), cudaSuccess);
  ASSERT_TRUE(parity.streamer().Publish(trainer_params.get(), trainer).ok());
  // The trainer's next step: here it zeroes every parameter.
  ASSERT_EQ(cudaMemsetAsync(trainer_params.get(), 0, parity.params().size() * sizeof(float), trainer), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(trainer), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(trainer), cudaSuccess);
  parity.Tick({3, 0, 9}, 79);
  parity.ExpectLogsMatch();
}

TEST(StreamStepManyTest, APublishThatFailsLeavesTheTicksOnTheWeightsBeforeIt) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // Ticks read only the pack, which a publish rebuilds after copying the new parameters: one whose pack fails leaves
  // the ticks on the set before it, whole (no kernel reads the copied parameters beside the old pack). Small ticks and
  // wide ones (the cluster kernel and the wide path); then the next publish serves the new set.
  StreamStepParity parity("small", 300, 4);
  std::vector<float> next = RandomParams(ParamLayout(parity.config()), 202);
  const DeviceArray<float> next_on_device(next);
  parity.streamer().FailNextPackForTest();
  const absl::Status failed = parity.streamer().Publish(next_on_device.get(), parity.streamer().stream());
  EXPECT_TRUE(testing::Contains(failed, "building the stream pack failed")) << failed;
  parity.Tick({3, 0, 9}, 83);
  std::vector<int32_t> every_slot(300);
  std::iota(every_slot.begin(), every_slot.end(), 0);
  parity.Tick(every_slot, 84);
  ASSERT_TRUE(parity.streamer().Publish(next_on_device.get(), parity.streamer().stream()).ok());
  parity.UseParams(std::move(next));
  parity.Tick({3, 7}, 85);
  parity.Tick(every_slot, 86);
  parity.ExpectLogsMatch();
}

}  // namespace
}  // namespace perception
