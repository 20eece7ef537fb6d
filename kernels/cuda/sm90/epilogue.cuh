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
//   kDSwiGLU (kPlain with kSlotOut): the backward's dA GEMM that never writes dA_u; from the
//     fp32 accumulators and the saved H it writes dH = [dH1 | dH3], pA = p * A and the row's
//     share of dp = <dA_u, A> (StoreSwiGLUBackwardTile).
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
// destination row (entries[slot], or slot with kSlotOut) and, for kDSwiGLU, the row's entry
// and routing weight. Rows past the tile's end keep zeros and are never stored.
struct EpiRows {
  int dst[4];
  int entry[4];
  float weight[4];
};

template <bool kSwiGLU, bool kSlotOut, bool kDSwiGLU>
__device__ __forceinline__ EpiRows LoadEpiRows(const GemmParams& p, const TileInfo& ti,
                                               int first_row) {
  EpiRows rows = {};
  if constexpr (!kSwiGLU) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = first_row + 16 * j;
      if (r < ti.rows) {
        const int slot = ti.slot0 + r;
        if constexpr (kDSwiGLU) {
          rows.entry[j] = p.entries[slot];
          rows.weight[j] = p.route_w[rows.entry[j]];
        }
        rows.dst[j] = kSlotOut ? slot : p.entries[slot];
      }
    }
  }
  return rows;
}

// The dA GEMM's epilogue with the SwiGLU backward in it (kDSwiGLU), for one warpgroup. The
// accumulators d = dA_u go through the staging 32 columns at a time as fp32 (so d is never
// rounded to bf16; 32 fp32 columns fill the same padded 144-byte rows as kPlain's 64 bf16
// ones), then each thread takes 4 consecutive columns of its 4 rows and writes
//   dH1 = p d H3 silu'(H1),  dH3 = p d silu(H1),  pA = p silu(H1) H3   (bf16)
// from the saved H, whose loads run one chunk ahead (issued before the previous chunk's math)
// so that their latency overlaps it; prefetching a tile's H into L2 as the tile starts measured
// slower on 4 of 5 presets (bench/results/2026-11-21-h100-fb-b2). d * A is summed per row in
// registers across the tile; the row's 8 threads combine their sums by a fixed shuffle tree,
// and one writes the tile's sum: straight to dp[entry] when a single column tile covers h
// (dp_part null), else to dp_part[column tile][slot] for the launcher's ordered reduction. No
// atomics, so dp is bit-reproducible.
template <int kN>
__device__ __forceinline__ void StoreSwiGLUBackwardTile(const GemmParams& p, const TileInfo& ti,
                                                        const float (&acc)[kN / 2],
                                                        const EpiRows& rows, uint8_t* stage,
                                                        int t_wg, int row_group, int bar_id) {
  constexpr int kCols = 32;
  constexpr int kRowBytes = kCols * 4 + 16;
  static_assert(kRowBytes == EpiRowBytes<false>(), "must fit the kPlain staging rows");
  const int lane = t_wg & 31;
  const int c_base = 2 * (lane & 3);
  const int rw = (t_wg >> 5) * 16 + (lane >> 2);  // fragment row within the warpgroup
  const int piece = t_wg & 7;                     // columns 4 piece .. +3 of every chunk
  const int h = p.n_dim;
  // H1 and H3 at this thread's 4 columns of chunk cc, for its 4 rows (zeros outside).
  auto load_h = [&](int cc, uint2(&g)[4], uint2(&u)[4]) {
    const int col = ti.n0 + cc * kCols + 4 * piece;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = row_group * 64 + (t_wg >> 3) + 16 * j;
      g[j] = u[j] = make_uint2(0, 0);
      if (r < ti.rows && col < h) {
        const __nv_bfloat16* hrow = p.saved_h + static_cast<int64_t>(ti.slot0 + r) * 2 * h + col;
        g[j] = __ldg(reinterpret_cast<const uint2*>(hrow));
        u[j] = __ldg(reinterpret_cast<const uint2*>(hrow + h));
      }
    }
  };
  float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  uint2 hg[4], hu[4];
  load_h(0, hg, hu);
#pragma unroll
  for (int cc = 0; cc < kN / kCols; ++cc) {
    const int col = ti.n0 + cc * kCols + 4 * piece;
#pragma unroll
    for (int ii = 0; ii < kCols / 8; ++ii) {
      const int i = cc * (kCols / 8) + ii;  // n8 block of the accumulator
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        *reinterpret_cast<float2*>(stage + (rw + 8 * hr) * kRowBytes + (8 * ii + c_base) * 4) =
            make_float2(acc[4 * i + 2 * hr], acc[4 * i + 2 * hr + 1]);
      }
    }
    uint2 next_g[4], next_u[4];
    if (cc + 1 < kN / kCols) load_h(cc + 1, next_g, next_u);
    asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory");
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = (t_wg >> 3) + 16 * j;
      const int r = row_group * 64 + row;
      const float4 d4 = *reinterpret_cast<const float4*>(stage + row * kRowBytes + piece * 16);
      if (r < ti.rows && col < h) {
        const float d[4] = {d4.x, d4.y, d4.z, d4.w};
        const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&hg[j]);
        const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&hu[j]);
        const float pw = rows.weight[j];
        uint2 out_dg, out_du, out_pa;
        __nv_bfloat162* dg2 = reinterpret_cast<__nv_bfloat162*>(&out_dg);
        __nv_bfloat162* du2 = reinterpret_cast<__nv_bfloat162*>(&out_du);
        __nv_bfloat162* pa2 = reinterpret_cast<__nv_bfloat162*>(&out_pa);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const float2 gf = __bfloat1622float2(g2[q]);
          const float2 uf = __bfloat1622float2(u2[q]);
          const float g[2] = {gf.x, gf.y}, u[2] = {uf.x, uf.y};
          float dg[2], du[2], pa[2];
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            float f, df;
            detail::ActAndGrad<detail::kActSwiGLU>(g[v], &f, &df);
            const float a = f * u[v];
            const float dv = d[2 * q + v];
            dot[j] = fmaf(dv, a, dot[j]);
            const float dav = pw * dv;
            dg[v] = dav * u[v] * df;
            du[v] = dav * f;
            pa[v] = pw * a;
          }
          dg2[q] = __floats2bfloat162_rn(dg[0], dg[1]);
          du2[q] = __floats2bfloat162_rn(du[0], du[1]);
          pa2[q] = __floats2bfloat162_rn(pa[0], pa[1]);
        }
        const int64_t slot = ti.slot0 + r;
        __nv_bfloat16* dh_row = p.out0 + slot * 2 * h + col;
        *reinterpret_cast<uint2*>(dh_row) = out_dg;
        *reinterpret_cast<uint2*>(dh_row + h) = out_du;
        *reinterpret_cast<uint2*>(p.out1 + slot * h + col) = out_pa;
      }
    }
    asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory");
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      hg[j] = next_g[j];
      hu[j] = next_u[j];
    }
  }
  // ---- dp: the 8 threads of a row are 8 consecutive lanes; every lane takes part.
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float v = dot[j];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    const int r = row_group * 64 + (t_wg >> 3) + 16 * j;
    if (piece == 0 && r < ti.rows) {
      if (p.dp_part == nullptr) {
        p.dp[rows.entry[j]] = v;
      } else {
        p.dp_part[(ti.n0 / kN) * p.dp_stride + ti.slot0 + r] = v;
      }
    }
  }
}

// The epilogue of both kernels, for one warpgroup (64 rows of the tile, rows `row_group`*64
// on): registers -> padded staging (one column chunk at a time) -> 16-byte row-contiguous
// global stores. Direct 4-byte stores from the fragments left the down-projection throttled
// on the load/store queue with L2 at 83% of its peak (ncu). `rows`: see EpiRows. `bar_id`: the
// warpgroup's named barrier. kDSwiGLU: StoreSwiGLUBackwardTile instead.
template <int kN, bool kSwiGLU, bool kDSwiGLU = false>
__device__ __forceinline__ void StoreTile(const GemmParams& p, const TileInfo& ti,
                                          const float (&acc)[kN / 2], const EpiRows& rows,
                                          uint8_t* stage, int t_wg, int row_group, int bar_id) {
  if constexpr (kDSwiGLU) {
    StoreSwiGLUBackwardTile<kN>(p, ti, acc, rows, stage, t_wg, row_group, bar_id);
    return;
  }
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
  // instructions: the compiler cannot hoist it past the "memory" clobbers of the bar.syncs.
  // Hoisted, the up-projection ran 1-8% faster (ws and plain kernels, sonic-7b, scale-8k and
  // olmoe; bench/results/2026-11-26-h100-epilogue-hoist).
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
