// The status of an input file that cannot be opened.
#include "engine/input_file.h"

#include <cerrno>

namespace perception {

absl::Status InputNotOpened(int error, absl::string_view message) {
  absl::Status status = absl::ErrnoToStatus(error, message);
  if (error != ENOTDIR) return status;
  return absl::NotFoundError(status.message());
}

}  // namespace perception
