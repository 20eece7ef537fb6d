// MoEBlaze dispatch structures on the CPU: the bitwise reference for the GPU dispatch.
//
// A counting sort over the flattened (t,k) entries. Scanning entries in ascending order and
// appending each to its expert's segment is what makes the list deterministic: within an
// expert, entries are ascending, whatever order a parallel implementation discovers them in.
#include "kernels/cpu/dispatch.h"

#include <vector>

namespace moe::kernels {

void DispatchCpu(const int32_t* expert_ids, int64_t num_tokens, int32_t top_k, int32_t expert_first,
                 int32_t expert_count, int32_t* counts, int32_t* offsets, int32_t* entries,
                 int32_t* slot_of) {
  const int64_t n = num_tokens * top_k;
  for (int32_t l = 0; l < expert_count; ++l) counts[l] = 0;
  // Pass 1: histogram of the shard's experts.
  for (int64_t i = 0; i < n; ++i) {
    const int32_t l = expert_ids[i] - expert_first;
    if (l >= 0 && l < expert_count) ++counts[l];
  }
  // Exclusive prefix sum; offsets[count] is the number of routed entries.
  offsets[0] = 0;
  for (int32_t l = 0; l < expert_count; ++l) offsets[l + 1] = offsets[l] + counts[l];
  // Pass 2: stable placement, ascending entry within each expert.
  std::vector<int32_t> cursor(offsets, offsets + expert_count);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t l = expert_ids[i] - expert_first;
    if (l >= 0 && l < expert_count) {
      const int32_t slot = cursor[l]++;
      entries[slot] = static_cast<int32_t>(i);
      slot_of[i] = slot;
    } else {
      slot_of[i] = -1;
    }
  }
}

}  // namespace moe::kernels
