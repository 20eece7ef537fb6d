// Deterministic initialisation: reproducible, seed-dependent, shard = slice of the full layer,
// N(0, (scale / sqrt(fan_in))^2), and pinned to the documented algorithm by known values.
#include "engine/init.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/engine/cpu/test_util.h"

namespace moe::testing {
namespace {

TEST(InitTest, ReproducibleAndSeedDependent) {
  std::vector<float> a(1000), b(1000), c(1000);
  InitNormal(5, 1, 0, 1000, 1.0, a.data());
  InitNormal(5, 1, 0, 1000, 1.0, b.data());
  InitNormal(6, 1, 0, 1000, 1.0, c.data());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::vector<float> tail(10);
  InitNormal(5, 1, 990, 10, 1.0, tail.data());  // any slice, independently
  EXPECT_EQ(tail, std::vector<float>(a.begin() + 990, a.end()));
}

TEST(InitTest, MatchesTheDocumentedAlgorithm) {
  // Recomputed here from the formula in init.h / docs/CONTRACT.md, so a change to either the
  // code or the document shows.
  auto mix = [](uint64_t v) {
    v += 0x9e3779b97f4a7c15ull;
    v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
    v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
    return v ^ (v >> 31);
  };
  std::vector<float> got(4);
  InitNormal(42, 3, 100, 4, 0.5, got.data());
  for (int j = 0; j < 4; ++j) {
    const uint64_t key = mix(mix(mix(42) ^ 3) ^ (100 + j));
    const double u1 = ((key >> 40) + 1) / 16777216.0, u2 = (key & 0xffffff) / 16777216.0;
    EXPECT_EQ(got[j], static_cast<float>(0.5 * std::sqrt(-2 * std::log(u1)) *
                                         std::cos(6.283185307179586 * u2)));
  }
}

TEST(InitTest, StandardDeviationIsScaleOverSqrtFanIn) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  c.num_experts = 8;
  c.d_model = 64;
  c.d_hidden = 256;
  c.init_scale = 2.0;
  struct Want {
    const char* name;
    double fan_in;
    int64_t n;
  };
  for (const Want& w : {Want{"w1", 64, 8 * 256 * 64}, Want{"w3", 64, 8 * 256 * 64},
                        Want{"w2", 256, 8 * 64 * 256}, Want{"router", 64, 64 * 8}}) {
    std::vector<float> v(w.n);
    ASSERT_TRUE(InitLayerWeight(c, w.name, v.data()).ok());
    double s = 0, s2 = 0;
    for (float x : v) {
      s += x;
      s2 += static_cast<double>(x) * x;
    }
    const double mean = s / w.n, sd = std::sqrt(s2 / w.n - mean * mean);
    const double want = 2.0 / std::sqrt(w.fan_in);
    EXPECT_NEAR(sd, want, want * (w.n > 10000 ? 0.02 : 0.1)) << w.name;
    EXPECT_NEAR(mean, 0.0, 5 * want / std::sqrt(static_cast<double>(w.n))) << w.name;
  }
  std::vector<float> v(1);
  EXPECT_EQ(
      InitLayerWeight(SmallConfig(Activation::kReLU, RoutingMode::kClient), "w3", v.data()).code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::testing
