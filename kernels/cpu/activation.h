// Expert activations and their derivatives, scalar fp32, shared by the CPU engine and tests.
//
// GeLU is the tanh approximation (what the contract names): 0.5 x (1 + tanh(c (x + a x^3))),
// c = sqrt(2/pi), a = 0.044715. Inline in a header so the engine's row loops vectorise.
#ifndef MOE_KERNELS_CPU_ACTIVATION_H_
#define MOE_KERNELS_CPU_ACTIVATION_H_

#include <cmath>
#include <cstdint>

namespace moe::kernels {

// Matches moe::Activation's numbering (engine/layer.h); kernels cannot include the engine.
enum class ActKind : int { kSwiGLU = 0, kSiLU = 1, kGeLUTanh = 2, kReLU = 3 };

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// act(x) for the non-gated kinds; SwiGLU uses silu on the W1 branch.
inline float ActForward(ActKind kind, float x) {
  switch (kind) {
    case ActKind::kSwiGLU:
    case ActKind::kSiLU:
      return x * Sigmoid(x);
    case ActKind::kGeLUTanh: {
      constexpr float kC = 0.7978845608028654f, kA = 0.044715f;
      return 0.5f * x * (1.0f + std::tanh(kC * (x + kA * x * x * x)));
    }
    case ActKind::kReLU:
      return x > 0.0f ? x : 0.0f;
  }
  return 0.0f;
}

// d act / dx. ReLU'(0) = 0.
inline float ActBackward(ActKind kind, float x) {
  switch (kind) {
    case ActKind::kSwiGLU:
    case ActKind::kSiLU: {
      const float s = Sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case ActKind::kGeLUTanh: {
      constexpr float kC = 0.7978845608028654f, kA = 0.044715f;
      const float t = std::tanh(kC * (x + kA * x * x * x));
      return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kC * (1.0f + 3.0f * kA * x * x);
    }
    case ActKind::kReLU:
      return x > 0.0f ? 1.0f : 0.0f;
  }
  return 0.0f;
}

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CPU_ACTIVATION_H_
