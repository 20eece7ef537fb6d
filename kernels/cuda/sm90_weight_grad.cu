// Host side of the fused Hopper weight gradients (LaunchSm90WeightGradW2/W13 of
// sm90_expert_backward.h): argument checks and the switch that turns the config's block_n
// into the kernel's template constants.
//
// Both gradients are one kernel family seen from two sides: dW2 = dout^T pA gathers its A
// operand (dout rows by token) and reads B (pA) in slot order; dW13 = dH^T x reads A (dH) in
// slot order and gathers B (x). block_n and tma_weights of the config pick the kernel
// (sm90_weight_grad_kernel in all three cases):
//   block_n 256: 128 x 256 tiles, one CTA an SM, both operands by cp.async;
//   block_n 256, tma_weights: the same with the slot-order operand's full slabs by TMA
//     (kTmaSlots; "weights" is the field's name from the other GEMMs, here it is pA or dH);
//   block_n 128: 128 x 128 tiles, one CTA an SM (tma_weights does not apply).
// Which one a gradient gets is engine/cuda/kernel_selection.h's rule. Two CTAs an SM at
// block_n 128 (kCtasPerSm = 2) is timed by the bench but never chosen, slower than one CTA
// (docs/decisions/0001-sm90-kernel-choice.md). The gathered operand always comes by cp.async
// (a gathered row set has no tensor-map box) and the tile order is fixed expert-major, so
// group_m, warp_specialized and ping_pong are ignored.
// The number of tiles is known only on the device (experts with rows), so CTAs past it exit
// at once.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/sm90/impls/weight_grad.cuh"
#include "kernels/cuda/sm90_expert_backward.h"

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
      if (config.tma_weights) {  // the slot-order operand's full slabs by TMA
        return sm90::LaunchWeightGradKernel<256, kSlabRows, kGatherA, /*kDrain=*/false,
                                            /*kCtasPerSm=*/1, /*kTmaSlots=*/true>(params, stream);
      }
      return sm90::LaunchWeightGradKernel<256, kSlabRows, kGatherA>(params, stream);
    case 128:
      return sm90::LaunchWeightGradKernel<128, kSlabRows, kGatherA>(params, stream);
    default:
      return cudaErrorInvalidValue;  // unsupported block_n
  }
}

// Both public launchers. The checks, the params and the dispatch are the same for dW2 and
// dW13; which operand is gathered decides the rest: gathering A is dW2 = dout^T pA, C [d, h];
// gathering B is dW13 = dH^T x, C [2h, d]. The shape is taken only once the problem has
// passed Sm90CanImplement.
template <bool kGatherA>
cudaError_t LaunchWeightGrad(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                             const uint16_t* a, const uint16_t* b, const int32_t* offsets,
                             const int32_t* entries, float* c, bool accumulate,
                             cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!Aligned16(a) || !Aligned16(b) || !Aligned16(c) || offsets == nullptr || entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  // The TMA map's row extent (kTmaSlots): T*K bounds the routed rows, and TMA reads only full
  // slabs inside an expert's rows, so nothing past the caller's buffer is read. Not
  // num_routed: it is only a hint, and a map shorter than the real rows would read zeros.
  const WeightGradParams params = sm90::MakeWeightGradParams(
      a, b, offsets, entries, c, problem.num_experts,
      kGatherA ? problem.d_model : 2 * problem.d_hidden,
      kGatherA ? problem.d_hidden : problem.d_model, problem.top_k,
      static_cast<int32_t>(problem.num_tokens * problem.top_k), accumulate);
  return DispatchWeightGrad<kGatherA>(config, params, stream);
}

}  // namespace

cudaError_t LaunchSm90WeightGradW2(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                   const uint16_t* dout, const uint16_t* pa, const int32_t* offsets,
                                   const int32_t* entries, float* dw2, bool accumulate,
                                   cudaStream_t stream) {
  return LaunchWeightGrad</*kGatherA=*/true>(problem, config, dout, pa, offsets, entries, dw2,
                                             accumulate, stream);
}

cudaError_t LaunchSm90WeightGradW13(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                    const uint16_t* dh, const uint16_t* x, const int32_t* offsets,
                                    const int32_t* entries, float* dw13, bool accumulate,
                                    cudaStream_t stream) {
  return LaunchWeightGrad</*kGatherA=*/false>(problem, config, dh, x, offsets, entries, dw13,
                                              accumulate, stream);
}

}  // namespace moe::kernels
