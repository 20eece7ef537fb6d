// Forward/Backward request validation shared by all engines (see routing.h).
//
// Duplicate ids are rejected because the contract sums over k: a token sent twice to the same
// expert would be a second copy of that expert, which no router produces and which breaks the
// "one (t, e) pair, one saved row" bookkeeping the dispatch relies on.
#include "engine/routing.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moe {
namespace {

// Client routing's shapes and dtypes: expert_ids [T, K] int32, weights [T, K] float32 or the
// layer dtype, both present.
absl::Status ClientRoutingShapes(const TensorView& expert_ids, const TensorView& weights,
                                 int64_t num_tokens, int64_t top_k, DType layer_dtype) {
  if (expert_ids.empty()) {
    return absl::InvalidArgumentError("expert_ids: required with client routing");
  }
  MOE_RETURN_IF_ERROR(CheckTensor(expert_ids, "expert_ids", DType::kInt32, {num_tokens, top_k}));
  if (weights.empty()) return absl::InvalidArgumentError("weights: required with client routing");
  const DType wdt = weights.dtype == layer_dtype ? layer_dtype : DType::kFloat32;
  return CheckTensor(weights, "weights", wdt, {num_tokens, top_k});
}

void AddView(std::vector<NamedView>* views, const char* field, const TensorView& v) {
  if (v.data != nullptr) views->push_back({field, v.data, v.size_bytes, v.location, false});
}
void AddView(std::vector<NamedView>* views, const char* field, const MutableTensorView& v) {
  if (v.data != nullptr) views->push_back({field, v.data, v.size_bytes, v.location, true});
}

// Every destination against every view before it (inputs come first in RequestViews).
absl::Status CheckDestinationsDisjoint(const std::vector<NamedView>& views) {
  for (size_t i = 0; i < views.size(); ++i) {
    if (!views[i].destination) continue;
    for (size_t j = 0; j < i; ++j) {
      MOE_RETURN_IF_ERROR(CheckDisjoint(views[i].data, views[i].size_bytes, views[i].field,
                                        views[j].data, views[j].size_bytes, views[j].field));
    }
  }
  return absl::OkStatus();
}

// The checks of element values read host memory.
absl::Status RequireHostValues(const TensorView& view, const char* field) {
  if (view.location.is_host()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": on ", view.location.DebugString(),
                                                 "; its values are checked in host memory"));
}

}  // namespace

absl::StatusOr<int64_t> ValidateForwardShapes(const LayerConfig& config,
                                              const ForwardRequest& request) {
  MOE_RETURN_IF_ERROR(CheckTensor(request.x, "x", config.dtype, {-1, config.d_model}));
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
  MOE_RETURN_IF_ERROR(
      ClientRoutingShapes(request.expert_ids, request.weights, t, config.top_k, config.dtype));
  return t;
}

absl::StatusOr<int64_t> ValidateForwardRequest(const LayerConfig& config,
                                               const ForwardRequest& request) {
  MOE_ASSIGN_OR_RETURN(const int64_t t, ValidateForwardShapes(config, request));
  if (config.routing == RoutingMode::kServer) return t;
  MOE_RETURN_IF_ERROR(RequireHostValues(request.expert_ids, "expert_ids"));
  MOE_RETURN_IF_ERROR(RequireHostValues(request.weights, "weights"));
  MOE_RETURN_IF_ERROR(CheckClientRoutingValues(request.expert_ids, request.weights, t, config.top_k,
                                               config.num_experts));
  return t;
}

absl::Status ValidateClientRouting(const TensorView& expert_ids, const TensorView& weights,
                                   int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                   DType layer_dtype) {
  MOE_RETURN_IF_ERROR(ClientRoutingShapes(expert_ids, weights, num_tokens, top_k, layer_dtype));
  return CheckClientRoutingValues(expert_ids, weights, num_tokens, top_k, num_experts);
}

absl::Status CheckClientRoutingValues(const TensorView& expert_ids, const TensorView& weights,
                                      int64_t num_tokens, int64_t top_k, int64_t num_experts) {
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

absl::Status ValidateForwardDestination(const LayerConfig& config, const ForwardRequest& request,
                                        int64_t num_tokens) {
  if (request.out.empty()) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(CheckTensor(request.out, "out", config.dtype, {num_tokens, config.d_model}));
  return CheckDestinationsDisjoint(RequestViews(request));
}

absl::Status ValidateBackwardRequest(const LayerConfig& config, const BackwardRequest& request,
                                     int64_t num_tokens) {
  MOE_RETURN_IF_ERROR(ValidateDout(config, request.dout, num_tokens));
  if (!request.dx.empty()) {
    MOE_RETURN_IF_ERROR(CheckTensor(request.dx, "dx", config.dtype, {num_tokens, config.d_model}));
  }
  if (!request.dweights.empty()) {
    if (config.routing == RoutingMode::kServer) {
      return absl::InvalidArgumentError(
          "dweights: must be empty with server routing (it has no routing-weight gradient)");
    }
    MOE_RETURN_IF_ERROR(
        CheckTensor(request.dweights, "dweights", DType::kFloat32, {num_tokens, config.top_k}));
  }
  return CheckDestinationsDisjoint(RequestViews(request));
}

std::vector<NamedView> RequestViews(const ForwardRequest& request) {
  std::vector<NamedView> views;
  AddView(&views, "x", request.x);
  AddView(&views, "expert_ids", request.expert_ids);
  AddView(&views, "weights", request.weights);
  AddView(&views, "out", request.out);
  return views;
}

std::vector<NamedView> RequestViews(const BackwardRequest& request) {
  std::vector<NamedView> views;
  AddView(&views, "dout", request.dout);
  AddView(&views, "dx", request.dx);
  AddView(&views, "dweights", request.dweights);
  return views;
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
