// Row gather kernel (see gather.h). One warp per row, grid-stride over rows.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/gather.h"

namespace moe::kernels {
namespace {

template <typename V>
__global__ void gather_rows_kernel(const V* __restrict__ src, int64_t row_vecs,
                                   const int32_t* __restrict__ entries, int top_k, int64_t num_rows,
                                   V* __restrict__ dst) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < num_rows;
       r += warps) {
    const V* s = src + static_cast<int64_t>(entries[r] / top_k) * row_vecs;
    V* o = dst + r * row_vecs;
    for (int64_t j = lane; j < row_vecs; j += 32) o[j] = s[j];
  }
}

template <typename V>
cudaError_t Launch(const void* src, size_t row_bytes, const int32_t* entries, int32_t top_k,
                   int64_t num_rows, void* dst, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((num_rows + 7) / 8, 132 * 64);
  gather_rows_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const V*>(src), static_cast<int64_t>(row_bytes / sizeof(V)), entries, top_k,
      num_rows, static_cast<V*>(dst));
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchGatherRows(const void* src, size_t row_bytes, const int32_t* entries,
                             int32_t top_k, int64_t num_rows, void* dst, cudaStream_t stream) {
  if (row_bytes % 2 != 0 || top_k < 1) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  const auto aligned = [&](size_t a) {
    return row_bytes % a == 0 && reinterpret_cast<uintptr_t>(src) % a == 0 &&
           reinterpret_cast<uintptr_t>(dst) % a == 0;
  };
  if (aligned(16)) return Launch<uint4>(src, row_bytes, entries, top_k, num_rows, dst, stream);
  if (aligned(4)) return Launch<uint32_t>(src, row_bytes, entries, top_k, num_rows, dst, stream);
  return Launch<uint16_t>(src, row_bytes, entries, top_k, num_rows, dst, stream);
}

}  // namespace moe::kernels
