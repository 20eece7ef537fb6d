// Forward and Backward requests (see requests.h): the small fields every message of a stream
// repeats, and which proto fields carry which of the call's tensors.
#include "client/requests.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace moe::client {
namespace {

// The payload per message: a micro-batch with references is one message.
int64_t ChunkBytes(const std::shared_ptr<const References>& refs, const ClientOptions& options) {
  return refs ? std::numeric_limits<int64_t>::max() : options.chunk_bytes;
}

// Request tensor `i` of the call's: by reference (set here, and absent from the payloads:
// nullptr), else `inline_tensor`.
v1::Tensor* TensorOrRef(const std::shared_ptr<const References>& refs, size_t i,
                        v1::Tensor* inline_tensor) {
  if (!refs || i >= refs->inputs.size() || !refs->inputs[i]) return inline_tensor;
  const TensorByRef& r = *refs->inputs[i];
  wire::SetTensorRef(r.dtype, r.shape, r.ref.region_id(), r.ref.offset(), inline_tensor);
  return nullptr;
}

// Destination `i`, when the call names one.
const v1::TensorRef* Destination(const std::shared_ptr<const References>& refs, size_t i) {
  if (!refs || i >= refs->destinations.size() || !refs->destinations[i]) return nullptr;
  return &*refs->destinations[i];
}

}  // namespace

int64_t ResponseChunkBytes(const ClientOptions& options) {
  return std::min(options.chunk_bytes, options.max_receive_bytes / 2);
}

wire::ChunkedMessages<v1::ForwardRequest> ForwardRequests(
    const ForwardCall& call, std::shared_ptr<const std::vector<Tensor>> tensors,
    const StreamRows& rows, const ClientOptions& options) {
  const int64_t response_chunk = ResponseChunkBytes(options);
  // A tensor by reference is present although the call holds no bytes of it.
  auto present = [&](size_t i) {
    return !(*tensors)[i].empty() ||
           (call.refs && i < call.refs->inputs.size() && call.refs->inputs[i].has_value());
  };
  const bool has_ids = present(1), has_weights = present(2);
  return wire::ChunkedMessages<v1::ForwardRequest>(
      std::move(tensors), rows.begin, rows.end,
      {v1::ForwardRequest::kXFieldNumber, v1::ForwardRequest::kExpertIdsFieldNumber,
       v1::ForwardRequest::kWeightsFieldNumber},
      ChunkBytes(call.refs, options), [=, stripe = rows.stripe](v1::ForwardRequest* r) {
        r->set_layer(call.layer);
        r->set_context_id(call.context_id);
        r->set_training(call.training);
        r->set_max_response_chunk_bytes(response_chunk);
        if (stripe.count() != 0) *r->mutable_stripe() = stripe;
        if (const v1::TensorRef* out = Destination(call.refs, 0)) *r->mutable_out_ref() = *out;
        if (call.refs) r->set_event_id(call.refs->event_id);
        // Absent tensors stay unset (server routing sends no ids or weights).
        return std::vector<v1::Tensor*>{
            TensorOrRef(call.refs, 0, r->mutable_x()),
            TensorOrRef(call.refs, 1, has_ids ? r->mutable_expert_ids() : nullptr),
            TensorOrRef(call.refs, 2, has_weights ? r->mutable_weights() : nullptr)};
      });
}

wire::ChunkedMessages<v1::BackwardRequest> BackwardRequests(
    const BackwardCall& call, std::shared_ptr<const std::vector<Tensor>> tensors,
    const StreamRows& rows, const ClientOptions& options) {
  const int64_t response_chunk = ResponseChunkBytes(options);
  return wire::ChunkedMessages<v1::BackwardRequest>(
      std::move(tensors), rows.begin, rows.end, {v1::BackwardRequest::kDoutFieldNumber},
      ChunkBytes(call.refs, options), [=, stripe = rows.stripe](v1::BackwardRequest* r) {
        r->set_layer(call.layer);
        r->set_context_id(call.context_id);
        r->set_max_response_chunk_bytes(response_chunk);
        if (stripe.count() != 0) *r->mutable_stripe() = stripe;
        if (const v1::TensorRef* dx = Destination(call.refs, 0)) *r->mutable_dx_ref() = *dx;
        if (const v1::TensorRef* dw = Destination(call.refs, 1)) *r->mutable_dweights_ref() = *dw;
        if (call.refs) r->set_event_id(call.refs->event_id);
        if (call.aux_loss_grad != 1.0) r->set_aux_loss_grad(call.aux_loss_grad);
        return std::vector<v1::Tensor*>{TensorOrRef(call.refs, 0, r->mutable_dout())};
      });
}

}  // namespace moe::client
