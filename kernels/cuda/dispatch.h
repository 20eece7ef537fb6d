// MoEBlaze dispatch on the GPU: the structures of kernels/cpu/dispatch.h, bitwise equal to
// DispatchCpu, built without atomics and without sorting.
//
// Two or three launches:
//   1. bitmap  one block per tile of 1024 tokens, one warp per 32 consecutive token rows (the
//              warp owns those rows, so no two warps write the same word). Lanes group their
//              (t,k) ids with __match_any_sync, giving for every local expert a 32-bit word of
//              the expert x token bitmap; per-(expert, tile) counts are popcounts summed by a
//              warp scan, which also gives each word the expert's tokens in the tile's earlier
//              words. (t,k) outside the shard get slot_of = -1 here.
//   2. scan    (large problems only) a block per expert scans its tile counts: the expert's
//              tokens in earlier tiles, and its count. Small problems (experts x tiles <= 16384)
//              skip it: each write block sums the few tile counts it needs itself.
//   3. write   one block per tile again; each block scans the per-expert counts into offsets
//              in shared memory (block 0 publishes counts and offsets), then a lane per token:
//              slot of (t,k) = offsets[e] + tile base + word prefix + set bits below the token
//              in its word; entry = t*K+k goes straight to that slot and slot_of[t*K+k] to the
//              entry. Ascending tokens within an expert is exactly the CPU order, so the result
//              is deterministic and bitwise equal. (Shards over 8192 experts add a one-block
//              offsets scan and read offsets from global memory.)
// Inputs must be valid (ids in range, no duplicate expert within a token): the engine checks.
#ifndef MOE_KERNELS_CUDA_DISPATCH_H_
#define MOE_KERNELS_CUDA_DISPATCH_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe::kernels {

// Scratch bytes LaunchDispatch needs for `num_tokens` tokens and `expert_count` local experts
// (bitmap, tile counts and tile bases).
size_t DispatchWorkspaceBytes(int64_t num_tokens, int32_t expert_count);

// counts [expert_count], offsets [expert_count + 1], entries [num_tokens * top_k] (only the
// first offsets[expert_count] are written), slot_of [num_tokens * top_k]. num_tokens * top_k
// must fit in int32. `workspace` is 256-byte aligned, at least DispatchWorkspaceBytes.
cudaError_t LaunchDispatch(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                           int32_t expert_first, int32_t expert_count, int32_t* counts,
                           int32_t* offsets, int32_t* entries, int32_t* slot_of, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_DISPATCH_H_
