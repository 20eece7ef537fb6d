// ToGrpcStatus: every absl code maps to the gRPC code of the same meaning, the message travels
// unchanged, and GrpcCodeName gives the metric label for each.
#include "server/status_map.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace moe::server {
namespace {

TEST(StatusMapTest, EveryCodeMapsToItsGrpcCode) {
  const std::vector<std::pair<absl::Status, std::pair<grpc::StatusCode, std::string>>> cases = {
      {absl::CancelledError("m1"), {grpc::StatusCode::CANCELLED, "CANCELLED"}},
      {absl::UnknownError("m2"), {grpc::StatusCode::UNKNOWN, "UNKNOWN"}},
      {absl::InvalidArgumentError("m3"), {grpc::StatusCode::INVALID_ARGUMENT, "INVALID_ARGUMENT"}},
      {absl::DeadlineExceededError("m4"),
       {grpc::StatusCode::DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"}},
      {absl::NotFoundError("m5"), {grpc::StatusCode::NOT_FOUND, "NOT_FOUND"}},
      {absl::AlreadyExistsError("m6"), {grpc::StatusCode::ALREADY_EXISTS, "ALREADY_EXISTS"}},
      {absl::PermissionDeniedError("m7"),
       {grpc::StatusCode::PERMISSION_DENIED, "PERMISSION_DENIED"}},
      {absl::ResourceExhaustedError("m8"),
       {grpc::StatusCode::RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"}},
      {absl::FailedPreconditionError("m9"),
       {grpc::StatusCode::FAILED_PRECONDITION, "FAILED_PRECONDITION"}},
      {absl::AbortedError("m10"), {grpc::StatusCode::ABORTED, "ABORTED"}},
      {absl::OutOfRangeError("m11"), {grpc::StatusCode::OUT_OF_RANGE, "OUT_OF_RANGE"}},
      {absl::UnimplementedError("m12"), {grpc::StatusCode::UNIMPLEMENTED, "UNIMPLEMENTED"}},
      {absl::InternalError("m13"), {grpc::StatusCode::INTERNAL, "INTERNAL"}},
      {absl::UnavailableError("m14"), {grpc::StatusCode::UNAVAILABLE, "UNAVAILABLE"}},
      {absl::DataLossError("m15"), {grpc::StatusCode::DATA_LOSS, "DATA_LOSS"}},
      {absl::UnauthenticatedError("m16"), {grpc::StatusCode::UNAUTHENTICATED, "UNAUTHENTICATED"}},
  };
  ASSERT_EQ(cases.size(), 16u);  // every non-OK absl code
  for (const auto& [in, want] : cases) {
    grpc::Status out = ToGrpcStatus(in);
    EXPECT_EQ(out.error_code(), want.first) << in;
    EXPECT_EQ(out.error_message(), std::string(in.message())) << in;
    EXPECT_EQ(GrpcCodeName(out.error_code()), want.second) << in;
  }
}

TEST(StatusMapTest, OkIsOk) {
  grpc::Status out = ToGrpcStatus(absl::OkStatus());
  EXPECT_TRUE(out.ok());
  EXPECT_STREQ(GrpcCodeName(out.error_code()), "OK");
}

TEST(StatusMapTest, UnknownAbslCodeBecomesUnknownKeepingTheMessage) {
  grpc::Status out = ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(42), "odd"));
  EXPECT_EQ(out.error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(out.error_message(), "odd");
}

}  // namespace
}  // namespace moe::server
