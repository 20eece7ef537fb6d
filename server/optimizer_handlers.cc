// ExpertService.Step and ZeroGrad: the optimizer's unary calls on a layer. Both run on the device
// executor (RunUnary), the thread every Forward and Backward runs on, so neither overlaps a
// micro-batch of the layer.
#include <memory>

#include "common/status_macros.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace moe::server {

grpc::ServerUnaryReactor* ExpertServiceImpl::Step(grpc::CallbackServerContext* ctx,
                                                  const v1::StepRequest* req,
                                                  v1::StepResponse* resp) {
  return RunUnary(ctx, "Step", req, resp, [this, req, resp](const Caller& caller) -> absl::Status {
    MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, FindLayer(req->layer()));
    MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, *entry, Access::kTrain, "layer"));
    MOE_ASSIGN_OR_RETURN(const StepResult result, entry->layer->Step());
    RefreshLayer(*entry);
    metrics_->OptimizerStep(req->layer(), result.grad_norm);
    resp->set_step(result.step);
    resp->set_grad_norm(result.grad_norm);
    resp->set_expert_first(entry->config.expert_first);
    for (int64_t n : result.tokens_per_expert) resp->add_tokens_per_expert(n);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::ZeroGrad(grpc::CallbackServerContext* ctx,
                                                      const v1::ZeroGradRequest* req,
                                                      v1::ZeroGradResponse* resp) {
  return RunUnary(ctx, "ZeroGrad", req, resp, [this, req](const Caller& caller) -> absl::Status {
    MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, FindLayer(req->layer()));
    MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, *entry, Access::kTrain, "layer"));
    return entry->layer->ZeroGrad();
  });
}

}  // namespace moe::server
