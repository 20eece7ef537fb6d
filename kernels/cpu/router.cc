// Softmax + top-K routing on the CPU (see router.h for the ordering contract).
//
// The softmax subtracts the row max before exp (no overflow for large logits); the sum is
// accumulated in double so the reference is tight even for thousands of experts.
#include "kernels/cpu/router.h"

#include <cmath>
#include <vector>

namespace moe::kernels {

void RouteTopKCpu(const float* logits, int64_t num_tokens, int32_t num_experts, int32_t top_k,
                  bool renormalize, float* probs, float* lse, int32_t* expert_ids, float* weights) {
  std::vector<float> s(num_experts);
  std::vector<char> taken(num_experts);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * num_experts;
    float mx = row[0];
    for (int32_t e = 1; e < num_experts; ++e) mx = std::fmax(mx, row[e]);
    double sum = 0.0;
    for (int32_t e = 0; e < num_experts; ++e) {
      s[e] = std::exp(row[e] - mx);
      sum += s[e];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int32_t e = 0; e < num_experts; ++e) s[e] *= inv;
    if (probs != nullptr)
      for (int32_t e = 0; e < num_experts; ++e) probs[t * num_experts + e] = s[e];
    if (lse != nullptr) lse[t] = mx + static_cast<float>(std::log(sum));
    for (int32_t e = 0; e < num_experts; ++e) taken[e] = 0;
    float total = 0.0f;
    for (int32_t k = 0; k < top_k; ++k) {
      int32_t best = -1;
      for (int32_t e = 0; e < num_experts; ++e) {
        if (!taken[e] && (best < 0 || s[e] > s[best])) best = e;
      }
      taken[best] = 1;
      expert_ids[t * top_k + k] = best;
      weights[t * top_k + k] = s[best];
      total += s[best];
    }
    if (renormalize) {
      for (int32_t k = 0; k < top_k; ++k) weights[t * top_k + k] /= total;
    }
  }
}

}  // namespace moe::kernels
