// Expert backward elementwise pass, fused: from H and dA_u = dO_gathered W2 (the gradient of
// the expert output before the routing weight), in one read of each:
//   A      = act(H1) (* H3)       recomputed here; the forward never stores it
//   dp     = <dA_u, A>            = <dO, W2 A>, the routing-weight gradient, without expert
//                                   outputs ever being stored; written to dweights[entry]
//   dA     = p * dA_u
//   dH1    = dA * H3 * silu'(H1)  (SwiGLU) or dA * act'(H1);  dH3 = dA * silu(H1)
//   A_p    = p * A                the left operand of the dW2 GEMM, so it needs no scaling
// One block per row: dp is a block reduction in a fixed order (deterministic).
#ifndef MOE_KERNELS_CUDA_EXPERT_BACKWARD_H_
#define MOE_KERNELS_CUDA_EXPERT_BACKWARD_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/types.h"

namespace moe::kernels {

// Row n is entry entries[n] = t*K + k. h [rows, g], da [rows, hidden], dh [rows, g],
// a_scaled [rows, hidden], all of `type` (g = 2*hidden for SwiGLU, else hidden). weights and
// dweights are fp32 [*, K] indexed by entry; dweights may be null (not needed).
cudaError_t LaunchActivationBackward(const void* h, const void* da, const int32_t* entries,
                                     const float* weights, ElemType type, int activation,
                                     int64_t rows, int64_t hidden, void* dh, void* a_scaled,
                                     float* dweights, cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_EXPERT_BACKWARD_H_
