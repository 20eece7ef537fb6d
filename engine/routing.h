// Request validation shared by every engine: shapes, dtypes and routing of Forward/Backward.
//
// The CPU and CUDA engines both call these before any work, so a bad request gets the same
// InvalidArgument (naming the field: "x", "expert_ids", "weights", "dout") on any device, and
// kernels may assume ids are in range and unique within a token.
#ifndef MOE_ENGINE_ROUTING_H_
#define MOE_ENGINE_ROUTING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"
#include "engine/layer.h"

namespace moe {

// Checks x (and, for client routing, expert_ids and weights; for server routing, that both
// are empty), reading no element: the views may be device memory. Returns T, the number of tokens
// (>= 1; T * K must fit in int32, and the hidden activations [T * K, 2h] and, with server routing,
// the logits [T, E] in CheckedByteSize's bounds).
absl::StatusOr<int64_t> ValidateForwardShapes(const LayerConfig& config,
                                              const ForwardRequest& request);

// ValidateForwardShapes, then the routing's values (client routing; CheckClientRoutingValues),
// which must then be in host memory (InvalidArgument otherwise).
absl::StatusOr<int64_t> ValidateForwardRequest(const LayerConfig& config,
                                               const ForwardRequest& request);

// Client routing: expert_ids [T, K] int32 with every id in [0, num_experts) and no id twice
// within a token; weights [T, K], float32 or `layer_dtype`, all finite. Host memory.
absl::Status ValidateClientRouting(const TensorView& expert_ids, const TensorView& weights,
                                   int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                   DType layer_dtype);
// Only the values part of it, on views whose shapes are already checked.
absl::Status CheckClientRoutingValues(const TensorView& expert_ids, const TensorView& weights,
                                      int64_t num_tokens, int64_t top_k, int64_t num_experts);

// dout: [T, d] in the layer dtype, all elements finite is NOT required (NaNs propagate).
absl::Status ValidateDout(const LayerConfig& config, const TensorView& dout, int64_t num_tokens);

// The request's destination `out`: empty, or [T, d] of the layer dtype, sharing no byte with an
// input.
absl::Status ValidateForwardDestination(const LayerConfig& config, const ForwardRequest& request,
                                        int64_t num_tokens);

// dout (ValidateDout) and the destinations: dx empty or [T, d] of the layer dtype; dweights
// empty or [T, K] float32, and empty with server routing (it has no routing-weight gradient);
// no destination sharing a byte with dout or the other.
absl::Status ValidateBackwardRequest(const LayerConfig& config, const BackwardRequest& request,
                                     int64_t num_tokens);

// A request's non-empty views with their field names, inputs first, for the checks an engine
// makes of their locations.
struct NamedView {
  const char* field;
  const void* data;
  size_t size_bytes;
  MemoryLocation location;
  bool destination;
};
std::vector<NamedView> RequestViews(const ForwardRequest& request);
std::vector<NamedView> RequestViews(const BackwardRequest& request);

// Copies a float tensor (float32 or bfloat16) to fp32.
void ToFloat(const TensorView& view, float* out);
std::vector<float> ToFloat(const TensorView& view);

}  // namespace moe

#endif  // MOE_ENGINE_ROUTING_H_
