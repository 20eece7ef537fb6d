// The weight (B) operand's stage of the grouped GEMM: its TMA loads (one CTA, or split over a
// 2-CTA cluster and multicast to both) and the descriptor and k16 step wgmma reads it with.
//
// Weights come K-major (the forward: rows of W run along the reduction) or MN-major (the
// backward: W read in its stored layout with the reduction dimension as its row, kTransB). An
// MN-major stage is kN/64 blocks of 64 k-rows x 64 n (8 KB, one TMA box each), read with
// wgmma's transpose flag; out-of-range rows and k are zero-filled by the tensor map.
#ifndef MOE_KERNELS_CUDA_SM90_WEIGHT_TILE_CUH_
#define MOE_KERNELS_CUDA_SM90_WEIGHT_TILE_CUH_

#include <cstdint>

#include "kernels/cuda/sm90/mma.cuh"
#include "kernels/cuda/sm90/params.cuh"
#include "kernels/cuda/sm90/ptx.cuh"

namespace moe::kernels::sm90 {

// One stage's weight tile by TMA, completing on `bar` (armed here with the tile's bytes, which
// count the zero fill past n_dim or k_dim too, plus `more_bytes` that the caller's own TMA
// copies will complete). K-major: one box of kN rows (kSwiGLU: kN/2 of W1 then kN/2 of W3);
// MN-major: kN/64 boxes of 64 n x 64 k, one per 8 KB block.
template <int kN, bool kSwiGLU, bool kTransB>
__device__ __forceinline__ void TmaLoadWeights(const GemmParams& p, uint32_t s_b, uint32_t bar,
                                               int k0, int n0, int expert,
                                               uint32_t more_bytes = 0) {
  MbarArriveExpectTx(bar, kN * kBlockK * 2 + more_bytes);
  if constexpr (kTransB) {
#pragma unroll
    for (int q = 0; q < kN / 64; ++q) {
      TmaLoad3d(s_b + q * kMnBlockBytes, &p.tmap_b0, bar, n0 + 64 * q, k0, expert);
    }
  } else {
    TmaLoad3d(s_b, &p.tmap_b0, bar, k0, n0, expert);
    if constexpr (kSwiGLU) TmaLoad3d(s_b + kN * kBlockK, &p.tmap_b1, bar, k0, n0, expert);
  }
}

// TmaLoadWeights for a cluster of 2 CTAs that share the weight tile: this CTA (rank 0 or 1) arms
// its own `bar` with the WHOLE tile's bytes, then loads half of the tile's boxes, multicast to
// both CTAs; the other CTA's half lands here and completes the same barrier. K-major: rank 0 the
// first kN/2 rows (kSwiGLU: the W1 box), rank 1 the rest (the W3 box); kPlain's map boxes are
// then kN/2 rows. MN-major: the 64-column boxes of the rank's parity.
template <int kN, bool kSwiGLU, bool kTransB>
__device__ __forceinline__ void TmaLoadWeightsMulticast(const GemmParams& p, uint32_t s_b,
                                                        uint32_t bar, int k0, int n0, int expert,
                                                        int rank) {
  MbarArriveExpectTx(bar, kN * kBlockK * 2);
  if constexpr (kTransB) {
    static_assert(kN % 128 == 0, "an even number of 64-column boxes");
#pragma unroll
    for (int q = rank; q < kN / 64; q += 2) {
      TmaLoad3dMulticast(s_b + q * kMnBlockBytes, &p.tmap_b0, bar, n0 + 64 * q, k0, expert, 3);
    }
  } else if constexpr (kSwiGLU) {
    TmaLoad3dMulticast(s_b + rank * kN * kBlockK, rank ? &p.tmap_b1 : &p.tmap_b0, bar, k0, n0,
                       expert, 3);
  } else {
    TmaLoad3dMulticast(s_b + rank * kN * kBlockK, &p.tmap_b0, bar, k0, n0 + rank * kN / 2, expert,
                       3);
  }
}

// The weight tile's descriptor and its start-address step per k16 (in 16-byte units): +32
// bytes K-major, +2048 (16 lines) MN-major. A is always K-major: MakeSmemDesc, +32 bytes.
template <bool kTransB>
__device__ __forceinline__ uint64_t WeightDesc(uint32_t s_b) {
  return kTransB ? MakeMnMajorDesc(s_b) : MakeSmemDesc(s_b);
}
template <bool kTransB>
constexpr int kWeightK16Step = (kTransB ? kMnK16Bytes : 32) >> 4;

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_WEIGHT_TILE_CUH_
