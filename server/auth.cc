// CallerPrincipal without authentication: every call is the anonymous principal.
#include "server/auth.h"

namespace moe::server {

std::string CallerPrincipal(const grpc::CallbackServerContext*) { return kAnonymousPrincipal; }

}  // namespace moe::server
