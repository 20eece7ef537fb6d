// Hopper (sm_90a) building blocks for the fused expert kernels: wgmma, cp.async, TMA, mbarrier,
// and the persistent grouped GEMM that the forward and backward launchers instantiate.
//
// One kernel serves both projections of an expert MLP. Each CTA (two consumer warpgroups,
// 256 threads) loops over output tiles of ALL experts (persistent grid, one CTA per SM), so
// one launch covers every expert however the tokens are spread. Operands are bf16, K-major on
// both sides (x rows and weight rows both run along the reduction dimension), staged through a
// multistage shared-memory ring in the 128-byte swizzle that wgmma reads without bank
// conflicts:
//   A (activations): cp.async, 16 bytes per thread, rows GATHERED through the dispatch index
//      while loading (row r of expert e is x[entries[offsets[e] + r] / K]), so the permuted copy
//      of x never exists in device memory. Rows past the expert's count are zero-filled. An A
//      read in slot order (the down-projection's activations, dXg's dH) comes, for the tiles
//      whose 128 rows are all the expert's, as one TMA box a stage on the weights' mbarrier
//      instead (plain and ws kernels; 3-13% less time on those GEMMs,
//      bench/results/2026-11-22-h100-67c219d-tma-a-plain); ragged tiles keep cp.async.
//   B (weights):     TMA (cp.async.bulk.tensor, 3-D map over [experts, rows, k]) completing on
//      an mbarrier, or cp.async as a fallback; out-of-range rows and k are zero-filled either way.
// The ring is shared by loads of the NEXT tile too (a load cursor runs kStages-2 steps ahead of
// the math across tile boundaries), so a tile's epilogue overlaps the next tile's loads.
// Why all 256 threads both load and multiply: it needs no cross-warpgroup protocol beyond one
// barrier per k-step, and it measured faster than the warp-specialised variant below (a
// producer warpgroup feeding two consumers through full/empty mbarriers), whose producer still
// blocks on cp.async completion (docs/FUSED.md).
//
// A third variant, sm90_grouped_gemm_pp_kernel, is the ping-pong schedule: the same producer,
// but each consumer warpgroup takes whole tiles in turn, so that one's epilogue overlaps the
// other's MMAs (optionally with the weight tile multicast over a 2-CTA cluster).
//
// The same kernel serves the backward's data gradients, through three compile-time choices
// independent of the epilogue: A gathered through the index or read in slot order; B K-major
// (rows of the weight run along the reduction) or MN-major (the weight read in its stored
// layout with the reduction dimension as its ROW, as the backward needs: dA_u = dout W2_e with
// W2_e [d, h], dXg = dH [W1_e; W3_e] with [2h, d]); and output rows scattered to entries[slot]
// or written in slot order. An MN-major B stage is kN/64 blocks of 64 k-rows x 64 n (8 KB,
// 128-byte swizzle, one TMA box each), read by wgmma with its transpose flag; the descriptor
// then needs both byte offsets (see MakeMnMajorDesc).
// Epilogues, from the fp32 accumulators, staged through padded shared memory so that global
// stores are 16-byte and row-contiguous:
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
// No Abseil, gRPC or protobuf here (house style): raw pointers and cudaError_t only.
#ifndef MOE_KERNELS_CUDA_SM90_GROUPED_GEMM_CUH_
#define MOE_KERNELS_CUDA_SM90_GROUPED_GEMM_CUH_

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/activation.cuh"

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
  // kDSwiGLU only (the backward's dA GEMM with the SwiGLU backward as its epilogue; out0 is
  // then dH [N, 2 * n_dim], out1 pA [N, n_dim]):
  const __nv_bfloat16* saved_h;  // the forward's H [N, 2 * n_dim], slot order
  const float* route_w;          // routing weights [T * top_k], by entry
  float* dp;                     // [T * top_k] by entry, written when one column tile spans h
  float* dp_part;                // else per-tile partial sums [column tiles][dp_stride]
  int64_t dp_stride;             // >= N
};

// ---------------------------------------------------------------------------------------------
// PTX wrappers.

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; src_bytes = 0 writes zeros (rows or k past the end).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Makes this thread's generic-proxy shared-memory writes (cp.async) visible to the async
// proxy (wgmma) once a barrier has ordered them.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// TMA: one box of a 3-D tensor map into shared memory, completing `bar`'s transaction count.
__device__ __forceinline__ void TmaLoad3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                          int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Plain arrival (no transaction bytes) on a CTA-local mbarrier.
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// TMA: one box of a 2-D tensor map into shared memory, completing `bar`'s transaction count.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                          int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// TMA multicast: the box lands at the same shared-memory offset in every CTA of `cta_mask` (this
// cluster), and completes the transaction count of the mbarrier at `bar`'s offset in each.
__device__ __forceinline__ void TmaLoad3dMulticast(uint32_t dst, const CUtensorMap* map,
                                                   uint32_t bar, int c0, int c1, int c2,
                                                   uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}
__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
// The shared::cluster address of this CTA's shared address `addr` in CTA `rank`.
__device__ __forceinline__ uint32_t MapaShared(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
// Arrival on another CTA's mbarrier, with the default (.release.cta) semantics as CUTLASS's
// ClusterBarrier::arrive uses: what it orders is this thread's wgmma reads of a ring slot, already
// retired, before the other CTA's TMA overwrites it. The first version asked for .release.cluster
// (presumably the cluster-scope fence it implies, per warp per k-step, was the cost) and took
// 1.21-2.28x the time of ping-pong without multicast over the 54 timings of the sweeps; with
// .release.cta it took 0.79-1.24x
// (bench/results/2026-11-21-h100-36b98f9-ping-pong, runs 3 and 4).
__device__ __forceinline__ void MbarArriveCluster(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}
// All threads of the cluster (every CTA's, all of them) meet here.
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across the async wgmma window.
template <int kN>
__device__ __forceinline__ void FenceOperands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor for a K-major operand in the 128-byte swizzle: 8-row core
// groups 1024 bytes apart (stride byte offset), leading byte offset unused for this layout.
// The tile base must be 1024-byte aligned; stepping k by 16 elements adds 32 bytes to the start.
__device__ __forceinline__ uint64_t MakeSmemDesc(uint32_t addr) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>(1) << 16;
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;
  desc |= static_cast<uint64_t>(1) << 62;
  return desc;
}

// The same descriptor in the 128-byte swizzle with both byte offsets explicit, for layouts
// where the leading offset matters (MN-major operands read with wgmma's transpose flag, whose
// 64-element-wide swizzle atoms repeat along M/N): lbo and sbo in bytes, multiples of 16.
__device__ __forceinline__ uint64_t MakeSmemDescSw128(uint32_t addr, uint32_t lbo_bytes,
                                                      uint32_t sbo_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
  desc |= static_cast<uint64_t>(1) << 62;
  return desc;
}

// An MN-major operand stored as consecutive blocks of 64 k-rows x 64 MN elements (8 KB, each
// 128-byte line one k-row of 64 consecutive MN elements, 16-byte chunk c of k-row r at chunk
// c ^ (r % 8), which is what a TMA box {64, 64} in SWIZZLE_128B writes). In the PTX ISA's
// canonical MN-major 128-byte-swizzle layout, the leading byte offset is the step between
// 64-element MN blocks and the stride byte offset the step between groups of 8 k-rows; a k16
// step is 16 whole lines (2048 bytes), which keeps the 1024-byte swizzle phase, so no base
// offset is needed as long as the block base is 1024-byte aligned.
constexpr uint32_t kMnBlockBytes = 64 * kBlockK * 2;  // one 64 x 64 bf16 block
constexpr uint32_t kMnLbo = kMnBlockBytes;
constexpr uint32_t kMnSbo = 8 * 128;
constexpr uint32_t kMnK16Bytes = 16 * 128;
__device__ __forceinline__ uint64_t MakeMnMajorDesc(uint32_t addr) {
  return MakeSmemDescSw128(addr, kMnLbo, kMnSbo);
}

// D[64x128] (+)= A[64x16] * B[128x16]^T from 128-byte-swizzled shared memory. kTransA/kTransB
// = 1 reads that operand MN-major (the wgmma transpose flag, bf16 only); 0 is K-major.
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void WgmmaM64N128K16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, %67, %68;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

// D[64x256] (+)= A[64x16] * B[256x16]^T; operand majors as for the 64x128 form.
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void WgmmaM64N256K16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
      "%127"
      "}, %128, %129, p, 1, 1, %131, %132;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

// kTransB: B MN-major (A is always K-major here).
template <int kN, int kTransB = 0>
struct Wgmma;
template <int kTransB>
struct Wgmma<128, kTransB> {
  __device__ __forceinline__ static void Run(float (&d)[64], uint64_t a, uint64_t b) {
    WgmmaM64N128K16<0, kTransB>(d, a, b, 1);
  }
};
template <int kTransB>
struct Wgmma<256, kTransB> {
  __device__ __forceinline__ static void Run(float (&d)[128], uint64_t a, uint64_t b) {
    WgmmaM64N256K16<0, kTransB>(d, a, b, 1);
  }
};

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

template <int kWarpgroups, int kN, int kStages, bool kSwiGLU>
__host__ __device__ constexpr int SmemBytes() {
  return kStages * (kWarpgroups * 64 * kBlockK * 2 + kN * kBlockK * 2) + 1024 /* alignment */ +
         kWarpgroups * 64 * EpiRowBytes<kSwiGLU>() /* epilogue staging */ +
         kStages * 8 /* mbarriers */ + 2 * (kMaxExperts + 1) * 4 /* prefix, offsets */;
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
      dst[j] = (piece < 8 ? p.out0 + slot * 2 * n_dim + (piece >> 2) * n_dim
                          : p.out1 + slot * n_dim) +
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

// kN: wgmma N, the rows of the B tile (kSwiGLU: kN/2 of W1 then kN/2 of W3).
// kStages: shared-memory ring depth; loads run kStages-2 steps ahead of the math (the buffer
// of step s-1 may still be read by an in-flight wgmma, so only s-2 and older are free).
// kWarpgroups: consumer warpgroups, 64 tile rows each. The launcher instantiates 2 (128-row
// tiles); 3 (192 rows, 25% fewer bytes per flop through L2, but only 3 stages and 168
// registers) measured slower on every preset and is left out.
// kGatherA: A row r of a tile is a[entries[slot] / top_k] (else a[slot]). kTransB: B is stored
// [k_dim][n_dim] per expert and staged MN-major (kPlain only). kSlotOut: kPlain rows go to
// out0[slot] instead of out0[entries[slot]]. kDSwiGLU (kPlain, kSlotOut): the SwiGLU backward
// epilogue (StoreSwiGLUBackwardTile). The defaults are the forward's two projections.
template <int kWarpgroups, int kN, int kStages, bool kSwiGLU, bool kTmaB, bool kGatherA = kSwiGLU,
          bool kTransB = false, bool kSlotOut = false, bool kDSwiGLU = false>
__global__ void __launch_bounds__(kWarpgroups * 128, 1)
    sm90_grouped_gemm_kernel(const __grid_constant__ GemmParams p) {
  constexpr int kThreads = kWarpgroups * 128;
  constexpr int kBlockM = kWarpgroups * 64;
  constexpr int kTileABytes = kBlockM * kBlockK * 2;
  // Full tiles of an A in slot order come by TMA (tmap_a's boxes are kMinBlockM rows).
  constexpr bool kTmaA = kTmaB && !kGatherA && kBlockM == kMinBlockM;
  constexpr int kTileBBytes = kN * kBlockK * 2;
  constexpr int kStageBytes = kTileABytes + kTileBBytes;
  constexpr int kAhead = kStages - 2;
  constexpr int kBlockN = kSwiGLU ? kN / 2 : kN;  // output columns per tile (per half)
  constexpr int kAcc = kN / 2;                    // fp32 accumulators per thread
  static_assert(kAhead >= 1, "need at least 3 stages");
  static_assert(kStageBytes % 1024 == 0, "swizzled tiles must stay 1024-byte aligned");
  static_assert(!(kSwiGLU && (kTransB || kSlotOut)), "MN-major B and slot rows are kPlain only");
  static_assert(!kDSwiGLU || (!kSwiGLU && kSlotOut), "the SwiGLU backward writes slot rows");

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_addr);
  uint8_t* epi = smem + kStages * kStageBytes;  // staging, EpiRowBytes x 64 rows per warpgroup
  uint64_t* bars = reinterpret_cast<uint64_t*>(epi + kWarpgroups * 64 * EpiRowBytes<kSwiGLU>());
  int* prefix = reinterpret_cast<int*>(bars + kStages);
  int* offs = prefix + (kMaxExperts + 1);

  const int tid = threadIdx.x;
  const int num_experts = p.num_experts;

  // ---- Phase 0: row-block prefix over experts (warp 0), offsets cached in shared memory.
  BuildTilePrefix<kBlockM, kThreads>(p.offsets, num_experts, prefix, offs);
  if (kTmaB && tid == 0) {
    for (int s = 0; s < kStages; ++s) MbarInit(SmemAddr(&bars[s]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int n_tiles = (p.n_dim + kBlockN - 1) / kBlockN;
  const int total = prefix[num_experts] * n_tiles;
  const int num_k = (p.k_dim + kBlockK - 1) / kBlockK;
  if (static_cast<int>(blockIdx.x) >= total) return;  // no barrier follows for this CTA

  // ---- Load cursor: runs kAhead k-steps ahead of the math, across tile boundaries. The
  // gather's source rows for the cursor's NEXT tile are fetched one whole tile ahead (the raw
  // entries stay in registers until the crossing), so a crossing never waits on global memory.
  constexpr int kRowsPerThread = kBlockM * 8 / kThreads;
  const int chunk = tid & 7;  // this thread's 16-byte chunk of every 128-byte row it loads
  int ld_tile = blockIdx.x;
  int ld_kt = 0;
  TileInfo ld =
      DecodeTile<kBlockM, kBlockN>(ld_tile, n_tiles, p.group_m, prefix, offs, num_experts);
  TileInfo nx = ld;
  int nx_raw[kRowsPerThread];
  const __nv_bfloat16* a_row[kRowsPerThread];
  bool a_ok[kRowsPerThread];
  auto fetch_rows = [&](const TileInfo& info, int(&raw)[kRowsPerThread]) {
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const int r = (tid >> 3) + j * (kThreads / 8);
      raw[j] = (kGatherA && r < info.rows) ? p.entries[info.slot0 + r] : 0;
    }
  };
  auto set_rows = [&](const int(&raw)[kRowsPerThread]) {
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const int r = (tid >> 3) + j * (kThreads / 8);
      a_ok[j] = r < ld.rows;
      int src = 0;
      if (a_ok[j]) src = kGatherA ? raw[j] / p.top_k : ld.slot0 + r;
      a_row[j] = p.a + static_cast<int64_t>(src) * p.k_dim;
    }
  };
  auto fetch_next = [&]() {
    const int t = ld_tile + static_cast<int>(gridDim.x);
    if (t < total) {
      nx = DecodeTile<kBlockM, kBlockN>(t, n_tiles, p.group_m, prefix, offs, num_experts);
      fetch_rows(nx, nx_raw);
    }
  };
  {
    int raw[kRowsPerThread];
    fetch_rows(ld, raw);
    set_rows(raw);
  }
  fetch_next();

  auto issue_load = [&](int stage) {
    if (ld_tile < total) {
      const uint32_t s_a = base + stage * kStageBytes;
      const uint32_t s_b = s_a + kTileABytes;
      const int k0 = ld_kt * kBlockK;
      const int kk = k0 + chunk * 8;
      const bool k_ok = kk < p.k_dim;
      // A in slot order, a tile of 128 rows all inside the expert's: one TMA box on the
      // weights' mbarrier (as in the ws kernel); otherwise cp.async, which zero-fills.
      const bool tma_a = kTmaA && ld.rows == kBlockM;
      if (!tma_a) {
        // A: gathered rows, 128-byte swizzle (chunk c of row r lands at chunk c ^ (r % 8)).
#pragma unroll
        for (int j = 0; j < kBlockM * 8 / kThreads; ++j) {
          const int r = (tid >> 3) + j * (kThreads / 8);
          const bool ok = a_ok[j] && k_ok;
          CpAsync16(s_a + r * 128 + ((chunk ^ (r & 7)) << 4), ok ? a_row[j] + kk : p.a, ok);
        }
      }
      if constexpr (kTmaB) {
        if (tid == 0) {
          const uint32_t bar = SmemAddr(&bars[stage]);
          TmaLoadWeights<kN, kSwiGLU, kTransB>(p, s_b, bar, k0, ld.n0, ld.expert,
                                               tma_a ? kTileABytes : 0);
          if (tma_a) TmaLoad2d(s_a, &p.tmap_a, bar, k0, ld.slot0);
        }
      } else if constexpr (kTransB) {
        // MN-major by cp.async, the same bytes the boxes above would write: 16-byte piece
        // (block q, k-row r, chunk c) holds n = n0 + 64 q + 8 c .. +7 of k = k0 + r.
#pragma unroll
        for (int j = 0; j < kN * 8 / kThreads; ++j) {
          const int piece = tid + j * kThreads;
          const int c = piece & 7;
          const int r = (piece >> 3) & 63;
          const int q = piece >> 9;
          const int n = ld.n0 + 64 * q + 8 * c;
          const bool ok = k0 + r < p.k_dim && n < p.n_dim;
          const __nv_bfloat16* src =
              p.b0 + ld.expert * p.b_expert_stride + static_cast<int64_t>(k0 + r) * p.n_dim + n;
          CpAsync16(s_b + q * kMnBlockBytes + r * 128 + ((c ^ (r & 7)) << 4), ok ? src : p.b0, ok);
        }
      } else {
#pragma unroll
        for (int j = 0; j < (kN * 8 + kThreads - 1) / kThreads; ++j) {
          const int r = (tid >> 3) + j * (kThreads / 8);
          if (kN % (kThreads / 8) != 0 && r >= kN) break;
          const int half = kSwiGLU ? r / kBlockN : 0;
          const int wr = ld.n0 + (kSwiGLU ? r % kBlockN : r);
          const bool ok = k_ok && wr < p.n_dim;
          const __nv_bfloat16* w = half ? p.b1 : p.b0;
          const __nv_bfloat16* src =
              w + ld.expert * p.b_expert_stride + static_cast<int64_t>(wr) * p.k_dim + kk;
          CpAsync16(s_b + r * 128 + ((chunk ^ (r & 7)) << 4), ok ? src : p.b0, ok);
        }
      }
      if (++ld_kt == num_k) {
        ld_kt = 0;
        ld_tile += gridDim.x;
        if (ld_tile < total) {
          ld = nx;
          set_rows(nx_raw);
          fetch_next();
        }
      }
    }
    CpAsyncCommit();  // always one group per step, so the wait counts stay exact
  };

  const int wg = tid >> 7;

  for (int s = 0; s < kAhead; ++s) issue_load(s);

  uint32_t it = 0;  // k-steps consumed by this CTA, across tiles: ring stage and mbarrier phase
  float acc[kAcc];
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const TileInfo ti =
        DecodeTile<kBlockM, kBlockN>(tile, n_tiles, p.group_m, prefix, offs, num_experts);
    // The epilogue's rows, loaded now so that their latency hides behind the main loop.
    const EpiRows rows =
        LoadEpiRows<kSwiGLU, kSlotOut, kDSwiGLU>(p, ti, wg * 64 + ((tid & 127) >> 3));
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

    // ---- Main loop: wait for step `it`, issue its wgmmas, refill the freed buffer.
    for (int kt = 0; kt < num_k; ++kt, ++it) {
      const int stage = it % kStages;
      CpAsyncWait<kAhead - 1>();
      if constexpr (kTmaB) MbarWait(SmemAddr(&bars[stage]), (it / kStages) & 1);
      FenceProxyAsync();
      __syncthreads();  // stage visible to all; every wgmma of step it-2 has retired
      const uint32_t s_a = base + stage * kStageBytes + wg * 64 * 128;
      const uint32_t s_b = base + stage * kStageBytes + kTileABytes;
      const uint64_t desc_a = MakeSmemDesc(s_a);
      const uint64_t desc_b = WeightDesc<kTransB>(s_b);
      FenceOperands(acc);
      WgmmaFence();
#pragma unroll
      for (int j = 0; j < kBlockK / 16; ++j) {
        Wgmma<kN, kTransB ? 1 : 0>::Run(acc, desc_a + 2 * j, desc_b + kWeightK16Step<kTransB> * j);
      }
      WgmmaCommit();
      FenceOperands(acc);
      issue_load((it + kAhead) % kStages);
      WgmmaWait<1>();
      FenceOperands(acc);
    }
    WgmmaWait<0>();
    FenceOperands(acc);

    // ---- Epilogue.
    StoreTile<kN, kSwiGLU, kDSwiGLU>(p, ti, acc, rows, epi + wg * 64 * EpiRowBytes<kSwiGLU>(),
                                     tid & 127, wg, 1 + wg);
  }
  CpAsyncWait<0>();
}

// Shared memory of the two producer/consumer kernels (ws and pp), in order: the load ring
// (1024-byte aligned for the swizzle), the two consumers' epilogue staging, the `full` and
// `empty` mbarrier of every ring slot, the tile prefix and the cached offsets.
template <int kStages, int kStageBytes, bool kSwiGLU>
struct WsSmem {
  uint32_t base;  // the ring, as a shared-memory address
  uint8_t* epi;
  uint64_t* full;
  uint64_t* empty;
  int* prefix;
  int* offs;

  __device__ __forceinline__ explicit WsSmem(uint8_t* raw) {
    const uint32_t raw_addr = SmemAddr(raw);
    base = (raw_addr + 1023u) & ~1023u;
    epi = raw + (base - raw_addr) + kStages * kStageBytes;
    full = reinterpret_cast<uint64_t*>(epi + 2 * 64 * EpiRowBytes<kSwiGLU>());
    empty = full + kStages;
    prefix = reinterpret_cast<int*>(empty + kStages);
    offs = prefix + (kMaxExperts + 1);
  }

  // Thread 0: `full` expects the producer's 128 cp.async arrivals plus the TMA's expect-tx
  // arrival; `empty` one arrival per consuming warp (8 when both consumers read every slot, 4
  // when one does, times the CTAs that share a multicast slot). The caller's __syncthreads
  // publishes them.
  __device__ __forceinline__ void InitBarriers(int empty_arrivals) const {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < kStages; ++s) {
      MbarInit(SmemAddr(&full[s]), 128 + 1);
      MbarInit(SmemAddr(&empty[s]), empty_arrivals);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
};

// The warp-specialised variant: warpgroup 0 produces, warpgroups 1 and 2 consume, and no
// CTA-wide barrier runs once tiles start.
//   Producer (register budget cut to 56 by setmaxnreg): per k-step it waits for the ring slot
//     to be released (`empty`), thread 0 arms `full` with the weight tile's bytes and issues the
//     TMA, and all 128 threads issue the gathered A tile by cp.async (8 x 16 bytes each),
//     then `cp.async.mbarrier.arrive.noinc`: each thread's arrival on `full` fires by itself
//     once its copies have landed, so the producer never waits for its own loads (`full`
//     expects 128 such arrivals + the TMA's expect-tx arrival). A full tile of an A in slot
//     order comes by TMA with the weights instead (thread 0 arms `full` with both tiles'
//     bytes) and the 128 threads arrive plainly. An earlier version waited on
//     cp.async groups to arrive and measured slower than the plain kernel.
//   Consumers (register budget raised to 224): wait `full`, fence the cp.async writes (generic
//     proxy) into the async proxy that wgmma reads, issue the wgmmas, and once the previous
//     step's wgmmas have retired, one lane per warp arrives on its `empty` (8 warps).
//     The epilogue is StoreTile, synchronised per warpgroup with named barriers 1 and 2.
// All kStages slots can be in flight (no "-2" rule), since slots are released explicitly.
// kGatherA, kTransB, kSlotOut as for sm90_grouped_gemm_kernel (weights by TMA only).
template <int kN, int kStages, bool kSwiGLU, bool kGatherA = kSwiGLU, bool kTransB = false,
          bool kSlotOut = false, bool kDSwiGLU = false>
__global__ void __launch_bounds__(384, 1)
    sm90_grouped_gemm_ws_kernel(const __grid_constant__ GemmParams p) {
  constexpr int kBlockM = 128;
  constexpr int kThreads = 384;
  constexpr int kTileABytes = kBlockM * kBlockK * 2;
  constexpr int kTileBBytes = kN * kBlockK * 2;
  constexpr int kStageBytes = kTileABytes + kTileBBytes;
  constexpr int kBlockN = kSwiGLU ? kN / 2 : kN;
  constexpr int kAcc = kN / 2;
  static_assert(kStageBytes % 1024 == 0, "swizzled tiles must stay 1024-byte aligned");
  static_assert(!(kSwiGLU && (kTransB || kSlotOut)), "MN-major B and slot rows are kPlain only");
  static_assert(!kDSwiGLU || (!kSwiGLU && kSlotOut), "the SwiGLU backward writes slot rows");

  extern __shared__ uint8_t smem_raw[];
  const WsSmem<kStages, kStageBytes, kSwiGLU> sm(smem_raw);
  const uint32_t base = sm.base;
  uint8_t* epi = sm.epi;
  uint64_t* full = sm.full;
  uint64_t* empty = sm.empty;
  int* prefix = sm.prefix;
  int* offs = sm.offs;

  const int tid = threadIdx.x;
  const int num_experts = p.num_experts;
  BuildTilePrefix<kBlockM, kThreads>(p.offsets, num_experts, prefix, offs);
  sm.InitBarriers(/*empty_arrivals=*/8);
  __syncthreads();
  const int n_tiles = (p.n_dim + kBlockN - 1) / kBlockN;
  const int total = prefix[num_experts] * n_tiles;
  const int num_k = (p.k_dim + kBlockK - 1) / kBlockK;
  if (static_cast<int>(blockIdx.x) >= total) return;

  const int wg = tid >> 7;
  const int t_wg = tid & 127;
  const int lane = tid & 31;
  if (wg == 0) {
    // ---- Producer.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const int chunk = t_wg & 7;
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
      const TileInfo ti =
          DecodeTile<kBlockM, kBlockN>(tile, n_tiles, p.group_m, prefix, offs, num_experts);
      const __nv_bfloat16* a_row[8];
      bool a_ok[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int r = (t_wg >> 3) + 16 * j;
        a_ok[j] = r < ti.rows;
        int src = 0;
        if (a_ok[j]) src = kGatherA ? p.entries[ti.slot0 + r] / p.top_k : ti.slot0 + r;
        a_row[j] = p.a + static_cast<int64_t>(src) * p.k_dim;
      }
      // A in slot order, a tile of 128 rows all inside the expert's: one TMA box a stage
      // (the same 128-byte swizzle the cp.async path writes). Ragged tiles stay on cp.async,
      // which zero-fills the rows past the expert's, so no box reads past the caller's rows.
      const bool tma_a = !kGatherA && ti.rows == kBlockM;
      for (int kt = 0; kt < num_k; ++kt) {
        MbarWait(SmemAddr(&empty[stage]), phase ^ 1);  // a fresh barrier passes parity 1
        const uint32_t s_a = base + stage * kStageBytes;
        const uint32_t s_b = s_a + kTileABytes;
        const uint32_t bar = SmemAddr(&full[stage]);
        const int k0 = kt * kBlockK;
        if (t_wg == 0) {
          TmaLoadWeights<kN, kSwiGLU, kTransB>(p, s_b, bar, k0, ti.n0, ti.expert,
                                               tma_a ? kTileABytes : 0);
          if (tma_a) TmaLoad2d(s_a, &p.tmap_a, bar, k0, ti.slot0);
        }
        if (tma_a) {
          MbarArrive(bar);  // the 128 arrivals `full` expects from the producer
        } else {
          const int kk = k0 + chunk * 8;
          const bool k_ok = kk < p.k_dim;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int r = (t_wg >> 3) + 16 * j;
            const bool ok = a_ok[j] && k_ok;
            CpAsync16(s_a + r * 128 + ((chunk ^ (r & 7)) << 4), ok ? a_row[j] + kk : p.a, ok);
          }
          asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar)
                       : "memory");
        }
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    CpAsyncWait<0>();  // no copy may outlive its issuing thread
  } else {
    // ---- Consumers.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
    const int cw = wg - 1;  // rows cw*64 .. cw*64+63 of each tile
    int stage = 0;
    uint32_t phase = 0;
    float acc[kAcc];
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
      const TileInfo ti =
          DecodeTile<kBlockM, kBlockN>(tile, n_tiles, p.group_m, prefix, offs, num_experts);
      const EpiRows rows = LoadEpiRows<kSwiGLU, kSlotOut, kDSwiGLU>(p, ti, cw * 64 + (t_wg >> 3));
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
      int release = -1;  // slot whose wgmmas may still run
      for (int kt = 0; kt < num_k; ++kt) {
        MbarWait(SmemAddr(&full[stage]), phase);
        FenceProxyAsync();  // the gathered A tile was written by cp.async (generic proxy)
        const uint32_t s_a = base + stage * kStageBytes + cw * 64 * 128;
        const uint32_t s_b = base + stage * kStageBytes + kTileABytes;
        const uint64_t desc_a = MakeSmemDesc(s_a);
        const uint64_t desc_b = WeightDesc<kTransB>(s_b);
        FenceOperands(acc);
        WgmmaFence();
#pragma unroll
        for (int j = 0; j < kBlockK / 16; ++j) {
          Wgmma<kN, kTransB ? 1 : 0>::Run(acc, desc_a + 2 * j,
                                          desc_b + kWeightK16Step<kTransB> * j);
        }
        WgmmaCommit();
        FenceOperands(acc);
        WgmmaWait<1>();  // the previous step's wgmmas have retired: its slot is free
        FenceOperands(acc);
        if (release >= 0 && lane == 0) {
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddr(&empty[release]))
                       : "memory");
        }
        release = stage;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      WgmmaWait<0>();
      FenceOperands(acc);
      if (lane == 0) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddr(&empty[release]))
                     : "memory");
      }
      StoreTile<kN, kSwiGLU, kDSwiGLU>(p, ti, acc, rows, epi + cw * 64 * EpiRowBytes<kSwiGLU>(),
                                       t_wg, cw, 1 + cw);
    }
  }
}

// The ping-pong variant: warpgroup 0 produces exactly as in the warp-specialised kernel, and
// warpgroups 1 and 2 each take WHOLE tiles of this CTA in turn (consumer c: the CTA's tiles
// j = c, c+2, ...), so that one consumer's epilogue runs while the other's wgmmas keep the
// tensor cores busy. Per consumer tile, at most 128 fp32 accumulators a thread:
//   kBlockM = 128, kN = 128: two m64n128k16 per k16 (rows 0..63 and 64..127 of the A tile,
//     whose descriptor for the second half starts 64 * 128 bytes on), a 6-stage ring;
//   kBlockM = 64,  kN = 256: one m64n256k16 per k16, a 4-stage ring (40 KB a stage).
// Ordering: the producer fills the ring in the CTA's tile order, and consumer c waits on `full`
// for tile j only after the other consumer has waited on `full` for every k-step of tile j-1
// (named barrier 3 + c: bar.arrive by the other consumer right after issuing its last wgmma
// of tile j-1, bar.sync by c). Without it consumer c could wait on a slot's `full` two phases
// ahead of the slot, and try_wait.parity, which only tells the current phase from the previous
// one, would pass at once on the previous occupant. It also queues the two tiles' wgmmas back
// to back. A consumer signals only when the other one has a next tile, so no barrier is left
// unmatched. Each `empty` then gets one warpgroup's arrivals per use (4: lane 0 of each warp).
// The epilogue is StoreTile once per 64-row half, on the consumer's own staging rows and its
// named barrier (1 + c). group_m counts kBlockM-row blocks (kMulticastB: 2 * kBlockM).
// kMulticastB: CTAs run in clusters of 2. A cluster decodes tiles of 2 * kBlockM rows, CTA rank r
// takes rows r * kBlockM on (a CTA whose half is empty still loads and multiplies zeros), and
// the two CTAs split each weight tile's load and multicast it to both (TmaLoadWeightsMulticast),
// so a 64 x 256 consumer tile costs the weight traffic of a 128 x 256 one. A slot is then free
// only when both CTAs' consumers have released it: each consumer arrives on its own `empty` and
// on the other CTA's (8 arrivals a use), and the producers wait on their own. Cluster barriers
// after the mbarrier init and before exit keep remote arrivals and multicast writes inside both
// CTAs' lifetimes.
// Measured on an H100 (bench/results/2026-11-21-h100-36b98f9-ping-pong): 64 x 256 beats the
// other kernels where 128-row tiles pad many rows (deepseek-v3 and scale-8k up-projections) and
// for the SwiGLU-backward epilogue (kBackwardDH) at h <= 768; elsewhere the smaller consumer
// tile's extra weight traffic (a 64 x 256 tile loads the weights of a 128 x 256 one) outweighs
// the overlap, and 128 x 128 (two m64n128 per k16) was slower still. Sm90ChooseConfig says where.
// setmaxnreg budgets: the ws kernel's. A 40-register producer (consumers 232) made ptxas spill
// 4-8 bytes in the 128-row variants; 224 holds the consumers' 128 accumulators without spills.
constexpr int kPpProducerRegs = 56;
constexpr int kPpConsumerRegs = 224;
static_assert(128 * kPpProducerRegs + 256 * kPpConsumerRegs <= 65536, "register file");

template <int kBlockM, int kN, int kStages, bool kSwiGLU>
__host__ __device__ constexpr int PpSmemBytes() {
  return kStages * (kBlockM * kBlockK * 2 + kN * kBlockK * 2) + 1024 /* alignment */ +
         2 * 64 * EpiRowBytes<kSwiGLU>() /* epilogue staging, one 64-row area per consumer */ +
         2 * kStages * 8 /* full, empty */ + 2 * (kMaxExperts + 1) * 4 /* prefix, offsets */;
}

template <int kBlockM, int kN, int kStages, bool kSwiGLU, bool kGatherA = kSwiGLU,
          bool kTransB = false, bool kSlotOut = false, bool kDSwiGLU = false,
          bool kMulticastB = false>
__global__ void __launch_bounds__(384, 1)
    sm90_grouped_gemm_pp_kernel(const __grid_constant__ GemmParams p) {
  constexpr int kCluster = kMulticastB ? 2 : 1;
  constexpr int kTileM = kBlockM * kCluster;  // rows of a decoded tile (all CTAs of a cluster)
  constexpr int kThreads = 384;
  constexpr int kHalves = kBlockM / 64;  // wgmmas per k16, 64 rows each
  constexpr int kTileABytes = kBlockM * kBlockK * 2;
  constexpr int kTileBBytes = kN * kBlockK * 2;
  constexpr int kStageBytes = kTileABytes + kTileBBytes;
  constexpr int kBlockN = kSwiGLU ? kN / 2 : kN;
  constexpr int kAcc = kN / 2;
  constexpr int kRowsPerThread = kBlockM / 16;  // producer: A rows per thread per k-step
  static_assert(kBlockM == 64 || kBlockM == 128, "64 or 128 rows per consumer tile");
  static_assert(kHalves * kAcc <= 128, "at most 128 fp32 accumulators per thread");
  static_assert(kStageBytes % 1024 == 0, "swizzled tiles must stay 1024-byte aligned");
  static_assert(!(kSwiGLU && (kTransB || kSlotOut)), "MN-major B and slot rows are kPlain only");
  static_assert(!kDSwiGLU || (!kSwiGLU && kSlotOut), "the SwiGLU backward writes slot rows");

  extern __shared__ uint8_t smem_raw[];
  const WsSmem<kStages, kStageBytes, kSwiGLU> sm(smem_raw);
  const uint32_t base = sm.base;
  uint8_t* epi = sm.epi;
  uint64_t* full = sm.full;
  uint64_t* empty = sm.empty;
  int* prefix = sm.prefix;
  int* offs = sm.offs;

  const int tid = threadIdx.x;
  const int num_experts = p.num_experts;
  BuildTilePrefix<kTileM, kThreads>(p.offsets, num_experts, prefix, offs);
  sm.InitBarriers(/*empty_arrivals=*/4 * kCluster);
  __syncthreads();
  if constexpr (kMulticastB) ClusterSync();  // the other CTA's barriers are initialised
  const int n_tiles = (p.n_dim + kBlockN - 1) / kBlockN;
  const int total = prefix[num_experts] * n_tiles;
  const int num_k = (p.k_dim + kBlockK - 1) / kBlockK;
  // Tiles go to clusters (of one CTA without kMulticastB) round-robin.
  const int rank = kMulticastB ? static_cast<int>(ClusterCtaRank()) : 0;
  const int cluster = static_cast<int>(blockIdx.x) / kCluster;
  const int clusters = static_cast<int>(gridDim.x) / kCluster;
  if (cluster >= total) return;  // the whole cluster returns: no barrier or copy is pending
  // This CTA's rows of a decoded tile (kMulticastB: kBlockM of its 2 * kBlockM, maybe none).
  auto own_rows = [&](TileInfo ti) {
    if constexpr (kMulticastB) {
      ti.slot0 += rank * kBlockM;
      ti.rows = max(0, min(kBlockM, ti.rows - rank * kBlockM));
    }
    return ti;
  };

  const int wg = tid >> 7;
  const int t_wg = tid & 127;
  const int lane = tid & 31;
  if (wg == 0) {
    // ---- Producer: every tile of this CTA, in order, through the ring.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kPpProducerRegs) : "memory");
    const int chunk = t_wg & 7;
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = cluster; tile < total; tile += clusters) {
      const TileInfo ti = own_rows(
          DecodeTile<kTileM, kBlockN>(tile, n_tiles, p.group_m, prefix, offs, num_experts));
      int a_src[kRowsPerThread];  // source row of a, or -1 past the tile's rows
#pragma unroll
      for (int j = 0; j < kRowsPerThread; ++j) {
        const int r = (t_wg >> 3) + 16 * j;
        a_src[j] = -1;
        if (r < ti.rows) a_src[j] = kGatherA ? p.entries[ti.slot0 + r] / p.top_k : ti.slot0 + r;
      }
      for (int kt = 0; kt < num_k; ++kt) {
        MbarWait(SmemAddr(&empty[stage]), phase ^ 1);  // a fresh barrier passes parity 1
        const uint32_t s_a = base + stage * kStageBytes;
        const uint32_t s_b = s_a + kTileABytes;
        const int k0 = kt * kBlockK;
        if (t_wg == 0) {
          if constexpr (kMulticastB) {
            TmaLoadWeightsMulticast<kN, kSwiGLU, kTransB>(p, s_b, SmemAddr(&full[stage]), k0, ti.n0,
                                                          ti.expert, rank);
          } else {
            TmaLoadWeights<kN, kSwiGLU, kTransB>(p, s_b, SmemAddr(&full[stage]), k0, ti.n0,
                                                 ti.expert);
          }
        }
        const int kk = k0 + chunk * 8;
        const bool k_ok = kk < p.k_dim;
#pragma unroll
        for (int j = 0; j < kRowsPerThread; ++j) {
          const int r = (t_wg >> 3) + 16 * j;
          const bool ok = a_src[j] >= 0 && k_ok;
          const __nv_bfloat16* src = p.a + static_cast<int64_t>(a_src[j]) * p.k_dim + kk;
          CpAsync16(s_a + r * 128 + ((chunk ^ (r & 7)) << 4), ok ? src : p.a, ok);
        }
        asm volatile(
            "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(SmemAddr(&full[stage]))
            : "memory");
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    CpAsyncWait<0>();  // no copy may outlive its issuing thread
  } else {
    // ---- Consumers.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kPpConsumerRegs) : "memory");
    const int cw = wg - 1;
    const int my_tiles = (total - cluster + clusters - 1) / clusters;
    // Frees a ring slot (lane 0 of each warp): in this CTA and, with kMulticastB, in the other,
    // whose producer multicasts into this CTA's copy of the slot too.
    auto release_slot = [&](int slot) {
      if (lane == 0) {
        const uint32_t bar = SmemAddr(&empty[slot]);
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
        if constexpr (kMulticastB) MbarArriveCluster(MapaShared(bar, rank ^ 1));
      }
    };
    uint8_t* stage_rows = epi + cw * 64 * EpiRowBytes<kSwiGLU>();
    float acc[kHalves][kAcc];
    for (int j = cw; j < my_tiles; j += 2) {
      const int tile = cluster + j * clusters;
      const TileInfo ti = own_rows(
          DecodeTile<kTileM, kBlockN>(tile, n_tiles, p.group_m, prefix, offs, num_experts));
      EpiRows rows[kHalves];
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) {
        rows[hf] = LoadEpiRows<kSwiGLU, kSlotOut, kDSwiGLU>(p, ti, hf * 64 + (t_wg >> 3));
      }
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[hf][i] = 0.0f;
      }
      // The other consumer has waited on `full` for every k-step of tile j-1.
      if (j > 0) asm volatile("bar.sync %0, 256;\n" ::"r"(3 + cw) : "memory");
      const bool signal = j + 1 < my_tiles;
      uint32_t it = static_cast<uint32_t>(j) * static_cast<uint32_t>(num_k);
      int release = -1;  // slot whose wgmmas may still run
      for (int kt = 0; kt < num_k; ++kt, ++it) {
        const int stage = static_cast<int>(it % kStages);
        MbarWait(SmemAddr(&full[stage]), (it / kStages) & 1);
        FenceProxyAsync();  // the gathered A tile was written by cp.async (generic proxy)
        const uint32_t s_a = base + stage * kStageBytes;
        const uint32_t s_b = s_a + kTileABytes;
        const uint64_t desc_b = WeightDesc<kTransB>(s_b);
#pragma unroll
        for (int hf = 0; hf < kHalves; ++hf) FenceOperands(acc[hf]);
        WgmmaFence();
#pragma unroll
        for (int k16 = 0; k16 < kBlockK / 16; ++k16) {
#pragma unroll
          for (int hf = 0; hf < kHalves; ++hf) {
            const uint64_t desc_a = MakeSmemDesc(s_a + hf * 64 * 128);
            Wgmma<kN, kTransB ? 1 : 0>::Run(acc[hf], desc_a + 2 * k16,
                                            desc_b + kWeightK16Step<kTransB> * k16);
          }
        }
        WgmmaCommit();
#pragma unroll
        for (int hf = 0; hf < kHalves; ++hf) FenceOperands(acc[hf]);
        if (signal && kt == num_k - 1) {
          asm volatile("bar.arrive %0, 256;\n" ::"r"(4 - cw) : "memory");
        }
        WgmmaWait<1>();  // the previous step's wgmmas have retired: its slot is free
#pragma unroll
        for (int hf = 0; hf < kHalves; ++hf) FenceOperands(acc[hf]);
        if (release >= 0) release_slot(release);
        release = stage;
      }
      WgmmaWait<0>();
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) FenceOperands(acc[hf]);
      release_slot(release);
      // ---- Epilogue, one 64-row half at a time (a half with no rows is skipped).
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) {
        if (hf * 64 < ti.rows) {
          StoreTile<kN, kSwiGLU, kDSwiGLU>(p, ti, acc[hf], rows[hf], stage_rows, t_wg, hf, 1 + cw);
        }
      }
    }
  }
  // No CTA of a cluster leaves while the other may still multicast into it or arrive on its
  // `empty` barriers.
  if constexpr (kMulticastB) ClusterSync();
}

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_GROUPED_GEMM_CUH_
