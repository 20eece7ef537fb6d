// ExpertService.Forward: the micro-batch stream (micro_batch_reactor.h) whose inputs are x and,
// for client routing, expert_ids and weights. A training Forward keeps the engine's context in
// the context store under the caller's principal and session, for the Backward that consumes it;
// it is not stored when a stream that carried the micro-batch was cancelled by then, so a
// cancelled call leaves no context behind. With out_ref the engine writes out into the client's
// region and the response carries out's dtype, shape and reference only; expert_ids and weights
// (the routing used) always come back as bytes.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/micro_batch_reactor.h"
#include "server/service.h"

namespace moe::server {
namespace {

// x's rows, from x as the micro-batch gives it (inline, or by reference: dtype and shape only),
// which must be [T, d_model] of the layer's dtype; InvalidArgument naming x otherwise. out's
// destination is [T, d_model], so x is checked before any reference is resolved.
absl::StatusOr<int64_t> RowsOfX(const TensorView& x, const wire::ResolvedTensor* ref,
                                const LayerConfig& config) {
  const DType dtype = ref != nullptr ? ref->dtype : x.dtype;
  const std::vector<int64_t>& shape = ref != nullptr ? ref->shape : x.shape;
  if (dtype != config.dtype) {  // the messages of CheckTensor, which checks an inline x later
    return absl::InvalidArgumentError(
        absl::StrCat("x: dtype ", DTypeName(dtype), ", expected ", DTypeName(config.dtype)));
  }
  if (shape.size() != 2 || shape[0] < 0 || shape[1] != config.d_model) {
    return absl::InvalidArgumentError(absl::StrCat("x: shape [", absl::StrJoin(shape, ", "),
                                                   "], expected [-1, ", config.d_model,
                                                   "] (-1 = any)"));
  }
  return shape[0];
}

class ForwardReactor final : public MicroBatchReactor<v1::ForwardRequest, v1::ForwardResponse> {
  using Sizing = wire::TensorAssembler::Sizing;

 public:
  // The client's claimed shapes are reserved only once an eighth of each tensor has arrived.
  ForwardReactor(ExpertServiceImpl* s, grpc::CallbackServerContext* ctx)
      : MicroBatchReactor(
            s, ctx, "Forward",
            {{v1::ForwardRequest::kXFieldNumber, "x", true, Sizing::kClaimedOnceAnEighthArrived},
             {v1::ForwardRequest::kExpertIdsFieldNumber, "expert_ids", false,
              Sizing::kClaimedOnceAnEighthArrived, /*indexes=*/true},
             {v1::ForwardRequest::kWeightsFieldNumber, "weights", false,
              Sizing::kClaimedOnceAnEighthArrived}},
            {v1::ForwardResponse::kOutFieldNumber, v1::ForwardResponse::kExpertIdsFieldNumber,
             v1::ForwardResponse::kWeightsFieldNumber}) {
    Start();
  }

 protected:
  absl::Status ReadHeader(const v1::ForwardRequest& first) override {
    if (first.has_nccl()) {
      return absl::InvalidArgumentError("nccl: only NcclForward moves tensors over a channel");
    }
    training_ = first.training();
    return absl::OkStatus();
  }
  absl::Status CheckSame(const v1::ForwardRequest& c) const override {
    if (c.training() != training_) {
      return absl::InvalidArgumentError(
          "training: must be the same in every chunk of a micro-batch");
    }
    return absl::OkStatus();
  }
  const v1::Tensor* InputOf(const v1::ForwardRequest& c, size_t i) const override {
    switch (i) {
      case 0:
        return c.has_x() ? &c.x() : nullptr;
      case 1:
        return c.has_expert_ids() ? &c.expert_ids() : nullptr;
      default:
        return c.has_weights() ? &c.weights() : nullptr;
    }
  }
  std::pair<std::string, std::string> StripeHeader() const override {
    return {"training", training_ ? "true" : "false"};
  }

  absl::StatusOr<Computed<v1::ForwardResponse>> Compute(
      const std::vector<TensorView>& inputs,
      const std::vector<grpc::CallbackServerContext*>& calls) override {
    MOE_ASSIGN_OR_RETURN(std::shared_ptr<LayerEntry> entry, service_->FindLayer(layer_));
    MOE_RETURN_IF_ERROR(service_->AuthorizeLayer(caller(), *entry, Access::kTrain, "layer"));
    if (training_) {
      MOE_RETURN_IF_ERROR(service_->contexts().CheckSession(session_, caller().principal));
    }
    const LayerConfig& config = entry->config;
    std::vector<std::optional<wire::ResolvedTensor>> destinations(1);
    if (const v1::TensorRef* out_ref = DestinationRef(0)) {
      MOE_ASSIGN_OR_RETURN(const int64_t tokens, RowsOfX(inputs[0], InputRef(0), config));
      MOE_ASSIGN_OR_RETURN(
          destinations[0],
          wire::DestinationTensor(*out_ref, config.dtype, {tokens, config.d_model}, "out_ref"));
    }
    MOE_ASSIGN_OR_RETURN(Bound bound, Bind(inputs, destinations));
    ForwardRequest request;
    request.training = training_;
    request.x = bound.inputs[0];
    request.expert_ids = bound.inputs[1];
    request.weights = bound.inputs[2];
    request.out = bound.destinations[0];
    request.order = bound.order;
    // An x the engine will refuse is left to its error; any other is admitted first.
    MemoryLedger::RequestCharge working;
    if (CheckTensor(request.x, "x", entry->config.dtype, {-1, entry->config.d_model}).ok()) {
      MOE_ASSIGN_OR_RETURN(working,
                           service_->AdmitEngineCall(
                               *entry, request.x.shape[0],
                               training_ ? EngineCall::kTrainingForward : EngineCall::kForward));
    }
    absl::StatusOr<ForwardResult> forward = entry->layer->Forward(request);
    working.Reset();  // the call's buffers are freed; its context is admitted on its own below
    MOE_ASSIGN_OR_RETURN(ForwardResult result, std::move(forward));
    // Nothing computed from or into memory its owner took away is kept or returned.
    MOE_RETURN_IF_ERROR(bound.call.CheckIntact());
    const int64_t tokens = request.x.shape.empty() ? 0 : request.x.shape[0];
    if (training_) {
      if (!result.context) return absl::InternalError("engine returned no training context");
      for (grpc::CallbackServerContext* call : calls) {
        if (call->IsCancelled()) return absl::CancelledError("the client cancelled the call");
      }
      MOE_RETURN_IF_ERROR(service_->contexts().Put(layer_, context_id_, caller().principal,
                                                   session_, std::move(result.context)));
    }
    service_->metrics().Tokens(layer_, "forward", tokens);
    service_->metrics().ExpertTokens(layer_, entry->config.expert_first,
                                     result.tokens_per_local_expert);
    const double aux = result.aux_loss, z = result.z_loss;
    const uint64_t id = context_id_;
    const bool has_ids = !result.expert_ids.empty(), has_weights = !result.weights.empty();
    const std::optional<v1::Tensor> out_in_place = WrittenInPlace(bound)[0];
    auto tensors = std::make_shared<std::vector<Tensor>>();
    tensors->push_back(std::move(result.out));
    tensors->push_back(std::move(result.expert_ids));
    tensors->push_back(std::move(result.weights));
    return Computed<v1::ForwardResponse>{std::move(tensors), [=](v1::ForwardResponse* r) {
                                           r->set_context_id(id);
                                           r->set_aux_loss(aux);
                                           r->set_z_loss(z);
                                           if (out_in_place) *r->mutable_out() = *out_in_place;
                                           return std::vector<v1::Tensor*>{
                                               out_in_place ? nullptr : r->mutable_out(),
                                               has_ids ? r->mutable_expert_ids() : nullptr,
                                               has_weights ? r->mutable_weights() : nullptr};
                                         }};
  }

 private:
  bool training_ = false;
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ExpertServiceImpl::Forward(
    grpc::CallbackServerContext* ctx) {
  return new ForwardReactor(this, ctx);
}

}  // namespace moe::server
