// ExpertService's unary calls on registered memory: RegisterRegion, UnregisterRegion,
// RegisterEvents, UnregisterEvents (docs/PROTOCOL.md, "Registered memory regions"). Each names
// the caller's session in its "moe-session-id" metadata; the registry (region_registry.h) checks
// that the session is open and the caller's, and owns every check of the request.
//
// All four run on the device executor (RunUnary): mapping CUDA memory and creating events are
// the engine's CUDA calls, made on the thread that runs its layers, and an unregistration queued
// behind a micro-batch that uses the region takes effect after it.
#include <string>

#include "common/status_macros.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace moe::server {

grpc::ServerUnaryReactor* ExpertServiceImpl::RegisterRegion(grpc::CallbackServerContext* ctx,
                                                            const v1::RegisterRegionRequest* req,
                                                            v1::RegisterRegionResponse* resp) {
  const std::string session = SessionOf(ctx);
  return RunUnary(
      ctx, "RegisterRegion", req, resp,
      [this, req, resp, session](const Caller& caller) -> absl::Status {
        MOE_ASSIGN_OR_RETURN(*resp, regions_->Register({caller.principal, session}, *req));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::UnregisterRegion(
    grpc::CallbackServerContext* ctx, const v1::UnregisterRegionRequest* req,
    v1::UnregisterRegionResponse* resp) {
  const std::string session = SessionOf(ctx);
  return RunUnary(ctx, "UnregisterRegion", req, resp,
                  [this, req, session](const Caller& caller) -> absl::Status {
                    return regions_->Unregister({caller.principal, session}, req->region_id());
                  });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::RegisterEvents(grpc::CallbackServerContext* ctx,
                                                            const v1::RegisterEventsRequest* req,
                                                            v1::RegisterEventsResponse* resp) {
  const std::string session = SessionOf(ctx);
  return RunUnary(
      ctx, "RegisterEvents", req, resp,
      [this, req, resp, session](const Caller& caller) -> absl::Status {
        MOE_ASSIGN_OR_RETURN(*resp, regions_->RegisterEvents({caller.principal, session}, *req));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::UnregisterEvents(
    grpc::CallbackServerContext* ctx, const v1::UnregisterEventsRequest* req,
    v1::UnregisterEventsResponse* resp) {
  const std::string session = SessionOf(ctx);
  return RunUnary(ctx, "UnregisterEvents", req, resp,
                  [this, req, session](const Caller& caller) -> absl::Status {
                    return regions_->UnregisterEvents({caller.principal, session}, req->event_id());
                  });
}

}  // namespace moe::server
