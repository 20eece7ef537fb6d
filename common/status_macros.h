// The status macros every layer above the kernels uses: engine, wire, server, client, tools.
//
// MOE_RETURN_IF_ERROR(expr) returns a non-OK absl::Status from the enclosing function.
// MOE_ASSIGN_OR_RETURN(lhs, expr) unwraps an absl::StatusOr or returns its status; it is a
// statement, not an expression, and lhs may declare a variable. The shape follows abseil's
// internal status_macros.h, which Abseil does not ship publicly.
#ifndef MOE_COMMON_STATUS_MACROS_H_
#define MOE_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MOE_RETURN_IF_ERROR(expr)                                     \
  do {                                                                \
    if (absl::Status moe_st_ = (expr); !moe_st_.ok()) return moe_st_; \
  } while (0)

#define MOE_ASSIGN_OR_RETURN(lhs, expr) \
  MOE_ASSIGN_OR_RETURN_IMPL_(MOE_CONCAT_(moe_statusor_, __LINE__), lhs, expr)
#define MOE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return statusor.status();         \
  lhs = std::move(*statusor)
#define MOE_CONCAT_(a, b) MOE_CONCAT_INNER_(a, b)
#define MOE_CONCAT_INNER_(a, b) a##b

#endif  // MOE_COMMON_STATUS_MACROS_H_
