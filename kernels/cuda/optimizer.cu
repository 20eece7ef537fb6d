// Optimizer, norm and cast kernels (see optimizer.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/optimizer.h"

namespace moe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kSumBlocks = 1024;  // fixed, so the reduction order never depends on the device

unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 132 * 16)));
}

__device__ double BlockSumDouble(double v) {
  __shared__ double scratch[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double s = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

__global__ void sum_squares_partial_kernel(const float* __restrict__ x, int64_t n,
                                           double* __restrict__ partial) {
  double acc = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double v = x[i];
    acc += v * v;
  }
  acc = BlockSumDouble(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void sum_squares_final_kernel(const double* __restrict__ partial, int blocks,
                                         double* __restrict__ out) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) acc += partial[i];
  acc = BlockSumDouble(acc);
  if (threadIdx.x == 0) out[0] = acc;
}

__global__ void adamw_kernel(float* __restrict__ w, float* __restrict__ m, float* __restrict__ v,
                             float* __restrict__ g, __nv_bfloat16* __restrict__ w_bf16, int64_t n,
                             AdamWParams p) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float grad = g[i] * p.grad_scale;
    float wi = w[i];
    wi -= p.lr * p.weight_decay * wi;
    const float mi = p.beta1 * m[i] + (1.f - p.beta1) * grad;
    const float vi = p.beta2 * v[i] + (1.f - p.beta2) * grad * grad;
    m[i] = mi;
    v[i] = vi;
    wi -= p.step_size * mi / (sqrtf(vi) * p.inv_sqrt_bc2 + p.eps);
    w[i] = wi;
    if (w_bf16 != nullptr) w_bf16[i] = __float2bfloat16_rn(wi);
    g[i] = 0.f;
  }
}

__global__ void sgd_kernel(float* __restrict__ w, float* __restrict__ mom, float* __restrict__ g,
                           __nv_bfloat16* __restrict__ w_bf16, int64_t n, SgdParams p) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float wi = w[i];
    float step = g[i] * p.grad_scale + p.weight_decay * wi;
    if (mom != nullptr) {
      step = p.momentum * mom[i] + step;
      mom[i] = step;
    }
    wi -= p.lr * step;
    w[i] = wi;
    if (w_bf16 != nullptr) w_bf16[i] = __float2bfloat16_rn(wi);
    g[i] = 0.f;
  }
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ src, int64_t n,
                                   __nv_bfloat16* __restrict__ dst) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

__global__ void bf16_to_f32_kernel(const __nv_bfloat16* __restrict__ src, int64_t n,
                                   float* __restrict__ dst) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __bfloat162float(src[i]);
  }
}

}  // namespace

size_t SumSquaresWorkspaceBytes() { return kSumBlocks * sizeof(double); }

cudaError_t LaunchSumSquares(const float* x, int64_t n, void* workspace, size_t workspace_bytes,
                             double* out, cudaStream_t stream) {
  if (workspace_bytes < SumSquaresWorkspaceBytes()) return cudaErrorInvalidValue;
  auto* partial = static_cast<double*>(workspace);
  sum_squares_partial_kernel<<<kSumBlocks, kThreads, 0, stream>>>(x, n, partial);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  sum_squares_final_kernel<<<1, 1024, 0, stream>>>(partial, kSumBlocks, out);
  return cudaGetLastError();
}

cudaError_t LaunchAdamW(float* w, float* m, float* v, float* g, void* w_bf16, int64_t n,
                        const AdamWParams& params, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  adamw_kernel<<<GridFor(n), kThreads, 0, stream>>>(w, m, v, g, static_cast<__nv_bfloat16*>(w_bf16),
                                                    n, params);
  return cudaGetLastError();
}

cudaError_t LaunchSgd(float* w, float* momentum_buf, float* g, void* w_bf16, int64_t n,
                      const SgdParams& params, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  sgd_kernel<<<GridFor(n), kThreads, 0, stream>>>(w, momentum_buf, g,
                                                  static_cast<__nv_bfloat16*>(w_bf16), n, params);
  return cudaGetLastError();
}

cudaError_t LaunchFloatToBFloat16(const float* src, int64_t n, void* dst, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  f32_to_bf16_kernel<<<GridFor(n), kThreads, 0, stream>>>(src, n, static_cast<__nv_bfloat16*>(dst));
  return cudaGetLastError();
}

cudaError_t LaunchBFloat16ToFloat(const void* src, int64_t n, float* dst, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  bf16_to_f32_kernel<<<GridFor(n), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(src), n,
                                                          dst);
  return cudaGetLastError();
}

}  // namespace moe::kernels
