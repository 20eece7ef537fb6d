// Combine: out[t] = sum_k w[t,k] * y[slot_of[t,k]], the per-token gather-sum that turns the
// expert-ordered rows back into token order.
//
// Each output row is summed by the threads that own it, over k in order, in fp32: no atomics,
// so the result is deterministic. (t,k) with slot_of = -1 (routed outside the shard) add
// nothing; a token with no local expert gets a zero row. The backward uses it with no weights
// to sum dx over a token's expert rows.
#ifndef MOE_KERNELS_CUDA_COMBINE_H_
#define MOE_KERNELS_CUDA_COMBINE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/types.h"

namespace moe::kernels {

// y [*, d] of y_type; slot_of [T, K]; weights [T, K] fp32 or null (all ones); out [T, d] of
// out_type. Supported: (bf16 -> bf16), (bf16 -> fp32), (fp32 -> fp32).
cudaError_t LaunchCombine(const void* y, ElemType y_type, const int32_t* slot_of,
                          const float* weights, int64_t num_tokens, int32_t top_k, int64_t d_model,
                          void* out, ElemType out_type, cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_COMBINE_H_
