// Server-side routing on the GPU: fused softmax + top-K after the router GEMM (which the
// engine runs through cuBLAS), the statistics the aux and z losses need, and the backward
// through top-K / renormalisation / softmax / aux / z terms to d logits.
//
// Math (engine/layer.h): s = softmax(logits); (idx, p) = top-K of s, ties to the lower expert
// id; p /= sum_k p when renormalising. One warp per token; reductions run in a fixed order,
// so every output is deterministic.
#ifndef MOE_KERNELS_CUDA_ROUTER_H_
#define MOE_KERNELS_CUDA_ROUTER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe::kernels {

// logits [T, E] fp32 -> idx [T, K] int32 (global ids), p [T, K] fp32, lse [T] fp32
// (logsumexp of each row, kept for the backward and the z-loss).
cudaError_t LaunchRouterTopK(const float* logits, int64_t num_tokens, int32_t num_experts,
                             int32_t top_k, bool renormalize, int32_t* idx, float* p, float* lse,
                             cudaStream_t stream);

size_t RouterStatsWorkspaceBytes(int64_t num_tokens, int32_t num_experts);

// prob_sum[e] = sum_t s[t,e] (E doubles), lse_sq_sum[0] = sum_t lse[t]^2, both deterministic.
cudaError_t LaunchRouterStats(const float* logits, const float* lse, int64_t num_tokens,
                              int32_t num_experts, void* workspace, size_t workspace_bytes,
                              double* prob_sum, double* lse_sq_sum, cudaStream_t stream);

// d logits [T, E] from dp [T, K] (gradient of the routing weights used, 0 where unused),
// plus aux_grad[e] = d aux / d s[t,e] (the same for every t; null for none) and the z-loss
// term z_scale * lse[t] * s[t,e] (z_scale = 2 * z_loss_coef / T_total; 0 for none).
cudaError_t LaunchRouterBackward(const float* logits, const float* lse, const int32_t* idx,
                                 const float* dp, const float* aux_grad, float z_scale,
                                 int64_t num_tokens, int32_t num_experts, int32_t top_k,
                                 bool renormalize, float* dlogits, cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_ROUTER_H_
