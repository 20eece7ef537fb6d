// sm90_grouped_gemm_ws_kernel: the warp-specialised grouped GEMM. One producer warpgroup loads
// while two consumer warpgroups multiply, handing ring slots over through `full` and `empty`
// mbarriers, so no CTA-wide barrier runs once tiles start and the producer keeps loading
// while the consumers run a tile's epilogue. That pays where tiles are short (narrow experts,
// and padded up-projections; docs/decisions/0001-sm90-kernel-choice.md).
#ifndef MOE_KERNELS_CUDA_SM90_IMPLS_GROUPED_GEMM_WS_CUH_
#define MOE_KERNELS_CUDA_SM90_IMPLS_GROUPED_GEMM_WS_CUH_

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
          bool kSlotOut = false>
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
  // ---- Phase 0: row-block prefix over experts, offsets cached, the ring's mbarriers.
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
    // ---- Producer: every tile of this CTA, in order, through the ring.
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
    // ---- Consumers: each warpgroup 64 rows of every tile.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
    const int cw = wg - 1;  // rows cw*64 .. cw*64+63 of each tile
    int stage = 0;
    uint32_t phase = 0;
    float acc[kAcc];
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
      const TileInfo ti =
          DecodeTile<kBlockM, kBlockN>(tile, n_tiles, p.group_m, prefix, offs, num_experts);
      const EpiRows rows = LoadEpiRows<kSwiGLU, kSlotOut>(p, ti, cw * 64 + (t_wg >> 3));
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
      int release = -1;  // slot whose wgmmas may still run
      // ---- Main loop: wait for a full slot, issue its wgmmas, release the slot before it.
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
      // ---- Epilogue.
      StoreTile<kN, kSwiGLU>(p, ti, acc, rows, epi + cw * 64 * EpiRowBytes<kSwiGLU>(), t_wg, cw,
                             1 + cw);
    }
  }
}

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_IMPLS_GROUPED_GEMM_WS_CUH_
