// Host <-> device copies of large pageable host tensors through pinned staging memory.
//
// The CUDA layer's inputs and outputs are the caller's pageable host buffers (a request's x or
// dout, the result's out or dx). cudaMemcpy from or to pageable memory runs through the
// driver's own small staging at a fraction of the bandwidth that 8 threads copying into pinned
// memory plus a DMA reach (docs/decisions/0004-host-staging.md). So transfers of at least
// kMinStagedBytes from or to pageable memory go through one pinned buffer per device, at most
// kMaxStagingBytes long (larger transfers go through it in pieces), shared by every layer on
// that device under a mutex and kept for the life of the process. Within a transfer the copies
// between pageable and pinned memory and the DMAs overlap, piece by piece (kPipelineBytes).
// A host buffer that is page-locked itself (engine/cuda/pinned_pool.h: moe-server's large
// tensors) is copied with one DMA and no staging.
#ifndef MOE_ENGINE_CUDA_HOST_STAGING_H_
#define MOE_ENGINE_CUDA_HOST_STAGING_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"

namespace moe::cuda {

inline constexpr size_t kMinStagedBytes = size_t{4} << 20;
inline constexpr size_t kMaxStagingBytes = size_t{256} << 20;
// Pieces in which a staged transfer's host copies and DMAs overlap: the DMA of one piece runs
// while the threads copy later ones (host to device), or the threads copy a piece out while
// later pieces' DMAs run (device to host).
inline constexpr size_t kPipelineBytes = size_t{2} << 20;

// Copies `bytes` from host `src` to device `dst`, stream-ordered on `stream`; returns once `src`
// may be reused (staged copies have also landed by then). `device` is the current device, whose
// staging buffer is used.
absl::Status CopyToDevice(int device, void* dst, const void* src, size_t bytes,
                          cudaStream_t stream);

// Copies `bytes` from device `src` to host `dst` after the work already on `stream`; returns
// once `dst` holds them.
absl::Status CopyToHost(int device, void* dst, const void* src, size_t bytes, cudaStream_t stream);

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_HOST_STAGING_H_
