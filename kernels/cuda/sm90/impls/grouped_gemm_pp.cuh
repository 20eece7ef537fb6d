// sm90_grouped_gemm_pp_kernel: the ping-pong grouped GEMM. The producer of the warp-specialised
// kernel, but each consumer warpgroup takes whole tiles in turn, so that one's epilogue overlaps
// the other's MMAs; optionally the weight tile is multicast over a 2-CTA cluster. Its 64-row
// consumer tiles pay where 128-row tiles would pad many rows
// (docs/decisions/0001-sm90-kernel-choice.md).
#ifndef MOE_KERNELS_CUDA_SM90_IMPLS_GROUPED_GEMM_PP_CUH_
#define MOE_KERNELS_CUDA_SM90_IMPLS_GROUPED_GEMM_PP_CUH_

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
// 64 x 256 beats the other kernels where 128-row tiles pad many rows (padded up-projections);
// elsewhere the smaller consumer tile's extra weight traffic (a 64 x 256 tile loads the weights
// of a 128 x 256 one) outweighs the overlap, and 128 x 128 (two m64n128 per k16) is slower
// still (docs/decisions/0001-sm90-kernel-choice.md; engine/cuda/kernel_selection.h says where).
// setmaxnreg budgets: the ws kernel's. A 40-register producer (consumers 232) made ptxas spill
// 4-8 bytes in the 128-row variants; 224 holds the consumers' 128 accumulators without spills.
constexpr int kPpProducerRegs = 56;
constexpr int kPpConsumerRegs = 224;
static_assert(128 * kPpProducerRegs + 256 * kPpConsumerRegs <= 65536, "register file");

template <int kBlockM, int kN, int kStages, bool kSwiGLU, bool kGatherA = kSwiGLU,
          bool kTransB = false, bool kSlotOut = false, bool kMulticastB = false>
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
  // ---- Phase 0: row-block prefix over experts, offsets cached, the ring's mbarriers (and, with
  // kMulticastB, the other CTA's).
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
    // ---- Consumers: whole tiles in turn (consumer c: this CTA's tiles c, c + 2, ...).
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
        rows[hf] = LoadEpiRows<kSwiGLU, kSlotOut>(p, ti, hf * 64 + (t_wg >> 3));
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
      // ---- Main loop: the wgmmas of every 64-row half per k16, the slot before released.
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
          StoreTile<kN, kSwiGLU>(p, ti, acc[hf], rows[hf], stage_rows, t_wg, hf, 1 + cw);
        }
      }
    }
  }
  // No CTA of a cluster leaves while the other may still multicast into it or arrive on its
  // `empty` barriers.
  if constexpr (kMulticastB) ClusterSync();
}

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_IMPLS_GROUPED_GEMM_PP_CUH_
