// The address perceptiond listens on by default and perceptionctl calls by default: part of the contract.
#pragma once

namespace perception::v1 {

inline constexpr char kDefaultAddress[] = "127.0.0.1:50051";

}  // namespace perception::v1
