// Fused optimizer over every parameter of a layer in one launch.
//
// The engine keeps all of a layer's parameters (stacked [W1; W3], W2, router) in one flat fp32
// buffer with gradients, moments and the bf16 storage copy in parallel flat buffers, so one
// grid-stride kernel updates them all: it reads the gradient, applies the clipping scale,
// updates the state, writes the fp32 weight and its bf16 copy, and zeroes the gradient for
// the next accumulation. The global gradient norm is a separate deterministic two-stage sum.
#ifndef MOE_KERNELS_CUDA_OPTIMIZER_H_
#define MOE_KERNELS_CUDA_OPTIMIZER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe::kernels {

size_t SumSquaresWorkspaceBytes();

// out[0] = sum_i x[i]^2 in fp64 (fixed reduction order).
cudaError_t LaunchSumSquares(const float* x, int64_t n, void* workspace, size_t workspace_bytes,
                             double* out, cudaStream_t stream);

// w -= lr * wd * w (decoupled); m, v moments; w -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)
// with step_size = lr / (1 - beta1^step), inv_sqrt_bc2 = 1 / sqrt(1 - beta2^step): the same
// formula, in the same order, as the CPU engine (and torch.optim.AdamW).
struct AdamWParams {
  float lr = 0.f, beta1 = 0.f, beta2 = 0.f, eps = 0.f, weight_decay = 0.f;
  float step_size = 0.f;
  float inv_sqrt_bc2 = 1.f;
  float grad_scale = 1.f;  // clipping factor applied to every gradient
};

// w, m, v, g fp32 [n]; w_bf16 (bf16 storage copy) may be null. g is zeroed.
cudaError_t LaunchAdamW(float* w, float* m, float* v, float* g, void* w_bf16, int64_t n,
                        const AdamWParams& params, cudaStream_t stream);

struct SgdParams {
  float lr = 0.f, momentum = 0.f, weight_decay = 0.f;
  float grad_scale = 1.f;
};

// momentum_buf may be null when params.momentum == 0. g is zeroed.
cudaError_t LaunchSgd(float* w, float* momentum_buf, float* g, void* w_bf16, int64_t n,
                      const SgdParams& params, cudaStream_t stream);

// Round-to-nearest-even casts between fp32 and bf16 (bf16 passed as raw 16-bit storage).
cudaError_t LaunchFloatToBFloat16(const float* src, int64_t n, void* dst, cudaStream_t stream);
cudaError_t LaunchBFloat16ToFloat(const void* src, int64_t n, float* dst, cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_OPTIMIZER_H_
