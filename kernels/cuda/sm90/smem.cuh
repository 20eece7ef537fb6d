// Shared-memory layouts of the grouped GEMM's kernels, in bytes and in order, so that each
// kernel and its launcher (launch.cuh) agree on one formula: the load ring (1024-byte aligned
// for the swizzle), the epilogue staging, the mbarriers, the tile prefix and the cached offsets.
// The ring is sized to fill about 192 KB of the SM's 227 KB.
#ifndef MOE_KERNELS_CUDA_SM90_SMEM_CUH_
#define MOE_KERNELS_CUDA_SM90_SMEM_CUH_

#include <cstdint>

#include "kernels/cuda/sm90/epilogue.cuh"
#include "kernels/cuda/sm90/params.cuh"
#include "kernels/cuda/sm90/ptx.cuh"

namespace moe::kernels::sm90 {

template <int kWarpgroups, int kN, int kStages, bool kSwiGLU>
__host__ __device__ constexpr int SmemBytes() {
  return kStages * (kWarpgroups * 64 * kBlockK * 2 + kN * kBlockK * 2) + 1024 /* alignment */ +
         kWarpgroups * 64 * EpiRowBytes<kSwiGLU>() /* epilogue staging */ +
         kStages * 8 /* mbarriers */ + 2 * (kMaxExperts + 1) * 4 /* prefix, offsets */;
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

template <int kBlockM, int kN, int kStages, bool kSwiGLU>
__host__ __device__ constexpr int PpSmemBytes() {
  return kStages * (kBlockM * kBlockK * 2 + kN * kBlockK * 2) + 1024 /* alignment */ +
         2 * 64 * EpiRowBytes<kSwiGLU>() /* epilogue staging, one 64-row area per consumer */ +
         2 * kStages * 8 /* full, empty */ + 2 * (kMaxExperts + 1) * 4 /* prefix, offsets */;
}

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_SMEM_CUH_
