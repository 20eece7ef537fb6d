// Host <-> device copies of large pageable host tensors through pinned staging memory.
//
// The CUDA layer's inputs and outputs are the caller's host buffers (a request's x or dout, the
// result's out or dx). cudaMemcpy from or to pageable memory runs through the driver's own
// small staging at a fraction of the DMA rate; a copy between pageable and pinned memory split
// over threads, overlapped piece by piece with the DMAs, is several times faster
// (docs/decisions/0004-host-staging.md). So transfers of at least kMinStagedBytes from or to
// pageable memory go through one pinned buffer per device, at most kMaxStagingBytes long
// (larger transfers go through it in pieces), shared by every layer on that device under a
// mutex and kept for the life of the process; within a transfer the copies between pageable and
// pinned memory and the DMAs overlap, piece by piece (kPipelineBytes). The three sizes are rules
// of kernel_selection.h. A host buffer that is page-locked itself (engine/cuda/pinned_pool.h:
// moe-server's large tensors) is copied with one DMA and no staging.
#ifndef MOE_ENGINE_CUDA_HOST_STAGING_H_
#define MOE_ENGINE_CUDA_HOST_STAGING_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "engine/cuda/kernel_selection.h"

namespace moe::cuda {

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
