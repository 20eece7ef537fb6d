// What every sm90 grouped-GEMM kernel reads: the tile constants shared by the three kernels and
// their launcher, and GemmParams, the one parameter block of a launch.
//
// GemmParams is passed by value as a __grid_constant__ so that its tensor maps stay in
// parameter space, where TMA may read them. The grouped GEMM serves the forward's two
// projections and the backward's data gradients; which fields a use reads is fixed by the
// kernel's template flags (see impls/grouped_gemm.cuh). No Abseil, gRPC or protobuf here.
#ifndef MOE_KERNELS_CUDA_SM90_PARAMS_CUH_
#define MOE_KERNELS_CUDA_SM90_PARAMS_CUH_

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace moe::kernels::sm90 {

constexpr int kMinBlockM = 128;   // tile height of the plain and ws kernels (2 x 64 rows); the
                                  // ping-pong kernel's 64-row tiles still fit CanImplement's bound
constexpr int kBlockK = 64;       // 64 bf16 = 128 bytes = one swizzle atom row
constexpr int kMaxExperts = 512;  // the tile prefix and offsets live in shared memory

// Everything the kernel reads; passed by value as a __grid_constant__ so the tensor maps stay
// in parameter space, where TMA may read them.
struct GemmParams {
  CUtensorMap tmap_a;       // A in slot order (plain and ws kernels): [a_rows][k_dim], boxes of
                            // 64 k x 128 rows (encoded by DispatchGemm; else unused)
  CUtensorMap tmap_b0;      // W1 (kSwiGLU) or W2 (kPlain): [experts][n_dim][k_dim] (K-major)
                            // or [experts][k_dim][n_dim] (kTransB, boxes of 64 n x 64 k),
  CUtensorMap tmap_b1;      // W3 (kSwiGLU only); experts b_expert_stride elements apart
  const __nv_bfloat16* a;   // gathered: x [T, k_dim] (row entries[s] / top_k); else [N, k_dim]
  const __nv_bfloat16* b0;  // same tensors as the maps, for the cp.async fallback
  const __nv_bfloat16* b1;
  const int32_t* offsets;  // [experts + 1]
  const int32_t* entries;  // [N]: t * top_k + k
  __nv_bfloat16* out0;     // kSwiGLU: H [N, 2 * n_dim]; kPlain: Y [T * top_k, n_dim], or
                           // [N, n_dim] with kSlotOut
  __nv_bfloat16* out1;     // kSwiGLU: A [N, n_dim]
  int32_t num_experts;
  int32_t k_dim;
  int32_t n_dim;
  int32_t top_k;
  int32_t group_m;          // row blocks per rasterisation band (>= 1)
  int64_t b_expert_stride;  // elements between experts in b0/b1 (>= n_dim * k_dim)
  int64_t a_rows;           // rows of `a` the caller's buffer holds at least (tmap_a's extent)
};

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_PARAMS_CUH_
