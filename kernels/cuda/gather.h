// Row gather: dst[n] = src[entries[n] / top_k] for the expert-ordered entry list of dispatch.
//
// Used for X (the expert GEMMs' input) and, in the backward, for dout. Type-agnostic: rows are
// moved as bytes, 16 at a time when the row length and the pointers allow it.
#ifndef MOE_KERNELS_CUDA_GATHER_H_
#define MOE_KERNELS_CUDA_GATHER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe::kernels {

// src [*, row_bytes], dst [num_rows, row_bytes]; row_bytes must be a multiple of 2.
cudaError_t LaunchGatherRows(const void* src, size_t row_bytes, const int32_t* entries,
                             int32_t top_k, int64_t num_rows, void* dst, cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_GATHER_H_
