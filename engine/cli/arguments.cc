// Normalization of the documented command-line spellings into what absl flags parse.
#include "engine/cli/arguments.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace perception {

std::vector<std::string> NormalizeArguments(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) == 0) {
      const size_t name_end = std::min(arg.find('='), arg.size());
      std::replace(arg.begin() + 2, arg.begin() + name_end, '-', '_');
    }
    const bool next_two_are_files = i + 2 < argc && argv[i + 1][0] != '-' && argv[i + 2][0] != '-';
    if (arg == "--lobster" && next_two_are_files) {
      out.push_back(absl::StrCat("--lobster=", argv[i + 1], ",", argv[i + 2]));
      i += 2;
      continue;
    }
    out.push_back(std::move(arg));
  }
  return out;
}

}  // namespace perception
