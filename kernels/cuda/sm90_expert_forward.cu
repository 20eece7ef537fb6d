// Host side of the fused Hopper forward: problem checks, the tile heuristics, tensor-map
// encoding and the switch that turns the runtime config into template constants.
//
// The tensor maps are encoded on every launch (a few microseconds of host work, no device
// sync) rather than cached, because the weights' addresses belong to the caller and may move
// between calls; cuTensorMapEncodeTiled is reached through the runtime's driver entry point so
// nothing here links libcuda directly.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kernels/cuda/sm90_expert_forward.h"
#include "kernels/cuda/sm90_grouped_gemm.cuh"

namespace moe::kernels {
namespace {

using sm90::GemmParams;

bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
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

// A 3-D map over weights [experts][rows][k] (bf16, experts `expert_stride` elements apart),
// boxes of 64 k x box_rows rows, in the 128-byte swizzle the kernel's descriptors expect;
// reads past rows or k fill zeros (so W1's map never reads into a stacked W3 block).
cudaError_t EncodeWeightMap(CUtensorMap* map, const void* weights, int64_t experts, int64_t rows,
                            int64_t k, int64_t expert_stride, int box_rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(experts)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(k) * 2,
                                 static_cast<cuuint64_t>(expert_stride) * 2};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(sm90::kBlockK),
                             static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(weights), dims, strides,
             box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

int SmCount() {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  return sms;
}

template <int kWarpgroups, int kN, int kStages, bool kSwiGLU, bool kTmaB>
cudaError_t LaunchGemm(const GemmParams& params, cudaStream_t stream) {
  auto* kernel = sm90::sm90_grouped_gemm_kernel<kWarpgroups, kN, kStages, kSwiGLU, kTmaB>;
  constexpr int kSmem = sm90::SmemBytes<kWarpgroups, kN, kStages, kSwiGLU>();
  static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 per-block limit");
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const int sms = SmCount();
  if (sms <= 0) return cudaErrorNoDevice;
  kernel<<<sms, kWarpgroups * 128, kSmem, stream>>>(params);
  return cudaGetLastError();
}

template <int kN, int kStages, bool kSwiGLU>
cudaError_t LaunchGemmWs(const GemmParams& params, cudaStream_t stream) {
  auto* kernel = sm90::sm90_grouped_gemm_ws_kernel<kN, kStages, kSwiGLU>;
  constexpr int kSmem = sm90::SmemBytes<2, kN, kStages, kSwiGLU>() + kStages * 8;
  static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 per-block limit");
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const int sms = SmCount();
  if (sms <= 0) return cudaErrorNoDevice;
  kernel<<<sms, 384, kSmem, stream>>>(params);
  return cudaGetLastError();
}

// The one place runtime config becomes template constants. The ring fills ~192 KB of shared
// memory: 4 stages of 128x256 tiles or 6 of 128x128.
template <bool kSwiGLU, bool kTmaB>
cudaError_t LaunchTile(const Sm90GemmConfig& config, const GemmParams& params,
                       cudaStream_t stream) {
  if (config.warp_specialized) {
    if (!kTmaB) return cudaErrorInvalidValue;  // the producer's weights come by TMA
    switch (config.block_n) {
      case 256:
        return LaunchGemmWs<256, 4, kSwiGLU>(params, stream);
      case 128:
        return LaunchGemmWs<128, 6, kSwiGLU>(params, stream);
      default:
        return cudaErrorInvalidValue;  // unsupported block_n
    }
  }
  switch (config.block_n) {
    case 256:
      return LaunchGemm<2, 256, 4, kSwiGLU, kTmaB>(params, stream);
    case 128:
      return LaunchGemm<2, 128, 6, kSwiGLU, kTmaB>(params, stream);
    default:
      return cudaErrorInvalidValue;  // unsupported block_n
  }
}

template <bool kSwiGLU>
cudaError_t DispatchGemm(const Sm90GemmConfig& config, GemmParams& params, const void* b0,
                         const void* b1, cudaStream_t stream) {
  if (config.block_n != 128 && config.block_n != 256) return cudaErrorInvalidValue;
  if (config.group_m < 1) return cudaErrorInvalidValue;
  params.group_m = config.group_m;
  if (!config.tma_weights) return LaunchTile<kSwiGLU, false>(config, params, stream);
  const int box_rows = kSwiGLU ? config.block_n / 2 : config.block_n;
  cudaError_t err = EncodeWeightMap(&params.tmap_b0, b0, params.num_experts, params.n_dim,
                                    params.k_dim, params.b_expert_stride, box_rows);
  if (err == cudaSuccess && kSwiGLU) {
    err = EncodeWeightMap(&params.tmap_b1, b1, params.num_experts, params.n_dim, params.k_dim,
                          params.b_expert_stride, box_rows);
  }
  if (err != cudaSuccess) return err;
  return LaunchTile<kSwiGLU, true>(config, params, stream);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

const char* Sm90CanImplement(const Sm90ExpertProblem& problem) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (problem.num_tokens <= 0) return "num_tokens must be positive";
  if (problem.top_k <= 0) return "top_k must be positive";
  if (problem.num_experts <= 0 || problem.num_experts > sm90::kMaxExperts) {
    return "num_experts must be in [1, 512]";
  }
  if (problem.d_model <= 0 || problem.d_model % 8 != 0) {
    return "d_model must be a positive multiple of 8 (16-byte rows)";
  }
  if (problem.d_hidden <= 0 || problem.d_hidden % 8 != 0) {
    return "d_hidden must be a positive multiple of 8 (16-byte rows)";
  }
  if (problem.num_tokens * problem.top_k > kInt32Max) {
    return "num_tokens * top_k exceeds the int32 range of entries";
  }
  // Row-block counts are int32 tile ids: (N / 128 + experts) * column blocks must fit.
  const int64_t row_blocks =
      CeilDiv(problem.num_tokens * problem.top_k, sm90::kMinBlockM) + problem.num_experts;
  const int64_t col_blocks =
      CeilDiv(2 * static_cast<int64_t>(problem.d_hidden) + problem.d_model, 64);
  if (row_blocks * col_blocks > kInt32Max) return "num_tokens too large for int32 tile ids";
  const int64_t block = static_cast<int64_t>(problem.d_hidden) * problem.d_model;
  if (problem.w13_expert_stride >= 0 &&
      (problem.w13_expert_stride < block || problem.w13_expert_stride % 8 != 0)) {
    return "w13_expert_stride must be -1 or a multiple of 8 no less than d_hidden * d_model";
  }
  return nullptr;
}

bool Sm90DeviceSupported(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
}

Sm90GemmConfig Sm90ChooseConfig(const Sm90ExpertProblem& problem, Sm90Projection projection,
                                int num_sms) {
  Sm90GemmConfig config;
  config.tma_weights = true;
  const int64_t routed =
      problem.num_routed >= 0 ? problem.num_routed : problem.num_tokens * problem.top_k;
  // Expected row blocks: full blocks plus about half a ragged block per expert.
  const int64_t row_blocks = CeilDiv(routed, sm90::kMinBlockM) + problem.num_experts / 2;
  // Output columns per tile: up-projection tiles cover block_n/2 of h (W1 and W3 halves).
  const int64_t n = projection == Sm90Projection::kUpSwiGLU ? problem.d_hidden : problem.d_model;
  const int wide_cols = projection == Sm90Projection::kUpSwiGLU ? 128 : 256;
  // Wide tiles (wgmma N = 256) read each A tile once per 256 weight rows, halving the gather
  // traffic per flop; narrow ones only when h is too small to fill them (up: h <= 64) or when
  // wide tiles would leave SMs idle on the single persistent wave.
  if (n <= wide_cols / 2) {
    config.block_n = 128;
  } else if (row_blocks * CeilDiv(n, wide_cols) < num_sms) {
    config.block_n = 128;
  } else {
    config.block_n = 256;
  }
  // Rasterisation band: as many row blocks as keep their A rows (128 x k bf16 each) within
  // ~24 MB of the 50 MB L2, at most 16, so weights stream once per band.
  const int64_t k = projection == Sm90Projection::kUpSwiGLU ? problem.d_model : problem.d_hidden;
  config.group_m = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(16, (int64_t{24} << 20) / (sm90::kMinBlockM * k * 2))));
  return config;
}

cudaError_t LaunchSm90ExpertUp(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                               const uint16_t* x, const uint16_t* w1, const uint16_t* w3,
                               const int32_t* offsets, const int32_t* entries, uint16_t* h,
                               uint16_t* a, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!Aligned16(x) || !Aligned16(w1) || !Aligned16(w3) || !Aligned16(h) || !Aligned16(a) ||
      offsets == nullptr || entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  GemmParams params = {};
  params.a = reinterpret_cast<const __nv_bfloat16*>(x);
  params.b0 = reinterpret_cast<const __nv_bfloat16*>(w1);
  params.b1 = reinterpret_cast<const __nv_bfloat16*>(w3);
  params.offsets = offsets;
  params.entries = entries;
  params.out0 = reinterpret_cast<__nv_bfloat16*>(h);
  params.out1 = reinterpret_cast<__nv_bfloat16*>(a);
  params.num_experts = problem.num_experts;
  params.k_dim = problem.d_model;
  params.n_dim = problem.d_hidden;
  params.top_k = problem.top_k;
  params.b_expert_stride = problem.w13_expert_stride >= 0
                               ? problem.w13_expert_stride
                               : static_cast<int64_t>(problem.d_hidden) * problem.d_model;
  return DispatchGemm<true>(config, params, w1, w3, stream);
}

cudaError_t LaunchSm90ExpertDown(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                 const uint16_t* a, const uint16_t* w2, const int32_t* offsets,
                                 const int32_t* entries, uint16_t* y, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!Aligned16(a) || !Aligned16(w2) || !Aligned16(y) || offsets == nullptr ||
      entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  GemmParams params = {};
  params.a = reinterpret_cast<const __nv_bfloat16*>(a);
  params.b0 = reinterpret_cast<const __nv_bfloat16*>(w2);
  params.b1 = params.b0;
  params.offsets = offsets;
  params.entries = entries;
  params.out0 = reinterpret_cast<__nv_bfloat16*>(y);
  params.out1 = nullptr;
  params.num_experts = problem.num_experts;
  params.k_dim = problem.d_hidden;
  params.n_dim = problem.d_model;
  params.top_k = problem.top_k;
  params.b_expert_stride = static_cast<int64_t>(problem.d_model) * problem.d_hidden;
  return DispatchGemm<false>(config, params, w2, w2, stream);
}

cudaError_t LaunchSm90Combine(const Sm90ExpertProblem& problem, const uint16_t* y, const float* p,
                              const int32_t* slot_of, uint16_t* out, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!Aligned16(y) || !Aligned16(out) || p == nullptr || slot_of == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t work = problem.num_tokens * (problem.d_model / 8);
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(CeilDiv(work, threads), 1 << 20));
  sm90::sm90_combine_kernel<<<blocks, threads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(y), p, slot_of, reinterpret_cast<__nv_bfloat16*>(out),
      problem.num_tokens, problem.top_k, problem.d_model);
  return cudaGetLastError();
}

}  // namespace moe::kernels
