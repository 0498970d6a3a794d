// The port check of listen addresses.
#include "server/listen_address.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace perception::server {

absl::Status CheckListenPort(const std::string& address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) return absl::OkStatus();
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not host:port"));
  }
  const std::string port = address.substr(colon + 1);
  int value = -1;
  const bool digits = !port.empty() && port.size() <= 5 &&
                      port.find_first_not_of("0123456789") == std::string::npos && absl::SimpleAtoi(port, &value);
  if (!digits || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "': the port must be a number from 0 to 65535 (0: any free one), got '", port, "'"));
  }
  return absl::OkStatus();
}

}  // namespace perception::server
