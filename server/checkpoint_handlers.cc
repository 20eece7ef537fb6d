// ExpertService.SaveCheckpoint and LoadCheckpoint: a layer's whole state to and from a
// safetensors file below --checkpoint_dir (checkpoint.h), each call handed between the two
// executors so that a slow disk holds no Forward.
//
// Save: the state is exported on the device executor (a copy, so the layer trains on), then
// encoded and written on the file executor. Load: read (bounded by --max_checkpoint_bytes),
// decoded and checked whole on the file executor, then imported on the device executor. Either
// way the call's deadline is asked between chunks of I/O and at each hand-over: a call past it
// gets DEADLINE_EXCEEDED with no file replaced (Save) and nothing imported (Load).
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/checkpoint.h"
#include "server/request_validation.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace moe::server {
namespace {

// The file I/O's liveness check: CallAlive, its message saying what the call's end leaves
// (`consequence`).
KeepGoing AliveOrStop(grpc::CallbackServerContext* ctx, const char* consequence) {
  return [ctx, consequence]() -> absl::Status {
    const absl::Status st = CallAlive(ctx);
    if (st.ok()) return st;
    return absl::Status(st.code(), absl::StrCat(st.code() == absl::StatusCode::kCancelled
                                                    ? "the client cancelled the call"
                                                    : "the call's deadline passed",
                                                consequence));
  };
}

}  // namespace

grpc::ServerUnaryReactor* ExpertServiceImpl::SaveCheckpoint(grpc::CallbackServerContext* ctx,
                                                            const v1::SaveCheckpointRequest* req,
                                                            v1::SaveCheckpointResponse* resp) {
  static constexpr char kMethod[] = "SaveCheckpoint";
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> authenticated = BeginUnary(ctx, kMethod, *req, reactor);
  if (!authenticated.ok()) return reactor;
  executor_.Submit([this, ctx, req, resp, reactor,
                    caller = *std::move(authenticated)](double queued) {
    metrics_->Stage(kMethod, "queue", queued);
    const Clock::time_point t0 = Clock::now();
    auto state = std::make_shared<std::map<std::string, Tensor>>();
    LayerConfig config;
    int64_t step = 0;
    const absl::Status exported = [&]() -> absl::Status {
      MOE_RETURN_IF_ERROR(CallAlive(ctx));
      MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, FindLayer(req->layer()));
      MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, *entry, Access::kRead, "layer"));
      // What needs no export first: a bad path or a server without --checkpoint_dir.
      MOE_RETURN_IF_ERROR(SplitCheckpointPath(req->path()).status());
      if (options_.checkpoint_dir.empty()) {
        return absl::FailedPreconditionError("the server was started without --checkpoint_dir");
      }
      MOE_ASSIGN_OR_RETURN(*state, entry->layer->ExportState(/*include_optimizer=*/true));
      config = entry->config;
      step = entry->layer->step();
      return absl::OkStatus();
    }();
    metrics_->Stage(kMethod, "compute", SecondsSince(t0));
    if (!exported.ok()) {
      FinishUnary(reactor, kMethod, exported);
      return;
    }
    file_executor_.Submit([this, ctx, req, resp, reactor, state, config, step, caller](double) {
      const Clock::time_point t1 = Clock::now();
      const KeepGoing alive = AliveOrStop(ctx, "; no checkpoint file was replaced");
      const absl::Status written = [&]() -> absl::Status {
        MOE_RETURN_IF_ERROR(alive());
        absl::StatusOr<std::string> bytes = EncodeCheckpoint(req->layer(), config, *state);
        state->clear();
        MOE_RETURN_IF_ERROR(bytes.status());
        MOE_ASSIGN_OR_RETURN(const std::string root, CheckpointRoot(caller));
        MOE_ASSIGN_OR_RETURN(
            const std::string path,
            WriteCheckpointFile(root, req->path(), *bytes, options_.max_checkpoint_bytes, alive));
        resp->set_path(path);
        resp->set_bytes(static_cast<int64_t>(bytes->size()));
        resp->set_step(step);
        return absl::OkStatus();
      }();
      metrics_->Stage(kMethod, "io", SecondsSince(t1));
      if (written.ok()) metrics_->BytesOut(kMethod, static_cast<int64_t>(resp->ByteSizeLong()));
      FinishUnary(reactor, kMethod, written);
    });
  });
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::LoadCheckpoint(grpc::CallbackServerContext* ctx,
                                                            const v1::LoadCheckpointRequest* req,
                                                            v1::LoadCheckpointResponse* resp) {
  static constexpr char kMethod[] = "LoadCheckpoint";
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> authenticated = BeginUnary(ctx, kMethod, *req, reactor);
  if (!authenticated.ok()) return reactor;
  file_executor_.Submit([this, ctx, req, resp, reactor,
                         caller = *std::move(authenticated)](double) {
    const Clock::time_point t1 = Clock::now();
    const KeepGoing alive =
        AliveOrStop(ctx, " while the checkpoint was read; nothing was imported");
    auto decoded = std::make_shared<DecodedCheckpoint>();
    const absl::Status read = [&]() -> absl::Status {
      MOE_RETURN_IF_ERROR(alive());
      MOE_RETURN_IF_ERROR(ValidateLayerName(req->layer(), "layer"));
      // Refused before the file is read: loading over another principal's layer.
      if (auto existing = FindLayer(req->layer()); existing.ok()) {
        MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, **existing, Access::kManage, "layer"));
      }
      MOE_RETURN_IF_ERROR(SharedWith(req->shared_with()).status());
      MOE_ASSIGN_OR_RETURN(const std::string root, CheckpointRoot(caller));
      MOE_ASSIGN_OR_RETURN(
          const std::string bytes,
          ReadCheckpointFile(root, req->path(), options_.max_checkpoint_bytes, alive));
      MOE_ASSIGN_OR_RETURN(*decoded, DecodeCheckpoint(bytes));
      // Whole or not at all: every tensor of the file's own layer config, nothing else.
      return CheckCheckpointState(decoded->config, decoded->state);
    }();
    metrics_->Stage(kMethod, "io", SecondsSince(t1));
    if (!read.ok()) {
      FinishUnary(reactor, kMethod, read);
      return;
    }
    executor_.Submit([this, ctx, req, resp, reactor, decoded, caller](double queued) {
      metrics_->Stage(kMethod, "queue", queued);
      const Clock::time_point t0 = Clock::now();
      const absl::Status imported = [&]() -> absl::Status {
        MOE_RETURN_IF_ERROR(CallAlive(ctx));
        if (auto entry = FindLayer(req->layer()); entry.ok()) {
          // Checked again here: the layer may have been created since the file was read.
          MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, **entry, Access::kManage, "layer"));
          // Into the existing layer: the checkpoint must fit it whole; ImportState then checks
          // the values and changes nothing unless all of them pass.
          MOE_RETURN_IF_ERROR(
              CheckCheckpointFitsLayer(req->layer(), (*entry)->config, decoded->state));
          MOE_RETURN_IF_ERROR((*entry)->layer->ImportState(decoded->state));
          RefreshLayer(**entry);
          FillInfo(**entry, resp->mutable_layer());
          return absl::OkStatus();
        }
        MOE_RETURN_IF_ERROR(CheckLayerCount());
        MOE_ASSIGN_OR_RETURN(std::set<std::string> shared_with, SharedWith(req->shared_with()));
        MOE_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer,
                             CreateAdmittedLayer(caller.principal, req->layer(), decoded->config));
        if (absl::Status st = layer->ImportState(decoded->state); !st.ok()) {
          layer.reset();
          ledger_.ReleaseLayer(req->layer());
          return st;
        }
        std::shared_ptr<LayerEntry> created;
        MOE_RETURN_IF_ERROR(InsertLayer(req->layer(), decoded->config, std::move(layer),
                                        caller.principal, std::move(shared_with), &created));
        FillInfo(*created, resp->mutable_layer());
        return absl::OkStatus();
      }();
      metrics_->Stage(kMethod, "compute", SecondsSince(t0));
      if (imported.ok()) metrics_->BytesOut(kMethod, static_cast<int64_t>(resp->ByteSizeLong()));
      FinishUnary(reactor, kMethod, imported);
    });
  });
  return reactor;
}

}  // namespace moe::server
