// The one place an absl::Status becomes a grpc::Status. Every handler in the service returns
// through ToGrpcStatus, so the code a client sees is exactly the code the engine or the server
// chose, and the message travels unchanged.
#ifndef MOE_SERVER_STATUS_MAP_H_
#define MOE_SERVER_STATUS_MAP_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace moe::server {

grpc::Status ToGrpcStatus(const absl::Status& status);

// "OK", "INVALID_ARGUMENT", ...: the label value metrics use for a gRPC code.
const char* GrpcCodeName(grpc::StatusCode code);

}  // namespace moe::server

#endif  // MOE_SERVER_STATUS_MAP_H_
