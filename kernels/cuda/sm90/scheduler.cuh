// The persistent tile scheduler of the grouped GEMM: how a tile number becomes (expert, row
// block, column block), and the per-expert row-block prefix every CTA builds first.
//
// One launch covers every expert however the tokens are spread: each CTA walks tile numbers
// from blockIdx.x in steps of gridDim.x. Tiles are numbered expert-major and, inside an expert,
// in bands of group_m row blocks whose tiles run column by column, so the CTAs running at one
// time share a band's rows and a few weight column blocks in L2 (weights larger than L2 then
// stream from memory once per band instead of once per row block).
#ifndef MOE_KERNELS_CUDA_SM90_SCHEDULER_CUH_
#define MOE_KERNELS_CUDA_SM90_SCHEDULER_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::kernels::sm90 {

// One output tile: expert, its first row (relative to the expert), how many of its 128 rows
// exist, the slot (position in `entries`) of its first row, and its first output column.
struct TileInfo {
  int expert;
  int rows;
  int slot0;
  int n0;
};

// Tiles are numbered expert-major. Within an expert, row blocks go in bands of `group_m`, and
// a band's tiles run column block by column block (rows fastest): the CTAs running at one time
// then share a band's gathered rows AND a few weight column blocks in L2, so an expert whose
// weights exceed L2 (mixtral, deepseek-v3) is streamed from memory once per band instead of
// once per row block. `prefix[e]` = row blocks of experts before e; `offs` = dispatch offsets.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ TileInfo DecodeTile(int tile, int n_tiles, int group_m,
                                               const int* prefix, const int* offs,
                                               int num_experts) {
  const int mt = tile / n_tiles;
  int lo = 0, hi = num_experts;  // largest e with prefix[e] <= mt; empty experts are skipped
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (prefix[mid] <= mt)
      lo = mid;
    else
      hi = mid;
  }
  const int local = tile - prefix[lo] * n_tiles;
  const int row_blocks = prefix[lo + 1] - prefix[lo];
  const int band = local / (group_m * n_tiles);
  const int band_m0 = band * group_m;
  const int band_rows = min(group_m, row_blocks - band_m0);
  const int rem = local - band * group_m * n_tiles;
  const int nt = rem / band_rows;
  const int m0 = (band_m0 + (rem - nt * band_rows)) * kBlockM;
  const int count = offs[lo + 1] - offs[lo];
  TileInfo ti;
  ti.expert = lo;
  ti.rows = min(kBlockM, count - m0);
  ti.slot0 = offs[lo] + m0;
  ti.n0 = nt * kBlockN;
  return ti;
}

// Phase 0 of both kernels: offsets cached in shared memory and, by warp 0, the exclusive
// prefix of 128-row blocks per expert. The caller's __syncthreads publishes them.
template <int kBlockM, int kThreads>
__device__ __forceinline__ void BuildTilePrefix(const int32_t* offsets, int num_experts,
                                                int* prefix, int* offs) {
  const int tid = threadIdx.x;
  for (int e = tid; e <= num_experts; e += kThreads) offs[e] = offsets[e];
  __syncthreads();
  if (tid < 32) {
    int carry = 0;
    if (tid == 0) prefix[0] = 0;
    for (int e0 = 0; e0 < num_experts; e0 += 32) {
      const int e = e0 + tid;
      int v = e < num_experts ? (offs[e + 1] - offs[e] + kBlockM - 1) / kBlockM : 0;
#pragma unroll
      for (int s = 1; s < 32; s <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, v, s);
        if (tid >= s) v += y;
      }
      if (e < num_experts) prefix[e + 1] = carry + v;
      carry += __shfl_sync(0xffffffffu, v, 31);
    }
  }
}

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_SCHEDULER_CUH_
