// ExpertService's unary calls on the layer table: CreateLayer, GetLayer, ListLayers,
// DeleteLayer, and GetStats, which reports the table with the server's memory.
//
// Creating and deleting change the table and so run on the device executor (RunUnary): a layer
// is created only once the memory ledger admits its state, and a deleted one is freed there and
// its bytes given back to the ledger. The reads
// (GetLayer, ListLayers, GetStats) answer at once from the values the executor caches, under the
// table's mutex, and never wait for the executor.
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/request_validation.h"
#include "server/service.h"
#include "server/service_internal.h"
#include "wire/wire.h"

namespace moe::server {

grpc::ServerUnaryReactor* ExpertServiceImpl::CreateLayer(grpc::CallbackServerContext* ctx,
                                                         const v1::CreateLayerRequest* req,
                                                         v1::LayerInfo* resp) {
  return RunUnary(
      ctx, "CreateLayer", req, resp, [this, req, resp](const Caller& caller) -> absl::Status {
        MOE_RETURN_IF_ERROR(ValidateLayerName(req->name(), "name"));
        MOE_ASSIGN_OR_RETURN(const LayerConfig config, wire::LayerConfigFromProto(req->config()));
        MOE_ASSIGN_OR_RETURN(std::set<std::string> shared_with, SharedWith(req->shared_with()));
        if (auto existing = FindLayer(req->name()); existing.ok()) {
          if (req->attach_if_exists()) {
            MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, **existing, Access::kTrain, "name"));
          }
          const std::string have =
              wire::LayerConfigToProto((*existing)->config).SerializeAsString();
          const std::string want = wire::LayerConfigToProto(config).SerializeAsString();
          if (req->attach_if_exists() && have == want) {
            FillInfo(**existing, resp);
            return absl::OkStatus();
          }
          return absl::AlreadyExistsError(
              absl::StrCat("name: layer \"", req->name(), "\" already exists",
                           req->attach_if_exists() ? " with a different config" : ""));
        }
        MOE_RETURN_IF_ERROR(CheckLayerCount());
        MOE_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer,
                             CreateAdmittedLayer(caller.principal, req->name(), config));
        std::shared_ptr<LayerEntry> entry;
        MOE_RETURN_IF_ERROR(InsertLayer(req->name(), config, std::move(layer), caller.principal,
                                        std::move(shared_with), &entry));
        FillInfo(*entry, resp);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::GetLayer(grpc::CallbackServerContext* ctx,
                                                      const v1::GetLayerRequest* req,
                                                      v1::LayerInfo* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const absl::Status st = [&]() -> absl::Status {
    MOE_ASSIGN_OR_RETURN(const Caller caller, Authenticate(ctx));
    MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, FindLayer(req->name()));
    MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, *entry, Access::kRead, "name"));
    FillInfo(*entry, resp);
    return absl::OkStatus();
  }();
  FinishUnary(reactor, "GetLayer", st);
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::ListLayers(grpc::CallbackServerContext* ctx,
                                                        const v1::ListLayersRequest*,
                                                        v1::ListLayersResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = Authenticate(ctx);
  if (caller.ok()) {
    for (const auto& e : VisibleLayers(*caller)) FillInfo(*e, resp->add_layers());
  }
  FinishUnary(reactor, "ListLayers", caller.status());
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::DeleteLayer(grpc::CallbackServerContext* ctx,
                                                         const v1::DeleteLayerRequest* req,
                                                         v1::DeleteLayerResponse* resp) {
  return RunUnary(ctx, "DeleteLayer", req, resp, [this, req](const Caller& caller) -> absl::Status {
    std::shared_ptr<LayerEntry> entry;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = layers_.find(req->name());
      if (it == layers_.end()) {
        return absl::NotFoundError(absl::StrCat("name: no layer named \"", req->name(), "\""));
      }
      MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, *it->second, Access::kManage, "name"));
      entry = it->second;
      layers_.erase(it);
      metrics_->Layers(static_cast<int64_t>(layers_.size()));
    }
    contexts_.DropLayer(req->name());
    metrics_->RemoveLayer(req->name(), entry->config.num_experts);
    entry.reset();  // the layer is freed here, on the executor
    ledger_.ReleaseLayer(req->name());
    SampleMemory();
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::GetStats(grpc::CallbackServerContext* ctx,
                                                      const v1::GetStatsRequest*,
                                                      v1::StatsResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = Authenticate(ctx);
  if (!caller.ok()) {
    FinishUnary(reactor, "GetStats", caller.status());
    return reactor;
  }
  resp->set_device(engine_->name());
  resp->set_device_memory_used_bytes(memory_used_);
  resp->set_device_memory_total_bytes(memory_total_);
  resp->set_saved_context_bytes(contexts_.bytes());
  resp->set_saved_context_budget_bytes(contexts_.budget());
  resp->set_saved_contexts(contexts_.count());
  resp->set_sessions(contexts_.sessions());
  resp->set_memory_budget_bytes(ledger_.limits().budget.engine_bytes);
  resp->set_memory_admitted_bytes(ledger_.usage().engine_bytes());
  resp->set_uptime_seconds(SecondsSince(started_));
  for (const auto& e : VisibleLayers(*caller)) FillInfo(*e, resp->add_layers());
  FinishUnary(reactor, "GetStats", absl::OkStatus());
  return reactor;
}

}  // namespace moe::server
