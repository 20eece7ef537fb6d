// Host-side launch plumbing of the persistent grouped GEMM (impls/grouped_gemm*.cuh), shared by
// the fused forward (sm90_expert_forward.cu) and the fused backward's data gradients
// (sm90_expert_backward.cu): tensor-map encoding, and the one switch that turns a runtime
// Sm90GemmConfig into the kernel's template constants.
//
// Tensor maps are encoded on every launch (a few microseconds of host work, no device sync)
// rather than cached, because the weights' addresses belong to the caller and may move between
// calls; cuTensorMapEncodeTiled is reached through the runtime's driver entry point so nothing
// here links libcuda directly. Only .cu files include this (it instantiates kernels).
#ifndef MOE_KERNELS_CUDA_SM90_LAUNCH_CUH_
#define MOE_KERNELS_CUDA_SM90_LAUNCH_CUH_

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/sm90/impls/grouped_gemm.cuh"
#include "kernels/cuda/sm90/impls/grouped_gemm_pp.cuh"
#include "kernels/cuda/sm90/impls/grouped_gemm_ws.cuh"
#include "kernels/cuda/sm90/params.cuh"
#include "kernels/cuda/sm90/smem.cuh"
#include "kernels/cuda/sm90_expert_forward.h"

namespace moe::kernels::sm90 {

inline bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The parameters every grouped-GEMM launch sets: A rows (x, dout, A or dH), the weights B (b1:
// W3 in the up-projection, else the same as b0), the dispatch index, the first output, the
// reduction (k) and output (n) widths and the elements between experts' weight blocks. The
// epilogue's extra outputs are the caller's to add.
inline GemmParams MakeGemmParams(const Sm90ExpertProblem& problem, const uint16_t* a,
                                 const uint16_t* b0, const uint16_t* b1, const int32_t* offsets,
                                 const int32_t* entries, uint16_t* out0, int32_t k_dim,
                                 int32_t n_dim, int64_t b_expert_stride) {
  GemmParams params = {};
  params.a = reinterpret_cast<const __nv_bfloat16*>(a);
  params.b0 = reinterpret_cast<const __nv_bfloat16*>(b0);
  params.b1 = reinterpret_cast<const __nv_bfloat16*>(b1);
  params.offsets = offsets;
  params.entries = entries;
  params.out0 = reinterpret_cast<__nv_bfloat16*>(out0);
  params.out1 = nullptr;
  params.num_experts = problem.num_experts;
  params.k_dim = k_dim;
  params.n_dim = n_dim;
  params.top_k = problem.top_k;
  params.b_expert_stride = b_expert_stride;
  // Every routed row is one of the T*K (token, k) pairs, so the caller's A holds at most that
  // many; the ws kernel's A map reads only rows below the last expert's end.
  params.a_rows = problem.num_tokens * problem.top_k;
  return params;
}

inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A 3-D map over weights [experts][rows][inner] (bf16, experts `expert_stride` elements apart),
// boxes of 64 inner x box_rows rows, in the 128-byte swizzle the kernel's descriptors expect;
// reads past rows or inner fill zeros (so W1's map never reads into a stacked W3 block). For
// a K-major operand inner is the reduction; for an MN-major one (kTransB) inner is the output
// column and the rows are the reduction (box 64 x 64).
inline cudaError_t EncodeWeightMap(CUtensorMap* map, const void* weights, int64_t experts,
                                   int64_t rows, int64_t inner, int64_t expert_stride,
                                   int box_rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(experts)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(inner) * 2,
                                 static_cast<cuuint64_t>(expert_stride) * 2};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kBlockK), static_cast<cuuint32_t>(box_rows),
                             1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(weights), dims, strides,
             box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// A 2-D map over rows read in slot order ([rows][row_elems] bf16), boxes of 64 elements x
// box_rows rows in the 128-byte swizzle: the grouped GEMM's A tiles (box_rows 128) and the
// weight gradients' slot-order operand (a slab, box_rows rows).
inline cudaError_t EncodeSlotRowsMap(CUtensorMap* map, const void* data, int64_t rows,
                                     int64_t row_elems, int box_rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_elems), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_elems) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBlockK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(data), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

inline int SmCount() {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  return sms;
}

// The compile-time choices of one use of the grouped GEMM (see sm90_grouped_gemm_kernel).
// The forward's up-projection is <true, true, false, false>, its down-projection
// <false, false, false, false>; the backward's dA <false, true, true, true> and dXg
// <false, false, true, true>.
template <bool kSwiGLU, bool kGatherA, bool kTransB, bool kSlotOut>
struct GemmVariant {};

// One persistent launch of `kernel`: a CTA of `threads` threads on every SM, kSmem bytes of
// dynamic shared memory each (the kernels walk their tiles from blockIdx.x in steps of gridDim.x).
template <int kSmem, typename Kernel>
cudaError_t LaunchPersistent(Kernel kernel, int threads, const GemmParams& params,
                             cudaStream_t stream) {
  static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 per-block limit");
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const int sms = SmCount();
  if (sms <= 0) return cudaErrorNoDevice;
  kernel<<<sms, threads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

template <int kWarpgroups, int kN, int kStages, bool kTmaB, bool kSwiGLU, bool kGatherA,
          bool kTransB, bool kSlotOut>
cudaError_t LaunchGemm(GemmVariant<kSwiGLU, kGatherA, kTransB, kSlotOut>, const GemmParams& params,
                       cudaStream_t stream) {
  auto* kernel = sm90_grouped_gemm_kernel<kWarpgroups, kN, kStages, kSwiGLU, kTmaB, kGatherA,
                                          kTransB, kSlotOut>;
  return LaunchPersistent<SmemBytes<kWarpgroups, kN, kStages, kSwiGLU>()>(kernel, kWarpgroups * 128,
                                                                          params, stream);
}

template <int kN, int kStages, bool kSwiGLU, bool kGatherA, bool kTransB, bool kSlotOut>
cudaError_t LaunchGemmWs(GemmVariant<kSwiGLU, kGatherA, kTransB, kSlotOut>,
                         const GemmParams& params, cudaStream_t stream) {
  auto* kernel = sm90_grouped_gemm_ws_kernel<kN, kStages, kSwiGLU, kGatherA, kTransB, kSlotOut>;
  return LaunchPersistent<SmemBytes<2, kN, kStages, kSwiGLU>() + kStages * 8>(kernel, 384, params,
                                                                              stream);
}

// kBlockM rows x kN columns per consumer tile; group_m stays in 128-row blocks for the caller,
// so smaller decoded tiles band proportionally more of theirs. kMulticastB launches clusters of
// 2 CTAs, as many as can be resident at once (cudaOccupancyMaxActiveClusters), which can be
// fewer than half the SMs.
template <int kBlockM, int kN, int kStages, bool kMulticastB, bool kSwiGLU, bool kGatherA,
          bool kTransB, bool kSlotOut>
cudaError_t LaunchGemmPp(GemmVariant<kSwiGLU, kGatherA, kTransB, kSlotOut>,
                         const GemmParams& params, cudaStream_t stream) {
  auto* kernel = sm90_grouped_gemm_pp_kernel<kBlockM, kN, kStages, kSwiGLU, kGatherA, kTransB,
                                             kSlotOut, kMulticastB>;
  constexpr int kSmem = PpSmemBytes<kBlockM, kN, kStages, kSwiGLU>();
  constexpr int kCluster = kMulticastB ? 2 : 1;
  GemmParams pp = params;
  pp.group_m = std::max(1, params.group_m * kMinBlockM / (kBlockM * kCluster));
  if constexpr (!kMulticastB) {
    return LaunchPersistent<kSmem>(kernel, 384, pp, stream);
  } else {
    static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 per-block limit");
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    const int sms = SmCount();
    if (sms <= 0) return cudaErrorNoDevice;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = kCluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t launch = {};
    launch.gridDim = dim3(sms / kCluster * kCluster);
    launch.blockDim = dim3(384);
    launch.dynamicSmemBytes = kSmem;
    launch.stream = stream;
    launch.attrs = &attr;
    launch.numAttrs = 1;
    int clusters = 0;
    err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch);
    if (err != cudaSuccess) return err;
    if (clusters <= 0) return cudaErrorInvalidConfiguration;
    launch.gridDim = dim3(std::min(clusters, sms / kCluster) * kCluster);
    return cudaLaunchKernelEx(&launch, kernel, pp);
  }
}

// The one place runtime config becomes template constants. The ring fills ~192 KB of shared
// memory: 4 stages of 128x256 tiles or 6 of 128x128; ping-pong: 6 stages of 128x128 (block_n
// 128) or 4 of 64x256 (block_n 256), 160-192 KB.
template <bool kTmaB, typename Variant>
cudaError_t LaunchTile(Variant variant, const Sm90GemmConfig& config, const GemmParams& params,
                       cudaStream_t stream) {
  if (config.ping_pong) {
    if constexpr (!kTmaB) {
      return cudaErrorInvalidValue;  // the producer's weights come by TMA
    } else {
      switch (config.block_n * (config.multicast_b ? -1 : 1)) {
        case 256:
          return LaunchGemmPp<64, 256, 4, false>(variant, params, stream);
        case 128:
          return LaunchGemmPp<128, 128, 6, false>(variant, params, stream);
        case -256:
          return LaunchGemmPp<64, 256, 4, true>(variant, params, stream);
        case -128:
          return LaunchGemmPp<128, 128, 6, true>(variant, params, stream);
        default:
          return cudaErrorInvalidValue;  // unsupported block_n
      }
    }
  }
  if (config.warp_specialized) {
    if constexpr (!kTmaB) {
      return cudaErrorInvalidValue;  // the producer's weights come by TMA
    } else {
      switch (config.block_n) {
        case 256:
          return LaunchGemmWs<256, 4>(variant, params, stream);
        case 128:
          return LaunchGemmWs<128, 6>(variant, params, stream);
        default:
          return cudaErrorInvalidValue;  // unsupported block_n
      }
    }
  }
  switch (config.block_n) {
    case 256:
      return LaunchGemm<2, 256, 4, kTmaB>(variant, params, stream);
    case 128:
      return LaunchGemm<2, 128, 6, kTmaB>(variant, params, stream);
    default:
      return cudaErrorInvalidValue;  // unsupported block_n
  }
}

// Validates the config, encodes the weight maps (b1 only for kSwiGLU) and launches. For
// kTransB the weights are [experts][k_dim][n_dim] and the map's boxes are 64 n x 64 k.
template <bool kSwiGLU, bool kGatherA, bool kTransB, bool kSlotOut>
cudaError_t DispatchGemm(GemmVariant<kSwiGLU, kGatherA, kTransB, kSlotOut> variant,
                         const Sm90GemmConfig& config, GemmParams& params, const void* b0,
                         const void* b1, cudaStream_t stream) {
  if (config.block_n != 128 && config.block_n != 256) return cudaErrorInvalidValue;
  if (config.group_m < 1) return cudaErrorInvalidValue;
  // The weight multicast exists only in the ping-pong kernel: asked for without it, refuse
  // rather than silently run another kernel than the one requested.
  if (config.multicast_b && !config.ping_pong) return cudaErrorInvalidValue;
  params.group_m = config.group_m;
  if (!config.tma_weights) return LaunchTile<false>(variant, config, params, stream);
  cudaError_t err;
  if constexpr (kTransB) {
    err = EncodeWeightMap(&params.tmap_b0, b0, params.num_experts, params.k_dim, params.n_dim,
                          params.b_expert_stride, 64);
  } else {
    // kSwiGLU: W1's and W3's halves of the tile; multicast: each CTA of a pair loads half.
    const bool halves = kSwiGLU || (config.ping_pong && config.multicast_b);
    const int box_rows = halves ? config.block_n / 2 : config.block_n;
    err = EncodeWeightMap(&params.tmap_b0, b0, params.num_experts, params.n_dim, params.k_dim,
                          params.b_expert_stride, box_rows);
    if (err == cudaSuccess && kSwiGLU) {
      err = EncodeWeightMap(&params.tmap_b1, b1, params.num_experts, params.n_dim, params.k_dim,
                            params.b_expert_stride, box_rows);
    }
  }
  // The plain and ws kernels load full tiles of an A read in slot order by TMA too.
  if (err == cudaSuccess && !config.ping_pong && !kGatherA) {
    err = EncodeSlotRowsMap(&params.tmap_a, params.a, params.a_rows, params.k_dim, kMinBlockM);
  }
  if (err != cudaSuccess) return err;
  return LaunchTile<true>(variant, config, params, stream);
}

}  // namespace moe::kernels::sm90

#endif  // MOE_KERNELS_CUDA_SM90_LAUNCH_CUH_
