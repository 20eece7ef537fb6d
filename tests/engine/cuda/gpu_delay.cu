// See gpu_delay.h.
#include "tests/engine/cuda/gpu_delay.h"

namespace moe::testing {
namespace {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(uint64_t ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) __nanosleep(1000);
}

}  // namespace

cudaError_t EnqueueGpuDelay(cudaStream_t stream, int64_t microseconds) {
  SpinKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(microseconds) * 1000);
  return cudaGetLastError();
}

}  // namespace moe::testing
