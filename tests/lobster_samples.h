// The LOBSTER samples that ship in tests/data/lobster (AAPL at 10 levels, AMZN at 1), for targets given their folder.
#pragma once

#include <string>

namespace perception::testing {

// The shipped `kind` file ("orderbook" or "message") of `stock`'s 2012-06-21 sample at `levels` book levels.
// PERCEPTION_TEST_DATA_DIR comes from the test target (tests/CMakeLists.txt); test_util.h cannot hold this, since
// targets without the data (the benchmarks) include it too.
inline std::string ShippedLobsterPath(const std::string& stock, const std::string& kind, int levels) {
  return std::string(PERCEPTION_TEST_DATA_DIR) + "/" + stock + "_2012-06-21_34200000_57600000_" + kind + "_" +
         std::to_string(levels) + ".csv";
}

}  // namespace perception::testing
