// Command-line spellings shared by the project's programs, accepted before absl parses the flags.
#pragma once

#include <string>
#include <vector>

namespace perception {

// `--lobster ORDERBOOK MESSAGES` (two words) becomes `--lobster=ORDERBOOK,MESSAGES`, and dashes in flag names
// become underscores (`--features-out` is `--features_out`). argv[0] is kept.
std::vector<std::string> NormalizeArguments(int argc, char** argv);

}  // namespace perception
