// Fused Hopper (sm_90a) expert backward: the launchers of its four GEMMs, plain C++ like
// sm90_expert_forward.h (whose Sm90ExpertProblem, Sm90GemmConfig and Sm90CanImplement they
// share), so the engine calls them from a .cc file.
//
// The backward of one SwiGLU expert layer, per chunk, from the forward's dispatch structures
// (offsets/entries of kernels/cpu/dispatch.h) and its saved H, in five launches:
//   1. LaunchSm90BackwardDA:    dA_u[s] = dout[entries[s] / K] W2_e     (rows of dout gathered
//      through the index while loading, W2 read in its stored [d, h] layout, one persistent
//      launch over all experts; nothing gathered is written to device memory).
//   2. the SwiGLU backward (kernels/cuda/expert_backward.h, LaunchActivationBackward): recomputes
//      A from H, gives dH = [dH1 | dH3], pA = p * A and dp = <dA_u, A>.
//   3. LaunchSm90WeightGradW2:  dW2_e (+)= sum over the expert's rows s of
//      dout[entries[s] / K]^T pA[s]   (reduction over a per-expert number of rows).
//   4. LaunchSm90WeightGradW13: dW13_e (+)= sum over s of dH[s]^T x[entries[s] / K].
//   5. LaunchSm90BackwardDX:    dXg[s] = dH[s] [W1_e; W3_e], in slot order, followed by the
//      engine's per-token gather-sum (LaunchCombine with no weights) into dx.
// Layouts (row-major; bf16 as its raw 16 bits; N = offsets[num_experts] routed rows of the
// chunk; T its tokens; slot s of expert e lies in [offsets[e], offsets[e+1])):
//   dout, x [T, d]   w2 [experts, d, h]   w13 [experts, 2h, d] (W1_e's h rows, then W3_e's,
//   experts problem.w13_expert_stride elements apart; -1 means 2*h*d)
//   dA_u [N, h]   dH [N, 2h]   pA [N, h]   dXg [N, d]
//   dw2 [experts, d, h] fp32   dw13 [experts, 2h, d] fp32
// Weight gradients: accumulate = false overwrites, true adds to what is there; an expert with
// no rows in the chunk is not touched either way (the caller's buffers already hold zeros or
// the earlier chunks' sums). Sums are fp32 in a fixed order: the same inputs give the same bits.
// Every launcher checks Sm90CanImplement and 16-byte alignment (cudaErrorInvalidValue
// otherwise), never synchronises, and takes the stream last.
#ifndef MOE_KERNELS_CUDA_SM90_EXPERT_BACKWARD_H_
#define MOE_KERNELS_CUDA_SM90_EXPERT_BACKWARD_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/sm90_expert_forward.h"

namespace moe::kernels {

// dA_u [N, h] (bf16) = dout rows gathered through entries, times W2_e ([d, h], read MN-major).
cudaError_t LaunchSm90BackwardDA(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                 const uint16_t* dout, const uint16_t* w2, const int32_t* offsets,
                                 const int32_t* entries, uint16_t* da, cudaStream_t stream);

// dXg [N, d] (bf16, slot order) = dH [N, 2h] times the stacked [W1_e; W3_e] ([2h, d]).
cudaError_t LaunchSm90BackwardDX(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                 const uint16_t* dh, const uint16_t* w13, const int32_t* offsets,
                                 uint16_t* dxg, cudaStream_t stream);

// dw2[e] [d, h] (+)= sum_s dout[entries[s] / K]^T pA[s], fp32.
cudaError_t LaunchSm90WeightGradW2(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                   const uint16_t* dout, const uint16_t* pa,
                                   const int32_t* offsets, const int32_t* entries, float* dw2,
                                   bool accumulate, cudaStream_t stream);

// dw13[e] [2h, d] (+)= sum_s dH[s]^T x[entries[s] / K], fp32.
cudaError_t LaunchSm90WeightGradW13(const Sm90ExpertProblem& problem,
                                    const Sm90GemmConfig& config, const uint16_t* dh,
                                    const uint16_t* x, const int32_t* offsets,
                                    const int32_t* entries, float* dw13, bool accumulate,
                                    cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_SM90_EXPERT_BACKWARD_H_
