// sm90_grouped_gemm_kernel: the plain persistent grouped GEMM, every thread both loading and
// multiplying. It serves both projections of an expert MLP and the backward's data gradients.
//
// Each CTA (two consumer warpgroups, 256 threads) loops over output tiles of ALL experts
// (persistent grid, one CTA per SM; scheduler.cuh), so one launch covers every expert however
// the tokens are spread. Operands are bf16, staged through a multistage shared-memory ring in
// the 128-byte swizzle:
//   A (activations): cp.async, 16 bytes per thread, rows GATHERED through the dispatch index
//      while loading (row r of expert e is x[entries[offsets[e] + r] / K]), so the permuted copy
//      of x never exists in device memory. Rows past the expert's count are zero-filled. An A
//      read in slot order (the down-projection's activations, dXg's dH) comes, for the tiles
//      whose 128 rows are all the expert's, as one TMA box a stage on the weights' mbarrier
//      instead; ragged tiles keep cp.async.
//   B (weights):     TMA completing on an mbarrier (weight_tile.cuh), or cp.async as a
//      fallback; out-of-range rows and k are zero-filled either way.
// The ring is shared by loads of the NEXT tile too (a load cursor runs kStages-2 steps ahead of
// the math across tile boundaries), so a tile's epilogue overlaps the next tile's loads.
// Why all 256 threads both load and multiply: it needs no cross-warpgroup protocol beyond one
// barrier per k-step, and it is the fastest kernel on most shapes (the decision record
// docs/decisions/0001-sm90-kernel-choice.md says where the other two win).
// Three compile-time choices besides the epilogue make the backward's data gradients: A
// gathered through the index or read in slot order; B K-major or MN-major (kTransB); output
// rows scattered to entries[slot] or written in slot order (kSlotOut).
#ifndef MOE_KERNELS_CUDA_SM90_IMPLS_GROUPED_GEMM_CUH_
#define MOE_KERNELS_CUDA_SM90_IMPLS_GROUPED_GEMM_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/sm90/epilogue.cuh"
#include "kernels/cuda/sm90/mma.cuh"
#include "kernels/cuda/sm90/params.cuh"
#include "kernels/cuda/sm90/ptx.cuh"
#include "kernels/cuda/sm90/scheduler.cuh"
#include "kernels/cuda/sm90/smem.cuh"
#include "kernels/cuda/sm90/weight_tile.cuh"

namespace moe::kernels::sm90 {

// kN: wgmma N, the rows of the B tile (kSwiGLU: kN/2 of W1 then kN/2 of W3).
// kStages: shared-memory ring depth; loads run kStages-2 steps ahead of the math (the buffer
// of step s-1 may still be read by an in-flight wgmma, so only s-2 and older are free).
// kWarpgroups: consumer warpgroups, 64 tile rows each. The launcher instantiates 2 (128-row
// tiles); 3 (192 rows, 25% fewer bytes per flop through L2, but only 3 stages and 168
// registers) measured slower on every preset and is left out.
// kGatherA: A row r of a tile is a[entries[slot] / top_k] (else a[slot]). kTransB: B is stored
// [k_dim][n_dim] per expert and staged MN-major (kPlain only). kSlotOut: kPlain rows go to
// out0[slot] instead of out0[entries[slot]]. The defaults are the forward's two projections.
template <int kWarpgroups, int kN, int kStages, bool kSwiGLU, bool kTmaB, bool kGatherA = kSwiGLU,
          bool kTransB = false, bool kSlotOut = false>
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
    const EpiRows rows = LoadEpiRows<kSwiGLU, kSlotOut>(p, ti, wg * 64 + ((tid & 127) >> 3));
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
    StoreTile<kN, kSwiGLU>(p, ti, acc, rows, epi + wg * 64 * EpiRowBytes<kSwiGLU>(), tid & 127, wg,
                           1 + wg);
  }
  CpAsyncWait<0>();
}

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_IMPLS_GROUPED_GEMM_CUH_
