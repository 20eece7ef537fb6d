// Fused activation backward kernel (see expert_backward.h). One block per row.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/expert_backward.h"

namespace moe::kernels {
namespace {

using detail::LoadVec;
using detail::StoreVec;

template <typename T, int ACT, int VEC>
__global__ void activation_backward_kernel(const T* __restrict__ h, const T* __restrict__ da,
                                           const int32_t* __restrict__ entries,
                                           const float* __restrict__ weights, int64_t hidden,
                                           T* __restrict__ dh, T* __restrict__ a_scaled,
                                           float* __restrict__ dweights) {
  constexpr bool kGated = ACT == detail::kActSwiGLU;
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int32_t entry = entries[r];
  const float p = weights[entry];
  const int64_t g_stride = kGated ? 2 * hidden : hidden;
  const T* hr = h + r * g_stride;
  T* dhr = dh + r * g_stride;
  float dot = 0.f;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < hidden;
       j += static_cast<int64_t>(blockDim.x) * VEC) {
    float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC], ap[VEC];
    LoadVec<T, VEC>(hr + j, g);
    LoadVec<T, VEC>(da + r * hidden + j, d);
    if constexpr (kGated) LoadVec<T, VEC>(hr + hidden + j, u);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      float f, df;
      detail::ActAndGrad<ACT>(g[v], &f, &df);
      const float a = kGated ? f * u[v] : f;
      dot = fmaf(d[v], a, dot);
      const float dav = p * d[v];
      dg[v] = kGated ? dav * u[v] * df : dav * df;
      du[v] = dav * f;
      ap[v] = p * a;
    }
    StoreVec<T, VEC>(dhr + j, dg);
    if constexpr (kGated) StoreVec<T, VEC>(dhr + hidden + j, du);
    StoreVec<T, VEC>(a_scaled + r * hidden + j, ap);
  }
  if (dweights != nullptr) {
    dot = detail::BlockSum(dot, scratch);
    if (threadIdx.x == 0) dweights[entry] = dot;
  }
}

template <typename T, int ACT>
cudaError_t LaunchTyped(const void* h, const void* da, const int32_t* entries, const float* weights,
                        int64_t rows, int64_t hidden, void* dh, void* a_scaled, float* dweights,
                        cudaStream_t stream) {
  constexpr int kWide = 16 / sizeof(T);
  const bool aligned =
      reinterpret_cast<uintptr_t>(h) % 16 == 0 && reinterpret_cast<uintptr_t>(da) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(dh) % 16 == 0 && reinterpret_cast<uintptr_t>(a_scaled) % 16 == 0;
  const int vec = aligned && hidden % kWide == 0 ? kWide : (hidden % 2 == 0 ? 2 : 1);
  const int64_t packs = hidden / vec;
  const int threads = packs >= 256 ? 256 : static_cast<int>((packs + 31) / 32 * 32);
  const auto* hp = static_cast<const T*>(h);
  const auto* dap = static_cast<const T*>(da);
  auto* dhp = static_cast<T*>(dh);
  auto* app = static_cast<T*>(a_scaled);
  const unsigned blocks = static_cast<unsigned>(rows);
  if (vec == kWide) {
    activation_backward_kernel<T, ACT, kWide>
        <<<blocks, threads, 0, stream>>>(hp, dap, entries, weights, hidden, dhp, app, dweights);
  } else if (vec == 2) {
    activation_backward_kernel<T, ACT, 2>
        <<<blocks, threads, 0, stream>>>(hp, dap, entries, weights, hidden, dhp, app, dweights);
  } else {
    activation_backward_kernel<T, ACT, 1>
        <<<blocks, threads, 0, stream>>>(hp, dap, entries, weights, hidden, dhp, app, dweights);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchForAct(int activation, const void* h, const void* da, const int32_t* entries,
                         const float* weights, int64_t rows, int64_t hidden, void* dh,
                         void* a_scaled, float* dweights, cudaStream_t stream) {
  switch (activation) {
    case detail::kActSwiGLU:
      return LaunchTyped<T, detail::kActSwiGLU>(h, da, entries, weights, rows, hidden, dh, a_scaled,
                                                dweights, stream);
    case detail::kActSiLU:
      return LaunchTyped<T, detail::kActSiLU>(h, da, entries, weights, rows, hidden, dh, a_scaled,
                                              dweights, stream);
    case detail::kActGeLUTanh:
      return LaunchTyped<T, detail::kActGeLUTanh>(h, da, entries, weights, rows, hidden, dh,
                                                  a_scaled, dweights, stream);
    case detail::kActReLU:
      return LaunchTyped<T, detail::kActReLU>(h, da, entries, weights, rows, hidden, dh, a_scaled,
                                              dweights, stream);
    default:
      return cudaErrorInvalidValue;  // unknown activation code
  }
}

}  // namespace

cudaError_t LaunchActivationBackward(const void* h, const void* da, const int32_t* entries,
                                     const float* weights, ElemType type, int activation,
                                     int64_t rows, int64_t hidden, void* dh, void* a_scaled,
                                     float* dweights, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff || hidden < 1) return cudaErrorInvalidValue;
  switch (type) {
    case ElemType::kFloat32:
      return LaunchForAct<float>(activation, h, da, entries, weights, rows, hidden, dh, a_scaled,
                                 dweights, stream);
    case ElemType::kBFloat16:
      return LaunchForAct<__nv_bfloat16>(activation, h, da, entries, weights, rows, hidden, dh,
                                         a_scaled, dweights, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moe::kernels
