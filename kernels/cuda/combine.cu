// Combine kernel (see combine.h). One block per token; threads own VEC-wide column packs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/combine.h"
#include "kernels/cuda/common.cuh"

namespace moe::kernels {
namespace {

using detail::LoadVec;
using detail::StoreVec;

template <typename Tin, typename Tout, int VEC>
__global__ void combine_kernel(const Tin* __restrict__ y, const int32_t* __restrict__ slot_of,
                               const float* __restrict__ weights, int top_k, int64_t d,
                               Tout* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int32_t* slots = slot_of + t * top_k;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < d;
       j += static_cast<int64_t>(blockDim.x) * VEC) {
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
    for (int k = 0; k < top_k; ++k) {
      const int32_t s = slots[k];
      if (s < 0) continue;
      const float w = weights != nullptr ? weights[t * top_k + k] : 1.f;
      float v[VEC];
      LoadVec<Tin, VEC>(y + static_cast<int64_t>(s) * d + j, v);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = fmaf(w, v[i], acc[i]);
    }
    StoreVec<Tout, VEC>(out + t * d + j, acc);
  }
}

template <typename Tin, typename Tout>
cudaError_t Launch(const void* y, const int32_t* slot_of, const float* weights, int64_t T,
                   int32_t K, int64_t d, void* out, cudaStream_t stream) {
  const auto* yin = static_cast<const Tin*>(y);
  auto* o = static_cast<Tout*>(out);
  constexpr int kVecIn = 16 / sizeof(Tin);
  const bool wide = d % kVecIn == 0 && d % 4 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % (sizeof(Tout) * kVecIn) == 0;
  if (wide) {
    // VEC = 8 for bf16 (16-byte loads), 4 for fp32 (16-byte loads and stores).
    const int64_t packs = d / kVecIn;
    const int threads = packs >= 256 ? 256 : static_cast<int>((packs + 31) / 32 * 32);
    combine_kernel<Tin, Tout, kVecIn>
        <<<static_cast<unsigned>(T), threads, 0, stream>>>(yin, slot_of, weights, K, d, o);
  } else {
    const int threads = d >= 256 ? 256 : static_cast<int>((d + 31) / 32 * 32);
    combine_kernel<Tin, Tout, 1>
        <<<static_cast<unsigned>(T), threads, 0, stream>>>(yin, slot_of, weights, K, d, o);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCombine(const void* y, ElemType y_type, const int32_t* slot_of,
                          const float* weights, int64_t num_tokens, int32_t top_k, int64_t d_model,
                          void* out, ElemType out_type, cudaStream_t stream) {
  if (num_tokens == 0 || d_model == 0) return cudaSuccess;
  if (num_tokens > 0x7fffffff || top_k < 1) return cudaErrorInvalidValue;
  if (y_type == ElemType::kBFloat16 && out_type == ElemType::kBFloat16) {
    return Launch<__nv_bfloat16, __nv_bfloat16>(y, slot_of, weights, num_tokens, top_k, d_model,
                                                out, stream);
  }
  if (y_type == ElemType::kBFloat16 && out_type == ElemType::kFloat32) {
    return Launch<__nv_bfloat16, float>(y, slot_of, weights, num_tokens, top_k, d_model, out,
                                        stream);
  }
  if (y_type == ElemType::kFloat32 && out_type == ElemType::kFloat32) {
    return Launch<float, float>(y, slot_of, weights, num_tokens, top_k, d_model, out, stream);
  }
  return cudaErrorInvalidValue;  // fp32 -> bf16 is not a combination the engine uses
}

}  // namespace moe::kernels
