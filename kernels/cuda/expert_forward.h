// Expert forward elementwise pass: A = act(H1) (* H3 for SwiGLU), one fused pass over H.
//
// H = [W1 x, W3 x] comes out of one grouped GEMM against the stacked [W1; W3] weights, so a
// row of H holds the gate half then the up half (gated) or just W1 x (SiLU, GeLU, ReLU).
// The expert GEMMs themselves live in the engine (cuBLAS); this is the part between them.
#ifndef MOE_KERNELS_CUDA_EXPERT_FORWARD_H_
#define MOE_KERNELS_CUDA_EXPERT_FORWARD_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/types.h"

namespace moe::kernels {

// activation: the moe::Activation value (0 SwiGLU, 1 SiLU, 2 GeLU-tanh, 3 ReLU).
// h [rows, gated ? 2*hidden : hidden], a [rows, hidden], both of `type`.
cudaError_t LaunchActivationForward(const void* h, ElemType type, int activation, int64_t rows,
                                    int64_t hidden, void* a, cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_EXPERT_FORWARD_H_
