// Progress of a training run: a bar rewritten in place on a terminal, a plain line every few steps otherwise.
#pragma once

#include <chrono>
#include <functional>
#include <string>

namespace perception::client {

// The cells of a bar `width` wide filled after `done` of `total` steps (all of them where total ≤ 0), in 64 bits:
// width · done overflowed an int past 71,582,788 steps of a 30-cell bar.
int FilledBarCells(int done, int total, int width);

class TrainingProgress {
 public:
  using Clock = std::chrono::steady_clock;

  // `log_every`: steps between plain lines (the first and last step always get one). `now`: the clock (tests).
  TrainingProgress(int total_steps, int log_every, bool terminal,
                   std::function<Clock::time_point()> now = Clock::now);

  // After each answered step.
  void Update(double loss, double grad_norm);
  // A line of its own between the updates (on a terminal, the bar continues below it).
  void Note(const std::string& line);
  // Ends the bar's line.
  void Finish();

 private:
  void DrawBar();
  // On a terminal: the bar drawn at the step answered last, then its line ended.
  void EndBarLine();
  void PrintLine(double loss, double grad_norm, const std::string& pace) const;

  const int total_steps_, log_every_;
  const bool terminal_;
  const std::function<Clock::time_point()> now_;
  // The first step's answer: the pace is measured from it, since the first step also carries the run's start
  // (the connection, the daemon's first step at the shape, which runs eagerly before a graph is captured).
  Clock::time_point first_answered_{};
  Clock::time_point last_draw_{};
  int done_ = 0;
  // The bar (terminal only): the last answer's loss and pace, the step it was last drawn at, and whether the cursor is
  // on its line.
  double last_loss_ = 0;
  std::string last_pace_;
  int drawn_ = 0;
  bool bar_on_line_ = false;
};

}  // namespace perception::client
