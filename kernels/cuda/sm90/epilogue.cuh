// The grouped GEMM's epilogues, from the fp32 accumulators of one warpgroup (64 rows of a tile)
// to global memory, staged through padded shared memory so that the global stores are 16-byte
// and row-contiguous (direct 4-byte stores from the fragments left the down-projection bound by
// the load/store queue):
//   kSwiGLU: B holds kN/2 rows of W1 then the same kN/2 rows of W3, so each thread owns H1 and
//     H3 of the same (row, column); it writes H = [H1 | H3] (bf16, kept for the backward) and
//     A = silu(H1) * H3 computed from the bf16-ROUNDED H, so a backward that recomputes A from H
//     gets bit-identical values.
//   kPlain: writes the row to Y[entries[slot]], i.e. each (token, k) row contiguously in
//     [T*K, n] order, so the combine is a contiguous per-token weighted sum; or, with kSlotOut,
//     to out[slot] (the backward's dA_u and dXg, which later stages read in slot order).
#ifndef MOE_KERNELS_CUDA_SM90_EPILOGUE_CUH_
#define MOE_KERNELS_CUDA_SM90_EPILOGUE_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/sm90/params.cuh"
#include "kernels/cuda/sm90/scheduler.cuh"

namespace moe::kernels::sm90 {

// Epilogue staging: each warpgroup stages 64 rows x one column chunk of its tile, rows padded
// by 16 bytes so that the fragment writes (8 rows x 4 column pairs per warp) and the 16-byte
// row reads are both free of bank conflicts. kSwiGLU chunks hold 32 columns each of H1, H3
// and A; kPlain chunks 64 columns of Y.
template <bool kSwiGLU>
__host__ __device__ constexpr int EpiChunkCols() {
  return kSwiGLU ? 32 : 64;
}
template <bool kSwiGLU>
__host__ __device__ constexpr int EpiRowBytes() {
  return (kSwiGLU ? 3 : 1) * EpiChunkCols<kSwiGLU>() * 2 + 16;
}

// What the epilogue needs of the 4 rows a thread stores ((t_wg / 8) + 16 j of its warpgroup),
// read at the start of a tile so that the loads' latency hides behind the main loop: kPlain's
// destination row (entries[slot], or slot with kSlotOut). Rows past the tile's end keep zeros
// and are never stored.
struct EpiRows {
  int dst[4];
};

template <bool kSwiGLU, bool kSlotOut>
__device__ __forceinline__ EpiRows LoadEpiRows(const GemmParams& p, const TileInfo& ti,
                                               int first_row) {
  EpiRows rows = {};
  if constexpr (!kSwiGLU) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = first_row + 16 * j;
      if (r < ti.rows) {
        const int slot = ti.slot0 + r;
        rows.dst[j] = kSlotOut ? slot : p.entries[slot];
      }
    }
  }
  return rows;
}

// The epilogue of both kernels, for one warpgroup (64 rows of the tile, rows `row_group`*64
// on): registers -> padded staging (one column chunk at a time) -> 16-byte row-contiguous
// global stores. Direct 4-byte stores from the fragments left the down-projection throttled
// on the load/store queue with L2 at 83% of its peak (ncu). `rows`: see EpiRows. `bar_id`: the
// warpgroup's named barrier.
template <int kN, bool kSwiGLU>
__device__ __forceinline__ void StoreTile(const GemmParams& p, const TileInfo& ti,
                                          const float (&acc)[kN / 2], const EpiRows& rows,
                                          uint8_t* stage, int t_wg, int row_group, int bar_id) {
  constexpr int kBlockN = kSwiGLU ? kN / 2 : kN;
  const int wg = row_group;
  constexpr int kCols = EpiChunkCols<kSwiGLU>();
  constexpr int kRowBytes = EpiRowBytes<kSwiGLU>();
  const int lane = t_wg & 31;
  const int c_base = 2 * (lane & 3);
  const int rw = (t_wg >> 5) * 16 + (lane >> 2);  // fragment row within the warpgroup
  // A thread's 16-byte stores take the same pieces of the same rows in every column chunk;
  // only the column moves, by kCols. So their staging offsets, destinations and row guards are
  // worked out once a tile. Redone in each chunk, that arithmetic was half of the epilogue's
  // instructions (the compiler cannot hoist it past the "memory" clobbers of the bar.syncs), and
  // the up-projection runs a few percent faster without it.
  constexpr int kStores = kSwiGLU ? 6 : 4;  // 16-byte stores a thread makes per chunk
  const int n_dim = p.n_dim;
  __nv_bfloat16* dst[kStores];
  int staged[kStores];  // byte offset in the staging
  int col[kStores];     // output column in the first chunk
  bool row_ok[kStores];
#pragma unroll
  for (int j = 0; j < kStores; ++j) {
    int row, piece, col_piece;
    if constexpr (kSwiGLU) {
      // 64 rows x 12 pieces (4 of H1, 4 of H3, 4 of A), 6 per thread.
      const int q = t_wg + 128 * j;
      row = q / 12;
      piece = q - row * 12;
      col_piece = piece & 3;
    } else {
      // 64 rows x 8 pieces, 4 per thread; rows go to Y[entries[slot]] (rows.dst).
      row = (t_wg >> 3) + 16 * j;
      piece = t_wg & 7;
      col_piece = piece;
    }
    const int r = wg * 64 + row;
    row_ok[j] = r < ti.rows;
    col[j] = ti.n0 + col_piece * 8;
    staged[j] = row * kRowBytes + piece * 16;
    if constexpr (kSwiGLU) {
      const int64_t slot = ti.slot0 + r;
      dst[j] =
          (piece < 8 ? p.out0 + slot * 2 * n_dim + (piece >> 2) * n_dim : p.out1 + slot * n_dim) +
          col[j];
    } else {
      dst[j] = p.out0 + static_cast<int64_t>(rows.dst[j]) * n_dim + col[j];
    }
  }
#pragma unroll
  for (int cc = 0; cc < kBlockN / kCols; ++cc) {
#pragma unroll
    for (int ii = 0; ii < kCols / 8; ++ii) {
      const int i = cc * (kCols / 8) + ii;  // n8 block of the accumulator
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        uint8_t* row = stage + (rw + 8 * hr) * kRowBytes + (8 * ii + c_base) * 2;
        const __nv_bfloat162 g =
            __floats2bfloat162_rn(acc[4 * i + 2 * hr], acc[4 * i + 2 * hr + 1]);
        *reinterpret_cast<__nv_bfloat162*>(row) = g;
        if constexpr (kSwiGLU) {
          const int iu = i + kN / 16;  // the matching W3 column block
          const __nv_bfloat162 u =
              __floats2bfloat162_rn(acc[4 * iu + 2 * hr], acc[4 * iu + 2 * hr + 1]);
          const float2 gf = __bfloat1622float2(g);
          const float2 uf = __bfloat1622float2(u);
          *reinterpret_cast<__nv_bfloat162*>(row + kCols * 2) = u;
          *reinterpret_cast<__nv_bfloat162*>(row + kCols * 4) =
              __floats2bfloat162_rn(detail::Act<detail::kActSwiGLU>(gf.x) * uf.x,
                                    detail::Act<detail::kActSwiGLU>(gf.y) * uf.y);
        }
      }
    }
    asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory");
#pragma unroll
    for (int j = 0; j < kStores; ++j) {
      if (row_ok[j] && col[j] + cc * kCols < n_dim) {
        *reinterpret_cast<uint4*>(dst[j] + cc * kCols) =
            *reinterpret_cast<const uint4*>(stage + staged[j]);
      }
    }
    asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory");
  }
}

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_EPILOGUE_CUH_
