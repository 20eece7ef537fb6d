// Deterministic weight initialisation, shared by every engine (the CUDA engine calls these
// same host functions and uploads the result, so both engines start bit-identical).
//
// The RNG is counter based, so any element can be generated independently of the others and a
// shard produces exactly the slice of the unsharded layer's weights:
//   key(i) = splitmix64(splitmix64(splitmix64(seed) ^ tensor_id) ^ i)   (i: global element)
//   u1 = ((key >> 40) + 1) / 2^24   in (0, 1]      u2 = (key & 0xffffff) / 2^24  in [0, 1)
//   z  = sqrt(-2 ln u1) * cos(2 pi u2)              (Box-Muller, in double)
//   w  = float(stddev * z),  stddev = init_scale / sqrt(fan_in)
// splitmix64(v): v += 0x9e3779b97f4a7c15; v = (v ^ v>>30) * 0xbf58476d1ce4e5b9;
//                v = (v ^ v>>27) * 0x94d049bb133111eb; return v ^ v>>31.
// Tensor ids: w1 = 1, w3 = 2, w2 = 3, router = 4. Global element index: w1/w3 are the full
// [E, h, d] tensor, w2 the full [E, d, h], router [d, E]. fan_in: d for w1, w3, router; h for w2.
#ifndef MOE_ENGINE_INIT_H_
#define MOE_ENGINE_INIT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/layer.h"

namespace moe {

uint64_t SplitMix64(uint64_t v);

// out[j] = sample for global element first_element + j of tensor `tensor_id`, j in [0, n).
void InitNormal(uint64_t seed, uint64_t tensor_id, int64_t first_element, int64_t n, double stddev,
                float* out);

// Fills `out` with the layer's initial (local, fp32, unrounded) values of the named weight:
// "w1", "w3", "w2" ([count, ...] of this shard) or "router" ([d, E]). With bf16 storage these
// are the fp32 master values; the stored weights are their bf16 rounding.
// InvalidArgument for a name the config does not have.
absl::Status InitLayerWeight(const LayerConfig& config, absl::string_view name, float* out);

}  // namespace moe

#endif  // MOE_ENGINE_INIT_H_
