// Router kernels (see router.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/router.h"

namespace moe::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kStatsTokens = 256;  // tokens per partial-sum block
constexpr int kStatsThreads = 256;

__global__ void router_topk_kernel(const float* __restrict__ logits, int64_t num_tokens, int E,
                                   int K, bool renormalize, int32_t* __restrict__ idx,
                                   float* __restrict__ p, float* __restrict__ lse_out) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= num_tokens) return;
  const float* l = logits + t * E;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
  mx = detail::WarpMax(mx);
  float sum = 0.f;
  for (int e = lane; e < E; e += 32) sum += expf(l[e] - mx);
  sum = detail::WarpSum(sum);
  const float inv = 1.f / sum;
  if (lane == 0) lse_out[t] = mx + logf(sum);
  // Repeated arg-max under the total order (s desc, id asc), each round restricted to what
  // ranks after the previous pick: no marking, and ties go to the lower expert id.
  float prev_v = INFINITY;
  int prev_e = -1;
  float psum = 0.f;
  for (int k = 0; k < K; ++k) {
    float best_v = -1.f;
    int best_e = INT_MAX;
    for (int e = lane; e < E; e += 32) {
      const float v = expf(l[e] - mx) * inv;
      const bool eligible = v < prev_v || (v == prev_v && e > prev_e);
      if (eligible && (v > best_v || (v == best_v && e < best_e))) {
        best_v = v;
        best_e = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ov > best_v || (ov == best_v && oe < best_e)) {
        best_v = ov;
        best_e = oe;
      }
    }
    prev_v = best_v;
    prev_e = best_e;
    psum += best_v;
    if (lane == 0) {
      idx[t * K + k] = best_e;
      p[t * K + k] = best_v;
    }
  }
  if (renormalize) {
    __syncwarp();
    for (int k = lane; k < K; k += 32) p[t * K + k] = p[t * K + k] / psum;
  }
}

// Partial column sums of s and of lse^2 over a block of kStatsTokens tokens.
__global__ void router_stats_partial_kernel(const float* __restrict__ logits,
                                            const float* __restrict__ lse, int64_t num_tokens,
                                            int E, double* __restrict__ partial) {
  __shared__ float scratch[32];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kStatsTokens;
  const int64_t t1 = min(num_tokens, t0 + kStatsTokens);
  double* out = partial + static_cast<int64_t>(blockIdx.x) * (E + 1);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float s = 0.f;
    for (int64_t t = t0; t < t1; ++t) s += expf(logits[t * E + e] - lse[t]);
    out[e] = s;
  }
  float z = 0.f;
  for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) z += lse[t] * lse[t];
  z = detail::BlockSum(z, scratch);
  if (threadIdx.x == 0) out[E] = z;
}

__global__ void router_stats_final_kernel(const double* __restrict__ partial, int64_t blocks, int E,
                                          double* __restrict__ prob_sum,
                                          double* __restrict__ lse_sq_sum) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e <= E; e += gridDim.x * blockDim.x) {
    double s = 0.0;
    for (int64_t b = 0; b < blocks; ++b) s += partial[b * (E + 1) + e];
    if (e < E) {
      prob_sum[e] = s;
    } else {
      lse_sq_sum[0] = s;
    }
  }
}

__global__ void router_backward_kernel(const float* __restrict__ logits,
                                       const float* __restrict__ lse,
                                       const int32_t* __restrict__ idx,
                                       const float* __restrict__ dp,
                                       const float* __restrict__ aux_grad, float z_scale,
                                       int64_t num_tokens, int E, int K, bool renormalize,
                                       float* __restrict__ dlogits) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= num_tokens) return;
  const float* l = logits + t * E;
  float* dl = dlogits + t * E;
  const float lt = lse[t];
  // Renormalisation backward: p_k = s_k / S, so ds_k = (dp_k - sum_j dp_j p_j) / S.
  float S = 0.f, c = 0.f;
  for (int k = lane; k < K; k += 32) {
    const float s = expf(l[idx[t * K + k]] - lt);
    S += s;
  }
  S = detail::WarpSum(S);
  for (int k = lane; k < K; k += 32) {
    const float q = expf(l[idx[t * K + k]] - lt) / S;
    c += dp[t * K + k] * q;
  }
  c = detail::WarpSum(c);
  // Row of d s: the aux term everywhere, plus the top-K terms at the selected ids (distinct
  // ids, so each element is written by one lane).
  for (int e = lane; e < E; e += 32) dl[e] = aux_grad != nullptr ? aux_grad[e] : 0.f;
  __syncwarp();
  for (int k = lane; k < K; k += 32) {
    const int e = idx[t * K + k];
    const float dpk = dp[t * K + k];
    dl[e] += renormalize ? (dpk - c) / S : dpk;
  }
  __syncwarp();
  // Softmax backward: dlogit_e = s_e (ds_e - sum_j s_j ds_j), plus the z-loss term.
  float dot = 0.f;
  for (int e = lane; e < E; e += 32) dot += expf(l[e] - lt) * dl[e];
  dot = detail::WarpSum(dot);
  for (int e = lane; e < E; e += 32) {
    const float s = expf(l[e] - lt);
    dl[e] = s * (dl[e] - dot) + z_scale * lt * s;
  }
}

}  // namespace

cudaError_t LaunchRouterTopK(const float* logits, int64_t num_tokens, int32_t num_experts,
                             int32_t top_k, bool renormalize, int32_t* idx, float* p, float* lse,
                             cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (top_k < 1 || top_k > num_experts) return cudaErrorInvalidValue;
  const int64_t blocks = (num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  router_topk_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      logits, num_tokens, num_experts, top_k, renormalize, idx, p, lse);
  return cudaGetLastError();
}

size_t RouterStatsWorkspaceBytes(int64_t num_tokens, int32_t num_experts) {
  const int64_t blocks = std::max<int64_t>(1, (num_tokens + kStatsTokens - 1) / kStatsTokens);
  return static_cast<size_t>(blocks) * (num_experts + 1) * sizeof(double);
}

cudaError_t LaunchRouterStats(const float* logits, const float* lse, int64_t num_tokens,
                              int32_t num_experts, void* workspace, size_t workspace_bytes,
                              double* prob_sum, double* lse_sq_sum, cudaStream_t stream) {
  if (workspace_bytes < RouterStatsWorkspaceBytes(num_tokens, num_experts)) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = std::max<int64_t>(1, (num_tokens + kStatsTokens - 1) / kStatsTokens);
  auto* partial = static_cast<double*>(workspace);
  router_stats_partial_kernel<<<static_cast<unsigned>(blocks), kStatsThreads, 0, stream>>>(
      logits, lse, num_tokens, num_experts, partial);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  const int final_blocks = (num_experts + 1 + 255) / 256;
  router_stats_final_kernel<<<final_blocks, 256, 0, stream>>>(partial, blocks, num_experts,
                                                              prob_sum, lse_sq_sum);
  return cudaGetLastError();
}

cudaError_t LaunchRouterBackward(const float* logits, const float* lse, const int32_t* idx,
                                 const float* dp, const float* aux_grad, float z_scale,
                                 int64_t num_tokens, int32_t num_experts, int32_t top_k,
                                 bool renormalize, float* dlogits, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t blocks = (num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  router_backward_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      logits, lse, idx, dp, aux_grad, z_scale, num_tokens, num_experts, top_k, renormalize,
      dlogits);
  return cudaGetLastError();
}

}  // namespace moe::kernels
