// Forward and Backward requests (see requests.h): the small fields every message of a stream
// repeats, and which proto fields carry which of the call's tensors.
#include "client/requests.h"

#include <algorithm>
#include <utility>

namespace moe::client {

int64_t ResponseChunkBytes(const ClientOptions& options) {
  return std::min(options.chunk_bytes, options.max_receive_bytes / 2);
}

wire::ChunkedMessages<v1::ForwardRequest> ForwardRequests(
    const ForwardCall& call, std::shared_ptr<const std::vector<Tensor>> tensors,
    const StreamRows& rows, const ClientOptions& options) {
  const int64_t response_chunk = ResponseChunkBytes(options);
  const bool has_ids = !(*tensors)[1].empty(), has_weights = !(*tensors)[2].empty();
  return wire::ChunkedMessages<v1::ForwardRequest>(
      std::move(tensors), rows.begin, rows.end,
      {v1::ForwardRequest::kXFieldNumber, v1::ForwardRequest::kExpertIdsFieldNumber,
       v1::ForwardRequest::kWeightsFieldNumber},
      options.chunk_bytes, [=, stripe = rows.stripe](v1::ForwardRequest* r) {
        r->set_layer(call.layer);
        r->set_context_id(call.context_id);
        r->set_training(call.training);
        r->set_max_response_chunk_bytes(response_chunk);
        if (stripe.count() != 0) *r->mutable_stripe() = stripe;
        // Absent tensors stay unset (server routing sends no ids or weights).
        return std::vector<v1::Tensor*>{r->mutable_x(), has_ids ? r->mutable_expert_ids() : nullptr,
                                        has_weights ? r->mutable_weights() : nullptr};
      });
}

wire::ChunkedMessages<v1::BackwardRequest> BackwardRequests(
    const BackwardCall& call, std::shared_ptr<const std::vector<Tensor>> tensors,
    const StreamRows& rows, const ClientOptions& options) {
  const int64_t response_chunk = ResponseChunkBytes(options);
  return wire::ChunkedMessages<v1::BackwardRequest>(
      std::move(tensors), rows.begin, rows.end, {v1::BackwardRequest::kDoutFieldNumber},
      options.chunk_bytes, [=, stripe = rows.stripe](v1::BackwardRequest* r) {
        r->set_layer(call.layer);
        r->set_context_id(call.context_id);
        r->set_max_response_chunk_bytes(response_chunk);
        if (stripe.count() != 0) *r->mutable_stripe() = stripe;
        return std::vector<v1::Tensor*>{r->mutable_dout()};
      });
}

}  // namespace moe::client
