// Device helpers shared by the kernels/cuda ops: float/bf16 loads and stores, vector packs,
// warp reductions. Header-only; included by .cu files only.
//
// Elementwise kernels move VEC contiguous elements per thread through one aligned pack so that
// bf16 rows use 16-byte accesses when the row length allows it (Hopper wants 16-byte,
// coalesced accesses; the launchers pick VEC from the shape and fall back to 1 for odd sizes).
#ifndef MOE_KERNELS_CUDA_COMMON_CUH_
#define MOE_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moe::kernels::detail {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// VEC elements of T moved as one aligned access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void LoadVec(const T* p, float (&out)[VEC]) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = ToFloat(pk.v[i]);
}

template <typename T, int VEC>
__device__ __forceinline__ void StoreVec(T* p, const float (&in)[VEC]) {
  Pack<T, VEC> pk;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pk.v[i] = FromFloat<T>(in[i]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum in a fixed order (deterministic); every thread gets the result.
// `scratch` holds at least 32 floats; blockDim.x is a multiple of 32.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  float s = lane < warps ? scratch[lane] : 0.f;
  return WarpSum(s);
}

}  // namespace moe::kernels::detail

#endif  // MOE_KERNELS_CUDA_COMMON_CUH_
