// MoEBlaze dispatch on the GPU: the structures of kernels/cpu/dispatch.h, bitwise equal to
// DispatchCpu, built without atomics and without sorting.
//
// Default path (tile ranks; shards of at most 256 experts), two launches:
//   1. rank   one block per tile of tokens, processed in sub-tiles of 32 * warps tokens; each
//             warp owns 32 consecutive token rows and builds their token x expert bitmap words
//             in shared memory from ballots alone (one per bit of the expert id, per k: lane j
//             assembles the words of experts j, j + 32, ...; no __match_any_sync, no atomics).
//             A thread (a warp when there are 32 words) per expert scans the popcounts of the
//             sub-tile's words (the expert's tokens in earlier words and sub-tiles of the tile);
//             each (t,k) then gets its rank
//             among the expert's tokens of the tile = that prefix + set bits below the token in
//             its word, written into slot_of[t*K+k] (the output doubles as scratch: -1 for ids
//             outside the shard). The per-(expert, tile) counts go to the workspace.
//   2. place  one block per tile again: warp reductions over the tile counts give each expert
//             its total and its tokens in earlier tiles, a block scan the offsets (block 0
//             publishes counts and offsets); then, over the tile's (t,k) in memory order,
//             slot = offsets[e] + earlier tiles + rank, written to slot_of[t*K+k]. Entry t*K+k
//             goes to that slot either directly (small tiles) or, staged (large tiles), first
//             to shared memory, grouped by expert in rank order, from where the block copies
//             the tile's runs out flat, so that consecutive threads store consecutive slots.
//             Ascending tokens within an expert is exactly the CPU order, so the result is
//             deterministic and bitwise equal.
//   Large tiles also launch both kernels as programmatic dependent launches: each is set up
//   while the kernel before it drains and waits (griddepcontrol.wait) before touching memory.
//   Nothing of size E x T goes through device memory (the bitmap lives in shared memory only),
//   and with staging every global read and write is coalesced.
//   On an H100 it is 2-4x faster than the CUB radix sort on the small presets (scale-8k, olmoe,
//   deepseek-v3) and about 2x at 128k to 2M tokens with staging and PDL (bench/dispatch_bench.cc
//   measures both).
//
// Legacy path (the first version; shards over 256 experts, or DispatchConfig::legacy), two or
// three launches:
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
//              entry. (Shards over 8192 experts add a one-block offsets scan and read offsets
//              from global memory.)
// Inputs must be valid (ids in range, no duplicate expert within a token): the engine checks.
#ifndef MOE_KERNELS_CUDA_DISPATCH_H_
#define MOE_KERNELS_CUDA_DISPATCH_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe::kernels {

// Tiling of the default path; zero fields are filled by DispatchHeuristic. Exposed so that the
// benchmark can sweep tilings and compare with the legacy path in one run.
struct DispatchConfig {
  int warps_per_tile = 0;  // 4, 8, 16 or 32 (32 only for shards of at most 128 experts):
                           // a sub-tile is 32 * warps_per_tile tokens
  int64_t tile_cells = 0;  // bound on tiles x experts: what each place block reads
  bool legacy = false;     // the global-bitmap path (always taken above 256 experts)
  // Default-path options, each 0 = heuristic (on for tiles of at least 4096 (t,k)), 1 = off,
  // 2 = on (so that the benchmark can A/B them in one run); other values are refused:
  //   pdl     both launches are programmatic dependent launches (cudaLaunchKernelEx with
  //           programmatic stream serialization): a launch is set up while the kernel before
  //           it drains, and waits (griddepcontrol.wait) before touching memory.
  //   staged  the place pass stages the tile's entries in shared memory grouped by expert and
  //           writes each expert's run contiguously (coalesced stores) instead of scattering
  //           them; tiles too large for the staging buffer scatter as before.
  int pdl = 0;
  int staged = 0;
};

// The tiling LaunchDispatch uses when given no config.
DispatchConfig DispatchHeuristic(int64_t num_tokens, int32_t top_k, int32_t expert_count);

// Scratch bytes LaunchDispatch needs for `num_tokens` tokens and `expert_count` local experts,
// for the default path (first form, any tiling) or the given config.
size_t DispatchWorkspaceBytes(int64_t num_tokens, int32_t expert_count);
size_t DispatchWorkspaceBytes(int64_t num_tokens, int32_t expert_count,
                              const DispatchConfig& config);

// counts [expert_count], offsets [expert_count + 1], entries [num_tokens * top_k] (only the
// first offsets[expert_count] are written), slot_of [num_tokens * top_k]. num_tokens * top_k
// must fit in int32. `workspace` is 256-byte aligned, at least DispatchWorkspaceBytes.
// Returns cudaErrorInvalidValue for bad sizes or an unsupported config.
cudaError_t LaunchDispatch(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                           int32_t expert_first, int32_t expert_count, int32_t* counts,
                           int32_t* offsets, int32_t* entries, int32_t* slot_of, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);
cudaError_t LaunchDispatch(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                           int32_t expert_first, int32_t expert_count, int32_t* counts,
                           int32_t* offsets, int32_t* entries, int32_t* slot_of,
                           const DispatchConfig& config, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_DISPATCH_H_
