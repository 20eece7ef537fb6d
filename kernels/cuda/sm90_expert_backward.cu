// Host side of the fused Hopper backward's data gradients (sm90_expert_backward.h):
// LaunchSm90BackwardDA and LaunchSm90BackwardDX, both one persistent launch of the forward's
// grouped GEMM (sm90_grouped_gemm.cuh) over all experts.
//
// The weights are read in the layout the forward stores them (W2 [d, h], W13 [2h, d] per
// expert), where the backward's reduction dimension is the ROW: the kernel stages them
// MN-major through TMA and wgmma's transpose flag, so no transposed copy of the weights is
// ever made. dA_u's A rows are dout gathered through the dispatch index as they are loaded
// (the up-projection's path); dXg's are dH in slot order. Both write rows in slot order, the
// order the SwiGLU backward and the combine read them in.
//
// LaunchSm90BackwardDH is the dA GEMM with the SwiGLU backward as its epilogue. dp needs a sum
// over all of h per row, which crosses column tiles (run by different CTAs) when h > block_n;
// rather than float atomics (whose order, and so whose bits, vary), each tile writes its
// partial sum to a workspace row, and a second small launch adds the tiles in column order.
// When one tile covers h (sonic-7b's h = 256) the epilogue writes dp itself and the second
// launch is skipped. Measured on an H100 it is correct but 0.80x to 0.98x the speed of
// LaunchSm90BackwardDA followed by the separate activation backward: the epilogue (320 KB of H
// in, dH and pA out per 128x256 tile) runs serially with the main loop on each SM, and costs
// about what the separate pass does (bench/results/2026-11-21-h100-fb-b2).
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/sm90/launch.cuh"
#include "kernels/cuda/sm90_expert_backward.h"

namespace moe::kernels {
namespace {

// dp[entries[s]] = sum over column tiles t, in order, of part[t * stride + s], for s < N.
// Lives here, not in a header, for the reason sm90_combine_kernel does.
__global__ void sm90_dp_reduce_kernel(const float* __restrict__ part, int64_t stride, int n_tiles,
                                      const int32_t* __restrict__ offsets, int num_experts,
                                      const int32_t* __restrict__ entries, float* __restrict__ dp) {
  const int64_t n = offsets[num_experts];
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < n; s += step) {
    float sum = part[s];
    for (int t = 1; t < n_tiles; ++t) sum += part[t * stride + s];
    dp[entries[s]] = sum;
  }
}

int64_t DHColumnTiles(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config) {
  return config.block_n > 0 ? sm90::CeilDiv(problem.d_hidden, config.block_n) : 0;
}

// The dA GEMM's operands (LaunchSm90BackwardDA and LaunchSm90BackwardDH): A = dout gathered
// through entries, B = W2 read MN-major, rows out in slot order to out0.
sm90::GemmParams DAParams(const Sm90ExpertProblem& problem, const uint16_t* dout,
                          const uint16_t* w2, const int32_t* offsets, const int32_t* entries,
                          uint16_t* out0) {
  return sm90::MakeGemmParams(problem, dout, w2, w2, offsets, entries, out0, problem.d_model,
                              problem.d_hidden,
                              static_cast<int64_t>(problem.d_model) * problem.d_hidden);
}

}  // namespace

cudaError_t LaunchSm90BackwardDA(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                 const uint16_t* dout, const uint16_t* w2, const int32_t* offsets,
                                 const int32_t* entries, uint16_t* da, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!sm90::Aligned16(dout) || !sm90::Aligned16(w2) || !sm90::Aligned16(da) ||
      offsets == nullptr || entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  sm90::GemmParams params = DAParams(problem, dout, w2, offsets, entries, da);
  // A gathered, B MN-major, rows out in slot order.
  return sm90::DispatchGemm(sm90::GemmVariant<false, true, true, true>{}, config, params, w2, w2,
                            stream);
}

size_t Sm90BackwardDHWorkspaceBytes(const Sm90ExpertProblem& problem,
                                    const Sm90GemmConfig& config) {
  const int64_t tiles = DHColumnTiles(problem, config);
  if (tiles <= 1 || problem.num_tokens <= 0 || problem.top_k <= 0) return 0;
  return static_cast<size_t>(tiles * problem.num_tokens * problem.top_k) * sizeof(float);
}

cudaError_t LaunchSm90BackwardDH(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                 const uint16_t* dout, const uint16_t* w2, const uint16_t* h,
                                 const float* weights, const int32_t* offsets,
                                 const int32_t* entries, uint16_t* dh, uint16_t* pa, float* dp,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!sm90::Aligned16(dout) || !sm90::Aligned16(w2) || !sm90::Aligned16(h) ||
      !sm90::Aligned16(dh) || !sm90::Aligned16(pa) || weights == nullptr || dp == nullptr ||
      offsets == nullptr || entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  const size_t need = Sm90BackwardDHWorkspaceBytes(problem, config);
  if (need > 0 && (workspace == nullptr || workspace_bytes < need ||
                   reinterpret_cast<uintptr_t>(workspace) % alignof(float) != 0)) {
    return cudaErrorInvalidValue;
  }
  sm90::GemmParams params = DAParams(problem, dout, w2, offsets, entries, dh);
  params.out1 = reinterpret_cast<__nv_bfloat16*>(pa);
  params.saved_h = reinterpret_cast<const __nv_bfloat16*>(h);
  params.route_w = weights;
  params.dp = dp;
  params.dp_part = need > 0 ? static_cast<float*>(workspace) : nullptr;
  params.dp_stride = problem.num_tokens * problem.top_k;
  // A gathered, B MN-major, slot rows, SwiGLU backward epilogue.
  cudaError_t err = sm90::DispatchGemm(sm90::GemmVariant<false, true, true, true, true>{}, config,
                                       params, w2, w2, stream);
  if (err != cudaSuccess || need == 0) return err;
  const int threads = 256;
  const int blocks =
      static_cast<int>(std::min<int64_t>(sm90::CeilDiv(params.dp_stride, threads), 4096));
  sm90_dp_reduce_kernel<<<blocks, threads, 0, stream>>>(
      params.dp_part, params.dp_stride, static_cast<int>(DHColumnTiles(problem, config)), offsets,
      problem.num_experts, entries, dp);
  return cudaGetLastError();
}

cudaError_t LaunchSm90BackwardDX(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                 const uint16_t* dh, const uint16_t* w13, const int32_t* offsets,
                                 uint16_t* dxg, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  const int64_t block = 2 * static_cast<int64_t>(problem.d_hidden) * problem.d_model;
  // Here the stride spans a whole [W1_e; W3_e] block, so it may not be shorter than 2*h*d.
  const int64_t stride = problem.w13_expert_stride >= 0 ? problem.w13_expert_stride : block;
  if (stride < block) return cudaErrorInvalidValue;
  if (!sm90::Aligned16(dh) || !sm90::Aligned16(w13) || !sm90::Aligned16(dxg) ||
      offsets == nullptr) {
    return cudaErrorInvalidValue;
  }
  // Slot order in and out: the index is never read.
  sm90::GemmParams params =
      sm90::MakeGemmParams(problem, dh, w13, w13, offsets, /*entries=*/nullptr, dxg,
                           2 * problem.d_hidden, problem.d_model, stride);
  // A in slot order, B MN-major, rows out in slot order.
  return sm90::DispatchGemm(sm90::GemmVariant<false, false, true, true>{}, config, params, w13, w13,
                            stream);
}

}  // namespace moe::kernels
