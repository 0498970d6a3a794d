// The port of a listen address (host:port), checked before anything binds it: gRPC and getaddrinfo take any number
// and keep its low 16 bits, so a mistyped port listened somewhere no probe would look.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace perception::server {

// OK for "host:port" or "[v6]:port" with a port of 0 to 65535 written in digits, and for gRPC's unix: addresses;
// INVALID_ARGUMENT naming the address otherwise.
absl::Status CheckListenPort(const std::string& address);

}  // namespace perception::server
