// Counter-based initialisation (the algorithm is spelled out in init.h and docs/CONTRACT.md).
#include "engine/init.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace moe {

uint64_t SplitMix64(uint64_t v) {
  v += 0x9e3779b97f4a7c15ull;
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
  return v ^ (v >> 31);
}

void InitNormal(uint64_t seed, uint64_t tensor_id, int64_t first_element, int64_t n, double stddev,
                float* out) {
  constexpr double kTwoPi = 6.283185307179586;
  constexpr double kInv24 = 1.0 / 16777216.0;
  const uint64_t base = SplitMix64(SplitMix64(seed) ^ tensor_id);
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t key = SplitMix64(base ^ static_cast<uint64_t>(first_element + j));
    const double u1 = static_cast<double>((key >> 40) + 1) * kInv24;
    const double u2 = static_cast<double>(key & 0xffffffull) * kInv24;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
    out[j] = static_cast<float>(stddev * z);
  }
}

absl::Status InitLayerWeight(const LayerConfig& c, absl::string_view name, float* out) {
  const int64_t d = c.d_model, h = c.d_hidden;
  const int64_t first = c.expert_first, count = c.local_experts();
  if (name == "w1" || (name == "w3" && c.gated())) {
    InitNormal(c.seed, name == "w1" ? 1 : 2, first * h * d, count * h * d,
               c.init_scale / std::sqrt(static_cast<double>(d)), out);
  } else if (name == "w2") {
    InitNormal(c.seed, 3, first * d * h, count * d * h,
               c.init_scale / std::sqrt(static_cast<double>(h)), out);
  } else if (name == "router" && c.routing == RoutingMode::kServer) {
    InitNormal(c.seed, 4, 0, d * c.num_experts, c.init_scale / std::sqrt(static_cast<double>(d)),
               out);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("name: this layer has no weight '", name, "'"));
  }
  return absl::OkStatus();
}

}  // namespace moe
