// UseFusedForward and UseFusedBackward, the two functions that decide whether a chunk's expert
// forward and backward run the fused sm90 kernels: host logic only, so it runs everywhere (in
// CI too, no GPU needed). The
// device is passed in as a flag, so both the sm_90 and the non-sm_90 answers are checked here;
// the GPU tests (cuda_engine_test.cc) check the answer on the real device and the numbers.
//
// Registered twice in ctest: once as is and once with MOE_DISABLE_FUSED=1 in the environment,
// which the pipeline reads once per process; EnvironmentSwitch asserts the matching answer.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "engine/cuda/expert_pipeline.h"
#include "kernels/cuda/sm90_expert_forward.h"

namespace moe::cuda {
namespace {

using kernels::Sm90ExpertProblem;

ExpertShape SwiGluBf16(int64_t d, int64_t h, ForwardKernels forward) {
  ExpertShape s;
  s.d_model = d;
  s.d_hidden = h;
  s.top_k = 2;
  s.expert_count = 8;
  s.activation = 0;  // SwiGLU
  s.type = kernels::ElemType::kBFloat16;
  s.forward = forward;
  return s;
}

Sm90ExpertProblem Problem(const ExpertShape& s, int64_t tokens) {
  Sm90ExpertProblem p;
  p.num_tokens = tokens;
  p.top_k = static_cast<int32_t>(s.top_k);
  p.num_experts = static_cast<int32_t>(s.expert_count);
  p.d_model = static_cast<int32_t>(s.d_model);
  p.d_hidden = static_cast<int32_t>(s.d_hidden);
  p.w13_expert_stride = 2 * s.d_hidden * s.d_model;
  return p;
}

bool EnvDisables() {
  const char* v = std::getenv("MOE_DISABLE_FUSED");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

TEST(UseFusedForwardTest, ForcedPathsOnSm90WhenTheKernelsTakeTheSizes) {
  for (ForwardKernels k :
       {ForwardKernels::kUnfused, ForwardKernels::kFusedUp, ForwardKernels::kFusedUpDown}) {
    const ExpertShape s = SwiGluBf16(200, 136, k);  // multiples of 8, not of 64
    EXPECT_EQ(UseFusedForward(s, Problem(s, 37), /*device_sm90=*/true), k) << ForwardKernelsName(k);
  }
}

TEST(UseFusedForwardTest, FallsBackOffSm90) {
  for (ForwardKernels k :
       {ForwardKernels::kAuto, ForwardKernels::kFusedUp, ForwardKernels::kFusedUpDown}) {
    const ExpertShape s = SwiGluBf16(256, 128, k);
    EXPECT_EQ(UseFusedForward(s, Problem(s, 64), /*device_sm90=*/false), ForwardKernels::kUnfused)
        << ForwardKernelsName(k);
  }
}

TEST(UseFusedForwardTest, FallsBackForSizesTheKernelsRefuse) {
  const ForwardKernels k = ForwardKernels::kFusedUpDown;
  ExpertShape s = SwiGluBf16(38, 24, k);  // d not a multiple of 8
  ASSERT_NE(kernels::Sm90CanImplement(Problem(s, 29)), nullptr);
  EXPECT_EQ(UseFusedForward(s, Problem(s, 29), true), ForwardKernels::kUnfused);
  s = SwiGluBf16(64, 20, k);  // h not a multiple of 8
  EXPECT_EQ(UseFusedForward(s, Problem(s, 29), true), ForwardKernels::kUnfused);
  s = SwiGluBf16(64, 64, k);
  s.expert_count = 600;  // more local experts than the kernels' shared-memory prefix holds
  EXPECT_EQ(UseFusedForward(s, Problem(s, 29), true), ForwardKernels::kUnfused);
}

TEST(UseFusedForwardTest, FallsBackForOtherActivationsAndDtypes) {
  ExpertShape s = SwiGluBf16(64, 64, ForwardKernels::kFusedUp);
  s.activation = 1;  // not SwiGLU
  EXPECT_EQ(UseFusedForward(s, Problem(s, 16), true), ForwardKernels::kUnfused);
  s = SwiGluBf16(64, 64, ForwardKernels::kFusedUp);
  s.type = kernels::ElemType::kFloat32;
  EXPECT_EQ(UseFusedForward(s, Problem(s, 16), true), ForwardKernels::kUnfused);
}

// The benchmark presets (bench/moe_bench.cc) and what kAuto picks for each on an sm_90 device,
// pinned to the H100 measurements:
//   forward: fused up + down where it measured faster than the unfused path (up to 2^31
//   multiply-adds per expert); above, the sm90 up with cuBLAS's down where that measured faster
//   than both (bench/results/2026-11-22-h100-caa32a1-fast-silu: olmoe 2.93 vs 3.28 unfused,
//   scale-32k 3.02 vs 3.35, deepseek-v3 13.23 vs 14.01, scale-128k 12.64 vs 13.10), unfused where
//   cuBLAS was faster (mixtral 8.79 vs 9.06);
//   backward: the fused backward where it measured faster
//   (bench/results/2026-11-21-h100-6674063-fused-backward: sonic-7b 2.48 vs 6.23 ms, qwen3-a3b
//   5.58 vs 6.90, scale-8k 2.19 vs 3.19); the hybrid (sm90 dA and dW2, cuBLAS dW13 and dXg) where
//   it measured faster than both (bench/results/2026-11-21-h100-50d6cf3-hybrid: olmoe 6.58 vs
//   6.65 unfused and 7.16 fused, scale-32k 6.43 vs 6.77 and 6.84, deepseek-v3 34.68 vs 35.01 and
//   37.31), and at the largest per-expert GEMMs too since the weight gradients have their own
//   stream (scale-128k 24.97 vs 25.87 unfused, bench/results/2026-11-22-h100-ec42bec-overlap);
//   the unfused one where cuBLAS was faster than both (mixtral, h = 14336: 18.43 vs 19.93
//   hybrid and 24.40 fused).
struct MeasuredPreset {
  const char* name;
  int64_t T, d, h, E, K;
  ForwardKernels forward;
  BackwardKernels backward;
};
constexpr BackwardKernels kF = BackwardKernels::kFused;
constexpr BackwardKernels kH = BackwardKernels::kHybrid;
constexpr BackwardKernels kU = BackwardKernels::kUnfused;
constexpr ForwardKernels kUpDown = ForwardKernels::kFusedUpDown;
constexpr ForwardKernels kUp = ForwardKernels::kFusedUp;
constexpr ForwardKernels kFwdU = ForwardKernels::kUnfused;
constexpr MeasuredPreset kMeasuredPresets[] = {
    {"sonic-7b", 24576, 1536, 256, 128, 8, kUpDown, kF},
    {"olmoe", 16384, 2048, 1024, 64, 8, kUp, kH},
    {"qwen3-a3b", 16384, 2048, 768, 128, 8, kUpDown, kF},
    {"mixtral", 8192, 4096, 14336, 8, 2, kFwdU, kU},
    {"deepseek-v3", 8192, 7168, 2048, 256, 8, kUp, kH},
    {"scale-8k", 8192, 2048, 1024, 64, 4, kUpDown, kF},
    {"scale-32k", 32768, 2048, 1024, 64, 4, kUp, kH},
    {"scale-128k", 131072, 2048, 1024, 64, 4, kUp, kH},
    {"scale-2m", 2097152, 2048, 1024, 64, 4, kUp, kH},
};

ExpertShape PresetShape(const MeasuredPreset& p) {
  ExpertShape s = SwiGluBf16(p.d, p.h, ForwardKernels::kAuto);
  s.top_k = p.K;
  s.expert_count = p.E;
  return s;
}

TEST(UseFusedForwardTest, AutoPicksTheMeasuredFasterPathPerPreset) {
  if (EnvDisables()) GTEST_SKIP() << "MOE_DISABLE_FUSED set: kAuto is always unfused";
  for (const MeasuredPreset& p : kMeasuredPresets) {
    ExpertShape s = PresetShape(p);
    const Sm90ExpertProblem prob = Problem(s, p.T);
    EXPECT_EQ(UseFusedForward(s, prob, true), p.forward)
        << p.name << ": " << ForwardKernelsName(UseFusedForward(s, prob, true));
    // Forcing the fused path ignores the work rule.
    s.forward = ForwardKernels::kFusedUpDown;
    EXPECT_EQ(UseFusedForward(s, prob, true), ForwardKernels::kFusedUpDown) << p.name;
  }
}

// d = h = 1024, K = 2, E = 8 as in the backward's threshold test: T = 8192 sits exactly on
// kFusedMaxWorkPerExpert. Above it, h decides: kFusedUpMaxHidden is inclusive too.
TEST(UseFusedForwardTest, WorkAndWidthThresholdsAreInclusiveUpperBounds) {
  if (EnvDisables()) GTEST_SKIP() << "MOE_DISABLE_FUSED set: kAuto is always unfused";
  const ExpertShape s = SwiGluBf16(1024, 1024, ForwardKernels::kAuto);
  EXPECT_EQ(UseFusedForward(s, Problem(s, 8192), true), ForwardKernels::kFusedUpDown);
  EXPECT_EQ(UseFusedForward(s, Problem(s, 8196), true), ForwardKernels::kFusedUp);
  const ExpertShape at_bound = SwiGluBf16(1024, kFusedUpMaxHidden, ForwardKernels::kAuto);
  EXPECT_EQ(UseFusedForward(at_bound, Problem(at_bound, 8192), true), ForwardKernels::kFusedUp);
  const ExpertShape wider = SwiGluBf16(1024, kFusedUpMaxHidden + 8, ForwardKernels::kAuto);
  EXPECT_EQ(UseFusedForward(wider, Problem(wider, 8192), true), ForwardKernels::kUnfused);
  // Under the work bound the width does not matter, and off sm_90 nothing fused runs.
  EXPECT_EQ(UseFusedForward(wider, Problem(wider, 16), true), ForwardKernels::kFusedUpDown);
  EXPECT_EQ(UseFusedForward(s, Problem(s, 16384), false), ForwardKernels::kUnfused);
}

TEST(UseFusedForwardTest, EnvironmentSwitch) {
  const ExpertShape s = SwiGluBf16(64, 64, ForwardKernels::kAuto);
  const ForwardKernels want = EnvDisables() ? ForwardKernels::kUnfused : kDefaultFusedForward;
  EXPECT_EQ(UseFusedForward(s, Problem(s, 16), true), want)
      << "MOE_DISABLE_FUSED=" << (std::getenv("MOE_DISABLE_FUSED") ? "set" : "unset");
  // A forced path ignores the variable: the benchmark shows fused and unfused side by side.
  const ExpertShape forced = SwiGluBf16(64, 64, ForwardKernels::kFusedUp);
  EXPECT_EQ(UseFusedForward(forced, Problem(forced, 16), true), ForwardKernels::kFusedUp);
}

ExpertShape SwiGluBf16Backward(int64_t d, int64_t h, BackwardKernels backward) {
  ExpertShape s = SwiGluBf16(d, h, ForwardKernels::kAuto);
  s.backward = backward;
  return s;
}

TEST(UseFusedBackwardTest, ForcedPathsOnSm90WhenTheKernelsTakeTheSizes) {
  for (BackwardKernels k : {BackwardKernels::kUnfused, BackwardKernels::kFused,
                            BackwardKernels::kFusedEpilogue, BackwardKernels::kHybrid}) {
    const ExpertShape s = SwiGluBf16Backward(40, 24, k);
    EXPECT_EQ(UseFusedBackward(s, Problem(s, 37), /*device_sm90=*/true), k)
        << BackwardKernelsName(k);
  }
}

TEST(UseFusedBackwardTest, FallsBackOffSm90ForOddSizesOtherActivationsAndDtypes) {
  for (BackwardKernels k :
       {BackwardKernels::kFused, BackwardKernels::kFusedEpilogue, BackwardKernels::kHybrid}) {
    ExpertShape s = SwiGluBf16Backward(64, 64, k);
    EXPECT_EQ(UseFusedBackward(s, Problem(s, 64), /*device_sm90=*/false),
              BackwardKernels::kUnfused);
    s = SwiGluBf16Backward(38, 64, k);  // d not a multiple of 8
    EXPECT_EQ(UseFusedBackward(s, Problem(s, 29), true), BackwardKernels::kUnfused);
    s = SwiGluBf16Backward(64, 20, k);  // h not a multiple of 8
    EXPECT_EQ(UseFusedBackward(s, Problem(s, 29), true), BackwardKernels::kUnfused);
    s = SwiGluBf16Backward(64, 64, k);
    s.activation = 1;  // GELU: the fused SwiGLU backward does not apply
    EXPECT_EQ(UseFusedBackward(s, Problem(s, 16), true), BackwardKernels::kUnfused);
    s = SwiGluBf16Backward(64, 64, k);
    s.type = kernels::ElemType::kFloat32;
    EXPECT_EQ(UseFusedBackward(s, Problem(s, 16), true), BackwardKernels::kUnfused);
  }
}

TEST(UseFusedBackwardTest, AutoPicksTheMeasuredFasterPathPerPreset) {
  if (EnvDisables()) GTEST_SKIP() << "MOE_DISABLE_FUSED set: kAuto is always unfused";
  for (const MeasuredPreset& p : kMeasuredPresets) {
    ExpertShape s = PresetShape(p);
    const Sm90ExpertProblem prob = Problem(s, p.T);
    EXPECT_EQ(UseFusedBackward(s, prob, true), p.backward)
        << p.name << ": " << BackwardKernelsName(UseFusedBackward(s, prob, true));
    s.backward = BackwardKernels::kFused;  // forcing ignores the work rule
    EXPECT_EQ(UseFusedBackward(s, prob, true), BackwardKernels::kFused) << p.name;
  }
}

// d = h = 1024, K = 2, E = 8: T tokens give T / 4 * 2^20 multiply-adds per expert, so T = 8192
// sits exactly on kFusedBackwardMaxWorkPerExpert. Above it the width decides, at any work.
TEST(UseFusedBackwardTest, WorkThresholdThenWidthBound) {
  if (EnvDisables()) GTEST_SKIP() << "MOE_DISABLE_FUSED set: kAuto is always unfused";
  const ExpertShape s = SwiGluBf16Backward(1024, 1024, BackwardKernels::kAuto);
  EXPECT_EQ(UseFusedBackward(s, Problem(s, 8192), true), BackwardKernels::kFused);
  EXPECT_EQ(UseFusedBackward(s, Problem(s, 8196), true), BackwardKernels::kHybrid);
  EXPECT_EQ(UseFusedBackward(s, Problem(s, 1 << 21), true), BackwardKernels::kHybrid);
  const ExpertShape at_bound =
      SwiGluBf16Backward(1024, kHybridBackwardMaxHidden, BackwardKernels::kAuto);
  EXPECT_EQ(UseFusedBackward(at_bound, Problem(at_bound, 8192), true), BackwardKernels::kHybrid);
  const ExpertShape wider =
      SwiGluBf16Backward(1024, kHybridBackwardMaxHidden + 64, BackwardKernels::kAuto);
  EXPECT_EQ(UseFusedBackward(wider, Problem(wider, 8192), true), BackwardKernels::kUnfused);
  // Below the work threshold the fused backward whatever the width.
  EXPECT_EQ(UseFusedBackward(wider, Problem(wider, 64), true), BackwardKernels::kFused);
  // The hybrid runs sm90 kernels too: off sm_90 it falls back like kFused.
  EXPECT_EQ(UseFusedBackward(s, Problem(s, 16384), false), BackwardKernels::kUnfused);
}

TEST(UseFusedBackwardTest, EnvironmentSwitch) {
  const ExpertShape s = SwiGluBf16Backward(64, 64, BackwardKernels::kAuto);
  const BackwardKernels want = EnvDisables() ? BackwardKernels::kUnfused : BackwardKernels::kFused;
  EXPECT_EQ(UseFusedBackward(s, Problem(s, 16), true), want)
      << "MOE_DISABLE_FUSED=" << (std::getenv("MOE_DISABLE_FUSED") ? "set" : "unset");
  const ExpertShape large = SwiGluBf16Backward(1024, 1024, BackwardKernels::kAuto);
  EXPECT_EQ(UseFusedBackward(large, Problem(large, 16384), true),
            EnvDisables() ? BackwardKernels::kUnfused : BackwardKernels::kHybrid);
  const ExpertShape forced = SwiGluBf16Backward(64, 64, BackwardKernels::kFused);
  EXPECT_EQ(UseFusedBackward(forced, Problem(forced, 16), true), BackwardKernels::kFused);
}

// The FusedKernelsTest shape T=256, E=128, K=2, d=64, h=264 (cuda_engine_test.cc) is there to
// run the ping-pong kernels through the engine; this keeps it reaching them on a 132-SM GPU.
TEST(Sm90ChooseConfigTest, EngineTestShapeReachesThePingPongKernels) {
  Sm90ExpertProblem p;
  p.num_tokens = 256;
  p.top_k = 2;
  p.num_experts = 128;
  p.d_model = 64;
  p.d_hidden = 264;
  p.num_routed = 512;
  EXPECT_TRUE(kernels::Sm90ChooseConfig(p, kernels::Sm90Projection::kUpSwiGLU, 132).ping_pong);
  EXPECT_TRUE(kernels::Sm90ChooseConfig(p, kernels::Sm90Projection::kBackwardDH, 132).ping_pong);
}

// The up-projection's kernel by how much of the routed rows 128-row tiles pad (half a block an
// expert): the ping-pong kernel's 64-row tiles above 20% (deepseek-v3, 25%), the ws kernel
// between 10% and 20% (scale-8k, 12.5%), the ws kernel at h <= 256 and the plain one otherwise
// below 10% (sonic-7b, olmoe); measured on an H100 (kernels/cuda/sm90_expert_forward.cu).
TEST(Sm90ChooseConfigTest, UpProjectionKernelFollowsThePaddedShare) {
  struct Want {
    const char* preset;
    bool ws, pp;
  };
  for (const Want& w : {Want{"deepseek-v3", false, true}, Want{"scale-8k", true, false},
                        Want{"sonic-7b", true, false}, Want{"olmoe", false, false}}) {
    const MeasuredPreset* p = nullptr;
    for (const MeasuredPreset& m : kMeasuredPresets) {
      if (std::strcmp(m.name, w.preset) == 0) p = &m;
    }
    ASSERT_NE(p, nullptr) << w.preset;
    const kernels::Sm90GemmConfig c = kernels::Sm90ChooseConfig(
        Problem(PresetShape(*p), p->T), kernels::Sm90Projection::kUpSwiGLU, 132);
    EXPECT_EQ(c.warp_specialized, w.ws) << w.preset;
    EXPECT_EQ(c.ping_pong, w.pp) << w.preset;
  }
}

}  // namespace
}  // namespace moe::cuda
