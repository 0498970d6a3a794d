// Early-return helpers for absl::Status / absl::StatusOr, used across every module.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PERCEPTION_CONCAT_INNER(a, b) a##b
#define PERCEPTION_CONCAT(a, b) PERCEPTION_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    ::absl::Status _status = (expr);               \
    if (!_status.ok()) return _status;             \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(*tmp)

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(PERCEPTION_CONCAT(_status_or_, __LINE__), lhs, expr)
