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
#include "engine/layer.h"
#include "common/tensor.h"

namespace moe {

// Checks x (and, for client routing, expert_ids and weights; for server routing, that both
// are empty). Returns T, the number of tokens (>= 1; T * K must fit in int32, and the hidden
// activations [T * K, 2h] and, with server routing, the logits [T, E] in CheckedByteSize's
// bounds).
absl::StatusOr<int64_t> ValidateForwardRequest(const LayerConfig& config,
                                               const ForwardRequest& request);

// Client routing: expert_ids [T, K] int32 with every id in [0, num_experts) and no id twice
// within a token; weights [T, K], float32 or `layer_dtype`, all finite.
absl::Status ValidateClientRouting(const TensorView& expert_ids, const TensorView& weights,
                                   int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                   DType layer_dtype);

// dout: [T, d] in the layer dtype, all elements finite is NOT required (NaNs propagate).
absl::Status ValidateDout(const LayerConfig& config, const TensorView& dout, int64_t num_tokens);

// Copies a float tensor (float32 or bfloat16) to fp32.
void ToFloat(const TensorView& view, float* out);
std::vector<float> ToFloat(const TensorView& view);

}  // namespace moe

#endif  // MOE_ENGINE_ROUTING_H_
