// Training progress output.
#include "client/training_progress.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"

namespace perception::client {
namespace {

constexpr int kBarWidth = 30;
constexpr auto kRedrawInterval = std::chrono::milliseconds(100);

std::string MinutesSeconds(double seconds) {
  const long total = std::lround(std::max(seconds, 0.0));
  char text[32];
  std::snprintf(text, sizeof(text), "%ld:%02ld", total / 60, total % 60);
  return text;
}

}  // namespace

int FilledBarCells(int done, int total, int width) {
  if (total <= 0) return width;
  return static_cast<int>(std::clamp<int64_t>(int64_t{width} * done / total, 0, width));
}

TrainingProgress::TrainingProgress(int total_steps, int log_every, bool terminal,
                                   std::function<Clock::time_point()> now)
    : total_steps_(total_steps), log_every_(std::max(log_every, 1)), terminal_(terminal), now_(std::move(now)) {}

void TrainingProgress::Update(double loss, double grad_norm) {
  ++done_;
  const Clock::time_point now = now_();
  if (done_ == 1) first_answered_ = now;
  // Steps per second since the first answer, and the time left at that pace; unknown until a second answer.
  const double elapsed = std::chrono::duration<double>(now - first_answered_).count();
  std::string pace = "-- steps/s  ETA --:--";
  if (done_ > 1 && elapsed > 0) {
    const double rate = (done_ - 1) / elapsed;
    pace = absl::StrFormat("%.2f steps/s  ETA %s", rate, MinutesSeconds((total_steps_ - done_) / rate));
  }
  const bool last = done_ == total_steps_;
  if (terminal_) {
    last_loss_ = loss;
    last_pace_ = std::move(pace);
    if (last || now - last_draw_ >= kRedrawInterval) {
      DrawBar();
      last_draw_ = now;
    }
  } else if (last || done_ == 1 || done_ % log_every_ == 0) {
    PrintLine(loss, grad_norm, pace);
  }
}

void TrainingProgress::Note(const std::string& line) {
  EndBarLine();
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void TrainingProgress::Finish() {
  EndBarLine();
  std::fflush(stdout);
}

void TrainingProgress::EndBarLine() {
  if (!terminal_ || done_ == 0) return;
  // Steps answered since the last draw (within kRedrawInterval of it) are shown before the line ends, and a line
  // without a bar (a note right after another) is not ended again: that left an empty line after a validation.
  if (drawn_ != done_) DrawBar();
  if (bar_on_line_) std::printf("\n");
  bar_on_line_ = false;
}

void TrainingProgress::DrawBar() {
  const int filled = FilledBarCells(done_, total_steps_, kBarWidth);
  const std::string bar = std::string(filled, '#') + std::string(kBarWidth - filled, '.');
  std::printf("\rstep %d/%d [%s] loss %.5f  %s ", done_, total_steps_, bar.c_str(), last_loss_, last_pace_.c_str());
  std::fflush(stdout);
  drawn_ = done_;
  bar_on_line_ = true;
}

void TrainingProgress::PrintLine(double loss, double grad_norm, const std::string& pace) const {
  std::printf("step %d/%d  loss %.5f  grad_norm %.4f  %s\n", done_, total_steps_, loss, grad_norm, pace.c_str());
  std::fflush(stdout);
}

}  // namespace perception::client
