// Checks of what a client sends that need no layer, context or join state: names, stripes,
// chunk sizes, the first message of a weight import. The service calls them before it looks
// anything up, so a bad request is INVALID_ARGUMENT naming the field whatever the server holds;
// kept out of the service's files so the fuzzers (fuzz/request_validation_fuzzer.cc) and tests
// reach them without a server.
//
// What needs a layer (shapes, dtypes and routing of x, expert_ids, weights, dout) is the
// engine's: ValidateForwardRequest and ValidateDout (engine/routing.h), LayerConfigFromProto
// (wire/wire.h) for a config.
#ifndef MOE_SERVER_REQUEST_VALIDATION_H_
#define MOE_SERVER_REQUEST_VALIDATION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "moe/v1/moe.pb.h"

namespace moe::server {

// Response chunk size when the request does not ask for one.
inline constexpr int64_t kDefaultResponseChunkBytes = int64_t{1} << 20;
// The smallest response or export chunk the server sends: smaller requests are raised to it, so
// a client asking for 1-byte chunks cannot make one tensor cost millions of messages.
inline constexpr int64_t kMinResponseChunkBytes = 1024;

// [A-Za-z0-9._-]{1,128}; InvalidArgument naming `field` otherwise.
absl::Status ValidateLayerName(absl::string_view name, absl::string_view field);

// The payload bytes per response message for a request's max_response_chunk_bytes: 0 or
// negative means kDefaultResponseChunkBytes; anything else is raised to kMinResponseChunkBytes.
int64_t ResponseChunkBytes(int64_t requested);
// The payload bytes per ExportWeights chunk for the request's max_chunk_bytes: 0 or negative
// means half of `max_message_bytes`; raised to kMinResponseChunkBytes.
int64_t ExportChunkBytes(int64_t requested, int64_t max_message_bytes);

// A striped micro-batch's `stripe` (moe.proto): count 2..kMaxStripes, index below count,
// total_rows in [1, kMaxTensorBytes], row_begin in [0, total_rows], and a nonzero context_id,
// which joins the streams. InvalidArgument naming the field.
absl::Status ValidateStripe(const v1::Stripe& stripe, uint64_t context_id);

// One ImportWeights message; `layer` is the layer named so far ("" before the first message).
// The first message must name the layer, every message its tensor.
absl::Status ValidateWeightChunk(const v1::WeightChunk& chunk, absl::string_view layer);
// The whole ImportWeights stream once the client half-closed: it must have named a layer (an
// empty stream did not).
absl::Status ValidateImportStream(absl::string_view layer);

}  // namespace moe::server

#endif  // MOE_SERVER_REQUEST_VALIDATION_H_
