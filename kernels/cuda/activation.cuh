// The four expert activations and their derivatives, in fp32, shared by the fused forward
// and backward elementwise kernels so that both use the same formulas as the CPU engine:
//   silu(x) = x * sigmoid(x)
//   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (the tanh approximation)
//   relu(x) = max(x, 0)
// SwiGLU applies silu to the gate half H1 = W1 x and multiplies by the up half H3 = W3 x.
#ifndef MOE_KERNELS_CUDA_ACTIVATION_CUH_
#define MOE_KERNELS_CUDA_ACTIVATION_CUH_

#include <cuda_runtime.h>

namespace moe::kernels::detail {

// Activation codes match moe::Activation (engine/layer.h) without including it.
constexpr int kActSwiGLU = 0;
constexpr int kActSiLU = 1;
constexpr int kActGeLUTanh = 2;
constexpr int kActReLU = 3;

// The reciprocal is the approximate one (rcp.approx, about 1 ulp): an IEEE division here costs
// about a sixth of the fused up-projection's time, whose epilogue takes 128 x 128 of these a
// tile. For x < -87 the denominator passes 2^126 and the result is 0 instead of a number below
// 1e-38.
__device__ __forceinline__ float Sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

// f(x) and f'(x) for the non-gated part (SwiGLU uses silu).
template <int ACT>
__device__ __forceinline__ void ActAndGrad(float x, float* f, float* df) {
  if constexpr (ACT == kActSwiGLU || ACT == kActSiLU) {
    const float s = Sigmoid(x);
    *f = x * s;
    *df = s * (1.f + x * (1.f - s));
  } else if constexpr (ACT == kActGeLUTanh) {
    constexpr float kC = 0.7978845608028654f;  // sqrt(2/pi)
    const float u = kC * (x + 0.044715f * x * x * x);
    const float th = tanhf(u);
    *f = 0.5f * x * (1.f + th);
    *df = 0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * kC * (1.f + 3.f * 0.044715f * x * x);
  } else {
    *f = x > 0.f ? x : 0.f;
    *df = x > 0.f ? 1.f : 0.f;
  }
}

template <int ACT>
__device__ __forceinline__ float Act(float x) {
  if constexpr (ACT == kActSwiGLU || ACT == kActSiLU) {
    return x * Sigmoid(x);
  } else if constexpr (ACT == kActGeLUTanh) {
    constexpr float kC = 0.7978845608028654f;
    return 0.5f * x * (1.f + tanhf(kC * (x + 0.044715f * x * x * x)));
  } else {
    return x > 0.f ? x : 0.f;
  }
}

}  // namespace moe::kernels::detail

#endif  // MOE_KERNELS_CUDA_ACTIVATION_CUH_
