// Client routing checked and copied on the GPU (see routing_check.h).
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/routing_check.h"

namespace moe::kernels {
namespace {

constexpr int kThreads = 256;

// One thread per token: its K ids against each other (K is small) and its K weights.
__global__ void check_client_routing_kernel(const int32_t* __restrict__ ids,
                                            const void* __restrict__ weights, bool weights_bf16,
                                            int64_t num_tokens, int32_t top_k,
                                            int32_t num_experts, int32_t* __restrict__ ids_out,
                                            float* __restrict__ p_out,
                                            unsigned long long* first_fault) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= num_tokens) return;
  const int32_t* row = ids + t * top_k;
  unsigned long long fault = kNoRoutingFault;
  for (int32_t k = 0; k < top_k; ++k) {
    const int64_t i = t * top_k + k;
    const int32_t e = row[k];
    bool bad = false;
    unsigned long long kind = 0;
    if (e < 0 || e >= num_experts) {
      bad = true;
      kind = static_cast<unsigned long long>(RoutingFault::kIdOutOfRange);
    } else {
      for (int32_t j = 0; j < k; ++j) {
        if (row[j] == e) {
          bad = true;
          kind = static_cast<unsigned long long>(RoutingFault::kIdRepeated);
          break;
        }
      }
    }
    float w;
    if (weights_bf16) {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(weights)[i]) << 16;
      w = __uint_as_float(bits);
    } else {
      w = static_cast<const float*>(weights)[i];
    }
    if (!bad && !isfinite(w)) {
      bad = true;
      kind = static_cast<unsigned long long>(RoutingFault::kWeightNotFinite);
    }
    ids_out[i] = bad ? -1 : e;
    p_out[i] = w;
    if (bad && fault == kNoRoutingFault) fault = static_cast<unsigned long long>(i) << 2 | kind;
  }
  if (fault != kNoRoutingFault) atomicMin(first_fault, fault);
}

}  // namespace

cudaError_t LaunchCheckClientRouting(const int32_t* ids, const void* weights, bool weights_bf16,
                                     int64_t num_tokens, int32_t top_k, int32_t num_experts,
                                     int32_t* ids_out, float* p_out,
                                     unsigned long long* first_fault, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (top_k < 1 || num_experts < 1) return cudaErrorInvalidValue;
  const int64_t blocks = (num_tokens + kThreads - 1) / kThreads;
  check_client_routing_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      ids, weights, weights_bf16, num_tokens, top_k, num_experts, ids_out, p_out, first_fault);
  return cudaGetLastError();
}

}  // namespace moe::kernels
