// Command-line handling shared by the programs: spellings, the flags given, and flags a command does not read.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"

// An absl flag whose presence on the command line (or in a --flagfile) FlagGiven tells, even at its default value.
// absl 20220623 keeps CommandLineFlag::IsSpecifiedOnCommandLine private; OnUpdate is its public record of a setting.
#define PERCEPTION_FLAG(Type, name, default_value, help) \
  ABSL_FLAG(Type, name, default_value, help).OnUpdate([] { ::perception::NoteFlagGiven(#name); })

namespace perception {

// absl::ParseCommandLine (which exits on a bad flag, 1, and after --help's usage), except that asking for help
// (--help, --helpfull, ...) exits 0: the flags' values set, the positional arguments returned, argv[0] first.
std::vector<char*> ParseFlags(int argc, char** argv);

// ParseFlags (which exits on a bad flag or --help) of the arguments with `--lobster ORDERBOOK MESSAGES` (two words)
// read as `--lobster=ORDERBOOK,MESSAGES` and dashes in flag names as underscores (`--features-out` is
// `--features_out`): the positional arguments, argv[0] first. FlagGiven answers for the flags this parse set.
std::vector<std::string> ParseArguments(int argc, char** argv);

// PERCEPTION_FLAG's callback.
void NoteFlagGiven(std::string_view name);
bool FlagGiven(const absl::CommandLineFlag& flag);
template <typename T>
bool FlagGiven(const absl::Flag<T>& flag) {
  return FlagGiven(absl::GetFlagReflectionHandle(flag));
}

// INVALID_ARGUMENT where `flag` was given more than once, `why` saying why once is all it takes: absl keeps the last
// setting, and a second `--lobster` (another day's files, say) was dropped without a word.
absl::Status CheckGivenOnce(const absl::CommandLineFlag& flag, std::string_view why);
template <typename T>
absl::Status CheckGivenOnce(const absl::Flag<T>& flag, std::string_view why) {
  return CheckGivenOnce(absl::GetFlagReflectionHandle(flag), why);
}

// A flag and the commands that read it.
struct FlagUse {
  template <typename T>
  FlagUse(const absl::Flag<T>& flag, std::initializer_list<std::string> readers)
      : flag(absl::GetFlagReflectionHandle(flag)), commands(readers) {}
  const absl::CommandLineFlag& flag;
  std::vector<std::string> commands;
};

// Refuses every flag of `uses` given on the command line that `command` does not read, naming whose it is: one set
// for another command would be ignored without a word (`perception train --checkpoint X` trained a fresh model).
absl::Status CheckFlagsTakenBy(const std::string& command, std::span<const FlagUse> uses);

// INVALID_ARGUMENT naming the first of `flags` (name without dashes, value) below 1: "--steps must be >= 1, got 0".
absl::Status CheckAtLeastOne(std::initializer_list<std::pair<std::string_view, int64_t>> flags);

// INVALID_ARGUMENT unless `value` of --`name` is a finite number > 0 ("--lr must be a finite number > 0, got inf"),
// `hint` in parentheses after the bound where given. NaN and infinity passed checks of `> 0` alone.
absl::Status CheckFinitePositive(std::string_view name, double value, std::string_view hint = "");

// INVALID_ARGUMENT unless 0 < `value` < 1 ("--train_fraction must be in (0, 1), got 1.5").
absl::Status CheckOpenFraction(std::string_view name, double value);

// The error for positional arguments (argv[0] first) that no command of `commands` takes: none given, an unknown
// command (named, with the known ones), or a known one with arguments its usage does not have; `usage` follows.
absl::Status UnexpectedArguments(std::span<const std::string> args, std::span<const std::string_view> commands,
                                 std::string_view usage);

}  // namespace perception
