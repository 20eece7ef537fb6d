// Host side of the fused Hopper backward's data gradients (sm90_expert_backward.h):
// LaunchSm90BackwardDA and LaunchSm90BackwardDX, both one persistent launch of the forward's
// grouped GEMM (sm90/impls/) over all experts.
//
// The weights are read in the layout the forward stores them (W2 [d, h], W13 [2h, d] per
// expert), where the backward's reduction dimension is the ROW: the kernel stages them
// MN-major through TMA and wgmma's transpose flag, so no transposed copy of the weights is
// ever made. dA_u's A rows are dout gathered through the dispatch index as they are loaded
// (the up-projection's path); dXg's are dH in slot order. Both write rows in slot order, the
// order the SwiGLU backward and the combine read them in.
#include <cstdint>

#include "kernels/cuda/sm90/launch.cuh"
#include "kernels/cuda/sm90_expert_backward.h"

namespace moe::kernels {

cudaError_t LaunchSm90BackwardDA(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                 const uint16_t* dout, const uint16_t* w2, const int32_t* offsets,
                                 const int32_t* entries, uint16_t* da, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!sm90::Aligned16(dout) || !sm90::Aligned16(w2) || !sm90::Aligned16(da) ||
      offsets == nullptr || entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  sm90::GemmParams params = sm90::MakeGemmParams(
      problem, dout, w2, w2, offsets, entries, da, problem.d_model, problem.d_hidden,
      static_cast<int64_t>(problem.d_model) * problem.d_hidden);
  // A gathered, B MN-major, rows out in slot order.
  return sm90::DispatchGemm(sm90::GemmVariant<false, true, true, true>{}, config, params, w2, w2,
                            stream);
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
