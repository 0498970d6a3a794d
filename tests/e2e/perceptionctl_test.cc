// perceptionctl against the real daemon: init, train on LOBSTER files, checkpoints, status, with flags before and
// after the subcommand, errors with the daemon's code and message, and stream and train giving up on a daemon that
// stopped answering.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <optional>
#include <utility>
#include <ranges>
#include <regex>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "engine/checkpoint.h"
#include "engine/dataset.h"
#include "engine/lobster.h"
#include "engine/param_layout.h"
#include "tests/e2e/e2e_util.h"
#include "tests/lobster_samples.h"

namespace perception::e2e {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kOrderbook = testing::ShippedLobsterPath("AAPL", "orderbook", 10);
const std::string kMessages = testing::ShippedLobsterPath("AAPL", "message", 10);
// 57,514 events at one level: long enough a feed to wrap a small conviction log many times.
const std::string kLongFeed = absl::StrCat(" --lobster ", testing::ShippedLobsterPath("AMZN", "orderbook", 1), " ",
                                           testing::ShippedLobsterPath("AMZN", "message", 1));
// Writes LOBSTER files (level 1, 300 rows) whose mid stays at 100 but at row 250, where the book jumps to a mid of
// ~5e9 (a mid return, feature 5, of 5e11) and back: under a normalizer fitted on the first 70% (the return's std
// floored at 1e-6, its inv_std 1e6) that event standardizes to 5e17, beyond kMaxStandardizedFeature. Returns the
// flags naming them (" --lobster ORDERBOOK MESSAGES").
std::string WriteFilesWithAJumpAtRow250(const std::filesystem::path& dir) {
  const std::string orderbook = (dir / "orderbook.csv").string(), messages = (dir / "message.csv").string();
  std::ofstream book(orderbook), message(messages);
  for (int row = 1; row <= 300; ++row) {
    const int64_t ask = row == 250 ? 9'999'999'000 : 101 + row % 3, bid = row == 250 ? 1 : 99 - row % 3;
    book << ask << ',' << 100 + row % 7 << ',' << bid << ',' << 200 - row % 5 << '\n';
    message << absl::StrFormat("%.2f", 34200 + row * 0.01) << ',' << 1 + row % 4 << ',' << row << ",10," << ask
            << ',' << (row % 2 ? 1 : -1) << '\n';
  }
  return absl::StrCat(" --lobster ", orderbook, " ", messages);
}

// Long enough for a command that never gives up to fail the test instead of hanging it.
const std::string kKillAfter30s = "timeout -s KILL 30 ";

// Runs `command` on a helper thread; once `started` holds, stops the daemon (SIGSTOP) and returns how long the
// command then took to exit and what it said. The daemon is resumed (SIGCONT) before returning.
std::pair<absl::Duration, CommandResult> RunThenStopTheDaemon(Daemon& daemon, const std::string& command,
                                                              const std::function<bool()>& started) {
  std::future<CommandResult> running = std::async(std::launch::async, RunCommand, command);
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!started() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(10));
  daemon.Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  CommandResult result = running.get();
  const absl::Duration waited = absl::Now() - stopped;
  daemon.Signal(SIGCONT);
  return {waited, std::move(result)};
}

// The processed events of the daemon's one live stream (0 while it has none, or more than one).
uint64_t ProcessedByTheOnlyStream(Daemon& daemon) {
  const absl::StatusOr<v1::ListStreamsResponse> streams = daemon.client().ListStreams();
  return streams.ok() && streams->streams_size() == 1 ? streams->streams(0).processed_events() : 0;
}

// N of a failed `perceptionctl stream`'s "acknowledged through seq N"; nullopt when it says none.
std::optional<uint64_t> AcknowledgedThrough(const std::string& output) {
  const std::string through = "acknowledged through seq ";
  const size_t at = output.find(through);
  if (at == std::string::npos) return std::nullopt;
  const size_t digits = at + through.size();
  uint64_t acked = 0;
  if (!absl::SimpleAtoi(output.substr(digits, output.find(' ', digits) - digits), &acked)) return std::nullopt;
  return acked;
}

// `shell_line` run on a helper thread, once `wait` has returned: the run, and the pid its line wrote where `pid_file`
// names (0 where `wait` answered false).
std::pair<std::future<CommandResult>, pid_t> StartThenWait(const std::string& shell_line,
                                                          const std::filesystem::path& pid_file,
                                                          const std::function<bool()>& wait) {
  std::future<CommandResult> running = std::async(std::launch::async, RunCommand, shell_line);
  const bool waited = wait();
  pid_t pid = 0;
  std::ifstream(pid_file) >> pid;
  return {std::move(running), waited ? pid : 0};
}

// Whether `done` answers true within a minute, asked every 20 ms.
bool WithinAMinute(const std::function<bool()>& done) {
  for (const absl::Time give_up = absl::Now() + absl::Seconds(60); absl::Now() < give_up;) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// The numbers `pattern`'s two groups match in `output`, nullopt where it does not match.
std::optional<std::pair<int64_t, int64_t>> TwoNumbers(const std::string& output, const std::string& pattern) {
  std::smatch match;
  if (!std::regex_search(output, match, std::regex(pattern)) || match.size() != 3) return std::nullopt;
  return std::pair(std::stoll(match[1].str()), std::stoll(match[2].str()));
}

// Every conviction the daemon's log holds for `instrument`, oldest first.
struct ConvictionLog {
  std::vector<uint64_t> seqs;
  std::vector<float> convictions;
};
ConvictionLog ReadLog(client::PerceptionClient& client, const std::string& instrument) {
  ConvictionLog log;
  v1::ReadConvictionsRequest request;
  request.set_instrument(instrument);
  while (true) {
    absl::StatusOr<v1::ReadConvictionsResponse> page = client.ReadConvictions(request);
    EXPECT_TRUE(page.ok()) << page.status();
    if (!page.ok() || page->convictions_size() == 0) return log;
    log.seqs.insert(log.seqs.end(), page->seqs().begin(), page->seqs().end());
    log.convictions.insert(log.convictions.end(), page->convictions().begin(), page->convictions().end());
    if (page->next_seq() >= page->end_seq()) return log;
    request.set_from_seq(page->next_seq());
  }
}

// `log` holds seq first..last, each conviction as `reference` (the same events streamed in one go) has it.
void ExpectReplayOf(const ConvictionLog& log, const ConvictionLog& reference, uint64_t first, uint64_t last) {
  ASSERT_EQ(log.seqs.size(), last - first + 1);
  ASSERT_EQ(reference.seqs, log.seqs);
  for (size_t i = 0; i < log.seqs.size(); ++i) {
    ASSERT_EQ(log.seqs[i], first + i) << "contiguous";
    ASSERT_NEAR(log.convictions[i], reference.convictions[i], 1e-6) << "seq " << log.seqs[i];
  }
}

// Waits until the daemon has processed at least `events` of `instrument` (false after 20 s).
bool WaitUntilProcessed(client::PerceptionClient& client, const std::string& instrument, uint64_t events) {
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (absl::Now() < give_up) {
    if (absl::StatusOr<v1::ListStreamsResponse> streams = client.ListStreams(); streams.ok()) {
      for (const v1::StreamInfo& stream : streams->streams()) {
        if (stream.instrument() == instrument && stream.processed_events() >= events) return true;
      }
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

std::string FileText(const std::filesystem::path& path) {
  std::ifstream file(path);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

// `command` followed by each case's arguments fails (exit code 1), its output naming the case's reason.
void ExpectEachRefused(const std::string& command, const std::vector<std::pair<std::string, std::string>>& cases) {
  for (const auto& [args, reason] : cases) {
    const CommandResult result = RunCommand(absl::StrCat(command, args));
    EXPECT_EQ(result.exit_code, 1) << args << result.output;
    EXPECT_THAT(result.output, HasSubstr(reason)) << args;
  }
}

// "loss L  grad_norm G" of a `train --steps 1` run's progress line.
std::string OnlyStep(const std::string& output) {
  const std::string line = "step 1/1  ";
  const size_t at = output.find(line);
  if (at == std::string::npos) return "";
  const size_t begin = at + line.size();
  return output.substr(begin, output.find("  ", output.find("grad_norm", begin)) - begin);
}

// Where `instrument`'s log ends once the daemon has settled: nothing pending and the end unchanged for 300 ms (a
// daemon just resumed may still be reading events a cancelled call had sent).
uint64_t EndSeqOnceSettled(client::PerceptionClient& client, const std::string& instrument) {
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  uint64_t end = 0;
  absl::Time since = absl::Now();
  while (absl::Now() < give_up) {
    if (absl::StatusOr<v1::ListStreamsResponse> streams = client.ListStreams(); streams.ok()) {
      for (const v1::StreamInfo& stream : streams->streams()) {
        if (stream.instrument() != instrument) continue;
        if (stream.pending_events() > 0 || stream.end_seq() != end) {
          end = stream.end_seq();
          since = absl::Now();
        } else if (absl::Now() - since >= absl::Milliseconds(300)) {
          return end;
        }
      }
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return 0;
}

TEST(PerceptionctlTest, InitTrainSaveLoadAndStatus) {
  const ScopedTempDir temp("ctl");
  const std::filesystem::path& dir = temp.path();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(dir / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  const std::string target_after = absl::StrCat(" --target ", (*daemon)->target());

  CommandResult init = RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10 --batch 8 --window 32"));
  ASSERT_EQ(init.exit_code, 0) << init.output;
  EXPECT_THAT(init.output, HasSubstr("trains on 8 x 32 events"));

  // Flags after the subcommand, the documented `--lobster ORDERBOOK MESSAGES`, output that is not a terminal.
  CommandResult train = RunCommand(absl::StrCat(PERCEPTIONCTL_PATH, " train --lobster ", kOrderbook, " ", kMessages,
                                                " --steps 20 --log-every 10", target_after));
  ASSERT_EQ(train.exit_code, 0) << train.output;
  EXPECT_THAT(train.output, HasSubstr("fitted the normalizer on 699 training events"));
  EXPECT_THAT(train.output, HasSubstr("step 10/20  loss"));
  EXPECT_THAT(train.output, HasSubstr("step 20/20  loss"));
  EXPECT_THAT(train.output, HasSubstr("vs class-prior baseline"));

  CommandResult save = RunCommand(absl::StrCat(ctl, " checkpoint save runs/ctl.safetensors"));
  ASSERT_EQ(save.exit_code, 0) << save.output;
  EXPECT_THAT(save.output, HasSubstr("saved runs/ctl.safetensors: step 20"));
  EXPECT_TRUE(std::filesystem::exists(dir / "checkpoints" / "runs" / "ctl.safetensors"));

  CommandResult load =
      RunCommand(absl::StrCat(PERCEPTIONCTL_PATH, " checkpoint load runs/ctl.safetensors", target_after));
  ASSERT_EQ(load.exit_code, 0) << load.output;
  CommandResult status = RunCommand(absl::StrCat(ctl, " status"));
  ASSERT_EQ(status.exit_code, 0) << status.output;
  EXPECT_THAT(status.output, HasSubstr("step 20,"));
  EXPECT_THAT(status.output, HasSubstr("normalizer fitted"));

  CommandResult eval = RunCommand(absl::StrCat(ctl, " eval --lobster ", kOrderbook, " ", kMessages));
  ASSERT_EQ(eval.exit_code, 0) << eval.output;
  EXPECT_THAT(eval.output, HasSubstr("accuracy by horizon (events): 10: "));
  // A window no longer than the warmup scores nothing: refused, where it printed a loss of 0 against a prior of 0.
  CommandResult unscored = RunCommand(absl::StrCat(ctl, " eval --window 2 --lobster ", kOrderbook, " ", kMessages));
  EXPECT_EQ(unscored.exit_code, 1);
  EXPECT_THAT(unscored.output, HasSubstr("--window 2 would mask every position"));

  CommandResult escape = RunCommand(absl::StrCat(ctl, " checkpoint load ../x.safetensors"));
  EXPECT_EQ(escape.exit_code, 1);
  EXPECT_THAT(escape.output,
              HasSubstr("INVALID_ARGUMENT: name: checkpoint name '../x.safetensors' must not contain '..'"));
  CommandResult mismatch = RunCommand(absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --batch 4"));
  EXPECT_EQ(mismatch.exit_code, 1);
  EXPECT_THAT(mismatch.output, HasSubstr("the model trains on batches of 8 windows x 32 events, fixed at init; --batch "
                                         "4 differs (re-init to change them)"));  // (it named --window 0 as well)
  CommandResult both = RunCommand(
      absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --batch 4 --window 16 --steps 1"));
  EXPECT_EQ(both.exit_code, 1);
  EXPECT_THAT(both.output, HasSubstr("fixed at init; --batch 4 and --window 16 differ (re-init to change them)"));
}

// The first 10 rows of the AAPL files: tiny's one window of 9 events, every label within a horizon (10 and more) of
// the end, so none is scored.
struct UnscoredFiles {
  std::string orderbook, messages;
};
UnscoredFiles WriteUnscoredFiles(const std::filesystem::path& dir) {
  UnscoredFiles files{(dir / "ob10.csv").string(), (dir / "msg10.csv").string()};
  for (const auto& [from, to] : {std::pair<std::string, std::string>{kOrderbook, files.orderbook},
                                 std::pair<std::string, std::string>{kMessages, files.messages}}) {
    std::ifstream in(from);
    std::ofstream out(to);
    std::string line;
    for (int i = 0; i < 10 && std::getline(in, line); ++i) out << line << '\n';
  }
  return files;
}

// Where no label is scored a masked loss reads 0: train printed "validation loss 0.00000 vs class-prior baseline
// 0.00000" (and its --save-best took the starting model as a best no step could beat), eval a loss of 0. Both refuse.
TEST(PerceptionctlTest, RunsOverDataThatScoresNoLabelAreRefused) {
  const ScopedTempDir temp("ctl_unscored");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  const CommandResult train = RunCommand(
      absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --steps 2 --train_fraction 0.99"));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("the validation part scores no label (each of its events is within a horizon "
                                      "of its end, in a window's warmup, or a tie: its mid's mean over the horizon "
                                      "equals its mid): a smaller --train_fraction gives it more events"));
  EXPECT_THAT(train.output, Not(HasSubstr("step 1/2")));
  const UnscoredFiles files = WriteUnscoredFiles(temp.path());
  const CommandResult eval = RunCommand(absl::StrCat(ctl, " eval --lobster ", files.orderbook, " ", files.messages));
  EXPECT_EQ(eval.exit_code, 1) << eval.output;
  EXPECT_THAT(eval.output, HasSubstr("the files' windows score no label"));
  EXPECT_THAT(eval.output, Not(HasSubstr("class-prior baseline")));
}

// A horizon that scores no label in the files has no accuracy: it read 0.000, as if the model were always wrong there.
// The files' first 52 events score labels at 10 and 20 events ahead, none at 50 (past the files' end).
TEST(PerceptionctlTest, AHorizonThatScoresNoLabelHasNoAccuracy) {
  const ScopedTempDir temp("ctl_no_accuracy");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  const std::string orderbook = (temp.path() / "orderbook.csv").string();
  const std::string messages = (temp.path() / "messages.csv").string();
  ASSERT_EQ(RunCommand(absl::StrCat("head -52 ", testing::ShippedLobsterPath("AMZN", "orderbook", 1), " > ", orderbook,
                                    " && head -52 ", testing::ShippedLobsterPath("AMZN", "message", 1), " > ",
                                    messages))
                .exit_code,
            0);
  const CommandResult eval = RunCommand(absl::StrCat(ctl, " eval --lobster ", orderbook, " ", messages));
  ASSERT_EQ(eval.exit_code, 0) << eval.output;
  EXPECT_THAT(eval.output, ContainsRegex("accuracy by horizon \\(events\\): 10: 0\\.[0-9]{3} 20: 0\\.[0-9]{3} 50: n/a "
                                         "\\(no label scored\\)\n"));
}

// The learning rate a run will train at, checked before the files are read. Past a cosine schedule's end every step
// trains at min_lr: with min_lr 0 a run left the weights as they were while its progress and status read as training,
// and a new --lr there changed nothing. The schedule's last step is already at min_lr, so a model one step short of it
// is past it too (the check once let that run through). train's --total_steps extends the schedule and --min_lr
// changes its floor.
TEST(PerceptionctlTest, ARunPastTheCosineScheduleIsToldItsLearningRate) {
  const ScopedTempDir temp("ctl_past_schedule");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  const std::string train = absl::StrCat(ctl, " train", kLongFeed, " --steps 2 --log-every 100");
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1 --lr_schedule cosine --total_steps 4"))
                .exit_code,
            0);
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " train", kLongFeed, " --steps 3")).exit_code, 0);
  for (const std::string extra : {"", " --lr 0.01"}) {
    const CommandResult idle = RunCommand(absl::StrCat(train, extra));
    EXPECT_EQ(idle.exit_code, 1) << idle.output;
    EXPECT_THAT(idle.output, HasSubstr("FAILED_PRECONDITION: this run would not change the model: the model is at "
                                       "step 3 and its cosine schedule ends at step 4: every step from 4 on trains "
                                       "at min_lr 0. Give --total_steps beyond 4 to extend the schedule"));
    EXPECT_THAT(idle.output, Not(HasSubstr("events:"))) << "refused before the files were read";
  }
  const CommandResult floor = RunCommand(absl::StrCat(train, " --min_lr 0.0005"));
  ASSERT_EQ(floor.exit_code, 0) << floor.output;
  EXPECT_THAT(floor.output, HasSubstr("the model is at step 3 and its cosine schedule ends at step 4: every step "
                                      "from 4 on trains at min_lr 0.0005\n"));
  const CommandResult ignored = RunCommand(absl::StrCat(train, " --lr 0.01"));
  EXPECT_EQ(ignored.exit_code, 1) << ignored.output;
  EXPECT_THAT(ignored.output, HasSubstr("INVALID_ARGUMENT: --lr 0.01 would not apply: the model is at step 5"));
  const CommandResult short_extension = RunCommand(absl::StrCat(train, " --lr 0.01 --total_steps 6"));
  EXPECT_EQ(short_extension.exit_code, 1) << short_extension.output;
  EXPECT_THAT(short_extension.output, HasSubstr("INVALID_ARGUMENT: --lr 0.01 would not apply: the model is at step 5 "
                                                "and its cosine schedule ends at step 6: every step from 6 on trains "
                                                "at min_lr 0.0005. Give --total_steps beyond 6"));
  const CommandResult extended = RunCommand(absl::StrCat(train, " --total_steps 20"));
  ASSERT_EQ(extended.exit_code, 0) << extended.output;
  EXPECT_THAT(extended.output, Not(HasSubstr("schedule ends")));
  const CommandResult status = RunCommand(absl::StrCat(ctl, " status"));
  EXPECT_THAT(status.output, HasSubstr("  step 7, "));
  EXPECT_THAT(status.output, HasSubstr("then cosine to 0.0005 at step 20)"));
  const CommandResult below = RunCommand(absl::StrCat(train, " --min_lr 0.5"));
  EXPECT_EQ(below.exit_code, 1) << below.output;
  EXPECT_THAT(below.output, HasSubstr("the learning rate 0.001 (the model's) is below min_lr 0.5 (--min_lr), where "
                                      "the cosine schedule ends: give --lr >= 0.5, or --min_lr in [0, 0.001]"));
  const CommandResult negative = RunCommand(absl::StrCat(train, " --min_lr=-0.5"));
  EXPECT_EQ(negative.exit_code, 1) << negative.output;
  EXPECT_THAT(negative.output, HasSubstr("INVALID_ARGUMENT: --min_lr (-0.5) must be at least 0"));

  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --replace --config tiny --levels 1")).exit_code, 0);
  const CommandResult constant = RunCommand(absl::StrCat(train, " --total_steps 10"));
  EXPECT_EQ(constant.exit_code, 1) << constant.output;
  EXPECT_THAT(constant.output, HasSubstr("--total_steps and --min_lr change the model's cosine schedule, and its "
                                         "learning rate is constant"));
}

// A model trained without a normalizer (here through TrainStep, as a user's own client trains) learned its weights on
// the features as they came: train once fitted one under them with a line of output, and the model meant another
// function from then on. It is refused before the files are read; --fit-normalizer fits one anyway.
TEST(PerceptionctlTest, AModelTrainedWithoutANormalizerIsNotGivenOneUnasked) {
  const ScopedTempDir temp("ctl_late_normalizer");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  ModelConfig tiny = *NamedConfig("tiny");
  tiny.n_features = 12;
  ASSERT_TRUE((*daemon)->client().TrainStep(TrainRequest(testing::MakeRandomBatch(tiny, tiny.batch, tiny.window, 7),
                                                         tiny)).ok());
  const std::string train = absl::StrCat(ctl, " train", kLongFeed, " --steps 1 --log-every 100");
  const CommandResult refused = RunCommand(train);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("FAILED_PRECONDITION: the model is at step 1 and has no normalizer (it trained "
                                        "on its features as they came): fitting one now would change the inputs its "
                                        "weights were trained on. Give --fit-normalizer to fit one anyway"));
  EXPECT_THAT(refused.output, Not(HasSubstr("events:"))) << "refused before the files were read";
  EXPECT_THAT(RunCommand(absl::StrCat(ctl, " status")).output, HasSubstr("normalizer not fitted (identity)"));
  const CommandResult fitted = RunCommand(absl::StrCat(train, " --fit-normalizer"));
  ASSERT_EQ(fitted.exit_code, 0) << fitted.output;
  EXPECT_THAT(fitted.output, HasSubstr("fitted the normalizer on "));
  EXPECT_THAT(RunCommand(absl::StrCat(ctl, " status")).output, HasSubstr("step 2, "));
  const CommandResult ignored = RunCommand(absl::StrCat(train, " --fit-normalizer"));
  EXPECT_EQ(ignored.exit_code, 1) << ignored.output;
  EXPECT_THAT(ignored.output, HasSubstr("INVALID_ARGUMENT: --fit-normalizer fits a normalizer onto a model without "
                                        "one, and this model has one"));
}

// A training part that scores no label is refused before anything is sent (the normalizer, the optimizer settings):
// every step would train on a loss of 0.
TEST(PerceptionctlTest, ATrainingPartThatScoresNoLabelIsRefusedBeforeAnythingIsSent) {
  const ScopedTempDir temp("ctl_unscored_train");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  const CommandResult train = RunCommand(absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages,
                                                      " --train_fraction 0.01 --steps 2 --lr 0.01"));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("INVALID_ARGUMENT: the training part (10 events) scores no label"));
  const std::string status = RunCommand(absl::StrCat(ctl, " status")).output;
  EXPECT_THAT(status, HasSubstr("normalizer not fitted (identity)"));
  EXPECT_THAT(status, HasSubstr("step 0, "));
  EXPECT_THAT(status, HasSubstr("AdamW lr 0.001 ")) << "--lr 0.01 not sent";
}

// A run whose model diverged (its validation outputs overflow) exited 0 and printed accuracies that were the share of
// "down" labels (NaN outputs score as down): `train && deploy` shipped it. At this rate the fifth run of three steps
// is the first whose validation loss is not finite, on the CPU's numerics and the batches `--seed` 1 samples.
TEST(PerceptionctlTest, ARunWhoseModelDivergedExitsNonZero) {
  if (DaemonDevice() != "cpu") GTEST_SKIP() << "the run that diverges is found on the CPU engine's numerics";
  const ScopedTempDir temp("ctl_diverged");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1 --lr 18")).exit_code, 0);
  for (int run = 1; run <= 4; ++run) {
    const CommandResult trained = RunCommand(absl::StrCat(ctl, " train", kLongFeed, " --steps 3"));
    ASSERT_EQ(trained.exit_code, 0) << "run " << run << ": " << trained.output;
  }
  const CommandResult diverged = RunCommand(absl::StrCat(ctl, " train", kLongFeed, " --steps 3"));
  EXPECT_EQ(diverged.exit_code, 1) << diverged.output;
  EXPECT_THAT(diverged.output, HasSubstr("validation loss nan vs class-prior baseline "));
  EXPECT_THAT(diverged.output, HasSubstr("FAILED_PRECONDITION: the model at step 15 has diverged: its validation loss "
                                         "is not finite. It stays on the daemon as it is; load a checkpoint saved "
                                         "before (perceptionctl checkpoint load) and train it with a lower --lr"));
  EXPECT_THAT(diverged.output, Not(HasSubstr("accuracy by horizon")));
}

// A model of fewer book levels than the files hold: without --levels the mismatch names the flag that fits; with it,
// train, eval and stream take the files' first levels. A model that fits no book is told how to make one.
TEST(PerceptionctlTest, LevelsTakesTheFirstLevelsOfDeeperFiles) {
  const ScopedTempDir temp("ctl_levels");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  const std::string files = absl::StrCat(" --lobster ", kOrderbook, " ", kMessages);
  // A preset's own feature count (tiny's 6, without --levels) fits no book: the refusal says how to make one that fits.
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny")).exit_code, 0);
  const CommandResult no_book = RunCommand(absl::StrCat(ctl, " train", files, " --steps 4"));
  EXPECT_EQ(no_book.exit_code, 1);
  EXPECT_THAT(no_book.output, HasSubstr("the model takes 6 features but 10 book levels give 48; no LOBSTER book gives "
                                        "6 (4 per level + 8): make the model for these files with --levels 10 "
                                        "(perceptiond: --init_levels 10)"));
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1 --batch 8 --window 32 --replace")).exit_code,
            0);

  const CommandResult refused = RunCommand(absl::StrCat(ctl, " train", files, " --steps 4"));
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_THAT(refused.output, HasSubstr("the model takes 12 features but 10 book levels give 48; --levels 1 reads the "
                                        "file's first 1"));
  const CommandResult train = RunCommand(absl::StrCat(ctl, " train", files, " --levels 1 --steps 4 --log-every 4"));
  ASSERT_EQ(train.exit_code, 0) << train.output;
  EXPECT_THAT(train.output, HasSubstr("step 4/4  loss"));
  const CommandResult eval = RunCommand(absl::StrCat(ctl, " eval", files, " --levels 1"));
  ASSERT_EQ(eval.exit_code, 0) << eval.output;
  const CommandResult unfit = RunCommand(absl::StrCat(ctl, " stream", files, " --instrument AAPL1 --count 50"));
  EXPECT_EQ(unfit.exit_code, 1);
  EXPECT_THAT(unfit.output, HasSubstr("--levels 1 reads the file's first 1"));
  const CommandResult stream =
      RunCommand(absl::StrCat(ctl, " stream", files, " --levels 1 --instrument AAPL1 --count 50"));
  ASSERT_EQ(stream.exit_code, 0) << stream.output;
  EXPECT_THAT(stream.output, HasSubstr("streamed 50 events of AAPL1"));
}

// A run's validations as printed (every "validation loss X" line, the final one included): the model step each
// names (-1 for the final line, which names none) and its loss.
std::vector<std::pair<int64_t, double>> Validations(const std::string& output) {
  std::vector<std::pair<int64_t, double>> found;
  for (const absl::string_view line : absl::StrSplit(output, '\n')) {
    int64_t step = -1;
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "model step ")) {
      const size_t colon = rest.find(':');
      if (colon == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(0, colon), &step)) continue;
      rest.remove_prefix(colon + 2);
    }
    double loss = 0;
    if (!absl::ConsumePrefix(&rest, "validation loss ") || !absl::SimpleAtod(rest.substr(0, rest.find(' ')), &loss)) {
      continue;
    }
    found.emplace_back(step, loss);
  }
  return found;
}

// --save-best holds the model of the run's lowest validation loss: the checkpoint's step is the one the run names
// as best, and that loss is the lowest printed.
void ExpectSavedBest(const std::string& output, const std::filesystem::path& checkpoint, int64_t best_step) {
  const std::vector<std::pair<int64_t, double>> validations = Validations(output);
  ASSERT_GE(validations.size(), 3u) << output;
  const double lowest = std::ranges::min(validations | std::views::values);
  EXPECT_THAT(output, HasSubstr(absl::StrFormat("best validation loss %.5f at model step %d", lowest, best_step)));
  absl::StatusOr<Checkpoint> saved = LoadCheckpoint(checkpoint.string());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step, best_step) << output;
}

// --eval-every validates during the run without changing it: the same batches, so the same final model as one
// uninterrupted run; --save-best keeps the best validated model.
TEST(PerceptionctlTest, EvalEveryValidatesDuringTheRunAndSaveBestKeepsTheBest) {
  const ScopedTempDir temp("ctl_eval_every");
  std::vector<std::string> finals;
  for (const std::string extra : {"", " --eval-every 3 --save-best best/run.safetensors"}) {
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
    ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10 --batch 8 --window 32")).exit_code, 0);
    const CommandResult train = RunCommand(
        absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --steps 8 --log-every 100", extra));
    ASSERT_EQ(train.exit_code, 0) << train.output;
    const size_t at = train.output.find("validation loss ");
    ASSERT_NE(at, std::string::npos) << train.output;
    finals.push_back(train.output.substr(train.output.rfind("\nvalidation loss ") + 1, 40));
    if (extra.empty()) continue;
    EXPECT_THAT(train.output, HasSubstr("model step 0: validation loss "));  // the starting model, a candidate too
    EXPECT_THAT(train.output, HasSubstr("model step 3: validation loss "));
    EXPECT_THAT(train.output, HasSubstr("model step 6: validation loss "));
    EXPECT_THAT(train.output, HasSubstr("best validation loss "));
    EXPECT_THAT(train.output, HasSubstr("saved the best model so far (validation loss "));
    ExpectSavedBest(train.output, temp.path() / "checkpoints" / "best" / "run.safetensors", 8);
    // A run on a trained model: its progress counts this run's steps, its validations name the model's step (they
    // read "step 10" before "step 3/3", as if the run had gone past its end).
    const CommandResult more = RunCommand(
        absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --steps 3 --eval-every 2"));
    ASSERT_EQ(more.exit_code, 0) << more.output;
    EXPECT_THAT(more.output, HasSubstr("\nmodel step 10: validation loss "));
    EXPECT_THAT(more.output, HasSubstr("\nstep 3/3 "));
    EXPECT_THAT(more.output, HasSubstr("at model step 1"));
    // A rate that makes things worse: the model the run started from (step 11) stays the best, and the one kept.
    const CommandResult worse = RunCommand(absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages,
                                                        " --steps 4 --eval-every 2 --lr 0.5 --save-best best/worse"));
    ASSERT_EQ(worse.exit_code, 0) << worse.output;
    ExpectSavedBest(worse.output, temp.path() / "checkpoints" / "best" / "worse", 11);
  }
  EXPECT_EQ(finals[0], finals[1]) << "validating during the run changed it";
}

// A --save-best name the daemon refuses fails the run before its first step, not at its first validation.
TEST(PerceptionctlTest, SaveBestRefusesABadNameBeforeTraining) {
  const ScopedTempDir temp("ctl_save_best");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10 --batch 8 --window 32")).exit_code, 0);
  const CommandResult train = RunCommand(absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages,
                                                      " --steps 50 --eval-every 25 --save-best ../outside"));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("INVALID_ARGUMENT: name: checkpoint name '../outside' must not contain '..'"));
  const CommandResult status = RunCommand(absl::StrCat(ctl, " status"));
  ASSERT_EQ(status.exit_code, 0) << status.output;
  EXPECT_THAT(status.output, HasSubstr("  step 0, ")) << "the run trained before it failed";
}

// A --save-best save that fails mid-run (a FIFO put at its name after the first best was saved, which the daemon's
// write refuses to replace) ends the saves, not the run, as perception train's --save_best does: every step runs, the
// failure is named when it happens and again as the run's last word (exit 1), with the step the model reached. It
// ended the run at that validation. On the AMZN day every validation of these steps beats the one before it.
TEST(PerceptionctlTest, ASaveBestThatFailsMidRunLeavesTheRunGoingOn) {
  const ScopedTempDir temp("ctl_save_best_fails");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  const std::filesystem::path best = temp.path() / "checkpoints" / "best" / "run";
  const std::string fifo = (temp.path() / "fifo").string();
  const std::string train =
      absl::StrCat(ctl, " train", kLongFeed, " --steps 12 --eval-every 1 --log-every 100 --save-best best/run");
  const CommandResult run = RunCommand(absl::StrCat(
      "(", train, " & pid=$!; while [ ! -e ", best.string(), " ] && kill -0 $pid 2>/dev/null; do sleep 0.005; done; ",
      "mkfifo ", fifo, " && mv -f ", fifo, " ", best.string(), "; wait $pid)"));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("saved the best model so far (validation loss ")) << "the first best, before";
  EXPECT_THAT(run.output, HasSubstr("warning: --save-best best/run not written at model step 1 (name: checkpoint "
                                    "name 'best/run' cannot be written: "));
  EXPECT_THAT(run.output, HasSubstr("the last best it saved was model step 0 (validation loss "));
  EXPECT_THAT(run.output, HasSubstr("the run goes on without saving its bests"));
  EXPECT_THAT(run.output, HasSubstr("model step 11: validation loss "));
  EXPECT_THAT(run.output, HasSubstr("best validation loss "));
  EXPECT_THAT(run.output, HasSubstr("\nperceptionctl: INVALID_ARGUMENT: --save-best best/run not written at model "
                                    "step 1 "));
  EXPECT_THAT(run.output, HasSubstr("The run went on to model step 12 (perceptionctl checkpoint save NAME keeps it)"));
  const CommandResult status = RunCommand(absl::StrCat(ctl, " status"));
  EXPECT_THAT(status.output, HasSubstr("  step 12, ")) << status.output;
  EXPECT_TRUE(std::filesystem::is_fifo(best)) << "the FIFO is left in place";
}

// A mistyped command or a bad flag fails at once, before --wait waits for a daemon (none listens here).
TEST(PerceptionctlTest, CommandsAreCheckedBeforeWaitingForTheDaemon) {
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=127.0.0.1:1 --wait 60s");
  const absl::Time start = absl::Now();
  const CommandResult mistyped = RunCommand(absl::StrCat(ctl, " stauts"));
  EXPECT_EQ(mistyped.exit_code, 1);
  EXPECT_THAT(mistyped.output, HasSubstr("INVALID_ARGUMENT: unknown command 'stauts' (the commands: status, init, "
                                         "train, eval, checkpoint, stream, convictions, streams, bench)"));
  const CommandResult negative =
      RunCommand(absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --steps -5"));
  EXPECT_EQ(negative.exit_code, 1);
  EXPECT_THAT(negative.output, HasSubstr("INVALID_ARGUMENT: --steps must be >= 1, got -5"));
  const CommandResult ranks = RunCommand(absl::StrCat(ctl, " --targets=127.0.0.1:1,127.0.0.1:2 stream"));
  EXPECT_EQ(ranks.exit_code, 1);
  EXPECT_THAT(ranks.output, HasSubstr("--targets applies to status, init, train and checkpoint save|load"));
  // stream, convictions and bench checked their flags only once --wait had waited for the daemon (a shorter wait
  // here, so that a regression fails on the messages within the test's time).
  const std::string waits_10s = absl::StrCat(PERCEPTIONCTL_PATH, " --target=127.0.0.1:1 --wait 10s");
  const CommandResult no_instrument =
      RunCommand(absl::StrCat(waits_10s, " stream --lobster ", kOrderbook, " ", kMessages, " --count 10"));
  EXPECT_EQ(no_instrument.exit_code, 1);
  EXPECT_THAT(no_instrument.output, HasSubstr("INVALID_ARGUMENT: stream needs --instrument ID"));
  for (const char* command : {" streams close A --while_fed", " streams --while_fed"}) {
    const CommandResult ignored = RunCommand(absl::StrCat(waits_10s, command));
    EXPECT_EQ(ignored.exit_code, 1) << command;
    EXPECT_THAT(ignored.output, HasSubstr("INVALID_ARGUMENT: --while_fed applies to streams reset ID only")) << command;
  }
  // An id the daemon refuses was sent, and its refusal ended "run the same command again".
  const std::string long_id(257, 'A');
  for (const std::string& command : {absl::StrCat(" stream --lobster ", kOrderbook, " ", kMessages, " --instrument "),
                                    std::string(" convictions --out x.csv --instrument ")}) {
    const CommandResult too_long = RunCommand(absl::StrCat(waits_10s, command, long_id));
    EXPECT_EQ(too_long.exit_code, 1) << command;
    EXPECT_THAT(too_long.output, HasSubstr("INVALID_ARGUMENT: --instrument: the instrument id has 257 bytes; at most "
                                           "256 are allowed")) << command;
  }
  const CommandResult no_out = RunCommand(absl::StrCat(waits_10s, " convictions --instrument AAPL"));
  EXPECT_EQ(no_out.exit_code, 1);
  EXPECT_THAT(no_out.output, HasSubstr("INVALID_ARGUMENT: convictions needs --out FILE.csv"));
  const CommandResult no_events = RunCommand(absl::StrCat(waits_10s, " bench --events 0"));
  EXPECT_EQ(no_events.exit_code, 1);
  EXPECT_THAT(no_events.output, HasSubstr("INVALID_ARGUMENT: --events must be >= 1, got 0"));
  // A second --lobster (another day's files) replaced the first without a word: each command reads one pair.
  const std::string files = absl::StrCat(" --lobster ", kOrderbook, " ", kMessages);
  for (const char* command : {" train", " eval", " stream --instrument A"}) {
    const CommandResult twice = RunCommand(absl::StrCat(waits_10s, command, files, files));
    EXPECT_EQ(twice.exit_code, 1) << command;
    EXPECT_THAT(twice.output, HasSubstr("INVALID_ARGUMENT: --lobster was given 2 times: a command reads one LOBSTER "
                                        "file pair, and only the last would have been read")) << command;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "none of them waited for the daemon";
}

// --help exited 1 (abseil 20220623's exit after usage), so a script that asked a program for its flags saw a failure.
// Asking for help exits 0. (A flag no program has still exits 1, but not here: abseil's parse exits on it holding a
// mutex of its own, which ThreadSanitizer reports as destroyed while locked, against abseil's code.)
TEST(PerceptionctlTest, EveryProgramsHelpExitsZero) {
  for (const char* program : {PERCEPTIONCTL_PATH, PERCEPTION_CLI_PATH, PERCEPTIOND_PATH}) {
    SCOPED_TRACE(program);
    for (const char* flag : {" --help", " --helpfull"}) {
      const CommandResult help = RunCommand(absl::StrCat(program, flag));
      EXPECT_EQ(help.exit_code, 0) << flag << ": " << help.output;
      EXPECT_THAT(help.output, HasSubstr("Flags from ")) << flag;
    }
  }
}

// Out-of-range values were replaced by defaults (--lr <= 0: init's 1e-3 or the model's; --warmup below -1: the
// preset's; eval --window below 0: the model's) or accepted (--timeout <= 0 failed every call at once): refused
// naming the flag, before --wait waits (none listens here; a regression fails on the message after 2 s).
TEST(PerceptionctlTest, OutOfRangeFlagsAreRefusedNotReplacedByDefaults) {
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=127.0.0.1:1 --wait 2s");
  const std::string files = absl::StrCat(" --lobster ", kOrderbook, " ", kMessages);
  const std::vector<std::pair<std::string, std::string>> refused = {
      {" init --config tiny --lr 0", "INVALID_ARGUMENT: --lr must be a finite number > 0"},
      {" init --config tiny --lr -0.001", "INVALID_ARGUMENT: --lr must be a finite number > 0"},
      {absl::StrCat(" train", files, " --steps 5 --lr -1"), "INVALID_ARGUMENT: --lr must be a finite number > 0"},
      // Infinity is > 0: it reached the daemon, which said "lr must be positive", after the files were read.
      {absl::StrCat(" train", files, " --steps 5 --lr inf"),
       "INVALID_ARGUMENT: --lr must be a finite number > 0 (leave it out for init's default or to keep the model's), "
       "got inf"},
      {" init --config tiny --lr nan", "INVALID_ARGUMENT: --lr must be a finite number > 0"},
      {" init --config tiny --warmup -2", "INVALID_ARGUMENT: --warmup must be >= 0, or -1 for the preset's, got -2"},
      {absl::StrCat(" eval", files, " --window -3"), "INVALID_ARGUMENT: --window must be >= 0 (0: the model's)"},
      {" --timeout 0s status", "INVALID_ARGUMENT: --timeout must be > 0, got 0"},
      {" --timeout -1s status", "INVALID_ARGUMENT: --timeout must be > 0, got -1s"},
      // A negative --levels was the preset's feature count for init and failed inside the file read for the rest; a
      // --log_every below 1 was 1, a negative --wait no wait.
      {" init --config tiny --levels -3", "INVALID_ARGUMENT: --levels must be >= 0 (0: the preset's), got -3"},
      {absl::StrCat(" eval", files, " --levels -1"), "INVALID_ARGUMENT: --levels must be >= 0 (0: all of the"},
      {absl::StrCat(" train", files, " --steps 5 --log_every 0"), "INVALID_ARGUMENT: --log_every must be >= 1, got 0"},
      {" --wait -1s status", "INVALID_ARGUMENT: --wait must be >= 0 (0: no wait), got -1s"},
      {" --targets=127.0.0.1:2,127.0.0.1:3 status",
       "INVALID_ARGUMENT: give --target (one daemon) or --targets (the ranks of a job), not both"},
      // Checked only once the daemon answered and the files were read, the first with another reason.
      {absl::StrCat(" train", files, " --steps 5 --train_fraction 1.5"),
       "INVALID_ARGUMENT: --train_fraction must be in (0, 1), got 1.5"},
      {absl::StrCat(" stream", files, " --instrument A --count 100 --seed-window -1"),
       "INVALID_ARGUMENT: --seed-window must be >= 0 (0: no seed), got -1"},
      {absl::StrCat(" stream", files, " --instrument A --count 100 --seed-window 100"),
       "INVALID_ARGUMENT: --seed-window 100 leaves nothing of the 100 events of --count to stream"},
      // --reseed without a seed did nothing; a bench too large to keep its latencies aborted in a worker thread.
      {absl::StrCat(" stream", files, " --instrument A --count 100 --reseed"),
       "INVALID_ARGUMENT: --reseed applies to --seed-window N"},
      {" bench --events 10000000000", "INVALID_ARGUMENT: --events 10000000000 is more than one bench keeps"},
      // An infinite rate paced every send at the run's start, and bench timed its latencies from there.
      {" bench --events 10 --rate inf", "INVALID_ARGUMENT: --rate must be a finite positive number of events per "
                                        "second, or max, not 'inf'"},
      {" train --lobster a b --steps 2 --total_steps -1", "INVALID_ARGUMENT: --total_steps must be >= 1 (0: the "
                                                           "model's), got -1"},
      // The cosine schedule's settings under the constant schedule (init's default) were ignored, even contradictory.
      {" init --config tiny --lr_warmup_steps 50 --total_steps 10",
       "INVALID_ARGUMENT: --lr_warmup_steps sets the cosine schedule: without --lr_schedule cosine it would be "
       "ignored"},
      {" init --config tiny --min_lr 5", "INVALID_ARGUMENT: --min_lr sets the cosine schedule"},
      {" init --config tiny --lr_schedule constant --total_steps 10",
       "INVALID_ARGUMENT: --total_steps sets the cosine"},
      // The cosine schedule's own bounds named the request's fields (warmup_steps, total_steps), after the wait.
      {" init --config tiny --lr_schedule cosine",
       "INVALID_ARGUMENT: --lr_schedule cosine needs 0 <= --lr_warmup_steps (0) < --total_steps (0)"},
      {" init --config tiny --lr 0.001 --lr_schedule cosine --total_steps 10 --min_lr 0.01",
       "INVALID_ARGUMENT: --min_lr (0.01) must be in [0, --lr] (--lr 0.001)"},
      {" init --config tiny --lr_schedule cosine --total_steps 10 --min_lr 0.01",
       "INVALID_ARGUMENT: --min_lr (0.01) must be in [0, --lr] (--lr 0.001, init's default)"},
  };
  ExpectEachRefused(ctl, refused);
}

// A command took the flags of the others and ignored them: `train --lr_schedule cosine --lr_warmup_steps 10` trained
// at the model's constant rate, `stream --out X` wrote nothing. Each is refused, naming whose flag it is, before --wait
// waits; the global flags and a flag's own commands pass.
TEST(PerceptionctlTest, CommandsRefuseFlagsTheyDoNotTake) {
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=127.0.0.1:1 --wait 2s");
  const std::string files = absl::StrCat(" --lobster ", kOrderbook, " ", kMessages);
  const std::vector<std::pair<std::string, std::string>> refused = {
      {absl::StrCat(" train", files, " --steps 3 --lr_schedule cosine --lr_warmup_steps 10 --config large"),
       "INVALID_ARGUMENT: train does not take --config (init's flag), --lr_schedule (init's flag), --lr_warmup_steps "
       "(init's flag)"},
      {absl::StrCat(" stream", files, " --instrument A --from 7 --out /tmp/x.csv"),
       "INVALID_ARGUMENT: stream does not take --from (convictions' flag), --out (convictions' flag)"},
      {absl::StrCat(" status", files), "INVALID_ARGUMENT: status does not take --lobster (train's, eval's and "
                                       "stream's flag)"},
      {" checkpoint save a --steps 3", "INVALID_ARGUMENT: checkpoint does not take --steps (train's flag)"},
      {" bench --instrument A", "INVALID_ARGUMENT: bench does not take --instrument (stream's and convictions' flag)"},
      // Given at its default value, a flag is still given.
      {" init --config tiny --rate max", "INVALID_ARGUMENT: init does not take --rate (stream's and bench's flag)"},
      // A mistyped command is named as unexpected, not its flags as another command's.
      {" trian --steps 3", "INVALID_ARGUMENT: unknown command 'trian' (the commands: status, init, train, eval"},
      {" checkpoint save",
       "INVALID_ARGUMENT: unexpected arguments for checkpoint: checkpoint save (its usage is below)"},
      // No command: it said "unexpected arguments: " and nothing after it.
      {"", "INVALID_ARGUMENT: no command given\n\ndrive perceptiond over gRPC."},
  };
  ExpectEachRefused(ctl, refused);
  // Taken: the command's own flags and the global ones reach the wait for the daemon, which none answers here.
  const CommandResult init = RunCommand(absl::StrCat(
      PERCEPTIONCTL_PATH, " --target=127.0.0.1:1 --wait 1s --timeout 5s init --config tiny --levels 1 --seed 3 "
                          "--lr_schedule cosine --lr_warmup_steps 2 --total_steps 10 --min_lr 1e-5 --replace"));
  EXPECT_EQ(init.exit_code, 1);
  EXPECT_THAT(init.output, HasSubstr("DEADLINE_EXCEEDED: perceptiond at 127.0.0.1:1 is not serving after 1s"));
}

// No command, or inspect without its checkpoint, said "unexpected arguments: inspect"; a mistyped command is named
// as unknown, with the commands there are.
TEST(PerceptionCliTest, AMissingCommandOrCheckpointIsNamed) {
  const CommandResult none = RunCommand(PERCEPTION_CLI_PATH);
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_THAT(none.output, HasSubstr("perception: no command given\n\ntrain, evaluate and inspect"));
  const CommandResult mistyped = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " trian"));
  EXPECT_EQ(mistyped.exit_code, 1);
  EXPECT_THAT(mistyped.output, HasSubstr("perception: unknown command 'trian' (the commands: train, eval, inspect)\n\n"
                                         "train, evaluate and inspect"));
  const CommandResult extra = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " eval more"));
  EXPECT_EQ(extra.exit_code, 1);
  EXPECT_THAT(extra.output, HasSubstr("perception: unexpected arguments for eval: eval more (its usage is below)"));
  const CommandResult inspect = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " inspect"));
  EXPECT_EQ(inspect.exit_code, 1);
  EXPECT_THAT(inspect.output, HasSubstr("perception: inspect needs a checkpoint: inspect CKPT"));
}

// --log_every 0 divided by zero at the first step (SIGFPE); perceptionctl already clamps its own.
TEST(PerceptionCliTest, TrainRefusesAZeroLogInterval) {
  const ScopedTempDir temp("cli_log_every");
  const CommandResult train =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ", kOrderbook, " ",
                              kMessages, " --steps 2 --log_every 0 --save ", (temp.path() / "a.safetensors").string()));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("--log_every must be >= 1, got 0"));
}

// A second --lobster (another day's files, say) replaced the first without a word: a command reads one pair.
TEST(PerceptionCliTest, ALobsterPairGivenTwiceIsRefused) {
  const ScopedTempDir temp("cli_lobster_twice");
  const std::string files = absl::StrCat(" --lobster ", kOrderbook, " ", kMessages);
  const std::string checkpoint = (temp.path() / "x.safetensors").string();
  for (const std::string& command :
       {absl::StrCat(" train --device cpu --config tiny --steps 2 --save ", checkpoint),
        absl::StrCat(" eval --checkpoint ", checkpoint, " --out ", (temp.path() / "x.npy").string())}) {
    const CommandResult twice = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, command, files, " --lobster=", kOrderbook,
                                                        ",", kMessages));
    EXPECT_EQ(twice.exit_code, 1) << command << twice.output;
    EXPECT_THAT(twice.output, HasSubstr("--lobster was given 2 times: a command reads one LOBSTER file pair, and only "
                                        "the last would have been read")) << command;
  }
}

// A training part that scores no label (AAPL's 998 events at --train_fraction 0.01: 10 events, each within a horizon
// of the part's end) trained every step on a loss of 0 and saved the result, exiting 0.
TEST(PerceptionCliTest, TrainRefusesATrainingPartThatScoresNoLabel) {
  const ScopedTempDir temp("cli_unscored_train");
  const std::string checkpoint = (temp.path() / "z.safetensors").string();
  const CommandResult train =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ", kOrderbook, " ",
                              kMessages, " --train_fraction 0.01 --steps 5 --save ", checkpoint));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("the training part (10 events) scores no label"));
  EXPECT_FALSE(std::filesystem::exists(checkpoint));
}

// --steps 0 failed on a derived setting ("warmup_steps (-1)"), and a run without --save trained for nothing.
TEST(PerceptionCliTest, TrainRefusesNoStepsAndNoSave) {
  const ScopedTempDir temp("cli_steps_save");
  const std::string train = absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ",
                                         kOrderbook, " ", kMessages);
  const CommandResult no_steps =
      RunCommand(absl::StrCat(train, " --steps 0 --save ", (temp.path() / "tiny.safetensors").string()));
  EXPECT_EQ(no_steps.exit_code, 1) << no_steps.output;
  EXPECT_THAT(no_steps.output, HasSubstr("--steps must be >= 1, got 0"));
  const CommandResult no_save = RunCommand(absl::StrCat(train, " --steps 2"));
  EXPECT_EQ(no_save.exit_code, 1) << no_save.output;
  EXPECT_THAT(no_save.output, HasSubstr("train needs --save CKPT"));
  const CommandResult saved =
      RunCommand(absl::StrCat(train, " --steps 2 --save ", (temp.path() / "tiny.safetensors").string()));
  EXPECT_EQ(saved.exit_code, 0) << saved.output;
  EXPECT_TRUE(std::filesystem::exists(temp.path() / "tiny.safetensors"));
}

// The (step, val_loss) of each progress line of `perception train` that validated.
std::vector<std::pair<int64_t, double>> PerceptionTrainValidations(const std::string& output) {
  std::vector<std::pair<int64_t, double>> found;
  for (const absl::string_view line : absl::StrSplit(output, '\n')) {
    const std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    const auto at = std::ranges::find(words, "val_loss");
    int64_t step = 0;
    double loss = 0;
    if (words.size() < 2 || words[0] != "step" || at == words.end() || std::next(at) == words.end() ||
        !absl::SimpleAtoi(words[1], &step) || !absl::SimpleAtod(*std::next(at), &loss)) {
      continue;
    }
    found.emplace_back(step, loss);
  }
  return found;
}

// --save_best holds the model of the run's lowest validation loss, --save the last. On the AMZN day at this rate
// the best is neither the first validation nor the last, so a file written at either would not pass; and under a
// constant rate a run that stops at the best's step trains the same batches, so its last model is the best's, bit
// for bit (parameters and moments).
TEST(PerceptionCliTest, TrainSaveBestKeepsTheLowestValidation) {
  const ScopedTempDir temp("cli_save_best");
  const std::filesystem::path last = temp.path() / "last.safetensors", best = temp.path() / "best.safetensors";
  const std::string amzn = absl::StrCat(testing::ShippedLobsterPath("AMZN", "orderbook", 1), " ",
                                        testing::ShippedLobsterPath("AMZN", "message", 1));
  const std::string train = absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ", amzn,
                                         " --val_every 2 --lr 0.05 --lr_schedule constant");
  const std::string twelve_steps = absl::StrCat(train, " --steps 12 --save ", last.string());
  const CommandResult run = RunCommand(absl::StrCat(twelve_steps, " --save_best ", best.string()));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::vector<std::pair<int64_t, double>> validations = PerceptionTrainValidations(run.output);
  ASSERT_EQ(validations.size(), 6u) << run.output;
  const auto lowest = std::ranges::min_element(validations, {}, [](const auto& v) { return v.second; });
  ASSERT_NE(lowest, validations.begin()) << "the run no longer tells the best from the first validation";
  ASSERT_NE(lowest, std::prev(validations.end())) << "the run no longer tells the best from the last";
  EXPECT_THAT(run.output, HasSubstr(absl::StrFormat("best validation loss %.5f at step %d: saved %s", lowest->second,
                                                    lowest->first, best.string())));
  const absl::StatusOr<Checkpoint> saved_best = LoadCheckpoint(best.string());
  const absl::StatusOr<Checkpoint> saved_last = LoadCheckpoint(last.string());
  ASSERT_TRUE(saved_best.ok()) << saved_best.status();
  ASSERT_TRUE(saved_last.ok()) << saved_last.status();
  EXPECT_EQ(saved_best->step, lowest->first);
  EXPECT_EQ(saved_last->step, 12);
  const std::filesystem::path stopped = temp.path() / "stopped.safetensors";
  const CommandResult stop_at_best =
      RunCommand(absl::StrCat(train, " --steps ", lowest->first, " --save ", stopped.string()));
  ASSERT_EQ(stop_at_best.exit_code, 0) << stop_at_best.output;
  const absl::StatusOr<Checkpoint> saved_stopped = LoadCheckpoint(stopped.string());
  ASSERT_TRUE(saved_stopped.ok()) << saved_stopped.status();
  EXPECT_TRUE(saved_best->params == saved_stopped->params);
  EXPECT_TRUE(saved_best->exp_avg == saved_stopped->exp_avg);
  EXPECT_TRUE(saved_best->exp_avg_sq == saved_stopped->exp_avg_sq);

  // Refused before any data is read (the LOBSTER files named here do not exist): --save's own file, a folder that
  // does not exist, no path.
  ExpectEachRefused(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster /nonexistent/ob.csv ",
                                 "/nonexistent/msg.csv --steps 2 --save ", last.string()),
                    {{absl::StrCat(" --save_best ", last.string()), "--save and --save_best name one file"},
                     {" --save_best /nonexistent/b.st",
                      "cannot write /nonexistent/b.st: cannot create its temporary file /nonexistent/b.st.tmp."},
                     {" --save_best=", "perception: --save_best needs a checkpoint path"}});
}

// `perception train` with `args` (--device cpu and a --save among them), interrupted by SIGINT once its log (the file
// at `log`) shows step 3 of the run: its end (the log's text as output), nullopt where it did not get there or the
// signal did not stop it within a minute. Runs at `log_every` 1.
std::optional<CommandResult> TrainInterruptedAtStepThree(const std::string& args, const std::filesystem::path& log) {
  const std::filesystem::path pid_file = absl::StrCat(log.string(), ".pid");
  auto [running, pid] = StartThenWait(
      absl::StrCat("echo $$ > ", pid_file.string(), "; exec ", PERCEPTION_CLI_PATH, " train ", args,
                   " --log_every 1 > ", log.string(), " 2>&1"),
      pid_file, [&] { return WithinAMinute([&] { return absl::StrContains(FileText(log), "\nstep     3 "); }); });
  // No daemon's end stops this run: one the test leaves early (or a signal that no longer stops it) is killed, where
  // the future's end would wait out its steps.
  const absl::Cleanup kill_the_run = [&running, &pid_file] {
    pid_t run = 0;
    std::ifstream(pid_file) >> run;
    if (running.valid() && run > 0) ::kill(run, SIGKILL);
  };
  EXPECT_GT(pid, 0) << "the run never reached step 3";
  if (pid <= 0 || ::kill(pid, SIGINT) != 0) return std::nullopt;
  EXPECT_EQ(running.wait_for(std::chrono::seconds(60)), std::future_status::ready) << "the signal did not stop it";
  if (running.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return std::nullopt;
  CommandResult interrupted = running.get();
  interrupted.output = FileText(log);
  return interrupted;
}

// Ctrl-C ended an offline run with nothing saved but --save_best's model. The first signal now stops it between
// steps; the model it reached is validated and saved to --save, the run says where it stopped, and it ends by the
// signal.
TEST(PerceptionCliTest, AnInterruptedTrainSavesTheModelItReached) {
  const ScopedTempDir temp("cli_interrupted");
  const std::filesystem::path saved = temp.path() / "saved.safetensors";
  const std::optional<CommandResult> interrupted =
      TrainInterruptedAtStepThree(absl::StrCat("--device cpu --config tiny --lobster ", kOrderbook, " ", kMessages,
                                               " --steps 1000000 --save ", saved.string()),
                                  temp.path() / "log");
  ASSERT_TRUE(interrupted.has_value());
  EXPECT_EQ(interrupted->ended_by_signal, SIGINT) << interrupted->exit_code;
  const std::string& output = interrupted->output;
  EXPECT_THAT(output, HasSubstr("perception: Interrupt: no further step is taken; the model is validated and saved "
                                "to --save"));
  const std::optional<std::pair<int64_t, int64_t>> stopped = TwoNumbers(
      output, "perception: interrupted after ([0-9]+) of 1000000 steps: the model of step ([0-9]+) is validated and "
              "saved to --save");
  ASSERT_TRUE(stopped.has_value()) << output;
  EXPECT_GE(stopped->first, 3);
  EXPECT_EQ(stopped->second, stopped->first);
  EXPECT_THAT(output, ContainsRegex("\nvalidation loss [0-9.]+ vs class-prior baseline"));
  EXPECT_THAT(output, HasSubstr(absl::StrCat("saved ", saved.string(), " (step ", stopped->first, ")")));
  const absl::StatusOr<Checkpoint> checkpoint = LoadCheckpoint(saved.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ(checkpoint->step, stopped->first);
}

// An offline run could not go on from a checkpoint: an interrupted one was lost but for its model, which only a
// daemon could train further. `train --checkpoint` goes on with its model, moments, step, schedule and normalizer,
// on the batches the run would have taken: the interrupted run resumed as its message says ends on the whole run's
// checkpoint byte for byte, through the same validations. (Each step validates on the AMZN day's held-out part,
// ~25 steps/s, so the run is still far from its end when the signal lands.)
TEST(PerceptionCliTest, AnInterruptedTrainResumedFromItsCheckpointEndsWhereTheWholeRunDoes) {
  const ScopedTempDir temp("cli_resumed");
  const std::filesystem::path whole = temp.path() / "whole.safetensors", part = temp.path() / "part.safetensors",
                              rest = temp.path() / "rest.safetensors";
  const std::string data = absl::StrCat(" --device cpu --lobster ", testing::ShippedLobsterPath("AMZN", "orderbook", 1),
                                        " ", testing::ShippedLobsterPath("AMZN", "message", 1), " --val_every 1");
  const std::string run = absl::StrCat(data, " --config tiny --steps 40 --seed 7 --lr 0.01");
  const CommandResult whole_run = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train", run, " --save ", whole.string()));
  ASSERT_EQ(whole_run.exit_code, 0) << whole_run.output;
  const std::optional<CommandResult> interrupted =
      TrainInterruptedAtStepThree(absl::StrCat(run, " --save ", part.string()), temp.path() / "log");
  ASSERT_TRUE(interrupted.has_value());
  const std::optional<std::pair<int64_t, int64_t>> stopped = TwoNumbers(
      interrupted->output, "interrupted after ([0-9]+) of 40 steps: .* to train the remaining ([0-9]+) steps on the "
                           "batches this run would have, run perception train --checkpoint ");
  ASSERT_TRUE(stopped.has_value()) << interrupted->output;
  ASSERT_LT(stopped->first, 40) << "the run ended before the signal";
  EXPECT_EQ(stopped->second, 40 - stopped->first);
  EXPECT_THAT(interrupted->output,
              HasSubstr(absl::StrCat("run perception train --checkpoint ", part.string(), " with this run's --lobster, "
                                     "--levels, --seed, --train_fraction, --device and --precision")));

  const CommandResult resumed = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --checkpoint ", part.string(),
                                                        data, " --seed 7 --save ", rest.string()));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr(absl::StrCat("from step ", stopped->first, " of ", part.string())));
  EXPECT_THAT(resumed.output, HasSubstr(absl::StrCat("saved ", rest.string(), " (step 40)")));
  const std::vector<std::pair<int64_t, double>> all = PerceptionTrainValidations(whole_run.output);
  ASSERT_EQ(all.size(), 40u) << whole_run.output;
  const std::vector<std::pair<int64_t, double>> after_the_stop(all.begin() + stopped->first, all.end());
  EXPECT_EQ(PerceptionTrainValidations(resumed.output), after_the_stop) << resumed.output;
  EXPECT_EQ(FileText(rest), FileText(whole)) << "the resumed run's checkpoint is not the whole run's";

  // Refused before any data is read: a setting the checkpoint holds, a schedule at its end without --steps.
  ExpectEachRefused(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --lobster /nonexistent/ob.csv ",
                                 "/nonexistent/msg.csv --save ", (temp.path() / "x.safetensors").string()),
                    {{absl::StrCat(" --checkpoint ", part.string(), " --config tiny"),
                      "--config is the checkpoint's where train goes on from --checkpoint"},
                     {absl::StrCat(" --checkpoint ", part.string(), " --lr 0.01"),
                      "--lr is the checkpoint's where train goes on from --checkpoint"},
                     {absl::StrCat(" --checkpoint ", whole.string()),
                      absl::StrCat(whole.string(), " is at step 40, where its schedule of 40 steps ends: give --steps "
                                   "N to train on past it")},
                     {" --checkpoint=", "--checkpoint needs a path"}});

  // A daemon's model at a constant rate sets no number of steps; one without optimizer settings (another program's
  // checkpoint) takes the rate flags, at a constant rate.
  absl::StatusOr<Checkpoint> model = LoadCheckpoint(part.string());
  ASSERT_TRUE(model.ok()) << model.status();
  model->optimizer = OptimizerConfig{};
  const std::filesystem::path constant = temp.path() / "constant.safetensors", bare = temp.path() / "bare.safetensors";
  ASSERT_TRUE(SaveCheckpoint(constant.string(), *model).ok());
  model->optimizer.reset();
  ASSERT_TRUE(SaveCheckpoint(bare.string(), *model).ok());
  ExpectEachRefused(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --lobster /nonexistent/ob.csv ",
                                 "/nonexistent/msg.csv --save ", (temp.path() / "x.safetensors").string()),
                    {{absl::StrCat(" --checkpoint ", constant.string()),
                      absl::StrCat(constant.string(), " sets no number of steps (a constant rate, as a daemon's model "
                                   "has where no --total_steps was given): give --steps N")},
                     {absl::StrCat(" --checkpoint ", bare.string()),
                      absl::StrCat(bare.string(), " holds no optimizer settings: give --steps N")},
                     {absl::StrCat(" --checkpoint ", bare.string(), " --steps 2 --lr_schedule cosine"),
                      "--lr_schedule sets a schedule, which a run from a checkpoint without optimizer settings does "
                      "not take: it trains at the constant --lr"}});
  const CommandResult bare_run = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --checkpoint ", bare.string(),
                                                         data, " --steps 2 --lr 0.02 --save ", rest.string()));
  ASSERT_EQ(bare_run.exit_code, 0) << bare_run.output;
  EXPECT_THAT(bare_run.output, HasSubstr("holds no optimizer settings: it trains on at a constant rate, --lr 0.02"));
  const absl::StatusOr<Checkpoint> trained_on = LoadCheckpoint(rest.string());
  ASSERT_TRUE(trained_on.ok()) << trained_on.status();
  EXPECT_EQ(trained_on->step, stopped->first + 2);
  ASSERT_TRUE(trained_on->optimizer.has_value());
  EXPECT_EQ(trained_on->optimizer->lr, 0.02);
}

// A --save_best write that fails mid-run (here: a FIFO put at its name after the first best was saved, which a
// write refuses to replace) ends the offers, not the run: every step runs, --save is written, the FIFO is left as it
// is, and the run exits 1 naming the failure. On the AMZN day at the default rate every validation of these 30 steps
// beats the one before it (25 steps/s here), so bests keep coming after the swap.
TEST(PerceptionCliTest, ASaveBestThatFailsMidRunLeavesTheRunAndSaveGoingOn) {
  const ScopedTempDir temp("cli_save_best_fails");
  const std::filesystem::path last = temp.path() / "last.safetensors", best = temp.path() / "best.safetensors";
  const std::string train = absl::StrCat(
      PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ",
      testing::ShippedLobsterPath("AMZN", "orderbook", 1), " ", testing::ShippedLobsterPath("AMZN", "message", 1),
      " --val_every 1 --steps 30 --save ", last.string(), " --save_best ", best.string());
  const std::string fifo = (temp.path() / "fifo").string();
  // (In a subshell, so that RunCommand's 2>&1 takes the background run's stderr too.)
  const CommandResult run = RunCommand(absl::StrCat(
      "(", train, " & pid=$!; while [ ! -e ", best.string(), " ] && kill -0 $pid 2>/dev/null; do sleep 0.005; done; ",
      "mkfifo ", fifo, " && mv -f ", fifo, " ", best.string(), "; wait $pid)"));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  const std::vector<std::pair<int64_t, double>> validations = PerceptionTrainValidations(run.output);
  ASSERT_EQ(validations.size(), 30u) << run.output;
  EXPECT_LT(validations.back().second, validations.front().second) << run.output;
  EXPECT_THAT(run.output, HasSubstr(absl::StrCat("--save_best ", best.string(), " not written: ")));
  EXPECT_THAT(run.output, HasSubstr("is a FIFO"));
  EXPECT_THAT(run.output, HasSubstr("the run goes on"));
  // The run's last word, after --save's line.
  EXPECT_THAT(run.output, HasSubstr(absl::StrCat("\nperception: saving checkpoint '", best.string(), "': ",
                                                 best.string(), " is a FIFO")));
  EXPECT_THAT(run.output, HasSubstr(absl::StrCat("saved ", last.string(), " (step 30)")));
  EXPECT_THAT(run.output, Not(HasSubstr("best validation loss")));
  const absl::StatusOr<Checkpoint> saved = LoadCheckpoint(last.string());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step, 30);
  EXPECT_TRUE(std::filesystem::is_fifo(best)) << "the FIFO is left in place";
}

// A run whose validation loss came out not finite (its steps' gradients were, so every step was taken) said "the
// model has diverged", saved it and exited 0. It now exits 1, saying so, with the model saved all the same.
TEST(PerceptionCliTest, ARunWhoseValidationIsNotFiniteExitsNonZero) {
  const ScopedTempDir temp("cli_nan_validation");
  const std::filesystem::path last = temp.path() / "last.safetensors";
  const CommandResult run = RunCommand(absl::StrCat(
      PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ",
      testing::ShippedLobsterPath("AMZN", "orderbook", 1), " ", testing::ShippedLobsterPath("AMZN", "message", 1),
      " --lr 15 --lr_schedule constant --steps 34 --val_every 0 --save ", last.string()));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("val_loss nan "));
  EXPECT_THAT(run.output, HasSubstr(absl::StrCat("saved ", last.string(), " (step 34)")));
  EXPECT_THAT(run.output, HasSubstr("perception: the model has diverged at step 34: its validation loss is not finite "
                                    "(saved to --save all the same); train again with a lower --lr"));
}

// A validation event that standardizes beyond kMaxStandardizedFeature under the normalizer fitted on the training
// part is refused before any step, naming its line, as eval refuses it (WriteFilesWithAJumpAtRow250). Before, the run
// trained and validated on outputs that were not MODEL.md's.
TEST(PerceptionCliTest, AValidationEventBeyondTheStandardizedBoundIsRefusedBeforeAnyStep) {
  const ScopedTempDir temp("cli_train_beyond_bound");
  const std::filesystem::path last = temp.path() / "last.safetensors";
  const CommandResult run =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny",
                              WriteFilesWithAJumpAtRow250(temp.path()), " --steps 2 --save ", last.string()));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("line 250 of the LOBSTER files: feature 5 is "));
  EXPECT_THAT(run.output, HasSubstr("a feature must stay within 1e+16 of it"));
  EXPECT_FALSE(std::filesystem::exists(last));
}

// A training shape the host cannot hold aborted on std::bad_alloc (exit 134) in the first batch's sampling; it is
// refused with what it needed. The address space is held to 2.5 GB for the run, below the two batches' ~4.7 GB.
TEST(PerceptionCliTest, TrainingBatchesTheHostCannotHoldAreRefused) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's shadow memory does not run under an address-space limit";
#endif
  const ScopedTempDir temp("cli_huge_batches");
  const CommandResult run = RunCommand(absl::StrCat(
      "ulimit -v 2500000; ", PERCEPTION_CLI_PATH, " train --device cpu --config tiny", kLongFeed,
      " --steps 1 --window 15000 --batch 1600 --save ", (temp.path() / "big.safetensors").string()));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("perception: cannot allocate two training batches of 1600 windows x 15000 events: "
                                    "out of host memory"));
}

// A step whose gradient norm is not finite ended the run with exit 1 and nothing saved: the steps before it were lost
// and the daemon's advice (train on without the batch) could not be taken. The run now stops there and saves the
// model before that step, whose weights are finite (LoadCheckpoint refuses a NaN), then exits 1 saying so.
TEST(PerceptionCliTest, ARunThatDivergesSavesTheModelBeforeTheStepNotTaken) {
  const ScopedTempDir temp("cli_diverges");
  const std::filesystem::path last = temp.path() / "last.safetensors";
  const CommandResult run = RunCommand(absl::StrCat(
      PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ",
      testing::ShippedLobsterPath("AMZN", "orderbook", 1), " ", testing::ShippedLobsterPath("AMZN", "message", 1),
      " --lr 100 --steps 300 --val_every 0 --save ", last.string()));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  const size_t stop = run.output.find(" of 300 was not taken (the batch's gradient norm is ");
  ASSERT_NE(stop, std::string::npos) << run.output;
  const size_t number = run.output.rfind("step ", stop) + 5;
  const int not_taken = std::stoi(run.output.substr(number, stop - number));
  ASSERT_GT(not_taken, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("perception train stops at a step not taken and saves the model before it"));
  EXPECT_THAT(run.output, HasSubstr(absl::StrCat("saved ", last.string(), " (step ", not_taken - 1, ")")));
  // Its weights already overflow: the validation says so, where it said "(WORSE by nan)".
  EXPECT_THAT(run.output, HasSubstr(": not finite, the model has diverged\n"));
  const absl::StatusOr<Checkpoint> saved = LoadCheckpoint(last.string());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step, not_taken - 1);

  // Evaluated, the diverged model is refused, where eval wrote a file of NaNs and exited 0.
  const std::filesystem::path logits = temp.path() / "logits.npy";
  const CommandResult eval = RunCommand(absl::StrCat(
      PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint ", last.string(), " --lobster ",
      testing::ShippedLobsterPath("AMZN", "orderbook", 1), " ", testing::ShippedLobsterPath("AMZN", "message", 1),
      " --out ", logits.string()));
  EXPECT_EQ(eval.exit_code, 1) << eval.output;
  EXPECT_THAT(eval.output, HasSubstr(absl::StrCat(" of 172545 logits are not finite: the checkpoint's model has "
                                                  "diverged (", logits.string(), " not written)")));
  EXPECT_FALSE(std::filesystem::exists(logits));
}

// A --lr below the model's cosine floor was refused by the daemon's optimizer check ("min_lr must be in [0, lr]"),
// naming neither flag, after the files were read.
TEST(PerceptionctlTest, ALearningRateBelowTheModelsFloorIsNamed) {
  const ScopedTempDir temp("ctl_lr_below_min");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10 --lr 0.005 --lr_schedule cosine ",
                                    "--total_steps 100 --lr_warmup_steps 10 --min_lr 0.001"))
                .exit_code,
            0);
  const CommandResult train =
      RunCommand(absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --steps 2 --lr 0.0005"));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("INVALID_ARGUMENT: the learning rate 0.0005 (--lr) is below min_lr 0.001 (the "
                                      "model's), where the cosine schedule ends: give --lr >= 0.001, or --min_lr in "
                                      "[0, 0.0005]"));
  EXPECT_EQ((*daemon)->client().GetStatus()->model().optimizer().lr(), 0.005) << "the model as it was";
}

// perceptionctl eval of a diverged model fails saying so: NaN outputs scored as "down", so it printed the share of
// down labels as accuracies, a model that seemed to beat a coin, and exited 0.
TEST(PerceptionctlTest, EvalOfADivergedModelFailsSayingSo) {
  const ScopedTempDir temp("ctl_eval_diverged");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  const CommandResult train =
      RunCommand(absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --steps 5 --lr 1e9"));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("the batch's gradient norm is nan")) << "step 1 took the weights to infinity";
  const CommandResult eval = RunCommand(absl::StrCat(ctl, " eval --lobster ", kOrderbook, " ", kMessages));
  EXPECT_EQ(eval.exit_code, 1) << eval.output;
  EXPECT_THAT(eval.output, HasSubstr("FAILED_PRECONDITION: the model at step 1 gives outputs that are not finite on "
                                     "these windows (loss nan): it has diverged; load a checkpoint saved before it "
                                     "did (perceptionctl checkpoint load) or init a new model"));
  EXPECT_THAT(eval.output, Not(HasSubstr("accuracy")));
}

// The offline train refuses a validation part that scores no label, before any step; eval still writes the logits
// of data that scores none and says that there is no loss, where it printed one of 0.
TEST(PerceptionCliTest, DataThatScoresNoLabelHasNoLoss) {
  const ScopedTempDir temp("cli_unscored");
  const std::string checkpoint = (temp.path() / "tiny.st").string();
  const std::string train = absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ",
                                         kOrderbook, " ", kMessages, " --steps 1 --save ", checkpoint);
  const CommandResult refused = RunCommand(train + " --train_fraction 0.99");
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("perception: the validation part scores no label"));
  EXPECT_THAT(refused.output, Not(HasSubstr("step     1")));
  const CommandResult trained = RunCommand(train);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const UnscoredFiles files = WriteUnscoredFiles(temp.path());
  const std::string logits = (temp.path() / "logits.npy").string();
  const CommandResult eval = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint ",
                                                     checkpoint, " --lobster ", files.orderbook, " ", files.messages,
                                                     " --out ", logits));
  ASSERT_EQ(eval.exit_code, 0) << eval.output;
  EXPECT_THAT(eval.output, HasSubstr("10 events, masked BCE over the whole stream none (no label is scored: each "
                                     "event is within a horizon of the file's end or a tie); logits [10, 3]"));
  EXPECT_EQ(ReadNpy(logits).size(), 30u);
}

// --save was first touched after training, so a typo in its folder threw the whole run away.
TEST(PerceptionCliTest, TrainRefusesAnUnwritableSaveBeforeTraining) {
  const CommandResult train =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ", kOrderbook, " ",
                              kMessages, " --steps 2 --save /nonexistent/x.st"));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output,
              HasSubstr("cannot write /nonexistent/x.st: cannot create its temporary file /nonexistent/x.st.tmp."));
  EXPECT_THAT(train.output, Not(HasSubstr("class-prior baseline")));
  EXPECT_THAT(train.output, Not(HasSubstr("step     1")));
}

// A folder as an output passed the check beside it (a trial file inside the folder's parent), so train ran every
// step and failed on the save's rename, and eval wrote its logits, then failed on --features_out: both are refused
// before the work, and eval writes neither file (the checkpoint and the LOBSTER files named here do not exist).
TEST(PerceptionCliTest, AFolderAsAnOutputIsRefusedBeforeTheWork) {
  const ScopedTempDir temp("cli_folder_outputs");
  std::filesystem::create_directory(temp.path() / "folder");
  const std::string folder = (temp.path() / "folder").string(), logits = (temp.path() / "logits.npy").string();
  const std::string train = absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ",
                                         kOrderbook, " ", kMessages, " --steps 2 --save ");
  for (const std::string& save : {folder, folder + "/", (temp.path() / "new").string() + "/"}) {
    SCOPED_TRACE(save);
    const CommandResult refused = RunCommand(train + save);
    EXPECT_EQ(refused.exit_code, 1) << refused.output;
    EXPECT_THAT(refused.output, HasSubstr(absl::StrCat("perception: ", save, " is a folder; the output is a file")));
    EXPECT_THAT(refused.output, Not(HasSubstr("class-prior baseline")));
  }
  const CommandResult eval = RunCommand(absl::StrCat(
      PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint /nonexistent/c.safetensors --lobster /nonexistent/ob.csv ",
      "/nonexistent/msg.csv --out ", logits, " --features_out ", folder));
  EXPECT_EQ(eval.exit_code, 1) << eval.output;
  EXPECT_THAT(eval.output, HasSubstr(absl::StrCat("perception: ", folder, " is a folder; the output is a file")));
  EXPECT_FALSE(std::filesystem::exists(logits));
}

// --batch and --window below 0 and --warmup below -1 were replaced by the config's values (only 0 and -1 mean the
// config's): refused naming the flag, before any data is read (the LOBSTER files named here do not exist).
TEST(PerceptionCliTest, TrainRefusesOutOfRangeShapeFlagsBeforeReadingData) {
  const ScopedTempDir temp("cli_shape_flags");
  const std::string train =
      absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster /nonexistent/ob.csv ",
                   "/nonexistent/msg.csv --steps 2 --save ", (temp.path() / "a.safetensors").string());
  const std::vector<std::pair<std::string, std::string>> refused = {
      {" --batch -1", "perception: --batch must be >= 0 (0: the config's), got -1"},
      {" --window -3", "perception: --window must be >= 0 (0: the config's), got -3"},
      {" --warmup -2", "perception: --warmup must be >= 0, or -1 for the config's, got -2"},
      {" --levels -1", "perception: --levels must be >= 0 (0: all of the files' levels), got -1"},
      // These said "optimizer: lr must be positive" (of infinity too), and the split "leaves an empty part".
      {" --lr inf", "perception: --lr must be a finite number > 0, got inf"},
      {" --lr nan", "perception: --lr must be a finite number > 0, got nan"},
      {" --train_fraction 1.5", "perception: --train_fraction must be in (0, 1), got 1.5"},
  };
  ExpectEachRefused(train, refused);
}

// --lr_warmup_steps at or past --steps was cut to steps - 1 without a word (--steps 5 --lr_warmup_steps 500 warmed
// up over 4 steps), and --lr_warmup_steps -5 and --val_every -1 (which acted as 0) were accepted: all refused naming
// the flags, before any data is read (the LOBSTER files named here do not exist).
TEST(PerceptionCliTest, TrainRefusesAWarmupPastTheStepsAndNegativeIntervals) {
  const ScopedTempDir temp("cli_schedule_flags");
  const std::string train =
      absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster /nonexistent/ob.csv ",
                   "/nonexistent/msg.csv --save ", (temp.path() / "a.safetensors").string());
  const std::vector<std::pair<std::string, std::string>> refused = {
      {" --steps 5 --lr_warmup_steps 500", "perception: --lr_warmup_steps (500) must be < --steps (5) for the cosine"},
      {" --steps 5 --lr_warmup_steps 5", "perception: --lr_warmup_steps (5) must be < --steps (5) for the cosine"},
      // The default's own value, given: still the user's word, so refused rather than cut.
      {" --steps 10 --lr_warmup_steps 20", "perception: --lr_warmup_steps (20) must be < --steps (10) for the cosine"},
      {" --steps 5 --lr_warmup_steps -5", "perception: --lr_warmup_steps must be >= 0, got -5"},
      {" --steps 5 --val_every -1", "perception: --val_every must be >= 0 (0: only at the end), got -1"},
      // A warmup under the constant schedule was ignored.
      {" --steps 5 --lr_schedule constant --lr_warmup_steps 2",
       "perception: --lr_warmup_steps sets the cosine schedule: with --lr_schedule constant it would be ignored"},
  };
  ExpectEachRefused(train, refused);
}

// A subcommand ignored the other's flags: train --out Y --features_out Z trained and wrote neither, and eval ran with
// --graphs, --config, --save, --steps and --train_fraction set. Each is refused, naming whose flag it is, before
// anything is read or written.
TEST(PerceptionCliTest, SubcommandsRefuseFlagsTheyDoNotTake) {
  const ScopedTempDir temp("cli_foreign_flags");
  const std::filesystem::path save = temp.path() / "a.safetensors", out = temp.path() / "logits.npy";
  const CommandResult train = RunCommand(
      absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ", kOrderbook, " ", kMessages,
                   " --steps 2 --save ", save.string(), " --out ", out.string(), " --features_out ", out.string()));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("perception: train does not take --out (eval's flag), --features_out (eval's"));
  EXPECT_FALSE(std::filesystem::exists(save));
  EXPECT_FALSE(std::filesystem::exists(out));

  const CommandResult eval = RunCommand(absl::StrCat(
      PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint /nonexistent/a.safetensors --lobster ", kOrderbook, " ",
      kMessages, " --out ", out.string(), " --graphs bogus --config huge --save /x --steps -4"));
  EXPECT_EQ(eval.exit_code, 1) << eval.output;
  EXPECT_THAT(eval.output, HasSubstr("perception: eval does not take --graphs (train's flag), --config (train's flag), "
                                     "--steps (train's flag), --save (train's"));
  EXPECT_FALSE(std::filesystem::exists(out));
  // eval takes --train_fraction (the part train held out, scored alone), in train's range.
  const CommandResult fraction = RunCommand(absl::StrCat(
      PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint /nonexistent/a.safetensors --lobster ", kOrderbook, " ",
      kMessages, " --out ", out.string(), " --train_fraction 7"));
  EXPECT_EQ(fraction.exit_code, 1) << fraction.output;
  EXPECT_THAT(fraction.output, HasSubstr("perception: --train_fraction must be in (0, 1), got 7"));
  EXPECT_FALSE(std::filesystem::exists(out));

  const CommandResult inspect =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " inspect /nonexistent/a.safetensors --device cpu"));
  EXPECT_EQ(inspect.exit_code, 1) << inspect.output;
  EXPECT_THAT(inspect.output, HasSubstr("perception: inspect does not take --device (train's and eval's flag)"));

  // A flag given in a --flagfile is given as well.
  const std::filesystem::path flagfile = temp.path() / "flags";
  { std::ofstream(flagfile) << "--config=small\n--steps=3\n"; }
  const CommandResult eval_flagfile = RunCommand(absl::StrCat(
      PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint /nonexistent/a.safetensors --lobster ", kOrderbook, " ",
      kMessages, " --out ", out.string(), " --flagfile ", flagfile.string()));
  EXPECT_EQ(eval_flagfile.exit_code, 1) << eval_flagfile.output;
  EXPECT_THAT(eval_flagfile.output,
              HasSubstr("perception: eval does not take --config (train's flag), --steps (train's flag)\n"));
}

// eval wrote --out and --features_out without comparing them with each other or with its inputs: one path for both
// kept only the features, and --out naming the checkpoint replaced it with logits, each with exit code 0. train's
// --save could name a LOBSTER file. Refused before anything is read or written; the files are unchanged.
TEST(PerceptionCliTest, AnOutputNamingAnInputOrTheOtherOutputIsRefused) {
  const ScopedTempDir temp("cli_same_paths");
  const std::filesystem::path orderbook = temp.path() / "ob.csv", messages = temp.path() / "msg.csv";
  std::filesystem::copy_file(kOrderbook, orderbook);
  std::filesystem::copy_file(kMessages, messages);
  const std::filesystem::path checkpoint = temp.path() / "a.safetensors", out = temp.path() / "x.npy";
  const std::string lobster = absl::StrCat(" --lobster ", orderbook.string(), " ", messages.string());
  const CommandResult trained = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny",
                                                        lobster, " --steps 2 --save ", checkpoint.string()));
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string checkpoint_bytes = FileText(checkpoint), orderbook_bytes = FileText(orderbook);

  const std::string eval = absl::StrCat(PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint ", checkpoint.string(),
                                        lobster);
  const std::vector<std::pair<std::string, std::string>> refused = {
      {absl::StrCat(" --out ", out.string(), " --features_out ", out.string()),
       absl::StrCat("perception: --out and --features_out name one file ('", out.string(), "')")},
      {absl::StrCat(" --out ", checkpoint.string()),
       absl::StrCat("perception: --out names the file --checkpoint reads ('", checkpoint.string(), "')")},
      // Another spelling of the same path.
      {absl::StrCat(" --out ", out.string(), " --features_out ", (temp.path() / "." / "ob.csv").string()),
       "perception: --features_out names the file --lobster reads"},
  };
  ExpectEachRefused(eval, refused);
  const CommandResult save_over_data =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny", lobster,
                              " --steps 2 --save ", orderbook.string()));
  EXPECT_EQ(save_over_data.exit_code, 1) << save_over_data.output;
  EXPECT_THAT(save_over_data.output,
              HasSubstr(absl::StrCat("perception: --save names the file --lobster reads ('", orderbook.string())));
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_EQ(FileText(checkpoint), checkpoint_bytes);
  EXPECT_EQ(FileText(orderbook), orderbook_bytes);

  // Two spellings of one file not there yet, relative to the folder the command runs in.
  const CommandResult relative = RunCommand(absl::StrCat("cd ", temp.path().string(), " && ", eval,
                                                         " --out new.npy --features_out ./new.npy"));
  EXPECT_EQ(relative.exit_code, 1) << relative.output;
  EXPECT_THAT(relative.output, HasSubstr("perception: --out and --features_out name one file ('./new.npy')"));
  EXPECT_FALSE(std::filesystem::exists(temp.path() / "new.npy"));

  // The comma form of --lobster before the subcommand: the word after it is the subcommand, not a third file.
  const CommandResult comma = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " --lobster ", orderbook.string(), ",",
                                                      messages.string(), " eval --device cpu --checkpoint ",
                                                      checkpoint.string(), " --out ", out.string()));
  EXPECT_EQ(comma.exit_code, 0) << comma.output;
  EXPECT_TRUE(std::filesystem::exists(out));
}

// eval first touched --out and --features_out after the forward pass, one after the other: an unwritable
// --features_out failed after LOGITS.npy was written. Both are checked first, so nothing is written.
TEST(PerceptionCliTest, EvalRefusesUnwritableOutputsBeforeWritingAny) {
  const ScopedTempDir temp("cli_eval_outputs");
  const std::filesystem::path checkpoint = temp.path() / "a.safetensors", out = temp.path() / "logits.npy";
  const CommandResult train =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ", kOrderbook, " ",
                              kMessages, " --steps 2 --save ", checkpoint.string()));
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const std::string eval = absl::StrCat(PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint ", checkpoint.string(),
                                        " --lobster ", kOrderbook, " ", kMessages);

  const CommandResult features = RunCommand(
      absl::StrCat(eval, " --out ", out.string(), " --features_out /nonexistent/features.npy"));
  EXPECT_EQ(features.exit_code, 1) << features.output;
  EXPECT_THAT(features.output, HasSubstr("cannot write /nonexistent/features.npy: cannot create its temporary file "
                                         "/nonexistent/features.npy.tmp."));
  EXPECT_THAT(features.output, Not(HasSubstr("masked BCE")));
  EXPECT_FALSE(std::filesystem::exists(out)) << "no output is written when one of them cannot be";

  const CommandResult logits = RunCommand(absl::StrCat(eval, " --out /nonexistent/logits.npy"));
  EXPECT_EQ(logits.exit_code, 1) << logits.output;
  EXPECT_THAT(logits.output, HasSubstr("cannot write /nonexistent/logits.npy: cannot create its temporary file "
                                       "/nonexistent/logits.npy.tmp."));
  EXPECT_THAT(logits.output, Not(HasSubstr("masked BCE")));
}

// eval --features_out writes [events, F + 1]: each event's raw MODEL.md §1.1 features, not standardized (the model
// here has a fitted normalizer), then its Δt, as the featurizer computes them over the file; inspect names the
// checkpoint's step and every tensor.
TEST(PerceptionCliTest, EvalWritesTheRawFeaturesAndDtAndInspectDescribesTheCheckpoint) {
  const ScopedTempDir temp("cli_eval_features");
  const std::filesystem::path checkpoint = temp.path() / "a.safetensors", logits = temp.path() / "logits.npy",
                              features = temp.path() / "features.npy";
  const CommandResult train =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ", kOrderbook, " ",
                              kMessages, " --steps 2 --save ", checkpoint.string()));
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const CommandResult eval =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint ", checkpoint.string(), " --lobster ",
                              kOrderbook, " ", kMessages, " --out ", logits.string(), " --features-out ",
                              features.string()));
  ASSERT_EQ(eval.exit_code, 0) << eval.output;

  absl::StatusOr<LobsterData> data = ReadLobster(kOrderbook, kMessages);
  ASSERT_TRUE(data.ok()) << data.status();
  LobsterFeaturizer featurizer(data->levels);
  const int F = featurizer.n_features();
  std::vector<float> expected;
  for (size_t i = 0; i < data->size(); ++i) {
    std::vector<float> row(F);
    const absl::StatusOr<double> dt = featurizer.Next(data->BookRow(i), data->messages[i], row);
    ASSERT_TRUE(dt.ok()) << dt.status();
    expected.insert(expected.end(), row.begin(), row.end());
    expected.push_back(static_cast<float>(*dt));
  }
  std::string header;
  const std::vector<float> written = ReadNpy(features, &header);
  EXPECT_THAT(header, HasSubstr(absl::StrCat("'shape': (", data->size(), ", ", F + 1, ")")));
  EXPECT_EQ(written, expected);

  const CommandResult inspect = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " inspect ", checkpoint.string()));
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_THAT(inspect.output, HasSubstr("format perception-v1, step 2,"));
  const ParamLayout layout(*NamedConfig("tiny"));
  for (const TensorSpec& tensor : layout.tensors()) {
    EXPECT_THAT(inspect.output, HasSubstr(absl::StrCat(tensor.name, " "))) << tensor.name;
  }
}

// The masked BCE (MODEL.md §2.7) of `logits` [n, H] against a part's labels, and of its class prior (each horizon's
// up-fraction among the scored labels of `prior_of`) predicted for every event: in double, from the definitions.
std::pair<double, double> LossAndPriorBaseline(std::span<const float> logits, const EventSeries& part,
                                               const EventSeries& prior_of) {
  const size_t H = static_cast<size_t>(part.n_horizons);
  std::vector<double> up(H), scored(H);
  for (size_t i = 0; i < prior_of.mask.size(); ++i) {
    up[i % H] += prior_of.mask[i] * prior_of.labels[i];
    scored[i % H] += prior_of.mask[i];
  }
  const auto bce = [](double logit, double label) {
    return std::max(logit, 0.0) - logit * label + std::log1p(std::exp(-std::abs(logit)));
  };
  double loss = 0, baseline = 0, count = 0;
  for (size_t i = 0; i < part.mask.size(); ++i) {
    const double p = up[i % H] / scored[i % H];
    loss += part.mask[i] * bce(logits[i], part.labels[i]);
    baseline += part.mask[i] * bce(std::log(p / (1 - p)), part.labels[i]);
    count += part.mask[i];
  }
  return {loss / count, baseline / count};
}

// The number printed right after `then`, itself the first such text after `line` in `output` (`then` empty: right
// after `line`); NaN where there is none.
double NumberAfter(const std::string& output, const std::string& line, const std::string& then) {
  size_t at = output.find(line);
  if (at == std::string::npos) return std::nan("");
  at += line.size();
  if (!then.empty()) {
    at = output.find(then, at);
    if (at == std::string::npos) return std::nan("");
    at += then.size();
  }
  return std::stod(output.substr(at));
}

// eval's loss over a file the checkpoint trained on was mostly in-sample, and had nothing to compare with: it prints
// the class prior's beside it, and with --train_fraction the part train held out, scored alone.
TEST(PerceptionCliTest, EvalScoresTheHeldOutPartAloneAgainstTheClassPrior) {
  const ScopedTempDir temp("cli_eval_held_out");
  const std::filesystem::path checkpoint = temp.path() / "a.safetensors", logits = temp.path() / "logits.npy";
  const CommandResult train =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny --lobster ", kOrderbook, " ",
                              kMessages, " --train_fraction 0.6 --steps 5 --save ", checkpoint.string()));
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const CommandResult eval =
      RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " eval --device cpu --checkpoint ", checkpoint.string(),
                              " --lobster ", kOrderbook, " ", kMessages, " --train-fraction 0.6 --out ",
                              logits.string()));
  ASSERT_EQ(eval.exit_code, 0) << eval.output;

  absl::StatusOr<LobsterData> data = ReadLobster(kOrderbook, kMessages);
  ASSERT_TRUE(data.ok()) << data.status();
  absl::StatusOr<EventSeries> series = BuildSeries(*data, NamedConfig("tiny")->horizons);
  ASSERT_TRUE(series.ok()) << series.status();
  absl::StatusOr<SplitSeries> split = SplitByTime(*series, 0.6);
  ASSERT_TRUE(split.ok()) << split.status();
  const std::vector<float> written = ReadNpy(logits);
  ASSERT_EQ(written.size(), series->labels.size());
  const auto [loss, baseline] = LossAndPriorBaseline(written, *series, *series);
  const std::string whole = "masked BCE over the whole stream ";
  EXPECT_NEAR(NumberAfter(eval.output, whole, ""), loss, 1e-5) << eval.output;
  EXPECT_NEAR(NumberAfter(eval.output, whole, " vs class-prior baseline "), baseline, 1e-5) << eval.output;
  const size_t first = split->train.size();
  const std::string held_out =
      absl::StrCat("the held-out part's (events ", first + 1, " to ", series->size(),
                   ", after --train_fraction 0.6, in the whole stream, not train's windows) masked BCE ");
  const auto [held_out_loss, held_out_baseline] = LossAndPriorBaseline(
      std::span<const float>(written).subspan(first * series->n_horizons), split->validation, split->train);
  EXPECT_NEAR(NumberAfter(eval.output, held_out, ""), held_out_loss, 1e-5) << eval.output;
  EXPECT_NEAR(NumberAfter(eval.output, held_out, " vs class-prior baseline "), held_out_baseline, 1e-5)
      << eval.output;
}

// A stream has no deadline as a whole; with events outstanding and no acknowledgement within --timeout it gives
// up instead of waiting forever on a daemon that stopped answering.
TEST(PerceptionctlTest, StreamGivesUpOnADaemonThatStopsAnswering) {
  const ScopedTempDir temp("ctl_stream_stall");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  const auto streaming = [&] { return ProcessedByTheOnlyStream(**daemon) > 0; };
  const auto [waited, stream] = RunThenStopTheDaemon(
      **daemon,
      absl::StrCat(kKillAfter30s, ctl, " --timeout 2s stream --lobster ", kOrderbook, " ", kMessages,
                   " --instrument AAPL --rate 200"),
      streaming);
  EXPECT_EQ(stream.exit_code, 1) << stream.output;
  EXPECT_THAT(stream.output, HasSubstr("DEADLINE_EXCEEDED: no answer from the daemon for 2.05s (--timeout 2s past "
                                       "the daemon's acknowledgement interval, 50ms) with "));
  EXPECT_LT(waited, absl::Seconds(4)) << "within twice the timeout";
}

// A stream that stops its instrument (here: a diverged model's outputs are not finite from the first event) said to
// resume with flags the daemon then refused ("stopped at seq N"): the instrument needs a reset or a seed first.
TEST(PerceptionctlTest, AStreamThatStopsItsInstrumentSaysToResetItBeforeResuming) {
  const ScopedTempDir temp("ctl_stopped_resume");
  const std::filesystem::path diverged = temp.path() / "checkpoints" / "diverged.safetensors";
  std::filesystem::create_directories(diverged.parent_path());
  const CommandResult trained = RunCommand(absl::StrCat(PERCEPTION_CLI_PATH, " train --device cpu --config tiny",
                                                        kLongFeed, " --lr 100 --steps 300 --val_every 0 --save ",
                                                        diverged.string()));
  ASSERT_TRUE(std::filesystem::exists(diverged)) << trained.output;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " checkpoint load diverged.safetensors")).exit_code, 0);
  const CommandResult stream = RunCommand(absl::StrCat(ctl, " stream", kLongFeed, " --instrument nf --count 20"));
  EXPECT_EQ(stream.exit_code, 1) << stream.output;
  EXPECT_THAT(stream.output, HasSubstr("stopped at seq 1: the model's output for that event was not finite"));
  EXPECT_THAT(stream.output, HasSubstr(". The instrument is stopped: before resuming, run `perceptionctl streams "
                                       "reset nf` (its state zeroed), or resume with --seed-window N --reseed as "
                                       "well"));
}

// Until the daemon's one stream has processed 100 events (at most 20 s).
void WaitUntilTheOnlyStreamProcessed100(Daemon& daemon) {
  for (const absl::Time give_up = absl::Now() + absl::Seconds(20);
       ProcessedByTheOnlyStream(daemon) < 100 && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(5));
  }
}

// `perceptionctl stream` of `instrument` (1,500 events of kLongFeed at 300 a second: slowly enough for a daemon under
// ThreadSanitizer to keep up, so that its queue is mostly empty between two events), once the daemon has processed
// 100 of them; its result once it ends.
std::future<CommandResult> StartPacedFeed(Daemon& daemon, const std::string& ctl, const std::string& instrument) {
  std::future<CommandResult> running = std::async(
      std::launch::async, RunCommand,
      absl::StrCat(ctl, " stream", kLongFeed, " --instrument ", instrument, " --count 1500 --rate 300"));
  WaitUntilTheOnlyStreamProcessed100(daemon);
  return running;
}

// `streams reset` under a running feed zeroed its state without a word to it (the run ended "all acknowledged", its
// convictions off a continuous run's): refused while the feed's call is open, taken with --while_fed.
TEST(PerceptionctlTest, AResetUnderARunningFeedIsRefusedUnlessWhileFed) {
  const ScopedTempDir temp("ctl_reset_under_feed");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  std::future<CommandResult> running = StartPacedFeed(**daemon, ctl, "rs");
  const CommandResult refused = RunCommand(absl::StrCat(ctl, " streams reset rs"));
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("FAILED_PRECONDITION: instrument 'rs' is fed by 1 open Stream call(s)"));
  // (Between two events, since the feed's queue must be empty; the rate leaves it so most of the time.)
  CommandResult taken;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(5); absl::Now() < give_up;) {
    taken = RunCommand(absl::StrCat(ctl, " streams reset rs --while_fed"));
    if (taken.exit_code == 0 || !absl::StrContains(taken.output, "not yet processed")) break;
  }
  EXPECT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_THAT(taken.output, HasSubstr("reset rs: its state is zeroed"));
  EXPECT_EQ(running.get().exit_code, 0);
}

// Another client's CloseStream during a run dropped the instrument's convictions so far, and the events after it ran
// from a zeroed state: the run exited 0 saying its first convictions "were overwritten". It fails, without the line
// of a run done ("all acknowledged") before its DATA_LOSS.
TEST(PerceptionctlTest, AStreamWhoseInstrumentIsClosedMidRunFails) {
  const ScopedTempDir temp("ctl_closed_mid_run");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  // CloseStream refuses an instrument with events still queued, so it is asked again until it meets an empty queue,
  // between two events.
  std::future<CommandResult> running = StartPacedFeed(**daemon, ctl, "cl");
  v1::CloseStreamRequest close;
  close.set_instrument("cl");
  absl::Status closed = (*daemon)->client().CloseStream(close).status();
  for (const absl::Time give_up = absl::Now() + absl::Seconds(3);
       absl::IsFailedPrecondition(closed) && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(1));
    closed = (*daemon)->client().CloseStream(close).status();
  }
  ASSERT_TRUE(closed.ok()) << closed;
  const CommandResult stream = running.get();
  EXPECT_EQ(stream.exit_code, 1) << stream.output;
  EXPECT_THAT(stream.output, HasSubstr("DATA_LOSS: instrument 'cl' was closed (CloseStream) during the run and opened "
                                       "afresh by seq "));
  EXPECT_THAT(stream.output, Not(HasSubstr("were overwritten")));
  EXPECT_THAT(stream.output, Not(HasSubstr("all acknowledged")));
}

// A daemon that acknowledges every --stream_ack_ms is not a stalled one: a paced stream's events wait that long for
// their acknowledgement, and the client's watchdog cancelled a healthy run once the interval passed --timeout.
TEST(PerceptionctlTest, AStreamWaitsOutTheDaemonsAcknowledgementInterval) {
  const ScopedTempDir temp("ctl_slow_acks");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--stream_ack_ms=2500", "--stream_ack_events=100000"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  const CommandResult stream = RunCommand(absl::StrCat(kKillAfter30s, ctl, " --timeout 1s stream --lobster ",
                                                       kOrderbook, " ", kMessages, " --instrument A --count 8 --rate 4"));
  EXPECT_EQ(stream.exit_code, 0) << stream.output;
  EXPECT_THAT(stream.output, HasSubstr("streamed 8 events of A (seq 1..8) in "));
}

// A daemon that stops answering before its first acknowledgement may have taken events all the same: the error said
// "the daemon acknowledged none of its events", and the same command then met "sequence number 1 out of order".
TEST(PerceptionctlTest, AStreamCutOffBeforeAnyAcknowledgementSaysWhereToResume) {
  const ScopedTempDir temp("ctl_no_acks");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--stream_ack_ms=5000", "--stream_ack_events=100000"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  const auto streaming = [&] { return ProcessedByTheOnlyStream(**daemon) > 0; };
  const auto [waited, stream] = RunThenStopTheDaemon(
      **daemon,
      absl::StrCat(kKillAfter30s, ctl, " --timeout 1s stream --lobster ", kOrderbook, " ", kMessages,
                   " --instrument AAPL --first 100 --count 500 --start_seq 7 --rate 100"),
      streaming);
  EXPECT_EQ(stream.exit_code, 1) << stream.output;
  EXPECT_THAT(stream.output, HasSubstr("DEADLINE_EXCEEDED: no answer from the daemon for 6s (--timeout 1s past the "
                                       "daemon's acknowledgement interval, 5s) with "));
  EXPECT_THAT(stream.output, HasSubstr("; the daemon acknowledged none of its events, but may have taken some (resume "
                                       "from the instrument's end_seq E in `perceptionctl streams`, once its pending "
                                       "reads 0 and E stays put for a second (a request the call sent may still be "
                                       "on its way), with --first 100 + (E - 7) --count 500 - (E - 7) (where that "
                                       "is 0, nothing is left) --start_seq E; where it is not listed, or listed "
                                       "with end_seq 0 (no event processed), the daemon took none: run the same "
                                       "command again)"));
  // The advice, followed: the rest of the 500 events from the instrument's end_seq, once what it took is processed.
  absl::StatusOr<v1::ListStreamsResponse> streams = (*daemon)->client().ListStreams();
  for (const absl::Time give_up = absl::Now() + absl::Seconds(10);
       streams.ok() && streams->streams_size() == 1 && streams->streams(0).pending_events() > 0 &&
       absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(20));
    streams = (*daemon)->client().ListStreams();
  }
  ASSERT_TRUE(streams.ok() && streams->streams_size() == 1) << streams.status();
  ASSERT_EQ(streams->streams(0).pending_events(), 0u);
  // A request the cut-off call had sent may still wait in the transport, unread, once the daemon runs again (under
  // the sanitizers one came after pending read 0): the end is taken once it has stood still for a second.
  uint64_t end = streams->streams(0).end_seq();
  for (absl::Time still_since = absl::Now(), give_up = still_since + absl::Seconds(10);
       absl::Now() - still_since < absl::Seconds(1) && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(50));
    streams = (*daemon)->client().ListStreams();
    ASSERT_TRUE(streams.ok() && streams->streams_size() == 1) << streams.status();
    if (streams->streams(0).end_seq() != end || streams->streams(0).pending_events() > 0) {
      end = streams->streams(0).end_seq();
      still_since = absl::Now();
    }
  }
  ASSERT_EQ(streams->streams(0).pending_events(), 0u);
  ASSERT_GT(end, 7u);
  const CommandResult resumed = RunCommand(absl::StrCat(ctl, " stream --lobster ", kOrderbook, " ", kMessages,
                                                        " --instrument AAPL --first ", 100 + (end - 7), " --count ",
                                                        500 - (end - 7), " --start_seq ", end));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr(absl::StrCat("(seq ", end, "..506)")));
}

// perceptionctl checks the files' events against the normalizer they will be standardized with before sending any:
// train (the one it fits on the training part, or the model's) and eval refuse files holding an event beyond the
// bound, naming its line, where the daemon would refuse a batch naming only its window (and, in a data-parallel job,
// leave the other ranks waiting in the step); with the model's normalizer, eval and stream warn, as perception eval
// does, that features it floored vary in the files.
TEST(PerceptionctlTest, FilesBeyondTheStandardizedBoundAreRefusedBeforeAnythingIsSent) {
  const ScopedTempDir temp("ctl_beyond_bound");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  const std::string files = WriteFilesWithAJumpAtRow250(temp.path());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  const auto model = [&] {
    absl::StatusOr<v1::GetStatusResponse> status = (*daemon)->client().GetStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    return status.ok() ? status->model() : v1::Model();
  };
  const std::string refusal = "line 250 of the LOBSTER files: feature 5 is 5e+11, 5e+17 standard deviations";

  const CommandResult fitting = RunCommand(absl::StrCat(ctl, " train", files, " --steps 2"));
  EXPECT_EQ(fitting.exit_code, 1) << fitting.output;
  EXPECT_THAT(fitting.output, HasSubstr(refusal));
  EXPECT_FALSE(model().normalizer_fitted()) << "the normalizer fitted was not sent";

  // The model's own normalizer, the mid return's std floored as a fit on the first rows would have it.
  v1::SetNormalizerRequest floored;
  for (int f = 0; f < 12; ++f) {
    floored.mutable_normalizer()->add_mean(0.f);
    floored.mutable_normalizer()->add_inv_std(f == 5 ? 1e6f : 1.f);
  }
  ASSERT_TRUE((*daemon)->client().SetNormalizer(floored).ok());
  EXPECT_EQ(model().normalizer().inv_std(5), 1e6f);
  for (const std::string command : {" train", " eval"}) {
    const CommandResult run = RunCommand(absl::StrCat(ctl, command, files, command == " train" ? " --steps 2" : ""));
    EXPECT_EQ(run.exit_code, 1) << run.output;
    EXPECT_THAT(run.output, HasSubstr(refusal));
    EXPECT_THAT(run.output, HasSubstr("feature(s) mid_return (2 events) never varied"));
  }
  EXPECT_EQ(model().step(), 0);
  // A stream warns, then the daemon refuses the event itself as it comes.
  const CommandResult stream = RunCommand(absl::StrCat(ctl, " stream", files, " --instrument J --count 260"));
  EXPECT_EQ(stream.exit_code, 1) << stream.output;
  EXPECT_THAT(stream.output, HasSubstr("warning: the model's normalizer was fitted where feature(s) mid_return (2 "
                                       "events) never varied"));
  EXPECT_THAT(stream.output, HasSubstr("seq 250): feature 5 is 5e+11, 5e+17 standard deviations"));
}

// A one-off call past --timeout says which limit it met and that the daemon may still do what it was asked: the
// message was gRPC's alone ("DEADLINE_EXCEEDED: Deadline Exceeded").
TEST(PerceptionctlTest, ACallPastTheTimeoutSaysWhatItMeans) {
  const ScopedTempDir temp("ctl_unary_timeout");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  (*daemon)->Signal(SIGSTOP);
  const CommandResult status = RunCommand(absl::StrCat(kKillAfter30s, ctl, " --timeout 1s status"));
  const CommandResult save =
      RunCommand(absl::StrCat(kKillAfter30s, ctl, " --timeout 1s checkpoint save a.safetensors"));
  (*daemon)->Signal(SIGCONT);
  for (const CommandResult& stalled : {status, save}) {
    EXPECT_EQ(stalled.exit_code, 1) << stalled.output;
    EXPECT_THAT(stalled.output, HasSubstr("DEADLINE_EXCEEDED: no answer from the daemon within 1s (--timeout); the "
                                          "call was abandoned, and what it asked for may still take effect there"));
  }
  const CommandResult after = RunCommand(absl::StrCat(ctl, " status"));
  EXPECT_EQ(after.exit_code, 0) << after.output;
}

// --timeout bounds each step of train, not the whole run (where 2 s x 100000 steps would never end).
TEST(PerceptionctlTest, TrainGivesUpOnADaemonThatStopsAnswering) {
  const ScopedTempDir temp("ctl_train_stall");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  const auto training = [&] {
    absl::StatusOr<v1::GetStatusResponse> status = (*daemon)->client().GetStatus();
    return status.ok() && status->model().step() > 0;
  };
  const auto [waited, train] = RunThenStopTheDaemon(
      **daemon,
      absl::StrCat(kKillAfter30s, ctl, " --timeout 2s train --lobster ", kOrderbook, " ", kMessages,
                   " --steps 100000"),
      training);
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("DEADLINE_EXCEEDED: no answer from the daemon for 2s (--timeout) with "));
  EXPECT_LT(waited, absl::Seconds(10));
}

// A run cut by --timeout in the middle of a step reported the model's step as GetStatus read it then, and the step
// completed after: "resume from the step reported" started a step behind. The error now says so.
TEST(PerceptionctlTest, ATrainCutByTheTimeoutSaysAStepMayStillComplete) {
  if (DaemonDevice() != "cpu") GTEST_SKIP() << "needs a step longer than --timeout: large on the CPU";
  const ScopedTempDir temp("ctl_train_cut");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config large --levels 10")).exit_code, 0);
  // A normalizer already there: train's own SetNormalizer, a unary call, ran past the 1 s under ThreadSanitizer.
  v1::SetNormalizerRequest normalizer;
  normalizer.mutable_normalizer()->mutable_mean()->Resize(48, 0.5f);  // not the identity, which counts as none
  normalizer.mutable_normalizer()->mutable_inv_std()->Resize(48, 1.f);
  ASSERT_TRUE((*daemon)->client().SetNormalizer(normalizer).ok());
  const CommandResult train = RunCommand(
      absl::StrCat(kKillAfter30s, ctl, " --timeout 1s train --lobster ", kOrderbook, " ", kMessages, " --steps 3"));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("DEADLINE_EXCEEDED: no answer from the daemon for 1s (--timeout)"));
  EXPECT_THAT(train.output, HasSubstr("; the model was at step 0 when read (GetStatus; no step was answered), and a "
                                      "step the daemon was running as the call ended still completes: read its step "
                                      "with `perceptionctl status` once it is idle before resuming"));
}

// A replay continues in a second run: --first picks up the file where the first run ended and --start_seq the
// sequence numbers, so the daemon's log is one contiguous run whose convictions equal a replay in one go.
TEST(PerceptionctlTest, AReplayContinuesInASecondRunWithStartSeq) {
  const ScopedTempDir temp("ctl_resume");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  const std::string stream = absl::StrCat(ctl, " stream --lobster ", kOrderbook, " ", kMessages);
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  const CommandResult head = RunCommand(absl::StrCat(stream, " --instrument AAPL --count 400"));
  ASSERT_EQ(head.exit_code, 0) << head.output;
  const CommandResult tail =
      RunCommand(absl::StrCat(stream, " --instrument AAPL --first 400 --count 400 --start_seq 401"));
  ASSERT_EQ(tail.exit_code, 0) << tail.output;
  EXPECT_THAT(tail.output, HasSubstr("streamed 400 events of AAPL (seq 401..800)"));
  const CommandResult whole = RunCommand(absl::StrCat(stream, " --instrument WHOLE --count 800"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  ExpectReplayOf(ReadLog((*daemon)->client(), "AAPL"), ReadLog((*daemon)->client(), "WHOLE"), 1, 800);

  const CommandResult restart = RunCommand(absl::StrCat(stream, " --instrument AAPL --first 800"));
  EXPECT_EQ(restart.exit_code, 1);
  EXPECT_THAT(restart.output, HasSubstr("instrument AAPL takes seq 801 next, but this run would start at seq 1"));
}

// A plain stream onto an instrument that takes another number next was sent, refused at its first event, and told to
// resume from a formula that took the instrument's events for its own: `--first 250 --count 10` onto an instrument
// at seq 251 was sent to `--first 500 --count -240`. It is now refused before it sends, with the flags that number
// its events on, or carry on after the instrument's where those are this command's. A first event the daemon refuses
// for itself (a time earlier than the instrument's last) says that none was taken and what lets it in, where the
// advice named the same command again.
TEST(PerceptionctlTest, AStreamThatWouldNotContinueItsInstrumentsNumbersIsRefusedBeforeItSends) {
  const ScopedTempDir temp("ctl_numbering");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  const std::string stream = absl::StrCat(ctl, " stream --lobster ", kOrderbook, " ", kMessages, " --instrument P1");
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  const CommandResult head = RunCommand(absl::StrCat(stream, " --count 250"));
  ASSERT_EQ(head.exit_code, 0) << head.output;

  const CommandResult unnumbered = RunCommand(absl::StrCat(stream, " --first 250 --count 10"));
  EXPECT_EQ(unnumbered.exit_code, 1) << unnumbered.output;
  EXPECT_THAT(unnumbered.output,
              HasSubstr("FAILED_PRECONDITION: instrument P1 takes seq 251 next, but this run would start at seq 1: the "
                        "daemon would refuse its first event. --start_seq 251 numbers this run's events after the "
                        "instrument's; where its events are this command's, numbered as it numbers them, it has every "
                        "one of them already; to start the instrument afresh, `perceptionctl streams close P1` first"));
  const CommandResult rerun = RunCommand(absl::StrCat(stream, " --count 400"));
  EXPECT_EQ(rerun.exit_code, 1) << rerun.output;
  EXPECT_THAT(rerun.output, HasSubstr("where its events are this command's, numbered as it numbers them, --first 250 "
                                      "--count 150 --start_seq 251 carries on after them"));
  const CommandResult ahead = RunCommand(absl::StrCat(stream, " --first 260 --count 10 --start_seq 261"));
  EXPECT_EQ(ahead.exit_code, 1) << ahead.output;
  EXPECT_THAT(ahead.output, HasSubstr("takes seq 251 next, but this run would start at seq 261: the daemon would "
                                      "refuse its first event. --start_seq 251 numbers this run's events after the "
                                      "instrument's; to start"));
  EXPECT_EQ(EndSeqOnceSettled((*daemon)->client(), "P1"), 251u) << "a refused run sent events";
  const CommandResult carried_on = RunCommand(absl::StrCat(stream, " --first 250 --count 150 --start_seq 251"));
  EXPECT_EQ(carried_on.exit_code, 0) << carried_on.output;

  // Numbered on, but earlier in time than the instrument's last event.
  const std::string earlier = absl::StrCat(stream, " --count 10 --start_seq 401");
  const CommandResult refused = RunCommand(earlier);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("is earlier than the previous event's"));
  EXPECT_THAT(refused.output, HasSubstr("; the daemon took none of its events: it refuses the first as above until "
                                        "that changes (an event earlier than the instrument's last: `perceptionctl "
                                        "streams reset P1` zeroes its state and its clock"));
  EXPECT_THAT(refused.output, Not(HasSubstr("may have taken some")));
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " streams reset P1")).exit_code, 0);
  const CommandResult after_the_reset = RunCommand(earlier);
  EXPECT_EQ(after_the_reset.exit_code, 0) << after_the_reset.output;
  EXPECT_THAT(after_the_reset.output, HasSubstr("streamed 10 events of P1 (seq 401..410)"));
}

// A stream that failed says through which sequence number the daemon acknowledged; a second run from the
// instrument's end_seq completes the log.
TEST(PerceptionctlTest, AFailedStreamSaysWhereToResume) {
  const ScopedTempDir temp("ctl_resume_failed");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  const std::string stream = absl::StrCat(ctl, " stream --lobster ", kOrderbook, " ", kMessages);
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  // The daemon acknowledges 50 ms after it processes an event: 300 ms after it has processed 100, it has sent an
  // acknowledgement, even when they were processed in one burst behind a slow start (as under ThreadSanitizer).
  std::optional<absl::Time> processed_100;
  const auto acknowledging = [&] {
    absl::StatusOr<v1::ListStreamsResponse> streams = (*daemon)->client().ListStreams();
    if (!processed_100.has_value() && streams.ok() && streams->streams_size() == 1 &&
        streams->streams(0).processed_events() >= 100) {
      processed_100 = absl::Now();
    }
    return processed_100.has_value() && absl::Now() - *processed_100 >= absl::Milliseconds(300);
  };
  const CommandResult failed =
      RunThenStopTheDaemon(**daemon, absl::StrCat(kKillAfter30s, stream, " --timeout 1s --instrument AAPL --rate 200"),
                           acknowledging)
          .second;
  ASSERT_EQ(failed.exit_code, 1) << failed.output;
  const std::optional<uint64_t> acked = AcknowledgedThrough(failed.output);
  ASSERT_TRUE(acked.has_value()) << failed.output;
  const uint64_t end = EndSeqOnceSettled((*daemon)->client(), "AAPL");
  EXPECT_GT(end, *acked) << "the daemon took at least what it acknowledged";
  ASSERT_LT(end, 1000u);

  const CommandResult resumed =
      RunCommand(absl::StrCat(stream, " --instrument AAPL --first ", end - 1, " --start_seq ", end));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(RunCommand(absl::StrCat(stream, " --instrument WHOLE")).exit_code, 0);
  ExpectReplayOf(ReadLog((*daemon)->client(), "AAPL"), ReadLog((*daemon)->client(), "WHOLE"), 1, 999);
}

// `shell_line` as StartThenWait runs it, once the daemon's one stream has processed 100 events.
std::pair<std::future<CommandResult>, pid_t> StartOnceStreaming(Daemon& daemon, const std::string& shell_line,
                                                               const std::filesystem::path& pid_file) {
  return StartThenWait(shell_line, pid_file, [&] {
    WaitUntilTheOnlyStreamProcessed100(daemon);
    return true;
  });
}

// `command` (a perceptionctl run) as StartOnceStreaming runs it, its own pid the one written.
std::pair<std::future<CommandResult>, pid_t> StartWithPid(Daemon& daemon, const std::string& command,
                                                         const std::filesystem::path& pid_file) {
  return StartOnceStreaming(daemon, absl::StrCat("echo $$ > ", pid_file.string(), "; exec ", command), pid_file);
}

// Ctrl-C ended a `perceptionctl stream` at once, saying nothing of where the instrument stood. The first signal now
// stops the sending and waits for the events sent to be acknowledged; the run names the flags that resume it, then
// ends by the signal (as bash expects of an interrupted command: a script stops there), and the resumed log equals
// one run's. A seeded run from past the files' first event, numbered from elsewhere: the resume's flags carry all
// three.
TEST(PerceptionctlTest, AnInterruptedStreamSaysWhereToResumeAndTheResumeCompletesIt) {
  const ScopedTempDir temp("ctl_interrupted");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  const std::string stream = absl::StrCat(ctl, " stream", kLongFeed);
  // Events 300..1699 of the files stream as seq 1101..2500, the 100 before them seeding the state.
  const std::string run = " --first 200 --count 1500 --start_seq 1001 --seed-window 100";
  auto [running, pid] =
      StartWithPid(**daemon, absl::StrCat(stream, " --instrument ic", run, " --rate 300"), temp.path() / "pid");
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  const CommandResult interrupted = running.get();
  EXPECT_EQ(interrupted.ended_by_signal, SIGINT) << interrupted.exit_code << ": " << interrupted.output;
  EXPECT_THAT(interrupted.output, HasSubstr("perceptionctl: Interrupt: no further events are sent; waiting for those "
                                            "sent to be acknowledged"));
  const std::optional<uint64_t> acked = AcknowledgedThrough(interrupted.output);
  ASSERT_TRUE(acked.has_value()) << interrupted.output;
  ASSERT_GE(*acked, 1200u);
  ASSERT_LT(*acked, 2500u);
  const uint64_t done = *acked - 1000;  // events of the files' 200.. used, the seed window's among them
  const std::string resume = absl::StrCat(" --first ", 200 + done, " --count ", 1500 - done, " --start_seq ",
                                          *acked + 1);
  EXPECT_THAT(interrupted.output,
              HasSubstr(absl::StrCat("perceptionctl: CANCELLED: interrupted after ", *acked - 1100, " of 1400 events, "
                                     "each acknowledged; acknowledged through seq ", *acked, " (resume with",
                                     resume, " and without --seed-window)")));
  const CommandResult resumed = RunCommand(absl::StrCat(stream, " --instrument ic", resume));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_EQ(RunCommand(absl::StrCat(stream, " --instrument whole", run)).exit_code, 0);
  ExpectReplayOf(ReadLog((*daemon)->client(), "ic"), ReadLog((*daemon)->client(), "whole"), 1101, 2500);
}

// A second signal stops the wait for acknowledgements (a daemon that stopped answering, here SIGSTOP): the call is
// cancelled and the run names the acknowledged seq to resume after, and that the daemon may have taken more.
TEST(PerceptionctlTest, ASecondInterruptCancelsTheWaitForAcknowledgements) {
  const ScopedTempDir temp("ctl_interrupted_twice");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  auto [running, pid] = StartWithPid(
      **daemon, absl::StrCat(ctl, " --timeout 20s stream", kLongFeed, " --instrument ic2 --count 1500 --rate 300"),
      temp.path() / "pid");
  ASSERT_GT(pid, 0);
  // The daemon acknowledges 50 ms after it processes an event: by now the run has an acknowledgement, unless a
  // sanitizer held it up (the message then says none was acknowledged).
  absl::SleepFor(absl::Seconds(1));
  (*daemon)->Signal(SIGSTOP);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_NE(running.wait_for(std::chrono::seconds(0)), std::future_status::ready) << "waits for acknowledgements";
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  const CommandResult interrupted = running.get();
  (*daemon)->Signal(SIGCONT);
  EXPECT_EQ(interrupted.ended_by_signal, SIGINT) << interrupted.exit_code << ": " << interrupted.output;
  EXPECT_THAT(interrupted.output, HasSubstr("perceptionctl: Interrupt again: the call is cancelled"));
  EXPECT_THAT(interrupted.output, ContainsRegex("perceptionctl: CANCELLED: interrupted after [0-9]+ of 1500 events, "
                                                "the wait for their acknowledgements cancelled; (acknowledged through "
                                                "seq [0-9]+ \\(resume with --first |the daemon acknowledged none)"));
  EXPECT_THAT(interrupted.output, ContainsRegex("the daemon took more than it acknowledged|may have taken some"));
}

// A signal before the sending starts (here during --wait for a daemon that is not there) ends the run as it would have
// ended any command: there is nothing yet to report or to resume.
TEST(PerceptionctlTest, AnInterruptBeforeTheSendingEndsTheRunAtOnce) {
  const ScopedTempDir temp("ctl_interrupted_early");
  std::future<CommandResult> running = std::async(
      std::launch::async, RunCommand,
      absl::StrCat("echo $$ > ", (temp.path() / "pid").string(), "; exec ", PERCEPTIONCTL_PATH, " --target=127.0.0.1:",
                   FreeLoopbackPort(), " --wait 30s stream", kLongFeed, " --instrument early"));
  pid_t pid = 0;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(10); pid == 0 && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(100));
    std::ifstream(temp.path() / "pid") >> pid;
  }
  ASSERT_GT(pid, 0);
  absl::SleepFor(absl::Milliseconds(1500));  // into the wait, past the start even under a sanitizer
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  const CommandResult ended = running.get();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(5));
  EXPECT_EQ(ended.ended_by_signal, SIGINT) << ended.exit_code << ": " << ended.output;
  EXPECT_THAT(ended.output, Not(HasSubstr("no further events are sent")));
}

// A signal the caller ignores (nohup; a shell's background job ignores SIGINT) stays ignored: the run streams on.
TEST(PerceptionctlTest, AnIgnoredSignalDoesNotInterruptTheStream) {
  const ScopedTempDir temp("ctl_interrupt_ignored");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  auto [running, pid] = StartWithPid(
      **daemon, absl::StrCat("bash -c \"trap '' INT HUP; exec ", ctl, " stream", kLongFeed, " --instrument ig --count "
                             "600 --rate 300\""),
      temp.path() / "pid");
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  ASSERT_EQ(::kill(pid, SIGHUP), 0);
  const CommandResult run = running.get();
  EXPECT_EQ(run.exit_code, 0) << run.ended_by_signal << ": " << run.output;
  EXPECT_THAT(run.output, HasSubstr("streamed 600 events of ig (seq 1..600)"));
  EXPECT_THAT(run.output, Not(HasSubstr("Interrupt")));
}

// The Ctrl-C that stops a run also ends the pipeline's other commands: perceptionctl's last output to the closed pipe
// ended it by SIGPIPE before it said where the run stopped.
TEST(PerceptionctlTest, AnInterruptedStreamWhoseStdoutPipeClosedStillSaysWhereToResume) {
  const ScopedTempDir temp("ctl_interrupt_pipe");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  const std::filesystem::path errors = temp.path() / "stderr.txt";
  // Its "seeded ..." line waits in stdout's buffer while the pipe's reader exits after a second.
  const std::filesystem::path pid_file = temp.path() / "pid";
  auto [running, pid] = StartOnceStreaming(
      **daemon, absl::StrCat("sh -c 'echo $$ > ", pid_file.string(), "; exec ", ctl, " stream", kLongFeed,
                             " --instrument pi --count 1500 --seed-window 20 --rate 300 2> ", errors.string(),
                             "' | sleep 1"),
      pid_file);
  ASSERT_GT(pid, 0);
  absl::SleepFor(absl::Seconds(2));
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  (void)running.get();
  std::string said;
  std::getline(std::ifstream(errors), said, '\0');
  EXPECT_THAT(said, HasSubstr("perceptionctl: CANCELLED: interrupted after "));
  EXPECT_THAT(said, HasSubstr(" and without --seed-window)"));
}

// `command` (a perceptionctl train) as StartThenWait runs it, once the daemon's model has trained 20 steps (pid 0
// where it did not within a minute).
std::pair<std::future<CommandResult>, pid_t> StartTrainingWithPid(Daemon& daemon, const std::string& command,
                                                                 const std::filesystem::path& pid_file) {
  return StartThenWait(absl::StrCat("echo $$ > ", pid_file.string(), "; exec ", command), pid_file, [&] {
    return WithinAMinute([&] {
      const absl::StatusOr<v1::GetStatusResponse> status = daemon.client().GetStatus();
      return status.ok() && status->model().step() >= 20;
    });
  });
}

// Ctrl-C killed a `perceptionctl train` without a word of where the model stood, and in a data-parallel job could
// leave the ranks at different steps (one of them then waiting in a collective until the job aborted). The first
// signal now stops the sending at a step every rank reaches, waits for the steps sent, and the run says where the
// model is and how to go on, then ends by the signal; the daemon takes no step after it, and trains on. Validations
// every 10 steps: the signal may come during one (dropped between its requests) or a chunk of steps alike.
TEST(PerceptionctlTest, AnInterruptedTrainSaysWhereTheModelStandsAndTheDaemonTrainsOn) {
  const ScopedTempDir temp("ctl_train_interrupted");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  const std::string train = absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages);
  auto [running, pid] = StartTrainingWithPid(
      **daemon, absl::StrCat(train, " --steps 1000000 --eval-every 10 --save-best best"), temp.path() / "pid");
  ASSERT_GT(pid, 0) << "the run never reached step 20";
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  const CommandResult interrupted = running.get();
  EXPECT_EQ(interrupted.ended_by_signal, SIGINT) << interrupted.exit_code << ": " << interrupted.output;
  EXPECT_THAT(interrupted.output, HasSubstr("perceptionctl: Interrupt: no further batches are sent; waiting for the "
                                            "steps sent to be answered"));
  const std::optional<std::pair<int64_t, int64_t>> stopped = TwoNumbers(
      interrupted.output, "CANCELLED: interrupted after ([0-9]+) of 1000000 steps, each answered: the model is at "
                          "step ([0-9]+) on the daemon");
  ASSERT_TRUE(stopped.has_value()) << interrupted.output;
  const auto [done, step] = *stopped;
  EXPECT_GE(done, 20);
  EXPECT_EQ(step, done) << "the model started at step 0";
  EXPECT_THAT(interrupted.output, ContainsRegex("; --save-best best holds the run's best validated model \\(step "
                                                "[0-9]+, validation loss [0-9.]+\\); `perceptionctl eval` scores it"));
  EXPECT_THAT(interrupted.output, HasSubstr(absl::StrCat("; the same command with --steps ", 1000000 - done,
                                                        " and another --save-best name trains the rest, on the "
                                                        "batches this run would have")));
  EXPECT_EQ((*daemon)->client().GetStatus()->model().step(), step);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ((*daemon)->client().GetStatus()->model().step(), step) << "no step runs after the run's end";

  const CommandResult more = RunCommand(absl::StrCat(train, " --steps 5"));
  ASSERT_EQ(more.exit_code, 0) << more.output;
  EXPECT_EQ((*daemon)->client().GetStatus()->model().step(), step + 5);
}

// A `perceptionctl train` interrupted and resumed as its message says (the same command with --steps the rest) trained
// other windows than the whole run would have: the sampler's seed was mixed with the step the run started at. It now
// skips the global batches of the model's steps, so the resumed run ends on the whole run's model, bit for bit on the
// CPU: two daemons from one init, one trained whole, the other interrupted and resumed, then their models compared.
// (Validations every 500 steps: the chunks of the two runs begin at other steps.)
TEST(PerceptionctlTest, AnInterruptedTrainResumedForTheRestEndsOnTheWholeRunsModel) {
  const ScopedTempDir temp("ctl_train_resumed");
  constexpr int kSteps = 1500;
  absl::StatusOr<std::unique_ptr<Daemon>> whole = Daemon::Start(temp.path() / "whole");
  absl::StatusOr<std::unique_ptr<Daemon>> parts = Daemon::Start(temp.path() / "parts");
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(parts.ok()) << parts.status();
  const auto ctl = [](const Daemon& daemon) { return absl::StrCat(PERCEPTIONCTL_PATH, " --target=", daemon.target()); };
  const std::string train = absl::StrCat(" train --lobster ", kOrderbook, " ", kMessages, " --seed 4 --eval-every 500");
  for (const Daemon* daemon : {whole->get(), parts->get()}) {
    ASSERT_EQ(RunCommand(absl::StrCat(ctl(*daemon), " init --config tiny --levels 10 --seed 9")).exit_code, 0);
  }
  const CommandResult whole_run = RunCommand(absl::StrCat(ctl(**whole), train, " --steps ", kSteps));
  ASSERT_EQ(whole_run.exit_code, 0) << whole_run.output;
  auto [running, pid] =
      StartTrainingWithPid(**parts, absl::StrCat(ctl(**parts), train, " --steps ", kSteps), temp.path() / "pid");
  ASSERT_GT(pid, 0) << "the run never reached step 20";
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  const CommandResult interrupted = running.get();
  const std::optional<std::pair<int64_t, int64_t>> stopped = TwoNumbers(
      interrupted.output, "interrupted after ([0-9]+) of 1500 steps, each answered: the model is at step ([0-9]+)");
  ASSERT_TRUE(stopped.has_value()) << interrupted.output;
  ASSERT_LT(stopped->first, kSteps) << "the run ended before the signal";
  const std::string rest = absl::StrCat(" --steps ", kSteps - stopped->first);
  EXPECT_THAT(interrupted.output, HasSubstr(absl::StrCat("the same command with", rest)));
  const CommandResult resumed = RunCommand(absl::StrCat(ctl(**parts), train, rest));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;

  std::vector<Checkpoint> models;
  for (const Daemon* daemon : {whole->get(), parts->get()}) {
    const CommandResult save = RunCommand(absl::StrCat(ctl(*daemon), " checkpoint save final.safetensors"));
    ASSERT_EQ(save.exit_code, 0) << save.output;
  }
  for (const char* folder : {"whole", "parts"}) {
    absl::StatusOr<Checkpoint> model = LoadCheckpoint((temp.path() / folder / "final.safetensors").string());
    ASSERT_TRUE(model.ok()) << model.status();
    models.push_back(*std::move(model));
  }
  EXPECT_EQ(models[1].step, kSteps);
  EXPECT_EQ(models[1].step, models[0].step);
  EXPECT_TRUE(models[1].params == models[0].params) << "the resumed run's model is not the whole run's";
  EXPECT_TRUE(models[1].exp_avg == models[0].exp_avg);
  EXPECT_TRUE(models[1].exp_avg_sq == models[0].exp_avg_sq);
}

// A second signal stops the wait for the steps sent (a daemon that stopped answering, here SIGSTOP): the call is
// cancelled, and the run says how many steps were answered and that the daemon's count could not be read.
TEST(PerceptionctlTest, ASecondInterruptCancelsTheWaitForTheStepsSent) {
  const ScopedTempDir temp("ctl_train_interrupted_twice");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  auto [running, pid] = StartTrainingWithPid(
      **daemon, absl::StrCat(ctl, " --timeout 20s train --lobster ", kOrderbook, " ", kMessages, " --steps 1000000"),
      temp.path() / "pid");
  ASSERT_GT(pid, 0) << "the run never reached step 20";
  (*daemon)->Signal(SIGSTOP);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_NE(running.wait_for(std::chrono::seconds(0)), std::future_status::ready) << "waits for the steps sent";
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  const CommandResult interrupted = running.get();
  (*daemon)->Signal(SIGCONT);
  EXPECT_EQ(interrupted.ended_by_signal, SIGINT) << interrupted.exit_code << ": " << interrupted.output;
  EXPECT_THAT(interrupted.output, HasSubstr("perceptionctl: Interrupt again: the wait for the steps sent is cancelled; "
                                            "a validation request or a save under way still completes"));
  EXPECT_THAT(interrupted.output, ContainsRegex("perceptionctl: CANCELLED: interrupted after [0-9]+ of 1000000 steps "
                                                "answered, then the call was cancelled; the last response's step was "
                                                "[0-9]+; the model's step could not be read: "));
}

// A device lost in the middle of a stream (--inject_device_loss_at_tick: the CPU backend records the loss as a
// sticky CUDA error would, and a CUDA daemon's tick traps) ends the call UNAVAILABLE, naming where the instrument
// stopped and that it must be seeded again after the restart, and the daemon drains and exits 1 for its supervisor,
// without waiting out --drain_grace (every read fails once the device is lost: the grace only delayed the restart).
TEST(PerceptionctlTest, ALostDeviceEndsTheStreamUnavailableAndTheDaemonExitsNonZero) {
  const ScopedTempDir temp("ctl_device_lost");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints",
                    {"--inject_device_loss_at_tick=200", "--drain_grace=60s", "--checkpoint_on_exit=exit.safetensors"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  const CommandResult failed = RunCommand(
      absl::StrCat(kKillAfter30s, ctl, " stream --lobster ", kOrderbook, " ", kMessages, " --instrument AAPL"));
  ASSERT_EQ(failed.exit_code, 1) << failed.output;
  // On the CPU the backend records the loss; on CUDA the tick's kernel traps, a real sticky error.
  const bool on_cuda = DaemonDevice() == "cuda";
  const std::string lost =
      on_cuda ? "the CUDA device is lost (" : "the CUDA device is lost (a loss of cpu injected by a test)";
  EXPECT_THAT(failed.output, HasSubstr(absl::StrCat("perceptionctl: UNAVAILABLE: the device failed a streaming tick (",
                                                    lost)));
  if (on_cuda) {
    EXPECT_THAT(failed.output, HasSubstr("cudaErrorLaunchFailure"));
  }
  EXPECT_THAT(failed.output, HasSubstr("seed each instrument named again (SeedStream), then stream from the seq"));
  // Tick 200 took the instrument's 200th event, which the files number seq 200 (the first row is seq 1). On CUDA the
  // error surfaces at the next check of the ticks, and the ticks launched since the last good one are lost with it:
  // the instrument stops at their first event.
  uint64_t stopped_at = 0;
  const size_t from = failed.output.find("'AAPL' from seq ");
  ASSERT_NE(from, std::string::npos) << failed.output;
  ASSERT_TRUE(absl::SimpleAtoi(
      failed.output.substr(from + 16, failed.output.find('.', from) - from - 16), &stopped_at)) << failed.output;
  if (on_cuda) {
    EXPECT_LE(stopped_at, 200u);
  } else {
    EXPECT_EQ(stopped_at, 200u);
  }
  const std::optional<uint64_t> acked = AcknowledgedThrough(failed.output);
  ASSERT_TRUE(acked.has_value()) << failed.output;
  EXPECT_LT(*acked, stopped_at) << "nothing past the lost tick was acknowledged";
  // The resume the error names seeds the state again: a plain one on the restarted daemon would start from zero.
  EXPECT_THAT(failed.output,
              HasSubstr(absl::StrCat("once it is back, resume with --first 0 --start_seq 1 --seed-window ", *acked,
                                     ", whose ", *acked, " events before seq ", *acked + 1, " seed the state again")));

  absl::StatusOr<int> exit_code = (*daemon)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status() << ": the 60 s grace was waited out";
  EXPECT_EQ(*exit_code, 1);
  EXPECT_THAT((*daemon)->Log(), HasSubstr("the device is lost: the drain's grace ends"));
  EXPECT_THAT((*daemon)->Log(), HasSubstr(lost));
  // The log tells what the loss took, and no signal that nobody sent.
  EXPECT_THAT((*daemon)->Log(), Not(HasSubstr("Terminated: draining")));
  // How many events the drain's notice still counts races the failed tick's drop of them; either way none is
  // processed, and the notice says so.
  EXPECT_THAT((*daemon)->Log(), HasSubstr("event(s) still to process: the drain stops waiting for them (the device is "
                                          "lost, and they with it); calls in flight are answered with where each "
                                          "instrument stopped\n"));
  EXPECT_THAT((*daemon)->Log(), Not(HasSubstr("their events processed")));
  EXPECT_THAT((*daemon)->Log(), HasSubstr("not read back and 0 event(s) still to process: they are lost with the exit"));
  EXPECT_THAT((*daemon)->Log(), HasSubstr("--checkpoint_on_exit=exit.safetensors not saved: the model was on the lost "
                                          "device"));
  EXPECT_FALSE(std::filesystem::exists(temp.path() / "checkpoints" / "exit.safetensors"));
}

// --seed-window replaces an instrument's live state, so onto one that already has events it is refused (nothing
// sent) unless --reseed: the stream then continues as if the second run had not happened.
TEST(PerceptionctlTest, ASeedWindowLeavesALiveInstrumentAloneUnlessReseed) {
  const ScopedTempDir temp("ctl_reseed");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  const std::string stream = absl::StrCat(ctl, " stream --lobster ", kOrderbook, " ", kMessages);
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  const std::string seeded = absl::StrCat(stream, " --instrument AAPL --seed-window 100 --count 300");
  ASSERT_EQ(RunCommand(seeded).exit_code, 0);
  const absl::StatusOr<v1::ListStreamsResponse> before = client.ListStreams();
  ASSERT_TRUE(before.ok()) << before.status();
  const CommandResult again = RunCommand(seeded);
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_THAT(again.output, HasSubstr("FAILED_PRECONDITION: instrument AAPL already has events (through seq 300): "
                                      "--seed-window would replace its live state"));
  EXPECT_THAT(again.output, Not(HasSubstr("seeded")));
  const absl::StatusOr<v1::ListStreamsResponse> after = client.ListStreams();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->SerializeAsString(), before->SerializeAsString());

  // The live state is the first run's: continuing it gives the convictions of one seeded run over all the events.
  ASSERT_EQ(RunCommand(absl::StrCat(stream, " --instrument AAPL --first 300 --count 50 --start_seq 301")).exit_code, 0);
  ASSERT_EQ(RunCommand(absl::StrCat(stream, " --instrument ONCE --seed-window 100 --count 350")).exit_code, 0);
  ExpectReplayOf(ReadLog(client, "AAPL"), ReadLog(client, "ONCE"), 101, 350);

  // --reseed replaces the state, numbering on from the instrument's next sequence number.
  const std::string reseed =
      absl::StrCat(stream, " --instrument AAPL --seed-window 100 --first 250 --count 150 --reseed");
  const CommandResult misnumbered = RunCommand(reseed);
  EXPECT_EQ(misnumbered.exit_code, 1);
  EXPECT_THAT(misnumbered.output, HasSubstr("instrument AAPL takes seq 351 next, but the stream after the seed window "
                                            "would start at 101 (--start_seq 251 continues it, the files' event 350 "
                                            "taking seq 351)"));
  const CommandResult reseeded = RunCommand(absl::StrCat(reseed, " --start_seq 251"));
  ASSERT_EQ(reseeded.exit_code, 0) << reseeded.output;
  EXPECT_THAT(reseeded.output, HasSubstr("streamed 50 events of AAPL (seq 351..400)"));
}

// A first event the daemon refuses opens no stream: the slot it took is free again, and with no stream live the model
// can be replaced. A refused seed window leaves no stream behind either.
TEST(PerceptionctlTest, ARefusedFirstEventOpensNoStream) {
  const ScopedTempDir temp("ctl_refused_first");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::PerceptionClient& client = (*daemon)->client();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  // perceptionctl refuses this number itself (PerceptionctlTest.SequenceNumbersPastTheLargestAreRefusedUpFront).
  const std::unique_ptr<client::EventStream> stream = client.OpenStream([](const v1::StreamResponse&) {});
  v1::StreamRequest request;
  v1::StreamEvent& event = *request.add_events();
  event.set_instrument("AAPL");
  event.set_seq(UINT64_MAX);
  for (int f = 0; f < 48; ++f) event.mutable_features()->add_features(0.f);
  stream->Write(request);
  const absl::Status refused = stream->Finish();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("sequence number 18446744073709551615 is the largest there is"));
  absl::StatusOr<v1::ListStreamsResponse> streams = client.ListStreams();
  ASSERT_TRUE(streams.ok()) << streams.status();
  EXPECT_EQ(streams->streams_size(), 0) << streams->DebugString();

  v1::SeedStreamRequest seed;
  seed.set_instrument("SEEDED");
  seed.add_events()->mutable_features()->add_features(1.f);  // the model takes 48 features
  EXPECT_EQ(client.SeedStream(seed).status().code(), absl::StatusCode::kInvalidArgument);
  streams = client.ListStreams();
  ASSERT_TRUE(streams.ok()) << streams.status();
  EXPECT_EQ(streams->streams_size(), 0) << streams->DebugString();

  const CommandResult replaced = RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10 --replace"));
  EXPECT_EQ(replaced.exit_code, 0) << replaced.output;
}

// The last event's number must stay below 2^64 − 1: the daemon took the events before it (opening the stream) and
// refused the rest, and numbers past 2^64 wrapped. Refused before anything is sent, with or without --count.
TEST(PerceptionctlTest, SequenceNumbersPastTheLargestAreRefusedUpFront) {
  const ScopedTempDir temp("ctl_last_seq");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  const std::string stream = absl::StrCat(ctl, " stream --lobster ", kOrderbook, " ", kMessages, " --instrument AAPL");
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  const CommandResult largest = RunCommand(absl::StrCat(stream, " --count 1 --start_seq 18446744073709551615"));
  EXPECT_EQ(largest.exit_code, 1);
  EXPECT_THAT(largest.output, HasSubstr("INVALID_ARGUMENT: --start_seq 18446744073709551615 numbers the last of 1 "
                                        "events past 18446744073709551614, the largest sequence number the daemon "
                                        "takes; with 1 events --start_seq must be <= 18446744073709551614"));
  const CommandResult past = RunCommand(absl::StrCat(stream, " --count 10 --start_seq 18446744073709551610"));
  EXPECT_EQ(past.exit_code, 1);
  EXPECT_THAT(past.output, HasSubstr("with 10 events --start_seq must be <= 18446744073709551605"));
  // Without --count, the files' 999 events.
  const CommandResult rest = RunCommand(absl::StrCat(stream, " --start_seq 18446744073709551000"));
  EXPECT_EQ(rest.exit_code, 1);
  EXPECT_THAT(rest.output, HasSubstr("with 999 events --start_seq must be <= 18446744073709550616"));
  absl::StatusOr<v1::ListStreamsResponse> streams = (*daemon)->client().ListStreams();
  ASSERT_TRUE(streams.ok()) << streams.status();
  EXPECT_EQ(streams->streams_size(), 0) << "nothing was sent: " << streams->DebugString();

  const CommandResult last = RunCommand(absl::StrCat(stream, " --count 10 --start_seq 18446744073709551605"));
  EXPECT_EQ(last.exit_code, 0) << last.output;
  EXPECT_THAT(last.output, HasSubstr("streamed 10 events of AAPL (seq 18446744073709551605..18446744073709551614)"));
}

// Without --from, convictions reads from the oldest entry even while a live stream overwrites it (the read starts
// over ahead of it), and writes contiguous sequence numbers.
TEST(PerceptionctlTest, ConvictionsFromTheOldestOfAWrappingLog) {
  const ScopedTempDir temp("ctl_convictions_wrap");
  // 2,000 log entries per slot, read 100 a page.
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(
      temp.path() / "checkpoints", {"--stream_slots=4", "--stream_log_entries=8000", "--stream_read_max=100"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);

  const std::string feed = absl::StrCat(ctl, " stream", kLongFeed, " --instrument AMZN --rate 20000");
  std::future<CommandResult> stream = std::async(std::launch::async, RunCommand, feed);
  ASSERT_TRUE(WaitUntilProcessed((*daemon)->client(), "AMZN", 4000)) << "the log has wrapped";
  for (int read = 0; read < 3; ++read) {
    const std::filesystem::path csv = temp.path() / absl::StrCat("amzn", read, ".csv");
    const CommandResult convictions =
        RunCommand(absl::StrCat(ctl, " convictions --instrument AMZN --out ", csv.string()));
    ASSERT_EQ(convictions.exit_code, 0) << convictions.output;
    const std::vector<std::string> lines = absl::StrSplit(FileText(csv), '\n', absl::SkipEmpty());
    ASSERT_GT(lines.size(), 1000u) << "most of the 2,000 entries the log holds";
    EXPECT_EQ(lines[0], "seq,conviction,p1,p2,p3");
    uint64_t previous = 0;
    for (size_t i = 1; i < lines.size(); ++i) {
      uint64_t seq = 0;
      ASSERT_TRUE(absl::SimpleAtoi(lines[i].substr(0, lines[i].find(',')), &seq)) << lines[i];
      if (i > 1) {
        ASSERT_EQ(seq, previous + 1) << "contiguous";
      }
      previous = seq;
    }
  }
  (*daemon)->Signal(SIGKILL);  // the feed has done its part
  stream.get();
}

// A run longer than what the daemon's log keeps an instrument says so before it streams (with the flags that keep
// them all) and after (which convictions are gone), and `convictions` says which of the instrument's it no longer
// has: the output alone looked like a whole run read back. A run that fits says neither.
TEST(PerceptionctlTest, AStreamLongerThanTheLogSaysWhichConvictionsAreOverwritten) {
  const ScopedTempDir temp("ctl_stream_past_the_log");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--stream_slots=4", "--stream_log_entries=400"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);

  const CommandResult stream = RunCommand(absl::StrCat(ctl, " stream", kLongFeed, " --instrument AMZN --count 250"));
  ASSERT_EQ(stream.exit_code, 0) << stream.output;
  EXPECT_THAT(stream.output,
              HasSubstr("warning: the daemon's log keeps the last 100 convictions of an instrument, and this run "
                        "streams 250 events: read back after it, the first 150 of its convictions will have been "
                        "overwritten; to keep them, read them while the instrument streams (perceptionctl "
                        "convictions --from SEQ), or run perceptiond with --stream_log_entries >= 1000 (each of its 4 "
                        "slots keeps --stream_log_entries / --stream_slots)"));
  EXPECT_THAT(stream.output, HasSubstr("its log now holds seq 151..250: the convictions of seq 1..150 were "
                                       "overwritten"));
  const std::filesystem::path csv = temp.path() / "amzn.csv";
  const CommandResult convictions =
      RunCommand(absl::StrCat(ctl, " convictions --instrument AMZN --out ", csv.string()));
  ASSERT_EQ(convictions.exit_code, 0) << convictions.output;
  EXPECT_THAT(convictions.output, HasSubstr("100 convictions of AMZN (seq 151..250"));
  EXPECT_THAT(convictions.output,
              HasSubstr("warning: the log no longer holds the first 150 convictions of AMZN (seq 1..150): it keeps "
                        "the last 100 of an instrument and overwrote them; to keep them, read them while the "
                        "instrument streams (perceptionctl convictions --from SEQ), or run perceptiond with "
                        "--stream_log_entries >= 1000"));
  // A second run continuing the instrument: its own events fit, but the instrument's first ones stay lost.
  const CommandResult more = RunCommand(
      absl::StrCat(ctl, " stream", kLongFeed, " --instrument AMZN --first 250 --count 50 --start_seq 251"));
  ASSERT_EQ(more.exit_code, 0) << more.output;
  EXPECT_THAT(more.output, Not(HasSubstr("warning")));
  EXPECT_THAT(more.output, Not(HasSubstr("overwritten")));
  const CommandResult all_of_it = RunCommand(absl::StrCat(ctl, " convictions --instrument AMZN --out ", csv.string()));
  EXPECT_THAT(all_of_it.output, HasSubstr("the first 200 convictions of AMZN (seq 1..200)"));
  EXPECT_THAT(all_of_it.output, HasSubstr("--stream_log_entries >= 1200"));

  const CommandResult fits = RunCommand(absl::StrCat(ctl, " stream", kLongFeed, " --instrument AAPL --count 100"));
  ASSERT_EQ(fits.exit_code, 0) << fits.output;
  EXPECT_THAT(fits.output, Not(HasSubstr("warning")));
  EXPECT_THAT(fits.output, Not(HasSubstr("overwritten")));
  const CommandResult whole = RunCommand(absl::StrCat(ctl, " convictions --instrument AAPL --out ", csv.string()));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_THAT(whole.output, HasSubstr("100 convictions of AAPL (seq 1..100"));
  EXPECT_THAT(whole.output, Not(HasSubstr("warning")));
  // From a sequence number the reader chose, what is before it is none of its concern.
  const CommandResult from =
      RunCommand(absl::StrCat(ctl, " convictions --instrument AMZN --from 260 --out ", csv.string()));
  ASSERT_EQ(from.exit_code, 0) << from.output;
  EXPECT_THAT(from.output, Not(HasSubstr("warning")));
}

// Where keeping a whole run would take more than --stream_log_entries' bound over the daemon's slots, the advice is
// fewer slots.
TEST(PerceptionctlTest, KeepingALongRunAdvisesFewerSlotsPastTheLogsBound) {
  const ScopedTempDir temp("ctl_stream_past_the_bound");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--stream_slots=65536", "--stream_log_entries=65536"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  const CommandResult stream = RunCommand(absl::StrCat(ctl, " stream", kLongFeed, " --instrument AMZN --count 20000"));
  ASSERT_EQ(stream.exit_code, 0) << stream.output;
  // 2^30 / 20,000 = 53,687.1.
  EXPECT_THAT(stream.output, HasSubstr("or run perceptiond with --stream_slots <= 53687 and --stream_log_entries "
                                       "1073741824 (each slot keeps --stream_log_entries / --stream_slots, and "
                                       "--stream_log_entries is at most 2^30)"));
  EXPECT_THAT(stream.output, HasSubstr("its log now holds seq 20000..20000: the convictions of seq 1..19999 were "
                                       "overwritten"));
}

// A writer that laps the reader (16 entries a slot, the feed at full speed) can make every read from the oldest fail:
// `convictions` then fails saying so, or writes what it caught, and never an empty file as if the log were empty
// (its retries once started past the log's end).
TEST(PerceptionctlTest, ConvictionsOfALogWrappingFasterThanTheReadNeverComeBackEmpty) {
  const ScopedTempDir temp("ctl_convictions_lapped");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(temp.path() / "checkpoints", {"--stream_slots=4", "--stream_log_entries=64"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  std::future<CommandResult> stream =
      std::async(std::launch::async, RunCommand, absl::StrCat(ctl, " stream", kLongFeed, " --instrument AMZN"));
  ASSERT_TRUE(WaitUntilProcessed((*daemon)->client(), "AMZN", 100)) << "the log has wrapped";
  int failed = 0;
  for (int read = 0; read < 20; ++read) {
    const std::filesystem::path csv = temp.path() / absl::StrCat("amzn", read, ".csv");
    const CommandResult convictions =
        RunCommand(absl::StrCat(ctl, " convictions --instrument AMZN --out ", csv.string()));
    if (convictions.exit_code != 0) {
      EXPECT_THAT(convictions.output, HasSubstr("OUT_OF_RANGE")) << read;
      ++failed;
      continue;
    }
    EXPECT_THAT(convictions.output, Not(HasSubstr("wrote only the header"))) << read;
    const std::vector<std::string> lines = absl::StrSplit(FileText(csv), '\n', absl::SkipEmpty());
    EXPECT_GT(lines.size(), 1u) << "rows beyond the header, read " << read;
  }
  std::printf("%d of 20 reads failed with OUT_OF_RANGE\n", failed);
  (*daemon)->Signal(SIGKILL);
  stream.get();
}

// The CSV is written only once every page is in: a read that fails on a later page (the stream overwrote what it
// had yet to reach) leaves an existing file as it was.
TEST(PerceptionctlTest, ConvictionsFailingOnALaterPageLeaveTheFileAsItWas) {
  const ScopedTempDir temp("ctl_convictions_later_page");
  // 10,000 log entries per slot, read one a page: slower than the feed fills the log.
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(
      temp.path() / "checkpoints", {"--stream_slots=4", "--stream_log_entries=40000", "--stream_read_max=1"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 1")).exit_code, 0);
  const std::filesystem::path csv = temp.path() / "amzn.csv";
  std::ofstream(csv) << "an earlier export\n";

  const std::string feed = absl::StrCat(ctl, " stream", kLongFeed, " --instrument AMZN --rate 20000");
  std::future<CommandResult> stream = std::async(std::launch::async, RunCommand, feed);
  ASSERT_TRUE(WaitUntilProcessed((*daemon)->client(), "AMZN", 12000)) << "the log has wrapped";
  absl::StatusOr<v1::ListStreamsResponse> streams = (*daemon)->client().ListStreams();
  ASSERT_TRUE(streams.ok()) << streams.status();
  // Far enough ahead of the oldest entry for the first page to be read before the feed overwrites it.
  const uint64_t from = streams->streams(0).oldest_retained_seq() + 5000;
  const CommandResult convictions =
      RunCommand(absl::StrCat(ctl, " convictions --instrument AMZN --from ", from, " --out ", csv.string()));
  EXPECT_EQ(convictions.exit_code, 1) << convictions.output;
  EXPECT_THAT(convictions.output, HasSubstr("OUT_OF_RANGE"));
  const std::string kept = FileText(csv);
  EXPECT_TRUE(kept == "an earlier export\n") << "replaced by: " << kept.substr(0, 100);
  (*daemon)->Signal(SIGKILL);
  stream.get();
}

// A Stream call with nothing written never reached the daemon (its metadata waits for the first write), and its
// Finish waited for the watchdog (--timeout) before failing DEADLINE_EXCEEDED: `bench` with fewer events than
// instruments opened such a call for each connection whose instruments got none.
TEST(PerceptionctlTest, AStreamWithNothingWrittenFinishesAtOnce) {
  const ScopedTempDir temp("ctl_stream_unwritten");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  client::PerceptionClient client((*daemon)->target(), {.timeout = absl::Seconds(5)});
  const absl::Time start = absl::Now();
  const absl::Status finished = client.OpenStream([](const v1::StreamResponse&) {})->Finish();
  EXPECT_TRUE(finished.ok()) << finished;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "Finish waited for the watchdog";

  const absl::Time bench_start = absl::Now();
  const CommandResult bench =
      RunCommand(absl::StrCat(kKillAfter30s, ctl, " --timeout 5s bench --instruments 4 --events 2 --connections 4"));
  EXPECT_EQ(bench.exit_code, 0) << bench.output;
  EXPECT_THAT(bench.output, HasSubstr("2 events (2 sent, 2 acknowledged)"));
  EXPECT_LT(absl::Now() - bench_start, absl::Seconds(4)) << bench.output;
}

// bench closed every bench-i at the end, also those that never got an event (fewer events than instruments), each
// a NOT_FOUND refusal in the daemon's metrics; it closes only the streams the daemon has.
TEST(PerceptionctlTest, BenchClosesOnlyTheInstrumentsThatGotEvents) {
  const ScopedTempDir temp("ctl_bench_close");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  const CommandResult bench = RunCommand(absl::StrCat(kKillAfter30s, ctl, " bench --instruments 4 --events 2"));
  ASSERT_EQ(bench.exit_code, 0) << bench.output;
  EXPECT_THAT(bench.output, HasSubstr("2 events (2 sent, 2 acknowledged)"));
  absl::StatusOr<v1::ListStreamsResponse> streams = (*daemon)->client().ListStreams();
  ASSERT_TRUE(streams.ok()) << streams.status();
  EXPECT_EQ(streams->streams_size(), 0) << "the streams it opened are closed: " << streams->DebugString();
  absl::StatusOr<std::string> metrics = HttpGet((*daemon)->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics, HasSubstr("\nperception_requests_rejected_total{reason=\"not_found\"} 0\n"));
}

// `ctl bench` of 8 instruments over 2 connections at `rate` events/s, as StartThenWait runs it, once the daemon has
// their 8 streams and has processed an event.
std::pair<std::future<CommandResult>, pid_t> StartBenchOfEight(Daemon& daemon, const std::string& ctl, int rate,
                                                              const std::filesystem::path& pid_file) {
  return StartThenWait(absl::StrCat("echo $$ > ", pid_file.string(), "; exec ", ctl,
                                    " bench --instruments 8 --events 10000000 --rate ", rate, " --connections 2"),
                       pid_file, [&] {
                         return WithinAMinute([&] {
                           const absl::StatusOr<v1::ListStreamsResponse> streams = daemon.client().ListStreams();
                           return streams.ok() && streams->streams_size() == 8 &&
                                  streams->streams(0).processed_events() > 0;
                         });
                       });
}

// Ctrl-C killed a bench without its report and left its instruments' streams open, holding the daemon's slots until
// the next bench closed them. The first signal now stops the sending, at once even between paced rounds (here two a
// second); the events sent are reported once acknowledged, the streams closed, and the run ends by the signal.
TEST(PerceptionctlTest, AnInterruptedBenchReportsTheEventsSentAndClosesItsInstruments) {
  const ScopedTempDir temp("ctl_bench_interrupted");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  auto [running, pid] = StartBenchOfEight(**daemon, ctl, 16, temp.path() / "pid");
  ASSERT_GT(pid, 0) << "the bench never opened its 8 streams";
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  const absl::Time signalled = absl::Now();
  const CommandResult interrupted = running.get();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(5));
  EXPECT_EQ(interrupted.ended_by_signal, SIGINT) << interrupted.exit_code << ": " << interrupted.output;
  EXPECT_THAT(interrupted.output, HasSubstr("perceptionctl: Interrupt: no further events are sent; waiting for those "
                                            "sent to be acknowledged, then the report"));
  EXPECT_THAT(interrupted.output, ContainsRegex("latency \\(scheduled send to acknowledgement\\): p50 [0-9.]+ ms"));
  const std::optional<std::pair<int64_t, int64_t>> counts = TwoNumbers(
      interrupted.output,
      "bench \\(interrupted\\): 8 instruments over 2 connection\\(s\\), 10000000 events \\(([0-9]+) sent, ([0-9]+) "
      "acknowledged\\)");
  ASSERT_TRUE(counts.has_value()) << interrupted.output;
  EXPECT_GT(counts->first, 0);
  EXPECT_EQ(counts->second, counts->first) << "every event sent is acknowledged before the report";
  EXPECT_THAT(interrupted.output, HasSubstr("(0 of them sent)"));
  EXPECT_THAT(interrupted.output, HasSubstr(absl::StrCat("perceptionctl: CANCELLED: interrupted after ", counts->first,
                                                         " of 10000000 events sent: the report above is theirs, its "
                                                         "instruments closed")));
  absl::StatusOr<v1::ListStreamsResponse> streams = (*daemon)->client().ListStreams();
  ASSERT_TRUE(streams.ok()) << streams.status();
  EXPECT_EQ(streams->streams_size(), 0) << "the streams it opened are closed: " << streams->DebugString();
  absl::StatusOr<std::string> metrics = HttpGet((*daemon)->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(*metrics, HasSubstr("\nperception_requests_rejected_total{reason=\"not_found\"} 0\n"));
}

// A second signal cancels the wait for acknowledgements (a daemon that stopped answering, here SIGSTOP, then going on):
// the run says so, and the streams are closed all the same once the daemon has processed what it still held.
TEST(PerceptionctlTest, ASecondInterruptCancelsTheBenchsWaitAndItsStreamsAreClosedAllTheSame) {
  const ScopedTempDir temp("ctl_bench_interrupted_twice");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config small --levels 10")).exit_code, 0);
  auto [running, pid] = StartBenchOfEight(**daemon, ctl, 2000, temp.path() / "pid");
  ASSERT_GT(pid, 0) << "the bench never opened its 8 streams";
  (*daemon)->Signal(SIGSTOP);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_NE(running.wait_for(std::chrono::seconds(0)), std::future_status::ready) << "waits for acknowledgements";
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  absl::SleepFor(absl::Milliseconds(300));
  (*daemon)->Signal(SIGCONT);
  const CommandResult interrupted = running.get();
  EXPECT_EQ(interrupted.ended_by_signal, SIGINT) << interrupted.exit_code << ": " << interrupted.output;
  EXPECT_THAT(interrupted.output, HasSubstr("perceptionctl: Interrupt again: the calls are cancelled"));
  EXPECT_THAT(interrupted.output, HasSubstr("bench (interrupted): 8 instruments over 2 connection(s)"));
  EXPECT_THAT(interrupted.output, HasSubstr("perceptionctl: CANCELLED: interrupted, then the wait for "
                                            "acknowledgements cancelled on 2 of 2 connection(s)\n"));
  absl::StatusOr<v1::ListStreamsResponse> streams = (*daemon)->client().ListStreams();
  ASSERT_TRUE(streams.ok()) << streams.status();
  EXPECT_EQ(streams->streams_size(), 0) << "the streams it opened are closed: " << streams->DebugString();
}

// train --lr sent the normalizer it fitted first, then the learning rate, which the daemon refuses while a live
// stream holds state: the command failed, and the stream went on reading a normalization that no run trained.
TEST(PerceptionctlTest, ARefusedLearningRateLeavesTheModelAsItWas) {
  const ScopedTempDir temp("ctl_refused_lr");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  const std::string files = absl::StrCat(" --lobster ", kOrderbook, " ", kMessages);
  const CommandResult stream =
      RunCommand(absl::StrCat(kKillAfter30s, ctl, " stream", files, " --instrument LIVE --count 20"));
  ASSERT_EQ(stream.exit_code, 0) << stream.output;

  const CommandResult train = RunCommand(absl::StrCat(kKillAfter30s, ctl, " train", files, " --steps 2 --lr 0.002"));
  EXPECT_EQ(train.exit_code, 1) << train.output;
  EXPECT_THAT(train.output, HasSubstr("1 live stream(s) hold state on the current model"));
  EXPECT_THAT(train.output, Not(HasSubstr("sent it")));
  absl::StatusOr<v1::GetStatusResponse> status = (*daemon)->client().GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_FALSE(status->model().normalizer_fitted());
  EXPECT_EQ(status->model().step(), 0);
}

// bench closed every stream whose name began with bench- before its run, a live feed's included (bench-live lost its
// state and its log without a word), and counted only the daemon's slots, so a run beside other streams failed
// partway. It closes only bench-0..N-1, and refuses N beyond the slots the other streams leave free before it sends.
TEST(PerceptionctlTest, BenchLeavesOtherStreamsAloneAndCountsOnlyTheirFreeSlots) {
  const ScopedTempDir temp("ctl_bench_others");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints", {"--stream_slots=4"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  for (const char* live : {"bench-live", "bench-2"}) {
    const CommandResult stream = RunCommand(absl::StrCat(kKillAfter30s, ctl, " stream --lobster ", kOrderbook, " ",
                                                         kMessages, " --instrument ", live, " --count 5"));
    ASSERT_EQ(stream.exit_code, 0) << stream.output;
  }
  const auto processed = [&] {
    std::map<std::string, uint64_t> events;
    absl::StatusOr<v1::ListStreamsResponse> streams = (*daemon)->client().ListStreams();
    EXPECT_TRUE(streams.ok()) << streams.status();
    if (streams.ok()) {
      for (const v1::StreamInfo& stream : streams->streams()) events[stream.instrument()] = stream.processed_events();
    }
    return events;
  };

  // bench-2 is not one of a two-instrument run's: both feeds keep their state, and the run fits the 2 free slots.
  const CommandResult bench = RunCommand(absl::StrCat(kKillAfter30s, ctl, " bench --instruments 2 --events 4"));
  ASSERT_EQ(bench.exit_code, 0) << bench.output;
  EXPECT_THAT(bench.output, HasSubstr("4 events (4 sent, 4 acknowledged)"));
  EXPECT_EQ(processed(), (std::map<std::string, uint64_t>{{"bench-live", 5}, {"bench-2", 5}}));

  // Three instruments: bench-2 is the run's own (closed and started afresh), so bench-live alone is another's.
  const CommandResult three = RunCommand(absl::StrCat(kKillAfter30s, ctl, " bench --instruments 3 --events 3"));
  ASSERT_EQ(three.exit_code, 0) << three.output;
  EXPECT_EQ(processed(), (std::map<std::string, uint64_t>{{"bench-live", 5}}));

  // Four: one slot is bench-live's, so only three are free, and nothing is sent. The refused run changes nothing:
  // bench-1, which an earlier run would have left and this one would close, stays.
  const CommandResult left = RunCommand(absl::StrCat(kKillAfter30s, ctl, " stream --lobster ", kOrderbook, " ",
                                                     kMessages, " --instrument bench-1 --count 5"));
  ASSERT_EQ(left.exit_code, 0) << left.output;
  const CommandResult four = RunCommand(absl::StrCat(kKillAfter30s, ctl, " bench --instruments 4 --events 4"));
  EXPECT_EQ(four.exit_code, 1) << four.output;
  EXPECT_THAT(four.output, HasSubstr("RESOURCE_EXHAUSTED: --instruments 4 is more than the daemon's free stream "
                                     "slots: 1 of its 4 hold other streams"));
  EXPECT_EQ(processed(), (std::map<std::string, uint64_t>{{"bench-live", 5}, {"bench-1", 5}}));
}

// A bench whose connections the daemon ends part way (here its drain) fails, naming the first connection's status,
// and counts the events never sent (the calls ended first) as not acknowledged, saying how many were sent.
TEST(PerceptionctlTest, ABenchTheDaemonEndsPartWayFailsAndCountsWhatWentUnanswered) {
  const ScopedTempDir temp("ctl_bench_drained");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);
  std::future<CommandResult> bench = std::async(
      std::launch::async, RunCommand,
      absl::StrCat(kKillAfter30s, ctl, " bench --instruments 2 --events 400 --rate 100"));  // ~4 s paced
  ASSERT_TRUE(WaitUntilProcessed((*daemon)->client(), "bench-0", 10));
  (*daemon)->Signal(SIGTERM);
  const CommandResult drained = bench.get();
  EXPECT_EQ(drained.exit_code, 1) << drained.output;
  EXPECT_THAT(drained.output,
              HasSubstr("UNAVAILABLE: 1 of 1 connection(s) failed; the first: perceptiond is draining"));
  EXPECT_THAT(drained.output, ContainsRegex("not acknowledged: [1-9][0-9]* events \\([0-9]+ of them sent\\)"));
}

// Paced, event k goes out at k / rate: 2 events at 1 per second take about 1 s, not 2 (the wait counted the request's
// own event, so the first waited a whole interval).
TEST(PerceptionctlTest, APacedStreamSendsItsFirstEventAtOnce) {
  const ScopedTempDir temp("ctl_paced");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(temp.path() / "checkpoints");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
  ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10")).exit_code, 0);

  const CommandResult paced = RunCommand(absl::StrCat(kKillAfter30s, ctl, " stream --lobster ", kOrderbook, " ",
                                                      kMessages, " --instrument AAPL --count 2 --rate 0.5"));
  ASSERT_EQ(paced.exit_code, 0) << paced.output;
  // "streamed 2 events of AAPL (seq 1..2) in S s: ..."
  const std::string line = "streamed 2 events of AAPL (seq 1..2) in ";
  const size_t at = paced.output.find(line);
  ASSERT_NE(at, std::string::npos) << paced.output;
  const size_t begin = at + line.size();
  double seconds = 0;
  ASSERT_TRUE(absl::SimpleAtod(paced.output.substr(begin, paced.output.find(' ', begin) - begin), &seconds))
      << paced.output;
  // (Intervals of 2 s leave a slow host, e.g. under ThreadSanitizer, 1.5 s of room either way.)
  EXPECT_GE(seconds, 2.0) << "the second event at 2 s";
  EXPECT_LT(seconds, 3.5) << "the first event waited a whole interval (then 4 s)";
}

// Training in chunks samples fresh windows each run (the sampler's seed takes in the model's step), and stays
// reproducible: the same chunks from the same start give the same steps. With a learning rate of 1e-12 the weights
// barely move, so a run that repeated the previous run's batch would report the same loss.
TEST(PerceptionctlTest, TrainingInChunksSamplesFreshWindowsEachRun) {
  const ScopedTempDir temp("ctl_train_chunks");
  std::vector<std::vector<std::string>> steps;  // by daemon, by run
  for (int daemon_index = 0; daemon_index < 2; ++daemon_index) {
    absl::StatusOr<std::unique_ptr<Daemon>> daemon =
        Daemon::Start(temp.path() / absl::StrCat("checkpoints", daemon_index));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    const std::string ctl = absl::StrCat(PERCEPTIONCTL_PATH, " --target=", (*daemon)->target());
    ASSERT_EQ(RunCommand(absl::StrCat(ctl, " init --config tiny --levels 10 --lr 1e-12")).exit_code, 0);
    std::vector<std::string>& runs = steps.emplace_back();
    for (int run = 0; run < 2; ++run) {
      const CommandResult train =
          RunCommand(absl::StrCat(ctl, " train --lobster ", kOrderbook, " ", kMessages, " --steps 1"));
      ASSERT_EQ(train.exit_code, 0) << train.output;
      runs.push_back(OnlyStep(train.output));
      ASSERT_THAT(runs.back(), HasSubstr("loss ")) << train.output;
    }
  }
  EXPECT_NE(steps[0][0], steps[0][1]) << "the second run trained on the first run's batch again";
  EXPECT_EQ(steps[1], steps[0]) << "the same runs from the same start";
}

}  // namespace
}  // namespace perception::e2e
