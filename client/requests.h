// Forward and Backward requests: the one place in the client that fills ForwardRequest and
// BackwardRequest (internal to the library; client.h does not include it).
//
// A call's request tensors are held by the call (a copy of the caller's, or the caller's own,
// handed over) and the messages refer to them (wire::ChunkedMessages): each message is encoded
// only when the stream is about to write it. A call may instead name some tensors by reference
// in regions the connection registered (References, filled by region_calls.cc): it is then one
// message, whatever its size.
#ifndef MOE_CLIENT_REQUESTS_H_
#define MOE_CLIENT_REQUESTS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/tensor.h"
#include "moe/v1/moe.pb.h"
#include "wire/raw_message.h"

namespace moe::client {

// A request tensor named by reference: what it is, and where (moe.proto TensorRef).
struct TensorByRef {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  v1::TensorRef ref;
};

// What a micro-batch names by reference (docs/PROTOCOL.md, "Registered memory regions"); such
// a micro-batch goes as one message, unstriped.
struct References {
  // Per request tensor, in the call's order: set when it goes by reference (the call's own
  // tensor is then empty).
  std::vector<std::optional<TensorByRef>> inputs;
  // Per destination (Forward: out; Backward: dx, dweights): set to have the server write that
  // result there.
  std::vector<std::optional<v1::TensorRef>> destinations;
  uint64_t event_id = 0;  // the event pair ordering the call's CUDA regions; 0: none
};

// What a Forward sends besides its tensors, which are, in this order: x, expert_ids, weights
// (the last two empty under server routing: absent on the wire).
struct ForwardCall {
  std::string layer;
  uint64_t context_id = 0;
  bool training = false;
  std::shared_ptr<const References> refs;  // null: every tensor inline
};

// What a Backward sends besides its one tensor, dout.
struct BackwardCall {
  std::string layer;
  uint64_t context_id = 0;
  std::shared_ptr<const References> refs;  // null: every tensor inline
  double aux_loss_grad = 1.0;              // BackwardOptions'
};

// The rows one stream sends: rows [begin, end) of every request tensor (end -1: all of them,
// the whole micro-batch), and its moe.proto `Stripe` (count 0: the stream is not striped and
// the message carries none).
struct StreamRows {
  int64_t begin = 0;
  int64_t end = -1;
  v1::Stripe stripe;
};

// The largest response message payload a call asks the server for: the request chunk size, but
// never more than half of what this client accepts in one message.
int64_t ResponseChunkBytes(const ClientOptions& options);

// One stream's request messages, in chunks of at most options.chunk_bytes tensor bytes (one
// message, with the call's references, when it has any).
wire::ChunkedMessages<v1::ForwardRequest> ForwardRequests(
    const ForwardCall& call, std::shared_ptr<const std::vector<Tensor>> tensors,
    const StreamRows& rows, const ClientOptions& options);
wire::ChunkedMessages<v1::BackwardRequest> BackwardRequests(
    const BackwardCall& call, std::shared_ptr<const std::vector<Tensor>> tensors,
    const StreamRows& rows, const ClientOptions& options);

}  // namespace moe::client

#endif  // MOE_CLIENT_REQUESTS_H_
