// MoEBlaze dispatch structures, the CPU reference (bitwise ground truth for the GPU version).
//
// Given expert ids idx [T, K] (global ids) and a shard [first, first + count), builds:
//   counts  [count]        (t,k) entries routed to each local expert
//   offsets [count + 1]    exclusive prefix sum of counts; offsets[count] = N routed entries
//   entries [N]            the expert-ordered list: entry = t * K + k, grouped by local
//                          expert, ascending entry within each expert (deterministic)
//   slot_of [T * K]        for every (t,k): its position in `entries`, or -1 when idx[t,k]
//                          lies outside the shard
// No validation here (kernels take raw pointers): the engine rejects out-of-range and
// duplicate ids before calling. Plain C++, no Abseil, so CUDA tests can link it too.
#ifndef MOE_KERNELS_CPU_DISPATCH_H_
#define MOE_KERNELS_CPU_DISPATCH_H_

#include <cstdint>

namespace moe::kernels {

void DispatchCpu(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                 int32_t expert_first, int32_t expert_count, int32_t* counts, int32_t* offsets,
                 int32_t* entries, int32_t* slot_of);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CPU_DISPATCH_H_
