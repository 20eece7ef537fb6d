// ExpertService.Backward: the micro-batch stream (micro_batch_reactor.h) whose one input is
// dout. It consumes the context its Forward saved, but only once dout and every reference have
// passed their checks, so a bad dout or reference leaves the context for a correct retry. Unless
// striped or given by reference, dout's room is reserved from the server's own numbers (the saved
// context's tokens and the layer's d_model), never from the client's claim. With dx_ref or
// dweights_ref the engine writes that result into the client's region and the response carries
// its dtype, shape and reference only. aux_loss_grad (absent: 1) scales the router's aux-loss
// gradients.
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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
  absl::Status ReadHeader(const v1::BackwardRequest& first) override {
    if (first.has_nccl()) {
      return absl::InvalidArgumentError("nccl: only NcclBackward moves tensors over a channel");
    }
    // d loss / d aux: absent means 1, what every Backward meant before the field existed.
    aux_loss_grad_ = first.has_aux_loss_grad() ? first.aux_loss_grad() : 1.0;
    if (!std::isfinite(aux_loss_grad_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("aux_loss_grad: ", aux_loss_grad_, " is not a finite number"));
    }
    // A striped stream's share is its own claim; a dout by reference needs no room.
    if (striped() || InputRef(0) != nullptr) return absl::OkStatus();
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
  absl::Status CheckSame(const v1::BackwardRequest& c) const override {
    if ((c.has_aux_loss_grad() ? c.aux_loss_grad() : 1.0) != aux_loss_grad_) {
      return absl::InvalidArgumentError(
          "aux_loss_grad: must be the same in every chunk of a micro-batch");
    }
    return absl::OkStatus();
  }
  const v1::Tensor* InputOf(const v1::BackwardRequest& c, size_t) const override {
    return c.has_dout() ? &c.dout() : nullptr;
  }
  std::pair<std::string, std::string> StripeHeader() const override {
    return {"aux_loss_grad", absl::StrFormat("%.17g", aux_loss_grad_)};
  }

  absl::StatusOr<Computed<v1::BackwardResponse>> Compute(
      const std::vector<TensorView>& inputs,
      const std::vector<grpc::CallbackServerContext*>&) override {
    MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, service_->FindLayer(layer_));
    MOE_RETURN_IF_ERROR(service_->AuthorizeLayer(caller(), *entry, Access::kTrain, "layer"));
    MOE_ASSIGN_OR_RETURN(const int64_t tokens,
                         service_->contexts().NumTokens(layer_, context_id_, caller().principal));
    const LayerConfig& config = entry->config;
    // Resolved and checked here, before the context is consumed, so a bad dout or reference, or
    // a call that does not fit, does not lose it.
    std::vector<std::optional<wire::ResolvedTensor>> destinations(2);
    if (const v1::TensorRef* ref = DestinationRef(0)) {
      MOE_ASSIGN_OR_RETURN(
          destinations[0],
          wire::DestinationTensor(*ref, config.dtype, {tokens, config.d_model}, "dx_ref"));
    }
    if (const v1::TensorRef* ref = DestinationRef(1)) {
      if (config.routing != RoutingMode::kClient) {
        return absl::InvalidArgumentError(
            absl::StrCat("dweights_ref: layer \"", layer_,
                         "\" routes on the server, so a Backward has no dweights to write"));
      }
      MOE_ASSIGN_OR_RETURN(
          destinations[1],
          wire::DestinationTensor(*ref, DType::kFloat32, {tokens, config.top_k}, "dweights_ref"));
    }
    MOE_ASSIGN_OR_RETURN(Bound bound, Bind(inputs, destinations));
    BackwardRequest request;
    request.dout = bound.inputs[0];
    request.dx = bound.destinations[0];
    request.dweights = bound.destinations[1];
    request.order = bound.order;
    request.aux_grad_scale = aux_loss_grad_;
    MOE_RETURN_IF_ERROR(CheckTensor(request.dout, "dout", config.dtype, {tokens, config.d_model}));
    MOE_ASSIGN_OR_RETURN(MemoryLedger::RequestCharge working,
                         service_->AdmitEngineCall(*entry, tokens, EngineCall::kBackward));
    MOE_ASSIGN_OR_RETURN(std::unique_ptr<SavedContext> context,
                         service_->contexts().Take(layer_, context_id_, caller().principal));
    MOE_ASSIGN_OR_RETURN(BackwardResult result,
                         entry->layer->Backward(std::move(context), request));
    // The gradients are accumulated by now; what was computed from or into memory its owner took
    // away is still not returned.
    MOE_RETURN_IF_ERROR(bound.call.CheckIntact());
    service_->metrics().Tokens(layer_, "backward", tokens);
    const uint64_t id = context_id_;
    const bool has_dweights = !result.dweights.empty();
    const std::vector<std::optional<v1::Tensor>> in_place = WrittenInPlace(bound);
    auto tensors = std::make_shared<std::vector<Tensor>>();
    tensors->push_back(std::move(result.dx));
    tensors->push_back(std::move(result.dweights));
    return Computed<v1::BackwardResponse>{
        std::move(tensors), [=](v1::BackwardResponse* m) {
          m->set_context_id(id);
          if (in_place[0]) *m->mutable_dx() = *in_place[0];
          if (in_place[1]) *m->mutable_dweights() = *in_place[1];
          return std::vector<v1::Tensor*>{
              in_place[0] ? nullptr : m->mutable_dx(),
              has_dweights && !in_place[1] ? m->mutable_dweights() : nullptr};
        }};
  }

 private:
  double aux_loss_grad_ = 1.0;
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ExpertServiceImpl::Backward(
    grpc::CallbackServerContext* ctx) {
  return new BackwardReactor(this, ctx);
}

}  // namespace moe::server
