// MoEBlaze dispatch kernels (see dispatch.h for the algorithm and its invariants).
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/dispatch.h"

namespace moe::kernels {
namespace {

constexpr int kWarps = 32;                // warps per block = 32-token words per tile
constexpr int kTileTokens = kWarps * 32;  // 1024 tokens per tile
constexpr int kExpertChunk = 256;         // experts held in shared memory at a time
constexpr int kScanThreads = 1024;
constexpr int kScanItems = 4;
constexpr int kExpertScanThreads = 256;
constexpr int kSharedOffsetExperts = 8192;  // 32 KiB of shared memory in the write kernel
constexpr int kFusedScanExperts = 2048;     // 3 arrays of 2048 ints: 24 KiB of shared memory
constexpr int64_t kFusedScanCells = 16384;  // tile counts each block of the fused path reads

int64_t NumTiles(int64_t num_tokens) { return (num_tokens + kTileTokens - 1) / kTileTokens; }

size_t AlignUp(size_t v) { return (v + 255) & ~size_t{255}; }

// Programmatic dependent launch (sm_90+). Wait: block until the grids this one depends on
// have finished and their writes are visible; a no-op for a kernel launched the usual way.
// Allow: let the next grid, if launched as a dependent, be scheduled now; it still waits for
// this whole grid before touching memory, so calling this early is safe.
__device__ __forceinline__ void PdlWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void PdlAllowNext() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Phase 1: bitmap words and per-(expert, tile) counts. bits is expert-major:
// bits[e * W + word], W = num_tiles * 32 words; bit b of a word is token word*32 + b.
__global__ void __launch_bounds__(kTileTokens)
    dispatch_bitmap_kernel(const int32_t* __restrict__ ids, int64_t num_tokens, int top_k,
                           int first, int count, int64_t num_tiles, uint32_t* __restrict__ bits,
                           uint16_t* __restrict__ word_prefix, int32_t* __restrict__ tile_counts,
                           int32_t* __restrict__ slot_of) {
  __shared__ uint32_t words[kExpertChunk][kWarps + 1];  // +1: lanes of a warp hit distinct banks
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t tile = blockIdx.x;
  const int64_t t = (tile * kWarps + warp) * 32 + lane;
  const bool valid = t < num_tokens;
  const int32_t* my_ids = ids + t * top_k;
  if (valid) {
    for (int k = 0; k < top_k; ++k) {
      const int e = my_ids[k] - first;
      if (e < 0 || e >= count) slot_of[t * top_k + k] = -1;
    }
  }
  const int64_t num_words = num_tiles * kWarps;
  for (int c0 = 0; c0 < count; c0 += kExpertChunk) {
    const int cn = min(kExpertChunk, count - c0);
    for (int e = lane; e < cn; e += 32) words[e][warp] = 0;
    __syncwarp();
    for (int k = 0; k < top_k; ++k) {
      const int e = valid ? my_ids[k] - first - c0 : -1;
      const bool mine = e >= 0 && e < cn;
      const unsigned active = __ballot_sync(0xffffffffu, mine);
      if (mine) {
        // Lanes naming the same expert in this k: the lowest one writes the word. An expert
        // appears at most once per token, so different k never set the same bit.
        const unsigned same = __match_any_sync(active, e);
        if (lane == __ffs(same) - 1) words[e][warp] |= same;
      }
      __syncwarp();
    }
    __syncthreads();
    // Warp w publishes experts w, w+32, ...: lane = word within the tile (coalesced stores).
    // The warp's scan of popcounts gives each word the number of the expert's tokens in the
    // tile's earlier words; its total is the (expert, tile) count.
    for (int e = warp; e < cn; e += kWarps) {
      const uint32_t b = words[e][lane];
      const int c = __popc(b);
      int incl = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      const int64_t at = static_cast<int64_t>(c0 + e) * num_words + tile * kWarps + lane;
      bits[at] = b;
      word_prefix[at] = static_cast<uint16_t>(incl - c);
      if (lane == 31) tile_counts[static_cast<int64_t>(c0 + e) * num_tiles + tile] = incl;
    }
    __syncthreads();
  }
}

// Exclusive scan of in[0, n) into out by one block (blockDim.x = kScanThreads), in chunks of
// kScanThreads * kScanItems with a running carry; returns the total to every thread.
__device__ int32_t BlockExclusiveScan(const int32_t* __restrict__ in, int64_t n,
                                      int32_t* __restrict__ out) {
  __shared__ int32_t warp_sums[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  int32_t carry = 0;
  for (int64_t base = 0; base < n; base += static_cast<int64_t>(blockDim.x) * kScanItems) {
    const int64_t i0 = base + static_cast<int64_t>(threadIdx.x) * kScanItems;
    int32_t v[kScanItems];
    int32_t local = 0;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      v[j] = i0 + j < n ? in[i0 + j] : 0;
      local += v[j];
    }
    int32_t incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int32_t w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      warp_sums[lane] = w;
    }
    __syncthreads();
    int32_t excl = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + incl - local;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      if (i0 + j < n) out[i0 + j] = excl;
      excl += v[j];
    }
    carry += warp_sums[31];
    __syncthreads();  // warp_sums is rewritten by the next chunk
  }
  return carry;
}

// Phase 2a: one block per expert scans that expert's tile counts, so tile_base[e][tile] is
// the expert's tokens in earlier tiles, and counts[e] its total. Experts run in parallel.
__global__ void __launch_bounds__(kExpertScanThreads)
    dispatch_expert_scan_kernel(const int32_t* __restrict__ tile_counts, int64_t num_tiles,
                                int32_t* __restrict__ tile_base, int32_t* __restrict__ counts) {
  const int64_t e = blockIdx.x;
  const int32_t total =
      BlockExclusiveScan(tile_counts + e * num_tiles, num_tiles, tile_base + e * num_tiles);
  if (threadIdx.x == 0) counts[e] = total;
}

// Phase 2b: one block, offsets = exclusive scan of the per-expert counts.
__global__ void __launch_bounds__(kScanThreads)
    dispatch_offsets_kernel(const int32_t* __restrict__ counts, int count,
                            int32_t* __restrict__ offsets) {
  const int32_t total = BlockExclusiveScan(counts, count, offsets);
  if (threadIdx.x == 0) offsets[count] = total;
}

// Phase 3: the warp that owns a token row places each of its (t,k): slot = offsets[e] + the
// expert's tokens in earlier tiles + in earlier words of this tile + set bits below this lane
// in its own word. Every slot is written exactly once. Where the offsets come from:
//   kGlobalOffsets  offsets and per-tile bases from the scan kernels (very large shards);
//   kSharedOffsets  per-tile bases from the expert scan; each block scans the per-expert counts
//                   into shared memory itself (block 0 publishes offsets), saving a launch;
//   kFusedScan      small problems (count * tiles <= kFusedScanCells): each block also sums the
//                   tile counts itself (its earlier tiles and the totals, warp reductions in a
//                   fixed order), so the expert scan kernel is not launched at all; block 0
//                   publishes counts and offsets.
enum WriteMode { kGlobalOffsets = 0, kSharedOffsets = 1, kFusedScan = 2 };

template <int kMode>
__global__ void __launch_bounds__(kTileTokens)
    dispatch_write_kernel(const int32_t* __restrict__ ids, int64_t num_tokens, int top_k, int first,
                          int count, int64_t num_tiles, const uint32_t* __restrict__ bits,
                          const uint16_t* __restrict__ word_prefix,
                          const int32_t* __restrict__ tile_counts,
                          const int32_t* __restrict__ tile_base, int32_t* __restrict__ counts,
                          int32_t* __restrict__ offsets, int32_t* __restrict__ entries,
                          int32_t* __restrict__ slot_of) {
  extern __shared__ int32_t shared[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t tile = blockIdx.x;
  const int32_t* off = offsets;
  if constexpr (kMode == kSharedOffsets) {
    const int32_t total = BlockExclusiveScan(counts, count, shared);
    if (blockIdx.x == 0) {
      for (int e = threadIdx.x; e < count; e += blockDim.x) offsets[e] = shared[e];
      if (threadIdx.x == 0) offsets[count] = total;
    }
    __syncthreads();
    off = shared;
  }
  int32_t* tile_off = nullptr;  // kFusedScan: the expert's tokens in earlier tiles
  if constexpr (kMode == kFusedScan) {
    int32_t* totals = shared;
    int32_t* shared_off = shared + count;
    tile_off = shared + 2 * count;
    for (int e = warp; e < count; e += kWarps) {
      int32_t before = 0, total = 0;
      for (int64_t i = lane; i < num_tiles; i += 32) {
        const int32_t v = tile_counts[static_cast<int64_t>(e) * num_tiles + i];
        total += v;
        if (i < tile) before += v;
      }
      before = __reduce_add_sync(0xffffffffu, before);
      total = __reduce_add_sync(0xffffffffu, total);
      if (lane == 0) {
        totals[e] = total;
        tile_off[e] = before;
      }
    }
    __syncthreads();
    const int32_t all = BlockExclusiveScan(totals, count, shared_off);
    if (blockIdx.x == 0) {
      for (int e = threadIdx.x; e < count; e += blockDim.x) {
        counts[e] = totals[e];
        offsets[e] = shared_off[e];
      }
      if (threadIdx.x == 0) offsets[count] = all;
    }
    __syncthreads();
    off = shared_off;
  }
  const int64_t word = tile * kWarps + warp;
  const int64_t t = word * 32 + lane;
  if (t >= num_tokens) return;
  const int64_t num_words = num_tiles * kWarps;
  const uint32_t below = (1u << lane) - 1u;
  constexpr int kIdsAtOnce = 8;  // independent loads in flight per lane
  for (int k0 = 0; k0 < top_k; k0 += kIdsAtOnce) {
    int e[kIdsAtOnce];
#pragma unroll
    for (int j = 0; j < kIdsAtOnce; ++j)
      e[j] = k0 + j < top_k ? ids[t * top_k + k0 + j] - first : -1;
#pragma unroll
    for (int j = 0; j < kIdsAtOnce; ++j) {
      if (e[j] < 0 || e[j] >= count) continue;
      const int64_t at = static_cast<int64_t>(e[j]) * num_words + word;
      int32_t base;
      if constexpr (kMode == kFusedScan) {
        base = tile_off[e[j]];
      } else {
        base = tile_base[static_cast<int64_t>(e[j]) * num_tiles + tile];
      }
      const int32_t pos = off[e[j]] + base + word_prefix[at] + __popc(bits[at] & below);
      const int32_t entry = static_cast<int32_t>(t * top_k + k0 + j);
      entries[pos] = entry;
      slot_of[entry] = pos;
    }
  }
}

// ---- Default path: tile ranks (see dispatch.h). ----

constexpr int kRankMaxExperts = 256;  // shards up to this size take the default path
constexpr int kPlaceThreads = 1024;
constexpr int kMinRankTokens = 128;  // smallest sub-tile (4 warps): bounds the tile count
// Largest staging buffer of the place pass (tile_tokens * top_k ints): 24576 (t,k) per tile,
// leaving room on the SM for a rank block of the next dispatch.
constexpr size_t kMaxStageBytes = 96 * 1024;

// Shared memory of the rank kernel is words + prefixes for every expert, (warps + 1) columns
// each (+1: a warp's lanes reading one column for different experts hit distinct banks); 32
// warps fit the 48 KiB static limit only with 128 experts.
__host__ __device__ constexpr int RankMaxExperts(int warps) {
  return warps >= 32 ? 128 : kRankMaxExperts;
}

template <int kW>
__global__ void __launch_bounds__(kW * 32)
    dispatch_rank_kernel(const int32_t* __restrict__ ids, int64_t num_tokens, int top_k, int first,
                         int count, int64_t tile_tokens, int64_t num_tiles,
                         int32_t* __restrict__ tile_counts, int32_t* __restrict__ slot_of) {
  constexpr int kMaxE = RankMaxExperts(kW);
  constexpr int kThreads = kW * 32;
  __shared__ uint32_t words[kMaxE][kW + 1];
  __shared__ int32_t prefix[kMaxE][kW + 1];
  __shared__ int32_t running[kMaxE];  // the expert's tokens in the tile's earlier sub-tiles
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t tile = blockIdx.x;
  const int64_t begin = tile * tile_tokens;
  const int64_t end = min(num_tokens, begin + tile_tokens);
  // The kernel before may still be writing ids (the router) or reading slot_of (the last
  // dispatch's place pass): nothing is touched before the wait.
  PdlWait();
  PdlAllowNext();
  // running[] is next read after the first sub-tile's __syncthreads.
  for (int e = threadIdx.x; e < count; e += kThreads) running[e] = 0;
  const uint32_t below = (1u << lane) - 1u;
  // Bits that name a local expert (0 for a one-expert shard).
  const int nbits = count <= 1 ? 0 : 32 - __clz(count - 1);
  for (int64_t sub = begin; sub < end; sub += kThreads) {
    const int64_t t = sub + warp * 32 + lane;
    const bool valid = t < end;
    const int32_t* my_ids = ids + t * top_k;
    // The warp's bitmap words, bit-sliced: per k, one ballot per bit of the expert id (and one
    // for "in the shard"); lane j then assembles the words of experts j, j + 32, ... as the AND
    // of those ballots or their complements. An expert appears at most once per token, so
    // different k never set the same bit. (Ballots only: __match_any_sync, the obvious way,
    // measured several times slower here, as it serialises within the SM.)
    uint32_t acc[kMaxE / 32];
#pragma unroll
    for (int c = 0; c < kMaxE / 32; ++c) acc[c] = 0;
    for (int k = 0; k < top_k; ++k) {
      const int e = valid ? __ldg(my_ids + k) - first : -1;
      const bool mine = e >= 0 && e < count;
      const uint32_t in_shard = __ballot_sync(0xffffffffu, mine);
      if (in_shard == 0) continue;  // warp-uniform
      uint32_t slice[8];            // slice[b]: lanes whose expert has bit b set
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        slice[b] = b < nbits ? __ballot_sync(0xffffffffu, mine && ((e >> b) & 1)) : 0u;
      }
#pragma unroll
      for (int c = 0; c < kMaxE / 32; ++c) {
        const int ex = c * 32 + lane;
        uint32_t w = in_shard;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          if (b < nbits) w &= ((ex >> b) & 1) ? slice[b] : ~slice[b];
        }
        acc[c] |= w;
      }
    }
#pragma unroll
    for (int c = 0; c < kMaxE / 32; ++c) {
      const int ex = c * 32 + lane;
      // Rows from count up are never read (and may alias a real expert's low bits).
      if (ex < count) words[ex][warp] = acc[c];
    }
    __syncthreads();
    if constexpr (kW == 32) {
      // Warp per expert, lane = word: a shuffle scan of the popcounts.
      for (int e = warp; e < count; e += kW) {
        const int32_t before = running[e];
        const int32_t c = __popc(words[e][lane]);
        int32_t incl = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int32_t y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        prefix[e][lane] = before + incl - c;
        __syncwarp();
        if (lane == 31) running[e] = before + incl;
      }
    } else {
      // Thread per expert, over the few words of the sub-tile.
      for (int e = threadIdx.x; e < count; e += kThreads) {
        int32_t acc_e = running[e];
#pragma unroll
        for (int w = 0; w < kW; ++w) {
          prefix[e][w] = acc_e;
          acc_e += __popc(words[e][w]);
        }
        running[e] = acc_e;
      }
    }
    __syncthreads();
    if (valid) {
      for (int k = 0; k < top_k; ++k) {
        const int e = __ldg(my_ids + k) - first;
        int32_t rank = -1;  // outside the shard: final value, the place pass skips it
        if (e >= 0 && e < count) rank = prefix[e][warp] + __popc(words[e][warp] & below);
        slot_of[t * top_k + k] = rank;
      }
    }
    __syncthreads();  // the next sub-tile rewrites words and prefix
  }
  // The last sub-tile's scan wrote running[] before its closing __syncthreads.
  for (int e = threadIdx.x; e < count; e += kThreads) {
    tile_counts[static_cast<int64_t>(e) * num_tiles + tile] = running[e];
  }
}

// kStaged: the tile's entries go first to shared memory (dynamic, tile_tokens * top_k ints),
// grouped by expert (expert e's run starts at local[e], the exclusive scan of the tile's
// per-expert counts) in rank order; then the block copies that buffer out flat, position i
// belonging to the last expert whose local start is <= i, so consecutive threads store
// consecutive slots of one expert's run: whole lines instead of one sector per store.
template <bool kStaged>
__global__ void __launch_bounds__(kPlaceThreads)
    dispatch_place_kernel(const int32_t* __restrict__ ids, int64_t num_tokens, int top_k, int first,
                          int count, int64_t tile_tokens, int64_t num_tiles,
                          const int32_t* __restrict__ tile_counts, int32_t* __restrict__ counts,
                          int32_t* __restrict__ offsets, int32_t* __restrict__ entries,
                          int32_t* __restrict__ slot_of) {
  __shared__ int32_t totals[kRankMaxExperts], before[kRankMaxExperts], base[kRankMaxExperts];
  __shared__ int32_t local[kStaged ? kRankMaxExperts + 1 : 1];
  extern __shared__ int32_t stage[];
  constexpr int kWarpsHere = kPlaceThreads / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t tile = blockIdx.x;
  PdlWait();  // tile_counts and slot_of come from the rank pass
  PdlAllowNext();
  // Per expert: its total and its tokens in earlier tiles, by warp reductions in a fixed order.
  for (int e = warp; e < count; e += kWarpsHere) {
    const int32_t* row = tile_counts + static_cast<int64_t>(e) * num_tiles;
    int32_t b = 0, total = 0;
    for (int64_t j = lane; j < num_tiles; j += 32) {
      const int32_t v = row[j];
      total += v;
      if (j < tile) b += v;
    }
    b = __reduce_add_sync(0xffffffffu, b);
    total = __reduce_add_sync(0xffffffffu, total);
    if (lane == 0) {
      totals[e] = total;
      before[e] = b;
    }
  }
  __syncthreads();
  const int32_t all = BlockExclusiveScan(totals, count, base);  // base = offsets for now
  for (int e = threadIdx.x; e < count; e += kPlaceThreads) {
    if (blockIdx.x == 0) {
      counts[e] = totals[e];
      offsets[e] = base[e];
    }
    base[e] += before[e];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) offsets[count] = all;
  __syncthreads();
  const int64_t i0 = tile * tile_tokens * top_k;
  const int64_t i1 = min(num_tokens, (tile + 1) * tile_tokens) * top_k;
  constexpr int kUnroll = 4;
  if constexpr (kStaged) {
    // totals[] is free again: reuse it for the tile's own per-expert counts.
    __syncthreads();
    for (int e = threadIdx.x; e < count; e += kPlaceThreads) {
      totals[e] = tile_counts[static_cast<int64_t>(e) * num_tiles + tile];
    }
    __syncthreads();
    const int32_t routed = BlockExclusiveScan(totals, count, local);
    if (threadIdx.x == 0) local[count] = routed;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += kUnroll * kPlaceThreads) {
      int32_t e[kUnroll], rank[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t at = i + j * kPlaceThreads;
        e[j] = at < i1 ? __ldg(ids + at) - first : -1;
        rank[j] = at < i1 ? slot_of[at] : -1;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (e[j] < 0 || e[j] >= count) continue;
        const int64_t at = i + j * kPlaceThreads;
        stage[local[e[j]] + rank[j]] = static_cast<int32_t>(at);
        slot_of[at] = base[e[j]] + rank[j];
      }
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < routed; i += kPlaceThreads) {
      // Last e with local[e] <= i (empty experts share their start with the next one, and
      // the search lands on the non-empty expert that owns i).
      int lo = 0, hi = count - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (local[mid] <= i) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      entries[base[lo] + (i - local[lo])] = stage[i];
    }
  } else {
    // The tile's (t,k) in memory order: coalesced ids and slot_of; 4 independent loads in
    // flight per thread before the dependent stores.
    for (int64_t i = i0 + threadIdx.x; i < i1; i += kUnroll * kPlaceThreads) {
      int32_t e[kUnroll], rank[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t at = i + j * kPlaceThreads;
        e[j] = at < i1 ? __ldg(ids + at) - first : -1;
        rank[j] = at < i1 ? slot_of[at] : -1;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (e[j] < 0 || e[j] >= count) continue;  // outside the shard: slot_of is already -1
        const int64_t at = i + j * kPlaceThreads;
        const int32_t pos = base[e[j]] + rank[j];
        entries[pos] = static_cast<int32_t>(at);
        slot_of[at] = pos;
      }
    }
  }
}

struct RankTiling {
  int warps;
  int64_t tile_tokens, tiles;
};

RankTiling MakeTiling(int64_t num_tokens, int32_t expert_count, const DispatchConfig& c) {
  const int64_t sub = 32 * c.warps_per_tile;
  const int64_t subtiles = (num_tokens + sub - 1) / sub;
  const int64_t max_tiles = std::max<int64_t>(1, c.tile_cells / expert_count);
  const int64_t per_tile = (subtiles + max_tiles - 1) / max_tiles;
  const int64_t tile_tokens = std::max<int64_t>(1, per_tile) * sub;
  return {c.warps_per_tile, tile_tokens, (num_tokens + tile_tokens - 1) / tile_tokens};
}

size_t RankWorkspaceBytes(int64_t num_tokens, int32_t expert_count) {
  // The most tiles any tiling makes: one per smallest sub-tile.
  const int64_t tiles = (num_tokens + kMinRankTokens - 1) / kMinRankTokens;
  return AlignUp(static_cast<size_t>(expert_count) * std::max<int64_t>(tiles, 1) * 4);
}

size_t LegacyWorkspaceBytes(int64_t num_tokens, int32_t expert_count) {
  const int64_t tiles = NumTiles(num_tokens);
  const size_t bits = static_cast<size_t>(expert_count) * tiles * kWarps * sizeof(uint32_t);
  const size_t prefix = static_cast<size_t>(expert_count) * tiles * kWarps * sizeof(uint16_t);
  const size_t per_tile = static_cast<size_t>(expert_count) * tiles * sizeof(int32_t);
  return AlignUp(bits) + AlignUp(prefix) + 2 * AlignUp(per_tile);
}

bool UsesLegacy(int32_t expert_count, const DispatchConfig& c) {
  return c.legacy || expert_count > kRankMaxExperts;
}

cudaError_t LaunchRank(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                       int32_t expert_first, int32_t expert_count, int32_t* counts,
                       int32_t* offsets, int32_t* entries, int32_t* slot_of,
                       const DispatchConfig& config, void* workspace, cudaStream_t stream) {
  if (expert_count > RankMaxExperts(config.warps_per_tile) || config.tile_cells < 1 ||
      config.pdl < 1 || config.pdl > 2 || config.staged < 1 || config.staged > 2) {
    return cudaErrorInvalidValue;
  }
  const RankTiling tiling = MakeTiling(num_tokens, expert_count, config);
  auto* tile_counts = static_cast<int32_t*>(workspace);
  const unsigned grid = static_cast<unsigned>(tiling.tiles);
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t launch = {};
  launch.gridDim = dim3(grid);
  launch.stream = stream;
  launch.attrs = config.pdl == 2 ? pdl : nullptr;
  launch.numAttrs = config.pdl == 2 ? 1 : 0;
  cudaError_t err = cudaErrorInvalidValue;
  switch (config.warps_per_tile) {
#define MOE_RANK_CASE(W)                                                                       \
  case W:                                                                                      \
    launch.blockDim = dim3(W * 32);                                                            \
    err = cudaLaunchKernelEx(&launch, dispatch_rank_kernel<W>, expert_ids, num_tokens,         \
                             static_cast<int>(top_k), static_cast<int>(expert_first),          \
                             static_cast<int>(expert_count), tiling.tile_tokens, tiling.tiles, \
                             tile_counts, slot_of);                                            \
    break;
    MOE_RANK_CASE(4)
    MOE_RANK_CASE(8)
    MOE_RANK_CASE(16)
    MOE_RANK_CASE(32)
#undef MOE_RANK_CASE
    default:  // no such sub-tile
      return cudaErrorInvalidValue;
  }
  if (err != cudaSuccess) return err;
  if (err = cudaGetLastError(); err != cudaSuccess) return err;
  // Staging needs the tile's (t,k) in shared memory; larger tiles scatter directly.
  const size_t stage_bytes = static_cast<size_t>(tiling.tile_tokens) * top_k * sizeof(int32_t);
  const bool staged = config.staged == 2 && stage_bytes <= kMaxStageBytes;
  launch.blockDim = dim3(kPlaceThreads);
  launch.dynamicSmemBytes = staged ? stage_bytes : 0;
  if (staged) {
    if (stage_bytes > 48 * 1024) {
      err = cudaFuncSetAttribute(dispatch_place_kernel<true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(kMaxStageBytes));
      if (err != cudaSuccess) return err;
    }
    err = cudaLaunchKernelEx(
        &launch, dispatch_place_kernel<true>, expert_ids, num_tokens, static_cast<int>(top_k),
        static_cast<int>(expert_first), static_cast<int>(expert_count), tiling.tile_tokens,
        tiling.tiles, static_cast<const int32_t*>(tile_counts), counts, offsets, entries, slot_of);
  } else {
    err = cudaLaunchKernelEx(
        &launch, dispatch_place_kernel<false>, expert_ids, num_tokens, static_cast<int>(top_k),
        static_cast<int>(expert_first), static_cast<int>(expert_count), tiling.tile_tokens,
        tiling.tiles, static_cast<const int32_t*>(tile_counts), counts, offsets, entries, slot_of);
  }
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

cudaError_t LaunchLegacy(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                         int32_t expert_first, int32_t expert_count, int32_t* counts,
                         int32_t* offsets, int32_t* entries, int32_t* slot_of, void* workspace,
                         cudaStream_t stream) {
  const int64_t tiles = NumTiles(num_tokens);
  const size_t bits_bytes = static_cast<size_t>(expert_count) * tiles * kWarps * sizeof(uint32_t);
  const size_t prefix_bytes = static_cast<size_t>(expert_count) * tiles * kWarps * sizeof(uint16_t);
  const size_t per_tile = static_cast<size_t>(expert_count) * tiles * sizeof(int32_t);
  char* ws = static_cast<char*>(workspace);
  auto* bits = reinterpret_cast<uint32_t*>(ws);
  ws += AlignUp(bits_bytes);
  auto* word_prefix = reinterpret_cast<uint16_t*>(ws);
  ws += AlignUp(prefix_bytes);
  auto* tile_counts = reinterpret_cast<int32_t*>(ws);
  auto* tile_base = reinterpret_cast<int32_t*>(ws + AlignUp(per_tile));
  if (tiles > 0) {
    dispatch_bitmap_kernel<<<static_cast<unsigned>(tiles), kTileTokens, 0, stream>>>(
        expert_ids, num_tokens, top_k, expert_first, expert_count, tiles, bits, word_prefix,
        tile_counts, slot_of);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  if (tiles == 0) {  // no tokens: every expert is empty
    if (cudaError_t err = cudaMemsetAsync(counts, 0, expert_count * sizeof(int32_t), stream);
        err != cudaSuccess) {
      return err;
    }
    return cudaMemsetAsync(offsets, 0, (expert_count + 1) * sizeof(int32_t), stream);
  }
  const unsigned grid = static_cast<unsigned>(tiles);
  if (expert_count <= kFusedScanExperts && tiles * expert_count <= kFusedScanCells) {
    dispatch_write_kernel<kFusedScan>
        <<<grid, kTileTokens, 3 * expert_count * sizeof(int32_t), stream>>>(
            expert_ids, num_tokens, top_k, expert_first, expert_count, tiles, bits, word_prefix,
            tile_counts, tile_base, counts, offsets, entries, slot_of);
    return cudaGetLastError();
  }
  dispatch_expert_scan_kernel<<<expert_count, kExpertScanThreads, 0, stream>>>(tile_counts, tiles,
                                                                               tile_base, counts);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (expert_count <= kSharedOffsetExperts) {
    dispatch_write_kernel<kSharedOffsets>
        <<<grid, kTileTokens, expert_count * sizeof(int32_t), stream>>>(
            expert_ids, num_tokens, top_k, expert_first, expert_count, tiles, bits, word_prefix,
            tile_counts, tile_base, counts, offsets, entries, slot_of);
    return cudaGetLastError();
  }
  dispatch_offsets_kernel<<<1, kScanThreads, 0, stream>>>(counts, expert_count, offsets);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  dispatch_write_kernel<kGlobalOffsets><<<grid, kTileTokens, 0, stream>>>(
      expert_ids, num_tokens, top_k, expert_first, expert_count, tiles, bits, word_prefix,
      tile_counts, tile_base, counts, offsets, entries, slot_of);
  return cudaGetLastError();
}
}  // namespace

DispatchConfig DispatchHeuristic(int64_t num_tokens, int32_t top_k, int32_t expert_count) {
  DispatchConfig c;
  if (expert_count > kRankMaxExperts) {
    c.legacy = true;
    return c;
  }
  // Enough blocks to fill the chip (132 SMs on an H100) with the largest sub-tile that has
  // them; the place pass reads tiles x experts counts per block, so those stay bounded.
  // Measured on an H100 (bench/dispatch_bench.cc --sweep): more tiles pay off at large T, where
  // the rank pass's sub-tile loop would otherwise be long, and cost little elsewhere.
  c.tile_cells = num_tokens >= (int64_t{1} << 20) ? 32768 : 16384;
  c.warps_per_tile = 4;
  for (int w : {32, 16, 8}) {
    if (expert_count > RankMaxExperts(w)) continue;
    if ((num_tokens + 32 * w - 1) / (32 * w) >= 100) {
      c.warps_per_tile = w;
      break;
    }
  }
  // Staged entries and PDL only for large tiles (at least 4096 (t,k) each): there both together
  // cut the dispatch by about a third on an H100, while on small tiles (512-1024 (t,k)) staging
  // costs up to 15% and PDL is slower on some presets (bench/dispatch_bench.cc --sweep).
  const int64_t tile_entries =
      expert_count < 1 ? 0 : MakeTiling(num_tokens, expert_count, c).tile_tokens * top_k;
  const bool large_tiles = tile_entries >= 4096;
  c.pdl = large_tiles ? 2 : 1;
  c.staged = large_tiles ? 2 : 1;
  return c;
}

size_t DispatchWorkspaceBytes(int64_t num_tokens, int32_t expert_count) {
  return DispatchWorkspaceBytes(num_tokens, expert_count, DispatchConfig{});
}

size_t DispatchWorkspaceBytes(int64_t num_tokens, int32_t expert_count,
                              const DispatchConfig& config) {
  return UsesLegacy(expert_count, config) ? LegacyWorkspaceBytes(num_tokens, expert_count)
                                          : RankWorkspaceBytes(num_tokens, expert_count);
}

cudaError_t LaunchDispatch(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                           int32_t expert_first, int32_t expert_count, int32_t* counts,
                           int32_t* offsets, int32_t* entries, int32_t* slot_of, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  return LaunchDispatch(expert_ids, num_tokens, top_k, expert_first, expert_count, counts, offsets,
                        entries, slot_of, DispatchConfig{}, workspace, workspace_bytes, stream);
}

cudaError_t LaunchDispatch(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                           int32_t expert_first, int32_t expert_count, int32_t* counts,
                           int32_t* offsets, int32_t* entries, int32_t* slot_of,
                           const DispatchConfig& config, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
  if (num_tokens < 0 || top_k < 1 || expert_count < 1 || num_tokens * top_k > int64_t{0x7fffffff}) {
    return cudaErrorInvalidValue;
  }
  if (workspace_bytes < DispatchWorkspaceBytes(num_tokens, expert_count, config)) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) {  // no tokens: every expert is empty
    if (cudaError_t err = cudaMemsetAsync(counts, 0, expert_count * sizeof(int32_t), stream);
        err != cudaSuccess) {
      return err;
    }
    return cudaMemsetAsync(offsets, 0, (expert_count + 1) * sizeof(int32_t), stream);
  }
  if (UsesLegacy(expert_count, config)) {
    return LaunchLegacy(expert_ids, num_tokens, top_k, expert_first, expert_count, counts, offsets,
                        entries, slot_of, workspace, stream);
  }
  DispatchConfig c = config;
  const DispatchConfig h = DispatchHeuristic(num_tokens, top_k, expert_count);
  if (c.warps_per_tile == 0) c.warps_per_tile = h.warps_per_tile;
  if (c.tile_cells == 0) c.tile_cells = h.tile_cells;
  if (c.pdl == 0) c.pdl = h.pdl;
  if (c.staged == 0) c.staged = h.staged;
  return LaunchRank(expert_ids, num_tokens, top_k, expert_first, expert_count, counts, offsets,
                    entries, slot_of, c, workspace, stream);
}

}  // namespace moe::kernels
