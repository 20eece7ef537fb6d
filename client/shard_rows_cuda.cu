// ShardedLayer's GPU ops (see shard_rows.h): per-shard flags with the first bad id, CUB's stable
// compaction of the flagged token indices, and the float32 scatter-add of a shard's partial.
#include <cub/device/device_select.cuh>
#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>

#include <algorithm>
#include <cstdint>

#include "client/shard_rows.h"

namespace moe::client::shard_rows {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 132 * 64;

unsigned Blocks(int64_t work, int64_t per_block) {
  return static_cast<unsigned>(std::max<int64_t>(
      1, std::min<int64_t>((work + per_block - 1) / per_block, kMaxBlocks)));
}

// summary: counts zeroed (DeviceSelect writes them), no bad id yet.
__global__ void init_summary_kernel(int32_t* summary, int32_t num_shards) {
  for (int32_t i = threadIdx.x; i < num_shards + 2; i += blockDim.x) {
    summary[i] = i == num_shards ? kNoBadId : 0;
  }
}

// One thread per token: its flag for every shard, and the smallest bad (t, j) index.
__global__ void shard_flags_kernel(const int32_t* __restrict__ ids, int64_t tokens, int32_t top_k,
                                   const int32_t* __restrict__ shard_of, int32_t num_experts,
                                   int32_t num_shards, uint8_t* __restrict__ flags,
                                   int32_t* __restrict__ bad_index) {
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t* row = ids + t * top_k;
    for (int32_t s = 0; s < num_shards; ++s) flags[s * tokens + t] = 0;
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t e = row[j];
      if (e < 0 || e >= num_experts) {
        atomicMin(bad_index, static_cast<int32_t>(t * top_k + j));
        continue;
      }
      flags[static_cast<int64_t>(shard_of[e]) * tokens + t] = 1;
    }
  }
}

// The bad id itself, next to its index (summary[num_shards]).
__global__ void bad_id_kernel(const int32_t* ids, int32_t* summary, int32_t num_shards) {
  const int32_t at = summary[num_shards];
  if (at != kNoBadId) summary[num_shards + 1] = ids[at];
}

// One warp per row, V = float or float4.
template <typename V>
__global__ void scatter_add_kernel(const V* __restrict__ src, const int32_t* __restrict__ rows,
                                   int64_t num_rows, int64_t row_vecs, V* __restrict__ dst) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       r < num_rows; r += warps) {
    const V* s = src + r * row_vecs;
    V* d = dst + static_cast<int64_t>(rows[r]) * row_vecs;
    for (int64_t j = lane; j < row_vecs; j += 32) {
      V a = d[j];
      const V b = s[j];
      if constexpr (sizeof(V) == sizeof(float4)) {
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
      } else {
        a += b;
      }
      d[j] = a;
    }
  }
}

}  // namespace

cudaError_t SelectTempBytes(int64_t tokens, size_t* bytes) {
  *bytes = 0;
  // The same instantiation as SelectShardRows's calls, so the size is theirs.
  return cub::DeviceSelect::Flagged(nullptr, *bytes, thrust::counting_iterator<int32_t>(0),
                                    static_cast<const uint8_t*>(nullptr),
                                    static_cast<int32_t*>(nullptr),
                                    static_cast<int32_t*>(nullptr), tokens);
}

cudaError_t SelectShardRows(const int32_t* ids, int64_t tokens, int32_t top_k,
                            const int32_t* shard_of, int32_t num_experts, int32_t num_shards,
                            uint8_t* flags, int32_t* rows, int32_t* summary, void* temp,
                            size_t temp_bytes, cudaStream_t stream) {
  if (tokens < 0 || top_k < 1 || num_shards < 1 || tokens * top_k > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  init_summary_kernel<<<1, 32, 0, stream>>>(summary, num_shards);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (tokens == 0) return cudaSuccess;
  shard_flags_kernel<<<Blocks(tokens, kThreads), kThreads, 0, stream>>>(
      ids, tokens, top_k, shard_of, num_experts, num_shards, flags, summary + num_shards);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  bad_id_kernel<<<1, 1, 0, stream>>>(ids, summary, num_shards);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  for (int32_t s = 0; s < num_shards; ++s) {
    size_t bytes = temp_bytes;
    if (cudaError_t e = cub::DeviceSelect::Flagged(
            temp, bytes, thrust::counting_iterator<int32_t>(0),
            static_cast<const uint8_t*>(flags + s * tokens), rows + s * tokens, summary + s,
            tokens, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

cudaError_t ScatterAddRows(const float* src, const int32_t* rows, int64_t num_rows,
                           int64_t width, float* dst, cudaStream_t stream) {
  if (num_rows < 0 || width < 1) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  const unsigned blocks = Blocks(num_rows, kThreads / 32);
  const bool vec4 = width % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (vec4) {
    scatter_add_kernel<float4><<<blocks, kThreads, 0, stream>>>(
        reinterpret_cast<const float4*>(src), rows, num_rows, width / 4,
        reinterpret_cast<float4*>(dst));
  } else {
    scatter_add_kernel<float><<<blocks, kThreads, 0, stream>>>(src, rows, num_rows, width, dst);
  }
  return cudaGetLastError();
}

}  // namespace moe::client::shard_rows
