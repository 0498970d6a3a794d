// Command-line spellings, the record of the flags given, and the refusal of flags a command does not read.
#include "engine/cli/arguments.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>

#include "absl/base/config.h"
#include "absl/container/flat_hash_map.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace perception {
namespace {

// The names of the flags set since ParseArguments began, and how many times each was; registration's own OnUpdate
// calls come before and are cleared. Unlocked: flags are parsed on the main thread before any other starts.
absl::flat_hash_map<std::string, int>& FlagsGiven() {
  static auto* const names = new absl::flat_hash_map<std::string, int>();
  return *names;
}

// "train's", "train's and eval's", "init's, train's and eval's", "convictions'".
std::string Owners(const std::vector<std::string>& commands) {
  std::vector<std::string> owners;
  for (const std::string& command : commands) {
    owners.push_back(absl::StrCat(command, absl::EndsWith(command, "s") ? "'" : "'s"));
  }
  if (owners.size() <= 1) return absl::StrJoin(owners, "");
  return absl::StrCat(absl::StrJoin(owners.begin(), owners.end() - 1, ", "), " and ", owners.back());
}

// `--lobster ORDERBOOK MESSAGES` as `--lobster=ORDERBOOK,MESSAGES`, dashes in flag names as underscores; argv[0] kept.
std::vector<std::string> NormalizeArguments(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) == 0) {
      const size_t name_end = std::min(arg.find('='), arg.size());
      std::replace(arg.begin() + 2, arg.begin() + name_end, '-', '_');
    }
    // Only the two-word form: after the comma form (`--lobster A,B`) the next word is a command or an argument.
    const bool next_two_are_files = i + 2 < argc && argv[i + 1][0] != '-' && argv[i + 2][0] != '-' &&
                                    !absl::StrContains(argv[i + 1], ',');
    if (arg == "--lobster" && next_two_are_files) {
      out.push_back(absl::StrCat("--lobster=", argv[i + 1], ",", argv[i + 2]));
      i += 2;
      continue;
    }
    out.push_back(std::move(arg));
  }
  return out;
}

}  // namespace

std::vector<char*> ParseFlags(int argc, char** argv) {
#if defined(ABSL_LTS_RELEASE_VERSION) && ABSL_LTS_RELEASE_VERSION <= 20220623
  // absl::ParseCommandLine, but for the exit after --help and its kin: abseil 20220623 (Debian 12's) exits 1 there,
  // as if asking for help failed. Its internal parse is the one ParseCommandLine runs; later releases changed it.
  namespace internal = absl::flags_internal;
  std::vector<char*> positional = internal::ParseCommandLineImpl(
      argc, argv, internal::ArgvListAction::kRemoveParsedArgs, internal::UsageFlagsAction::kIgnoreUsage,
      internal::OnUndefinedFlag::kAbortIfUndefined);
  // (--version and --only_check_args exit 0 there too)
  if (internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) != -1) std::exit(0);
  return positional;
#else
  return absl::ParseCommandLine(argc, argv);
#endif
}

std::vector<std::string> ParseArguments(int argc, char** argv) {
  std::vector<std::string> normalized = NormalizeArguments(argc, argv);
  std::vector<char*> normalized_argv;
  for (std::string& arg : normalized) normalized_argv.push_back(arg.data());
  FlagsGiven().clear();
  const std::vector<char*> positional = ParseFlags(static_cast<int>(normalized_argv.size()), normalized_argv.data());
  return {positional.begin(), positional.end()};
}

void NoteFlagGiven(std::string_view name) { ++FlagsGiven()[std::string(name)]; }

bool FlagGiven(const absl::CommandLineFlag& flag) { return FlagsGiven().contains(flag.Name()); }

absl::Status CheckGivenOnce(const absl::CommandLineFlag& flag, std::string_view why) {
  const auto given = FlagsGiven().find(flag.Name());
  if (given == FlagsGiven().end() || given->second < 2) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--", flag.Name(), " was given ", given->second, " times: ",
                                                 std::string(why), ", and only the last would have been read"));
}

absl::Status CheckFlagsTakenBy(const std::string& command, std::span<const FlagUse> uses) {
  std::vector<std::string> refused;
  for (const FlagUse& use : uses) {
    if (std::ranges::find(use.commands, command) != use.commands.end() || !FlagGiven(use.flag)) continue;
    refused.push_back(absl::StrCat("--", use.flag.Name(), " (", Owners(use.commands), " flag)"));
  }
  if (refused.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(command, " does not take ", absl::StrJoin(refused, ", ")));
}

absl::Status CheckAtLeastOne(std::initializer_list<std::pair<std::string_view, int64_t>> flags) {
  for (const auto& [name, value] : flags) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", std::string(name), " must be >= 1, got ", value));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckFinitePositive(std::string_view name, double value, std::string_view hint) {
  if (value > 0 && std::isfinite(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--", std::string(name), " must be a finite number > 0",
                                                 hint.empty() ? "" : absl::StrCat(" (", std::string(hint), ")"),
                                                 ", got ", value));
}

absl::Status CheckOpenFraction(std::string_view name, double value) {
  if (value > 0 && value < 1) return absl::OkStatus();  // (NaN fails both)
  return absl::InvalidArgumentError(absl::StrCat("--", std::string(name), " must be in (0, 1), got ", value));
}

absl::Status UnexpectedArguments(std::span<const std::string> args, std::span<const std::string_view> commands,
                                 std::string_view usage) {
  // (This absl's string_view is not std's: both views are taken as strings.)
  const std::string usage_text(usage);
  if (args.size() < 2) return absl::InvalidArgumentError(absl::StrCat("no command given\n\n", usage_text));
  const std::string& command = args[1];
  if (std::ranges::find(commands, command) == commands.end()) {
    const std::string known = absl::StrJoin(commands, ", ", [](std::string* out, std::string_view name) {
      out->append(name);
    });
    return absl::InvalidArgumentError(
        absl::StrCat("unknown command '", command, "' (the commands: ", known, ")\n\n", usage_text));
  }
  return absl::InvalidArgumentError(absl::StrCat("unexpected arguments for ", command, ": ",
                                                 absl::StrJoin(args.begin() + 1, args.end(), " "),
                                                 " (its usage is below)\n\n", usage_text));
}

}  // namespace perception
