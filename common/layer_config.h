// A layer's configuration: sizes, activation, storage dtype, routing mode, shard and optimizer,
// shared by the engine, the wire conversions, the server and the client.
//
// engine/layer.h says what a layer of this configuration computes. ValidateLayerConfig is the
// one place that decides whether a configuration is usable, so every engine and the server
// refuse a bad one with the same message naming the field.
#ifndef MOE_COMMON_LAYER_CONFIG_H_
#define MOE_COMMON_LAYER_CONFIG_H_

#include <cstdint>

#include "absl/status/status.h"
#include "common/tensor.h"

namespace moe {

enum class Activation { kSwiGLU = 0, kSiLU = 1, kGeLUTanh = 2, kReLU = 3 };
enum class RoutingMode { kClient = 0, kServer = 1 };
enum class OptimizerKind { kAdamW = 0, kSgd = 1 };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double learning_rate = 1e-3;
  double beta1 = 0.9;           // AdamW
  double beta2 = 0.999;         // AdamW
  double epsilon = 1e-8;        // AdamW
  double weight_decay = 0.0;    // AdamW: decoupled, w -= lr * wd * w. SGD: added to the grad.
  double momentum = 0.0;        // SGD: v = momentum * v + g; w -= lr * v
  double max_grad_norm = 0.0;   // > 0: clip all gradients together by their global L2 norm
};

struct LayerConfig {
  int64_t num_experts = 0;      // E, global
  int64_t top_k = 0;            // K, 1 <= K <= E
  int64_t d_model = 0;          // d
  int64_t d_hidden = 0;         // h (per expert)
  Activation activation = Activation::kSwiGLU;
  DType dtype = DType::kFloat32;  // storage of weights and activations: kFloat32 or kBFloat16
  RoutingMode routing = RoutingMode::kClient;
  int64_t expert_first = 0;     // shard: this layer owns experts [first, first + count)
  int64_t expert_count = -1;    // -1 means all E
  uint64_t seed = 0;            // initialisation: deterministic given the seed
  double init_scale = 1.0;      // weights ~ N(0, (init_scale / sqrt(fan_in))^2)
  bool renormalize = true;      // server routing: p /= sum_k p
  double aux_loss_coef = 0.0;   // server routing: Switch load-balancing loss coefficient
  double z_loss_coef = 0.0;     // server routing: router z-loss coefficient
  // Memory mode of a training Forward. false: keep x and H = [W1 x, W3 x] per routed (t,k)
  // for the Backward. true: keep only x (and the routing/dispatch index arrays) and recompute H
  // in the Backward with the same kernels, so outputs and gradients are bitwise those of the
  // keep-H mode on the same engine, for one more up-projection GEMM per Backward. For very long
  // batches: H is K*(2h)/d times the size of x (SwiGLU).
  bool recompute_h = false;
  OptimizerConfig optimizer;

  int64_t local_experts() const { return expert_count < 0 ? num_experts : expert_count; }
  bool gated() const { return activation == Activation::kSwiGLU; }
};

// InvalidArgument naming the field for any inconsistent value.
absl::Status ValidateLayerConfig(const LayerConfig& config);

}  // namespace moe

#endif  // MOE_COMMON_LAYER_CONFIG_H_
