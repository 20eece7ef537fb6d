// Server-side routing on the CPU: fp32 softmax over expert logits, top-K, renormalisation.
//
// Top-K order is part of the contract: k = 0 is the largest probability, and equal
// probabilities go to the lower expert id first (a strict '>' scan), so every engine picks the
// same experts for the same logits. Raw pointers, no validation (the engine validates).
#ifndef MOE_KERNELS_CPU_ROUTER_H_
#define MOE_KERNELS_CPU_ROUTER_H_

#include <cstdint>

namespace moe::kernels {

// For each of `num_tokens` rows of logits [T, E]:
//   probs[t, :]   = softmax(logits[t, :])           (if probs != nullptr)
//   lse[t]        = logsumexp(logits[t, :])         (if lse != nullptr)
//   expert_ids[t, k], weights[t, k] = top-K of probs, weights renormalised to sum 1 when
//   `renormalize`.
void RouteTopKCpu(const float* logits, int64_t num_tokens, int32_t num_experts, int32_t top_k,
                  bool renormalize, float* probs, float* lse, int32_t* expert_ids, float* weights);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CPU_ROUTER_H_
