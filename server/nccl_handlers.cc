// ExpertService's NCCL calls (docs/PROTOCOL.md, "NCCL channels"): OpenNcclChannel and
// CloseNcclChannel on the device executor (the engine starts and aborts communicators), and
// NcclForward / NcclBackward, one micro-batch each, whose tensors travel over the channel.
//
// A micro-batch's path: the reaction checks the caller and plans the transfers from the request
// alone (nccl_channels.h), and queues it on its channel, which posts its receives in sequence
// order; once its inputs are in, the engine call runs on the executor with views of the received
// device buffers and a device destination, and the executor posts the results' sends (zeros,
// for a call that failed: the channel stays in step) before answering. A call whose transfer
// sizes cannot be known aborts its channel, as its order with the client is then lost.
//
// The engine call returns once its work is queued (StreamOrder::done_event on the link's event)
// and the sends wait for that work on the device: the executor starts the next micro-batch
// while the GPU still runs this one, and the answer overlaps it (decision 0018, "Overlap").
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/nccl_channels.h"
#include "server/service.h"
#include "server/service_internal.h"
#include "wire/wire.h"

namespace moe::server {
namespace {

TensorView InputView(const NcclPlan::Part& p, const NcclBuffer& b, const MemoryLocation& at) {
  if (!p.present) return {};
  return TensorView{p.dtype, p.shape, b.data, static_cast<size_t>(p.bytes), at};
}

MutableTensorView OutputView(const NcclPlan::Part& p, const NcclBuffer& b,
                             const MemoryLocation& at) {
  if (!p.present) return {};
  return MutableTensorView{p.dtype, p.shape, b.data, static_cast<size_t>(p.bytes), at};
}

// A result the response carries as bytes (server routing's routing, a dweights not sent over
// the channel).
void SetTensor(const Tensor& t, v1::Tensor* proto) {
  wire::SetTensorHeader(t.dtype, t.shape, proto);
  proto->set_data(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
}

}  // namespace

grpc::ServerUnaryReactor* ExpertServiceImpl::OpenNcclChannel(
    grpc::CallbackServerContext* ctx, const v1::OpenNcclChannelRequest* req,
    v1::OpenNcclChannelResponse* resp) {
  const std::string session = SessionOf(ctx);
  return RunUnary(ctx, "OpenNcclChannel", req, resp,
                  [this, resp, session](const Caller& caller) -> absl::Status {
                    MOE_ASSIGN_OR_RETURN(*resp, nccl_->Open({caller.principal, session}));
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::CloseNcclChannel(
    grpc::CallbackServerContext* ctx, const v1::CloseNcclChannelRequest* req,
    v1::CloseNcclChannelResponse* resp) {
  const std::string session = SessionOf(ctx);
  return RunUnary(ctx, "CloseNcclChannel", req, resp,
                  [this, req, session](const Caller& caller) -> absl::Status {
                    return nccl_->Close({caller.principal, session}, req->channel_id());
                  });
}

template <typename Req, typename Resp, typename Compute>
grpc::ServerUnaryReactor* ExpertServiceImpl::RunNccl(grpc::CallbackServerContext* ctx,
                                                     const char* method, const Req* req,
                                                     Resp* resp,
                                                     absl::StatusOr<NcclPlan> plan,
                                                     Compute compute) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> authenticated = BeginUnary(ctx, method, *req, reactor);
  if (!authenticated.ok()) return reactor;
  const RegionOwner owner{authenticated->principal, SessionOf(ctx)};
  const uint64_t channel = req->nccl().channel_id();
  if (!plan.ok()) {
    // The client posted transfers of sizes this server cannot know: the channel is out of step.
    nccl_->Abort(owner, channel, plan.status());
    FinishUnary(reactor, method, plan.status());
    return reactor;
  }
  const Clock::time_point arrived = Clock::now();
  NcclChannels::Batch batch;
  batch.plan = *plan;
  batch.failed = [this, reactor, method](absl::Status st) { FinishUnary(reactor, method, st); };
  batch.received = [this, ctx, reactor, method, resp, owner, compute, arrived,
                    plan = *plan, caller = *authenticated](NcclChannels::Received r) {
    metrics_->Stage(method, "receive", SecondsSince(arrived));
    executor_.Submit([=](double queued) {
      metrics_->Stage(method, "queue", queued);
      const Clock::time_point t0 = Clock::now();
      const MemoryLocation at = r.link->location();
      std::vector<TensorView> inputs;
      for (size_t i = 0; i < plan.inputs.size(); ++i) {
        inputs.push_back(InputView(plan.inputs[i], r.inputs[i], at));
      }
      std::vector<MutableTensorView> outputs;
      for (size_t i = 0; i < plan.outputs.size(); ++i) {
        outputs.push_back(OutputView(plan.outputs[i], r.outputs[i], at));
      }
      // The sends follow the engine's work on the device through this event (null: the call
      // waits for its work instead).
      void* computed = r.link->compute_done_event();
      // A call already cancelled still moves its bytes: the client posted them.
      absl::Status st = CallAlive(ctx);
      if (st.ok()) {
        st = GuardAllocation(method, [&] { return compute(caller, inputs, outputs, computed); });
      }
      metrics_->Stage(method, "compute", SecondsSince(t0));
      std::vector<NcclBuffer> sends;
      for (size_t i = 0; i < plan.outputs.size(); ++i) {
        if (plan.outputs[i].present) sends.push_back({r.outputs[i].data, plan.outputs[i].bytes});
      }
      absl::StatusOr<std::unique_ptr<NcclCompletion>> sent =
          r.link->Send(sends, !st.ok(), computed);
      std::vector<NcclBuffer> held = r.inputs;
      held.insert(held.end(), r.outputs.begin(), r.outputs.end());
      if (sent.ok()) {
        nccl_->TrackSend(r.channel_id, r.link, *std::move(sent), std::move(held));
      } else {
        nccl_->Abort(owner, r.channel_id, sent.status());
        for (const NcclBuffer& b : held) r.link->Release(b);
        if (st.ok()) st = absl::UnavailableError(sent.status().message());
      }
      if (st.ok()) {
        metrics_->BytesOut(method, static_cast<int64_t>(resp->ByteSizeLong()));
        int64_t in = 0, out = 0;
        for (const NcclPlan::Part& p : plan.inputs) in += p.present ? p.bytes : 0;
        for (const NcclPlan::Part& p : plan.outputs) out += p.present ? p.bytes : 0;
        metrics_->TransportCall(method, "nccl");
        metrics_->TransportBytes("in", "nccl", in);
        metrics_->TransportBytes("out", "nccl", out);
      }
      FinishUnary(reactor, method, st);
    });
  };
  if (absl::Status st = nccl_->Submit(owner, req->nccl(), std::move(batch)); !st.ok()) {
    FinishUnary(reactor, method, st);
  }
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServiceImpl::NcclForward(grpc::CallbackServerContext* ctx,
                                                         const v1::ForwardRequest* req,
                                                         v1::ForwardResponse* resp) {
  const std::string session = SessionOf(ctx);
  return RunNccl(
      ctx, "NcclForward", req, resp, PlanForward(*req),
      [this, req, resp, session](const Caller& caller, const std::vector<TensorView>& in,
                                 const std::vector<MutableTensorView>& out,
                                 void* done_event) -> absl::Status {
        MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, FindLayer(req->layer()));
        MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, *entry, Access::kTrain, "layer"));
        if (req->training()) {
          MOE_RETURN_IF_ERROR(contexts().CheckSession(session, caller.principal));
        }
        ForwardRequest request;
        request.training = req->training();
        request.x = in[0];
        request.expert_ids = in[1];
        request.weights = in[2];
        request.out = out[0];
        request.order.done_event = done_event;
        MOE_RETURN_IF_ERROR(
            CheckTensor(request.x, "x", entry->config.dtype, {-1, entry->config.d_model}));
        const int64_t tokens = request.x.shape[0];
        MOE_ASSIGN_OR_RETURN(
            MemoryLedger::RequestCharge working,
            AdmitEngineCall(*entry, tokens,
                            request.training ? EngineCall::kTrainingForward
                                             : EngineCall::kForward));
        absl::StatusOr<ForwardResult> forward = entry->layer->Forward(request);
        working.Reset();
        MOE_ASSIGN_OR_RETURN(ForwardResult result, std::move(forward));
        if (request.training) {
          if (!result.context) return absl::InternalError("engine returned no training context");
          MOE_RETURN_IF_ERROR(contexts().Put(req->layer(), req->context_id(), caller.principal,
                                             session, std::move(result.context)));
        }
        metrics().Tokens(req->layer(), "forward", tokens);
        metrics().ExpertTokens(req->layer(), entry->config.expert_first,
                               result.tokens_per_local_expert);
        resp->set_context_id(req->context_id());
        resp->set_aux_loss(result.aux_loss);
        resp->set_z_loss(result.z_loss);
        resp->set_last_chunk(true);
        wire::SetTensorHeader(request.out.dtype, request.out.shape, resp->mutable_out());
        if (!result.expert_ids.empty()) SetTensor(result.expert_ids, resp->mutable_expert_ids());
        if (!result.weights.empty()) SetTensor(result.weights, resp->mutable_weights());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ExpertServiceImpl::NcclBackward(grpc::CallbackServerContext* ctx,
                                                          const v1::BackwardRequest* req,
                                                          v1::BackwardResponse* resp) {
  return RunNccl(
      ctx, "NcclBackward", req, resp, PlanBackward(*req),
      [this, req, resp](const Caller& caller, const std::vector<TensorView>& in,
                        const std::vector<MutableTensorView>& out,
                        void* done_event) -> absl::Status {
        const double aux_grad = req->has_aux_loss_grad() ? req->aux_loss_grad() : 1.0;
        if (!std::isfinite(aux_grad)) {
          return absl::InvalidArgumentError(
              absl::StrCat("aux_loss_grad: ", aux_grad, " is not a finite number"));
        }
        MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, FindLayer(req->layer()));
        MOE_RETURN_IF_ERROR(AuthorizeLayer(caller, *entry, Access::kTrain, "layer"));
        const LayerConfig& config = entry->config;
        MOE_ASSIGN_OR_RETURN(
            const int64_t tokens,
            contexts().NumTokens(req->layer(), req->context_id(), caller.principal));
        BackwardRequest request;
        request.dout = in[0];
        request.dx = out[0];
        request.dweights = out[1];
        request.aux_grad_scale = aux_grad;
        request.order.done_event = done_event;
        // Checked before the context is consumed, so a wrong shape does not lose it.
        MOE_RETURN_IF_ERROR(CheckTensor(request.dout, "dout", config.dtype,
                                        {tokens, config.d_model}));
        if (!request.dweights.empty() && (config.routing != RoutingMode::kClient ||
                                          req->nccl().dweights_k() != config.top_k)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "nccl.dweights_k: ", req->nccl().dweights_k(), ", but layer \"", req->layer(),
              "\" has ",
              config.routing == RoutingMode::kClient
                  ? absl::StrCat("top_k ", config.top_k)
                  : std::string("server routing (no dweights)")));
        }
        MOE_ASSIGN_OR_RETURN(MemoryLedger::RequestCharge working,
                             AdmitEngineCall(*entry, tokens, EngineCall::kBackward));
        MOE_ASSIGN_OR_RETURN(std::unique_ptr<SavedContext> context,
                             contexts().Take(req->layer(), req->context_id(), caller.principal));
        MOE_ASSIGN_OR_RETURN(BackwardResult result,
                             entry->layer->Backward(std::move(context), request));
        metrics().Tokens(req->layer(), "backward", tokens);
        resp->set_context_id(req->context_id());
        resp->set_last_chunk(true);
        wire::SetTensorHeader(request.dx.dtype, request.dx.shape, resp->mutable_dx());
        if (!request.dweights.empty()) {
          wire::SetTensorHeader(request.dweights.dtype, request.dweights.shape,
                                resp->mutable_dweights());
        } else if (!result.dweights.empty()) {
          SetTensor(result.dweights, resp->mutable_dweights());
        }
        return absl::OkStatus();
      });
}

}  // namespace moe::server
