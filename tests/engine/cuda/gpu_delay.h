// A wait enqueued on a stream: one thread that spins on the GPU's global timer. The CUDA
// engine's tests put it where a missing stream wait would let work run too early, so that the
// bug shows on every run instead of only when the GPU happens to run behind the host.
#ifndef MOE_TESTS_ENGINE_CUDA_GPU_DELAY_H_
#define MOE_TESTS_ENGINE_CUDA_GPU_DELAY_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moe::testing {

// Everything enqueued on `stream` after this starts at least `microseconds` later than it
// would have.
cudaError_t EnqueueGpuDelay(cudaStream_t stream, int64_t microseconds);

}  // namespace moe::testing

#endif  // MOE_TESTS_ENGINE_CUDA_GPU_DELAY_H_
