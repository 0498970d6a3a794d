// Training batches and streamed events as messages, for the tests that send them to a daemon (e2e, in process), and
// a message's bytes cut as the transport delivers a large one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"
#include "grpcpp/support/slice.h"
#include "perception/v1/perception.pb.h"
#include "tests/test_util.h"

namespace perception::testing {

inline v1::Batch BatchMessage(int batch, int window, int n_features, int n_horizons, const std::vector<float>& x,
                              const std::vector<float>& dt, const std::vector<float>& labels,
                              const std::vector<float>& mask) {
  v1::Batch message;
  message.set_batch(batch);
  message.set_window(window);
  message.set_n_features(n_features);
  message.set_n_horizons(n_horizons);
  message.mutable_x()->Assign(x.begin(), x.end());
  message.mutable_dt()->Assign(dt.begin(), dt.end());
  message.mutable_labels()->Assign(labels.begin(), labels.end());
  message.mutable_mask()->Assign(mask.begin(), mask.end());
  return message;
}

inline v1::Batch BatchMessage(const RandomBatch& batch, const ModelConfig& config) {
  return BatchMessage(batch.batch, batch.window, config.n_features, config.n_horizons, batch.x, batch.dt, batch.labels,
                      batch.mask);
}

// Event t of `series` (one window of F features an event) as the instrument's event `seq`.
inline v1::StreamEvent FeatureEvent(const RandomBatch& series, int F, int t, const std::string& instrument,
                                    uint64_t seq) {
  v1::StreamEvent event;
  event.set_instrument(instrument);
  event.set_seq(seq);
  event.mutable_features()->mutable_features()->Assign(series.x.begin() + t * F, series.x.begin() + (t + 1) * F);
  event.mutable_features()->set_dt(series.dt[t]);
  return event;
}

// `bytes` cut into slices of `slice` bytes, as the transport delivers a large request (a grpc::ByteBuffer of them is
// one read).
inline std::vector<grpc::Slice> Slices(const std::string& bytes, size_t slice) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += slice) {
    slices.emplace_back(bytes.data() + at, std::min(slice, bytes.size() - at));
  }
  return slices;
}

}  // namespace perception::testing
