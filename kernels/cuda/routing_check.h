// Client routing (expert ids and weights a caller chose) checked and taken into a layer's own
// buffers on the GPU, so that neither the check nor the copy needs the values on the host: the
// CPU scan it replaces cost more than the forward's expert work at large T.
//
// The rules are the CPU engine's (engine/routing.h CheckClientRoutingValues): every id in
// [0, num_experts), no id twice within a token, every weight finite. A faulty pair is recorded
// and also neutralised (its id becomes -1, which the dispatch treats as another shard's), so
// nothing launched after the check can index out of bounds before the host reads the verdict.
#ifndef MOE_KERNELS_CUDA_ROUTING_CHECK_H_
#define MOE_KERNELS_CUDA_ROUTING_CHECK_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::kernels {

// What a routing fault is; the record orders faults of one pair the way the CPU check tests them.
enum class RoutingFault : uint64_t { kIdOutOfRange = 0, kIdRepeated = 1, kWeightNotFinite = 2 };

// The record's value while no fault was found.
inline constexpr unsigned long long kNoRoutingFault = ~0ull;

// Fault records: (pair index t * K + k) << 2 | fault kind; the least one is the first fault in
// the CPU check's order.
inline uint64_t RoutingFaultPair(unsigned long long record) { return record >> 2; }
inline RoutingFault RoutingFaultKind(unsigned long long record) {
  return static_cast<RoutingFault>(record & 3);
}

// ids [T, K] int32, weights [T, K] fp32 (or bf16 when weights_bf16), all on the stream's device
// -> ids_out [T, K] int32 (-1 at a faulty pair), p_out [T, K] fp32. *first_fault must hold
// kNoRoutingFault before the launch (cudaMemsetAsync 0xff) and holds the least fault record
// after it.
cudaError_t LaunchCheckClientRouting(const int32_t* ids, const void* weights, bool weights_bf16,
                                     int64_t num_tokens, int32_t top_k, int32_t num_experts,
                                     int32_t* ids_out, float* p_out,
                                     unsigned long long* first_fault, cudaStream_t stream);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CUDA_ROUTING_CHECK_H_
