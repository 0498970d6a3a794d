// The instrument ids every streaming call takes: part of the contract, checked by the daemon and by its clients.
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace perception::v1 {

// The longest instrument id any streaming call takes, so that a ListStreams page of a few thousand streams stays far
// below gRPC's default 4 MiB receive limit.
inline constexpr size_t kMaxInstrumentIdBytes = 256;

// Every streaming call names its instrument with 1 to kMaxInstrumentIdBytes bytes, none of them a control character:
// ids are printed in tables (perceptionctl streams) and log lines, which a newline in one broke.
inline absl::Status CheckInstrumentId(absl::string_view instrument) {
  if (instrument.empty()) return absl::InvalidArgumentError("the instrument id is empty");
  if (instrument.size() > kMaxInstrumentIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the instrument id has ", instrument.size(), " bytes; at most ",
                                                   kMaxInstrumentIdBytes, " are allowed"));
  }
  for (size_t i = 0; i < instrument.size(); ++i) {
    if (const unsigned char c = instrument[i]; absl::ascii_iscntrl(c)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the instrument id holds a control character (byte %d is 0x%02x); ids are printed in tables and logs", i,
          c));
    }
  }
  return absl::OkStatus();
}

}  // namespace perception::v1
