// Progress of a training run: a bar rewritten in place on a terminal, a plain line every few steps otherwise.
#pragma once

#include <chrono>
#include <string>

namespace perception::client {

// The cells of a bar `width` wide filled after `done` of `total` steps (all of them where total ≤ 0), in 64 bits:
// width · done overflowed an int past 71,582,788 steps of a 30-cell bar.
int FilledBarCells(int done, int total, int width);

class TrainingProgress {
 public:
  // `log_every`: steps between plain lines (the first and last step always get one).
  TrainingProgress(int total_steps, int log_every, bool terminal);

  // After each answered step.
  void Update(double loss, double grad_norm);
  // A line of its own between the updates (on a terminal, the bar continues below it).
  void Note(const std::string& line);
  // Ends the bar's line.
  void Finish();

 private:
  using Clock = std::chrono::steady_clock;

  void DrawBar(double loss, double steps_per_second, double eta_seconds);
  void PrintLine(double loss, double grad_norm, double steps_per_second, double eta_seconds) const;

  const int total_steps_, log_every_;
  const bool terminal_;
  const Clock::time_point start_ = Clock::now();
  Clock::time_point last_draw_{};
  int done_ = 0;
};

}  // namespace perception::client
