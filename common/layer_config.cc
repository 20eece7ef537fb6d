// ValidateLayerConfig: the one place that decides whether a LayerConfig is usable.
//
// Every engine calls it before allocating anything, so the server's error for a bad config is
// the same whichever device serves it. Each message names the offending field.
#include "common/layer_config.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

absl::Status Bad(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("layer config: ", field, " ", why));
}

bool Finite(double v) { return std::isfinite(v); }

}  // namespace

absl::Status ValidateLayerConfig(const LayerConfig& c) {
  constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
  if (c.num_experts < 1 || c.num_experts > kMaxInt32) {
    return Bad("num_experts", absl::StrCat("= ", c.num_experts, ", must be in [1, 2^31)"));
  }
  if (c.top_k < 1 || c.top_k > c.num_experts) {
    return Bad("top_k",
               absl::StrCat("= ", c.top_k, ", must be in [1, num_experts = ", c.num_experts, "]"));
  }
  if (c.d_model < 1 || c.d_model > kMaxInt32) {
    return Bad("d_model", absl::StrCat("= ", c.d_model, ", must be >= 1"));
  }
  if (c.d_hidden < 1 || c.d_hidden > kMaxInt32) {
    return Bad("d_hidden", absl::StrCat("= ", c.d_hidden, ", must be >= 1"));
  }
  const int a = static_cast<int>(c.activation);
  if (a < 0 || a > 3) return Bad("activation", absl::StrCat("= ", a, " is not a known activation"));
  if (c.dtype != DType::kFloat32 && c.dtype != DType::kBFloat16) {
    return Bad("dtype", absl::StrCat("= ", DTypeName(c.dtype), ", must be float32 or bfloat16"));
  }
  const int r = static_cast<int>(c.routing);
  if (r < 0 || r > 1) return Bad("routing", absl::StrCat("= ", r, " is not client or server"));
  if (c.expert_count == -1) {
    if (c.expert_first != 0) {
      return Bad("expert_first",
                 absl::StrCat("= ", c.expert_first, ", must be 0 when expert_count = -1 (all)"));
    }
  } else {
    if (c.expert_count < 1) {
      return Bad("expert_count", absl::StrCat("= ", c.expert_count, ", must be -1 or >= 1"));
    }
    // Written so that no sum can overflow: expert_count >= 1 and num_experts >= 1 here.
    if (c.expert_first < 0 || c.expert_first > c.num_experts - c.expert_count) {
      return Bad("expert_first",
                 absl::StrCat("= ", c.expert_first, " with expert_count = ", c.expert_count,
                              " exceeds num_experts = ", c.num_experts));
    }
  }
  // Each weight tensor [count, h, d] and the router [d, E] (server routing), fp32 as the
  // optimizer keeps them, must be tensors that can exist (CheckedByteSize: at most 2^40 bytes,
  // products checked).
  if (!CheckedByteSize({c.local_experts(), c.d_model, c.d_hidden}, DType::kFloat32, "d_hidden")
           .ok()) {
    return Bad("d_hidden", "makes the expert weights too large");
  }
  if (c.routing == RoutingMode::kServer &&
      !CheckedByteSize({c.d_model, c.num_experts}, DType::kFloat32, "num_experts").ok()) {
    return Bad("num_experts", "with d_model makes the router too large");
  }
  if (!Finite(c.init_scale) || c.init_scale < 0) {
    return Bad("init_scale", absl::StrCat("= ", c.init_scale, ", must be finite and >= 0"));
  }
  if (!Finite(c.aux_loss_coef) || c.aux_loss_coef < 0) {
    return Bad("aux_loss_coef", absl::StrCat("= ", c.aux_loss_coef, ", must be >= 0"));
  }
  if (!Finite(c.z_loss_coef) || c.z_loss_coef < 0) {
    return Bad("z_loss_coef", absl::StrCat("= ", c.z_loss_coef, ", must be >= 0"));
  }
  if (c.routing == RoutingMode::kClient && (c.aux_loss_coef != 0 || c.z_loss_coef != 0)) {
    return Bad(c.aux_loss_coef != 0 ? "aux_loss_coef" : "z_loss_coef",
               "needs server routing (the client computes its own router losses)");
  }
  const OptimizerConfig& o = c.optimizer;
  const int k = static_cast<int>(o.kind);
  if (k < 0 || k > 1) return Bad("optimizer.kind", absl::StrCat("= ", k, " is not adamw or sgd"));
  if (!Finite(o.learning_rate) || o.learning_rate < 0) {
    return Bad("optimizer.learning_rate", absl::StrCat("= ", o.learning_rate, ", must be >= 0"));
  }
  if (!Finite(o.beta1) || o.beta1 < 0 || o.beta1 >= 1) {
    return Bad("optimizer.beta1", absl::StrCat("= ", o.beta1, ", must be in [0, 1)"));
  }
  if (!Finite(o.beta2) || o.beta2 < 0 || o.beta2 >= 1) {
    return Bad("optimizer.beta2", absl::StrCat("= ", o.beta2, ", must be in [0, 1)"));
  }
  if (!Finite(o.epsilon) || o.epsilon <= 0) {
    return Bad("optimizer.epsilon", absl::StrCat("= ", o.epsilon, ", must be > 0"));
  }
  if (!Finite(o.weight_decay) || o.weight_decay < 0) {
    return Bad("optimizer.weight_decay", absl::StrCat("= ", o.weight_decay, ", must be >= 0"));
  }
  if (!Finite(o.momentum) || o.momentum < 0 || o.momentum >= 1) {
    return Bad("optimizer.momentum", absl::StrCat("= ", o.momentum, ", must be in [0, 1)"));
  }
  if (!Finite(o.max_grad_norm) || o.max_grad_norm < 0) {
    return Bad("optimizer.max_grad_norm",
               absl::StrCat("= ", o.max_grad_norm, ", must be >= 0 (0 = no clipping)"));
  }
  return absl::OkStatus();
}

}  // namespace moe
