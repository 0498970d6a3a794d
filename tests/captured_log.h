// The default spdlog logger's records captured in memory, for tests that check what the daemon logs.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"

namespace perception::testing {

// The default logger's records, as "level|message", while it is in scope. Declare it before anything that logs
// from its own thread (a server, a daemon), so that the logger is not swapped under that thread.
class CapturedLog {
 public:
  CapturedLog() : previous_(spdlog::default_logger()) {
    sink_->set_pattern("%l|%v");
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("captured", sink_));
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }

  std::vector<std::string> lines() const { return sink_->last_formatted(); }

 private:
  const std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_ =
      std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
  const std::shared_ptr<spdlog::logger> previous_;
};

}  // namespace perception::testing
