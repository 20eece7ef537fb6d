// Host side of the fused Hopper weight gradients (LaunchSm90WeightGradW2/W13 of
// sm90_expert_backward.h): argument checks and the switch that turns the config's block_n
// into the kernel's template constants.
//
// Both gradients are one kernel, sm90_weight_grad_kernel, seen from two sides: dW2 = dout^T pA
// gathers its A operand (dout rows by token) and reads B (pA) in slot order; dW13 = dH^T x
// reads A (dH) in slot order and gathers B (x). Only block_n of the config applies: operands
// are loaded by cp.async (a gathered row set has no tensor-map box), and the tile order is
// fixed expert-major, so tma_weights, group_m and warp_specialized are ignored. The grid is
// one CTA per SM; the number of tiles is known only on the device (experts with rows), so
// CTAs past it exit at once.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/sm90_expert_backward.h"
#include "kernels/cuda/sm90_weight_grad.cuh"

namespace moe::kernels {
namespace {

using sm90::WeightGradParams;

bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// The one place block_n becomes a template constant. Slabs of kSlabRows reduction rows a ring
// stage; the ring fills ~192 KB either way.
constexpr int kSlabRows = 64;

template <bool kGatherA>
cudaError_t DispatchWeightGrad(const Sm90GemmConfig& config, const WeightGradParams& params,
                               cudaStream_t stream) {
  switch (config.block_n) {
    case 256:
      return sm90::LaunchWeightGradKernel<256, kSlabRows, kGatherA>(params, stream);
    case 128:
      return sm90::LaunchWeightGradKernel<128, kSlabRows, kGatherA>(params, stream);
    default:
      return cudaErrorInvalidValue;  // unsupported block_n
  }
}

}  // namespace

cudaError_t LaunchSm90WeightGradW2(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                   const uint16_t* dout, const uint16_t* pa, const int32_t* offsets,
                                   const int32_t* entries, float* dw2, bool accumulate,
                                   cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!Aligned16(dout) || !Aligned16(pa) || !Aligned16(dw2) || offsets == nullptr ||
      entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  WeightGradParams params = {};
  params.a = reinterpret_cast<const __nv_bfloat16*>(dout);
  params.b = reinterpret_cast<const __nv_bfloat16*>(pa);
  params.offsets = offsets;
  params.entries = entries;
  params.c = dw2;
  params.num_experts = problem.num_experts;
  params.m_dim = problem.d_model;
  params.n_dim = problem.d_hidden;
  params.top_k = sm90::MakeFastDivisor(static_cast<uint32_t>(problem.top_k));
  params.accumulate = accumulate ? 1 : 0;
  return DispatchWeightGrad<true>(config, params, stream);
}

cudaError_t LaunchSm90WeightGradW13(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                    const uint16_t* dh, const uint16_t* x, const int32_t* offsets,
                                    const int32_t* entries, float* dw13, bool accumulate,
                                    cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!Aligned16(dh) || !Aligned16(x) || !Aligned16(dw13) || offsets == nullptr ||
      entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  WeightGradParams params = {};
  params.a = reinterpret_cast<const __nv_bfloat16*>(dh);
  params.b = reinterpret_cast<const __nv_bfloat16*>(x);
  params.offsets = offsets;
  params.entries = entries;
  params.c = dw13;
  params.num_experts = problem.num_experts;
  params.m_dim = 2 * problem.d_hidden;
  params.n_dim = problem.d_model;
  params.top_k = sm90::MakeFastDivisor(static_cast<uint32_t>(problem.top_k));
  params.accumulate = accumulate ? 1 : 0;
  return DispatchWeightGrad<false>(config, params, stream);
}

}  // namespace moe::kernels
