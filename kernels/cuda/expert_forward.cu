// Activation forward kernel (see expert_forward.h). Grid-stride over VEC-wide packs of A.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/expert_forward.h"

namespace moe::kernels {
namespace {

using detail::LoadVec;
using detail::StoreVec;

template <typename T, int ACT, int VEC>
__global__ void activation_forward_kernel(const T* __restrict__ h, int64_t rows, int64_t hidden,
                                          T* __restrict__ a) {
  constexpr bool kGated = ACT == detail::kActSwiGLU;
  const int64_t packs_per_row = hidden / VEC;
  const int64_t total = rows * packs_per_row;
  const int64_t h_stride = kGated ? 2 * hidden : hidden;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / packs_per_row;
    const int64_t j = (i - r * packs_per_row) * VEC;
    float g[VEC], out[VEC];
    LoadVec<T, VEC>(h + r * h_stride + j, g);
    if constexpr (kGated) {
      float u[VEC];
      LoadVec<T, VEC>(h + r * h_stride + hidden + j, u);
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[v] = detail::Act<ACT>(g[v]) * u[v];
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[v] = detail::Act<ACT>(g[v]);
    }
    StoreVec<T, VEC>(a + r * hidden + j, out);
  }
}

template <typename T, int ACT>
cudaError_t LaunchTyped(const void* h, int64_t rows, int64_t hidden, void* a, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const auto* hp = static_cast<const T*>(h);
  auto* ap = static_cast<T*>(a);
  const bool aligned =
      reinterpret_cast<uintptr_t>(h) % 16 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0;
  constexpr int kWide = 16 / sizeof(T);
  const int vec = aligned && hidden % kWide == 0 ? kWide : (hidden % 2 == 0 ? 2 : 1);
  const int64_t total = rows * hidden / vec;
  const unsigned blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, 132 * 32)));
  if (vec == kWide) {
    activation_forward_kernel<T, ACT, kWide><<<blocks, kThreads, 0, stream>>>(hp, rows, hidden, ap);
  } else if (vec == 2) {
    activation_forward_kernel<T, ACT, 2><<<blocks, kThreads, 0, stream>>>(hp, rows, hidden, ap);
  } else {
    activation_forward_kernel<T, ACT, 1><<<blocks, kThreads, 0, stream>>>(hp, rows, hidden, ap);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchForAct(int activation, const void* h, int64_t rows, int64_t hidden, void* a,
                         cudaStream_t stream) {
  switch (activation) {
    case detail::kActSwiGLU:
      return LaunchTyped<T, detail::kActSwiGLU>(h, rows, hidden, a, stream);
    case detail::kActSiLU:
      return LaunchTyped<T, detail::kActSiLU>(h, rows, hidden, a, stream);
    case detail::kActGeLUTanh:
      return LaunchTyped<T, detail::kActGeLUTanh>(h, rows, hidden, a, stream);
    case detail::kActReLU:
      return LaunchTyped<T, detail::kActReLU>(h, rows, hidden, a, stream);
    default:
      return cudaErrorInvalidValue;  // unknown activation code
  }
}

}  // namespace

cudaError_t LaunchActivationForward(const void* h, ElemType type, int activation, int64_t rows,
                                    int64_t hidden, void* a, cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return cudaSuccess;
  switch (type) {
    case ElemType::kFloat32:
      return LaunchForAct<float>(activation, h, rows, hidden, a, stream);
    case ElemType::kBFloat16:
      return LaunchForAct<__nv_bfloat16>(activation, h, rows, hidden, a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moe::kernels
