// Benchmark input generation and the CUB radix-sort dispatch baseline (see bench_kernels.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/device/device_radix_sort.cuh>

#include "bench/bench_kernels.h"

namespace moe::bench {
namespace {

__device__ __forceinline__ uint64_t Mix(uint64_t v) {
  v += 0x9e3779b97f4a7c15ull;
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
  return v ^ (v >> 31);
}

__device__ __forceinline__ float Normal(uint64_t seed, int64_t i) {
  const uint64_t k = Mix(Mix(seed) ^ static_cast<uint64_t>(i));
  const float u1 = (static_cast<float>(k >> 40) + 1.f) * (1.f / 16777216.f);
  const float u2 = static_cast<float>(k & 0xffffff) * (1.f / 16777216.f);
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

template <typename T>
__global__ void fill_normal_kernel(T* dst, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = scale * Normal(seed, i);
    if constexpr (sizeof(T) == 2) {
      dst[i] = __float2bfloat16_rn(v);
    } else {
      dst[i] = v;
    }
  }
}

__global__ void iota_kernel(int32_t* v, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    v[i] = static_cast<int32_t>(i);
  }
}

// offsets[e] = first position of a key >= e in the sorted keys (binary search), counts[e].
__global__ void offsets_kernel(const int32_t* sorted, int64_t n, int num_experts, int32_t* offsets,
                               int32_t* counts) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e > num_experts) return;
  auto lower = [&](int key) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (sorted[mid] < key)
        lo = mid + 1;
      else
        hi = mid;
    }
    return static_cast<int32_t>(lo);
  };
  const int32_t begin = lower(e);
  offsets[e] = begin;
  if (e < num_experts) counts[e] = lower(e + 1) - begin;
}

__global__ void scatter_slots_kernel(const int32_t* entries, int64_t n, int32_t* slot_of) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    slot_of[entries[i]] = static_cast<int32_t>(i);
  }
}

unsigned Grid(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 16)));
}

int EndBit(int32_t num_experts) {
  int bits = 1;
  while ((1 << bits) < num_experts) ++bits;
  return bits;
}

size_t Align(size_t v) { return (v + 255) & ~size_t{255}; }

}  // namespace

cudaError_t FillNormalBf16(void* dst, int64_t n, float scale, uint64_t seed, cudaStream_t stream) {
  fill_normal_kernel<<<Grid(n), 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), n, scale, seed);
  return cudaGetLastError();
}

cudaError_t FillNormalF32(float* dst, int64_t n, float scale, uint64_t seed, cudaStream_t stream) {
  fill_normal_kernel<<<Grid(n), 256, 0, stream>>>(dst, n, scale, seed);
  return cudaGetLastError();
}

size_t CubSortDispatchWorkspaceBytes(int64_t num_tokens, int32_t top_k, int32_t num_experts) {
  const int64_t n = num_tokens * top_k;
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(
      nullptr, temp, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(n), 0,
      EndBit(num_experts));
  return Align(temp) + 2 * Align(static_cast<size_t>(n) * 4);
}

cudaError_t CubSortDispatch(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                            int32_t num_experts, int32_t* counts, int32_t* offsets,
                            int32_t* entries, int32_t* slot_of, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
  const int64_t n = num_tokens * top_k;
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(
      nullptr, temp, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(n), 0,
      EndBit(num_experts));
  if (workspace_bytes < Align(temp) + 2 * Align(static_cast<size_t>(n) * 4)) {
    return cudaErrorInvalidValue;
  }
  char* ws = static_cast<char*>(workspace);
  auto* values_in = reinterpret_cast<int32_t*>(ws + Align(temp));
  auto* keys_out = reinterpret_cast<int32_t*>(ws + Align(temp) + Align(static_cast<size_t>(n) * 4));
  iota_kernel<<<Grid(n), 256, 0, stream>>>(values_in, n);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e =
          cub::DeviceRadixSort::SortPairs(ws, temp, expert_ids, keys_out, values_in, entries,
                                          static_cast<int>(n), 0, EndBit(num_experts), stream);
      e != cudaSuccess) {
    return e;
  }
  offsets_kernel<<<(num_experts + 1 + 255) / 256, 256, 0, stream>>>(keys_out, n, num_experts,
                                                                    offsets, counts);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  scatter_slots_kernel<<<Grid(n), 256, 0, stream>>>(entries, n, slot_of);
  return cudaGetLastError();
}

}  // namespace moe::bench
