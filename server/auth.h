// The principal a call acts for: the identity that owns the layers, sessions and saved contexts
// it creates and that the per-principal quotas are kept for. "anonymous" when authentication is
// off, which makes every client one principal.
#ifndef MOE_SERVER_AUTH_H_
#define MOE_SERVER_AUTH_H_

#include <grpcpp/grpcpp.h>

#include <string>

namespace moe::server {

inline constexpr char kAnonymousPrincipal[] = "anonymous";

// The calling principal of `ctx`.
std::string CallerPrincipal(const grpc::CallbackServerContext* ctx);

}  // namespace moe::server

#endif  // MOE_SERVER_AUTH_H_
