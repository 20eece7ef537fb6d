// Device-side input generation for the benchmark, and the CUB radix-sort dispatch that the
// MoEBlaze dispatch is measured against.
//
// Inputs are generated on the GPU (a counter-based hash turned into normals) because the
// largest preset has 4 G elements of x and dout alone; host generation would dominate the run.
//
// The CUB baseline builds the same structures as kernels/cuda/dispatch.h for a full shard:
// a stable radix sort of (expert id, entry) pairs over only the bits an id needs, per-expert
// offsets by binary search in the sorted ids, and slot_of by scattering the sorted positions.
// A stable sort keeps entries ascending within an expert, so its output must equal MoEBlaze's
// bit for bit; the benchmark checks that on every preset.
#ifndef MOE_BENCH_BENCH_KERNELS_H_
#define MOE_BENCH_BENCH_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe::bench {

// dst[i] = scale * N(0, 1) sample keyed by (seed, i); bf16 (raw 16-bit) or fp32.
cudaError_t FillNormalBf16(void* dst, int64_t n, float scale, uint64_t seed, cudaStream_t stream);
cudaError_t FillNormalF32(float* dst, int64_t n, float scale, uint64_t seed, cudaStream_t stream);

// Scratch bytes for CubSortDispatch (CUB temp storage plus sort buffers).
size_t CubSortDispatchWorkspaceBytes(int64_t num_tokens, int32_t top_k, int32_t num_experts);

// Full-shard dispatch (expert_first = 0, count = num_experts) by CUB radix sort.
cudaError_t CubSortDispatch(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k,
                            int32_t num_experts, int32_t* counts, int32_t* offsets,
                            int32_t* entries, int32_t* slot_of, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);

}  // namespace moe::bench

#endif  // MOE_BENCH_BENCH_KERNELS_H_
