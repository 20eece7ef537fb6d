// ExpertService.Backward: the micro-batch stream (micro_batch_reactor.h) whose one input is
// dout. It consumes the context its Forward saved, but only once dout has passed its checks, so
// a bad dout leaves the context for a correct retry. Unless striped, dout's room is reserved
// from the server's own numbers (the saved context's tokens and the layer's d_model), never
// from the client's claim.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "server/micro_batch_reactor.h"
#include "server/service.h"

namespace moe::server {
namespace {

class BackwardReactor final : public MicroBatchReactor<v1::BackwardRequest, v1::BackwardResponse> {
 public:
  BackwardReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx)
      : MicroBatchReactor(
            s, ctx, "Backward",
            {{v1::BackwardRequest::kDoutFieldNumber, "dout", true,
              wire::TensorAssembler::Sizing::kClaimedOnceAnEighthArrived}},
            {v1::BackwardResponse::kDxFieldNumber, v1::BackwardResponse::kDweightsFieldNumber}) {
    Start();
  }

 protected:
  absl::Status ReadHeader(const v1::BackwardRequest&) override {
    if (striped()) return absl::OkStatus();  // each stream's share is its own claim
    // dout is [tokens, d_model] of the saved context: room for exactly that, from the server's
    // own numbers, not the client's claim (Compute still checks the shape).
    auto entry = service_->FindLayer(layer_);
    auto tokens = service_->contexts().NumTokens(layer_, context_id_, caller().principal);
    if (entry.ok() && tokens.ok()) {
      return ReserveInput(0, *tokens * (*entry)->config.d_model *
                                 static_cast<int64_t>(DTypeSize((*entry)->config.dtype)));
    }
    return absl::OkStatus();
  }
  absl::Status CheckSame(const v1::BackwardRequest&) const override { return absl::OkStatus(); }
  const v1::Tensor* InputOf(const v1::BackwardRequest& c, size_t) const override {
    return c.has_dout() ? &c.dout() : nullptr;
  }
  std::pair<std::string, std::string> StripeHeader() const override { return {"", ""}; }

  absl::StatusOr<Computed<v1::BackwardResponse>> Compute(
      const std::vector<TensorView>& inputs,
      const std::vector<grpc::CallbackServerContext*>&) override {
    MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, service_->FindLayer(layer_));
    MOE_RETURN_IF_ERROR(service_->AuthorizeLayer(caller(), *entry, Access::kTrain, "layer"));
    MOE_ASSIGN_OR_RETURN(const int64_t tokens,
                         service_->contexts().NumTokens(layer_, context_id_, caller().principal));
    const TensorView& dout = inputs[0];
    // Checked here, before the context is consumed, so a bad dout or a call that does not fit
    // does not lose it.
    MOE_RETURN_IF_ERROR(
        CheckTensor(dout, "dout", entry->config.dtype, {tokens, entry->config.d_model}));
    MOE_ASSIGN_OR_RETURN(MemoryLedger::RequestCharge working,
                         service_->AdmitEngineCall(*entry, tokens, EngineCall::kBackward));
    MOE_ASSIGN_OR_RETURN(std::unique_ptr<SavedContext> context,
                         service_->contexts().Take(layer_, context_id_, caller().principal));
    MOE_ASSIGN_OR_RETURN(BackwardResult result, entry->layer->Backward(std::move(context), dout));
    service_->metrics().Tokens(layer_, "backward", tokens);
    const uint64_t id = context_id_;
    const bool has_dweights = !result.dweights.empty();
    auto tensors = std::make_shared<std::vector<Tensor>>();
    tensors->push_back(std::move(result.dx));
    tensors->push_back(std::move(result.dweights));
    return Computed<v1::BackwardResponse>{std::move(tensors), [=](v1::BackwardResponse* m) {
                                            m->set_context_id(id);
                                            return std::vector<v1::Tensor*>{
                                                m->mutable_dx(),
                                                has_dweights ? m->mutable_dweights() : nullptr};
                                          }};
  }
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ExpertServiceImpl::Backward(
    grpc::CallbackServerContext* ctx) {
  return new BackwardReactor(this, ctx);
}

}  // namespace moe::server
