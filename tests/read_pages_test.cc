// ReadConvictions' pages through the service in process: bounded by bytes as well as by count, so that a page stays
// within what gRPC's clients receive at any --stream_read_max (a large one made pages perceptionctl could not take,
// entries the daemon then counted as read).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "engine/config.h"
#include "grpcpp/grpcpp.h"
#include "perception/v1/perception.grpc.pb.h"
#include "tests/batch_message.h"
#include "tests/in_process_daemon.h"
#include "tests/test_util.h"

namespace perception::testing {
namespace {

// 40 events of one instrument, then every page from its first: their sizes, and every entry read once, in order.
std::vector<int> PageSizes(InProcessDaemon& daemon, int64_t max_count, bool with_probabilities) {
  v1::ReadConvictionsRequest request;
  request.set_instrument("A");
  request.set_from_seq(1);
  request.set_max_count(max_count);
  request.set_with_probabilities(with_probabilities);
  std::vector<int> sizes;
  uint64_t expected_seq = 1;
  while (true) {
    grpc::ClientContext context;
    v1::ReadConvictionsResponse page;
    const grpc::Status status = daemon.stub().ReadConvictions(&context, request, &page);
    EXPECT_TRUE(status.ok()) << status.error_message();
    if (!status.ok() || page.convictions_size() == 0) break;
    sizes.push_back(page.convictions_size());
    EXPECT_EQ(page.probabilities_size(), with_probabilities ? page.convictions_size() * page.n_horizons() : 0);
    for (const uint64_t seq : page.seqs()) EXPECT_EQ(seq, expected_seq++);
    if (page.next_seq() >= page.end_seq()) break;
    request.set_from_seq(page.next_seq());
  }
  EXPECT_EQ(expected_seq, 41u) << "every entry once";
  return sizes;
}

TEST(ReadPagesTest, APageStaysWithinItsBytesAtAnyCount) {
  server::StreamOptions options;
  options.max_read_count = 1'000'000;
  // tiny has 3 horizons: an entry takes 14 bytes, 26 with its probabilities; 10 of those fit, or 18 without.
  options.max_read_bytes = 260;
  InProcessDaemon daemon(nullptr, "read_pages_checkpoints", options);
  ASSERT_TRUE(daemon.InitTinyModel(3).ok());
  const ModelConfig config = *NamedConfig("tiny");
  ASSERT_EQ(config.n_horizons, 3);
  const RandomBatch series = MakeRandomBatch(config, 1, 40, 5);
  std::vector<v1::StreamEvent> events;
  for (int t = 0; t < 40; ++t) events.push_back(FeatureEvent(series, config.n_features, t, "A", t + 1));
  const StreamOutcome outcome = daemon.Stream({events});
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();

  EXPECT_EQ(PageSizes(daemon, 0, true), (std::vector<int>{10, 10, 10, 10}));
  EXPECT_EQ(PageSizes(daemon, 0, false), (std::vector<int>{18, 18, 4}));
  EXPECT_EQ(PageSizes(daemon, 7, true), (std::vector<int>{7, 7, 7, 7, 7, 5}));
  EXPECT_EQ(PageSizes(daemon, 1'000'000'000, false), (std::vector<int>{18, 18, 4}));
}

}  // namespace
}  // namespace perception::testing
