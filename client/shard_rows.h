// The GPU ops of ShardedLayer's device path (client/sharded_device_cuda.cc): which rows of a
// micro-batch each shard gets, and the sum of the shards' partial results. Raw pointers, sizes
// and a stream; cudaError_t; no Abseil, gRPC or protobuf (the .cu is compiled by nvcc). Rows are
// gathered with kernels/cuda/gather.h (top_k 1).
//
// Each shard's rows are the tokens with at least one top-K pick in its expert range, in
// ascending token order (what the host path sends): a flag per (shard, token), then CUB's
// DeviceSelect::Flagged over the token indices, which is a stable, deterministic compaction.
// Scatter-adds touch each destination row once per shard and run shard after shard on one
// stream, so every output element is 0 + p_0 + p_1 + ... in shard order, in float32, exactly the
// host path's sums.
#ifndef MOE_CLIENT_SHARD_ROWS_H_
#define MOE_CLIENT_SHARD_ROWS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe::client::shard_rows {

// What SelectShardRows leaves in `summary` (int32 [num_shards + 2]): each shard's row count,
// then the linear index t * K + j of the first id outside [0, num_experts) (kNoBadId: none), then
// that id.
constexpr int32_t kNoBadId = INT32_MAX;
inline int64_t SummaryInts(int64_t num_shards) { return num_shards + 2; }

// Bytes of scratch SelectShardRows needs for `tokens` tokens (CUB's temporary storage).
cudaError_t SelectTempBytes(int64_t tokens, size_t* bytes);

// ids [tokens, top_k] int32 (device); shard_of [num_experts] int32 (device): the shard of each
// expert. Writes flags [num_shards, tokens] uint8, rows [num_shards, tokens] int32 (shard s's
// rows first in rows + s * tokens) and summary (above). temp: SelectTempBytes bytes.
// tokens * top_k must fit in int32.
cudaError_t SelectShardRows(const int32_t* ids, int64_t tokens, int32_t top_k,
                            const int32_t* shard_of, int32_t num_experts, int32_t num_shards,
                            uint8_t* flags, int32_t* rows, int32_t* summary, void* temp,
                            size_t temp_bytes, cudaStream_t stream);

// dst[rows[i], :] += src[i, :] for i < num_rows, float32 rows of `width` elements; rows distinct.
cudaError_t ScatterAddRows(const float* src, const int32_t* rows, int64_t num_rows,
                           int64_t width, float* dst, cudaStream_t stream);

}  // namespace moe::client::shard_rows

#endif  // MOE_CLIENT_SHARD_ROWS_H_
