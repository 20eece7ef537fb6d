// Forward/Backward request validation shared by all engines (see routing.h).
//
// Duplicate ids are rejected because the contract sums over k: a token sent twice to the same
// expert would be a second copy of that expert, which no router produces and which breaks the
// "one (t, e) pair, one saved row" bookkeeping the dispatch relies on.
#include "engine/routing.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<int64_t> ValidateForwardRequest(const LayerConfig& config,
                                               const ForwardRequest& request) {
  if (absl::Status s = CheckTensor(request.x, "x", config.dtype, {-1, config.d_model}); !s.ok()) {
    return s;
  }
  const int64_t t = request.x.shape[0];
  if (t < 1) return absl::InvalidArgumentError("x: needs at least one token (shape [0, d])");
  // The routed pairs are indexed with int32 (dispatch, kernels): T * K, checked.
  absl::StatusOr<int64_t> pairs = CheckedNumElements({t, config.top_k}, "x");
  if (!pairs.ok() || *pairs > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("x: ", t, " tokens times top_k = ", config.top_k, " exceeds 2^31 - 1"));
  }
  // The engine's working set grows with T too: the routed rows' hidden activations [T * K, 2h]
  // and, with server routing, the router's logits [T, E], both fp32. A T for which either could
  // not exist is refused here, before an engine sizes a buffer from it.
  if (!CheckedByteSize({t, config.top_k, 2 * config.d_hidden}, DType::kFloat32, "x").ok() ||
      (config.routing == RoutingMode::kServer &&
       !CheckedByteSize({t, config.num_experts}, DType::kFloat32, "x").ok())) {
    return absl::InvalidArgumentError(
        absl::StrCat("x: ", t,
                     " tokens would need more than 2^40 bytes of activations in this "
                     "layer (top_k = ",
                     config.top_k, ", d_hidden = ", config.d_hidden,
                     ", num_experts = ", config.num_experts, ")"));
  }
  if (config.routing == RoutingMode::kServer) {
    if (!request.expert_ids.empty() || request.expert_ids.size_bytes != 0) {
      return absl::InvalidArgumentError("expert_ids: must be empty with server routing");
    }
    if (!request.weights.empty() || request.weights.size_bytes != 0) {
      return absl::InvalidArgumentError("weights: must be empty with server routing");
    }
    return t;
  }
  if (absl::Status s = ValidateClientRouting(request.expert_ids, request.weights, t, config.top_k,
                                             config.num_experts, config.dtype);
      !s.ok()) {
    return s;
  }
  return t;
}

absl::Status ValidateClientRouting(const TensorView& expert_ids, const TensorView& weights,
                                   int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                   DType layer_dtype) {
  if (expert_ids.empty()) {
    return absl::InvalidArgumentError("expert_ids: required with client routing");
  }
  if (absl::Status s = CheckTensor(expert_ids, "expert_ids", DType::kInt32, {num_tokens, top_k});
      !s.ok()) {
    return s;
  }
  if (weights.empty()) return absl::InvalidArgumentError("weights: required with client routing");
  const DType wdt = weights.dtype == layer_dtype ? layer_dtype : DType::kFloat32;
  if (absl::Status s = CheckTensor(weights, "weights", wdt, {num_tokens, top_k}); !s.ok()) {
    return s;
  }
  const int32_t* ids = expert_ids.as<int32_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t e = ids[t * top_k + k];
      if (e < 0 || e >= num_experts) {
        return absl::InvalidArgumentError(absl::StrCat("expert_ids[", t, ", ", k, "] = ", e,
                                                       " out of range [0, ", num_experts, ")"));
      }
      for (int64_t j = 0; j < k; ++j) {
        if (ids[t * top_k + j] == e) {
          return absl::InvalidArgumentError(absl::StrCat("expert_ids[", t, ", ", k, "] = ", e,
                                                         " duplicates expert_ids[", t, ", ", j,
                                                         "] (each token picks K distinct "
                                                         "experts)"));
        }
      }
      const float w = LoadFloat(weights, t * top_k + k);
      if (!std::isfinite(w)) {
        return absl::InvalidArgumentError(
            absl::StrCat("weights[", t, ", ", k, "] = ", w, " is not finite"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateDout(const LayerConfig& config, const TensorView& dout, int64_t num_tokens) {
  return CheckTensor(dout, "dout", config.dtype, {num_tokens, config.d_model});
}

void ToFloat(const TensorView& view, float* out) {
  const int64_t n = view.num_elements();
  if (view.dtype == DType::kBFloat16) {
    const uint16_t* src = view.as<uint16_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(src[i]);
  } else {
    const float* src = view.as<float>();
    for (int64_t i = 0; i < n; ++i) out[i] = src[i];
  }
}

std::vector<float> ToFloat(const TensorView& view) {
  std::vector<float> out(static_cast<size_t>(view.num_elements()));
  ToFloat(view, out.data());
  return out;
}

}  // namespace moe
