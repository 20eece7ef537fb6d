// The rules of engine/cuda/kernel_selection.h: which path runs a chunk's expert forward and
// backward (UseFusedForward, UseFusedBackward) and which sm90 kernel and tiles run each fused
// GEMM (Sm90ChooseConfig). Host logic only, so it runs everywhere (in CI too, no GPU needed):
// the device is passed in as a flag, so both the sm_90 and the non-sm_90 answers are checked
// here; the GPU tests (cuda_engine_test.cc) check the answer on the real device and the
// numbers. The presets' answers are pinned to what their decision records measured.
#include "engine/cuda/kernel_selection.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kernels/cuda/sm90_expert_forward.h"

namespace moe::cuda {
namespace {

using kernels::Sm90ExpertProblem;

ExpertShape SwiGluBf16(int64_t d, int64_t h) {
  ExpertShape s;
  s.d_model = d;
  s.d_hidden = h;
  s.top_k = 2;
  s.expert_count = 8;
  s.activation = 0;  // SwiGLU
  s.type = kernels::ElemType::kBFloat16;
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

PipelineOptions Forcing(ForwardKernels forward) {
  PipelineOptions o;
  o.forward = forward;
  return o;
}

PipelineOptions Forcing(BackwardKernels backward) {
  PipelineOptions o;
  o.backward = backward;
  return o;
}

const PipelineOptions kService;  // what moe-server runs: kAuto both ways, fused kernels on

TEST(UseFusedForwardTest, ForcedPathsOnSm90WhenTheKernelsTakeTheSizes) {
  for (ForwardKernels k :
       {ForwardKernels::kUnfused, ForwardKernels::kFusedUp, ForwardKernels::kFusedUpDown}) {
    const ExpertShape s = SwiGluBf16(200, 136);  // multiples of 8, not of 64
    EXPECT_EQ(UseFusedForward(s, Forcing(k), Problem(s, 37), /*device_sm90=*/true), k)
        << ForwardKernelsName(k);
  }
}

TEST(UseFusedForwardTest, FallsBackOffSm90) {
  for (ForwardKernels k :
       {ForwardKernels::kAuto, ForwardKernels::kFusedUp, ForwardKernels::kFusedUpDown}) {
    const ExpertShape s = SwiGluBf16(256, 128);
    EXPECT_EQ(UseFusedForward(s, Forcing(k), Problem(s, 64), /*device_sm90=*/false),
              ForwardKernels::kUnfused)
        << ForwardKernelsName(k);
  }
}

TEST(UseFusedForwardTest, FallsBackForSizesTheKernelsRefuse) {
  const PipelineOptions o = Forcing(ForwardKernels::kFusedUpDown);
  ExpertShape s = SwiGluBf16(38, 24);  // d not a multiple of 8
  ASSERT_NE(kernels::Sm90CanImplement(Problem(s, 29)), nullptr);
  EXPECT_EQ(UseFusedForward(s, o, Problem(s, 29), true), ForwardKernels::kUnfused);
  s = SwiGluBf16(64, 20);  // h not a multiple of 8
  EXPECT_EQ(UseFusedForward(s, o, Problem(s, 29), true), ForwardKernels::kUnfused);
  s = SwiGluBf16(64, 64);
  s.expert_count = 600;  // more local experts than the kernels' shared-memory prefix holds
  EXPECT_EQ(UseFusedForward(s, o, Problem(s, 29), true), ForwardKernels::kUnfused);
}

TEST(UseFusedForwardTest, FallsBackForOtherActivationsAndDtypes) {
  const PipelineOptions o = Forcing(ForwardKernels::kFusedUp);
  ExpertShape s = SwiGluBf16(64, 64);
  s.activation = 1;  // not SwiGLU
  EXPECT_EQ(UseFusedForward(s, o, Problem(s, 16), true), ForwardKernels::kUnfused);
  s = SwiGluBf16(64, 64);
  s.type = kernels::ElemType::kFloat32;
  EXPECT_EQ(UseFusedForward(s, o, Problem(s, 16), true), ForwardKernels::kUnfused);
}

// The benchmark presets (bench/moe_bench.cc) and what kAuto picks for each on an sm_90 device,
// each the path that measured fastest on the H100:
//   forward (docs/decisions/0002-fused-path-bounds.md): fused up + down up to 2^31
//   multiply-adds per expert; above, the sm90 up with cuBLAS's down while h <= 4096; unfused
//   for mixtral (h = 14336);
//   backward (0002 and docs/decisions/0003-hybrid-backward.md): the fused backward up to 2^31
//   multiply-adds per expert; above, the hybrid (sm90 dA and dW2, cuBLAS dW13 and dXg) while
//   h <= 4096; unfused for mixtral.
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
  ExpertShape s = SwiGluBf16(p.d, p.h);
  s.top_k = p.K;
  s.expert_count = p.E;
  return s;
}

const MeasuredPreset& FindPreset(const char* name) {
  for (const MeasuredPreset& m : kMeasuredPresets) {
    if (std::strcmp(m.name, name) == 0) return m;
  }
  ADD_FAILURE() << "no preset " << name;
  return kMeasuredPresets[0];
}

TEST(UseFusedForwardTest, AutoPicksTheMeasuredFasterPathPerPreset) {
  for (const MeasuredPreset& p : kMeasuredPresets) {
    const ExpertShape s = PresetShape(p);
    const Sm90ExpertProblem prob = Problem(s, p.T);
    EXPECT_EQ(UseFusedForward(s, kService, prob, true), p.forward)
        << p.name << ": " << ForwardKernelsName(UseFusedForward(s, kService, prob, true));
    // Forcing the fused path ignores the work rule.
    EXPECT_EQ(UseFusedForward(s, Forcing(ForwardKernels::kFusedUpDown), prob, true),
              ForwardKernels::kFusedUpDown)
        << p.name;
  }
}

// d = h = 1024, K = 2, E = 8 as in the backward's threshold test: T = 8192 sits exactly on
// kFusedMaxWorkPerExpert. Above it, h decides: kFusedUpMaxHidden is inclusive too.
TEST(UseFusedForwardTest, WorkAndWidthThresholdsAreInclusiveUpperBounds) {
  const ExpertShape s = SwiGluBf16(1024, 1024);
  EXPECT_EQ(UseFusedForward(s, kService, Problem(s, 8192), true), ForwardKernels::kFusedUpDown);
  EXPECT_EQ(UseFusedForward(s, kService, Problem(s, 8196), true), ForwardKernels::kFusedUp);
  const ExpertShape at_bound = SwiGluBf16(1024, kFusedUpMaxHidden);
  EXPECT_EQ(UseFusedForward(at_bound, kService, Problem(at_bound, 8192), true),
            ForwardKernels::kFusedUp);
  const ExpertShape wider = SwiGluBf16(1024, kFusedUpMaxHidden + 8);
  EXPECT_EQ(UseFusedForward(wider, kService, Problem(wider, 8192), true), ForwardKernels::kUnfused);
  // Under the work bound the width does not matter, and off sm_90 nothing fused runs.
  EXPECT_EQ(UseFusedForward(wider, kService, Problem(wider, 16), true),
            ForwardKernels::kFusedUpDown);
  EXPECT_EQ(UseFusedForward(s, kService, Problem(s, 16384), false), ForwardKernels::kUnfused);
}

// The operator's switch (EngineOptions::fused_kernels, moe-server --fused_kernels=false): kAuto
// runs unfused; a forced path is kept, so a benchmark still shows fused and unfused side by side.
TEST(UseFusedForwardTest, FusedKernelsOffMakesAutoUnfused) {
  const ExpertShape s = SwiGluBf16(64, 64);
  EXPECT_EQ(UseFusedForward(s, kService, Problem(s, 16), true), kDefaultFusedForward);
  PipelineOptions off;
  off.fused_kernels = false;
  EXPECT_EQ(UseFusedForward(s, off, Problem(s, 16), true), ForwardKernels::kUnfused);
  off.forward = ForwardKernels::kFusedUp;
  EXPECT_EQ(UseFusedForward(s, off, Problem(s, 16), true), ForwardKernels::kFusedUp);
}

TEST(UseFusedBackwardTest, ForcedPathsOnSm90WhenTheKernelsTakeTheSizes) {
  for (BackwardKernels k :
       {BackwardKernels::kUnfused, BackwardKernels::kFused, BackwardKernels::kHybrid}) {
    const ExpertShape s = SwiGluBf16(40, 24);
    EXPECT_EQ(UseFusedBackward(s, Forcing(k), Problem(s, 37), /*device_sm90=*/true), k)
        << BackwardKernelsName(k);
  }
}

TEST(UseFusedBackwardTest, FallsBackOffSm90ForOddSizesOtherActivationsAndDtypes) {
  for (BackwardKernels k : {BackwardKernels::kFused, BackwardKernels::kHybrid}) {
    const PipelineOptions o = Forcing(k);
    ExpertShape s = SwiGluBf16(64, 64);
    EXPECT_EQ(UseFusedBackward(s, o, Problem(s, 64), /*device_sm90=*/false),
              BackwardKernels::kUnfused);
    s = SwiGluBf16(38, 64);  // d not a multiple of 8
    EXPECT_EQ(UseFusedBackward(s, o, Problem(s, 29), true), BackwardKernels::kUnfused);
    s = SwiGluBf16(64, 20);  // h not a multiple of 8
    EXPECT_EQ(UseFusedBackward(s, o, Problem(s, 29), true), BackwardKernels::kUnfused);
    s = SwiGluBf16(64, 64);
    s.activation = 1;  // GELU: the fused SwiGLU backward does not apply
    EXPECT_EQ(UseFusedBackward(s, o, Problem(s, 16), true), BackwardKernels::kUnfused);
    s = SwiGluBf16(64, 64);
    s.type = kernels::ElemType::kFloat32;
    EXPECT_EQ(UseFusedBackward(s, o, Problem(s, 16), true), BackwardKernels::kUnfused);
  }
}

TEST(UseFusedBackwardTest, AutoPicksTheMeasuredFasterPathPerPreset) {
  for (const MeasuredPreset& p : kMeasuredPresets) {
    const ExpertShape s = PresetShape(p);
    const Sm90ExpertProblem prob = Problem(s, p.T);
    EXPECT_EQ(UseFusedBackward(s, kService, prob, true), p.backward)
        << p.name << ": " << BackwardKernelsName(UseFusedBackward(s, kService, prob, true));
    // Forcing ignores the work rule.
    EXPECT_EQ(UseFusedBackward(s, Forcing(BackwardKernels::kFused), prob, true),
              BackwardKernels::kFused)
        << p.name;
  }
}

// d = h = 1024, K = 2, E = 8: T tokens give T / 4 * 2^20 multiply-adds per expert, so T = 8192
// sits exactly on kFusedBackwardMaxWorkPerExpert. Above it the width decides, at any work.
TEST(UseFusedBackwardTest, WorkThresholdThenWidthBound) {
  const ExpertShape s = SwiGluBf16(1024, 1024);
  EXPECT_EQ(UseFusedBackward(s, kService, Problem(s, 8192), true), BackwardKernels::kFused);
  EXPECT_EQ(UseFusedBackward(s, kService, Problem(s, 8196), true), BackwardKernels::kHybrid);
  EXPECT_EQ(UseFusedBackward(s, kService, Problem(s, 1 << 21), true), BackwardKernels::kHybrid);
  const ExpertShape at_bound = SwiGluBf16(1024, kHybridBackwardMaxHidden);
  EXPECT_EQ(UseFusedBackward(at_bound, kService, Problem(at_bound, 8192), true),
            BackwardKernels::kHybrid);
  const ExpertShape wider = SwiGluBf16(1024, kHybridBackwardMaxHidden + 64);
  EXPECT_EQ(UseFusedBackward(wider, kService, Problem(wider, 8192), true),
            BackwardKernels::kUnfused);
  // Below the work threshold the fused backward whatever the width.
  EXPECT_EQ(UseFusedBackward(wider, kService, Problem(wider, 64), true), BackwardKernels::kFused);
  // The hybrid runs sm90 kernels too: off sm_90 it falls back like kFused.
  EXPECT_EQ(UseFusedBackward(s, kService, Problem(s, 16384), false), BackwardKernels::kUnfused);
}

TEST(UseFusedBackwardTest, FusedKernelsOffMakesAutoUnfused) {
  PipelineOptions off;
  off.fused_kernels = false;
  const ExpertShape s = SwiGluBf16(64, 64);
  EXPECT_EQ(UseFusedBackward(s, kService, Problem(s, 16), true), BackwardKernels::kFused);
  EXPECT_EQ(UseFusedBackward(s, off, Problem(s, 16), true), BackwardKernels::kUnfused);
  const ExpertShape large = SwiGluBf16(1024, 1024);
  EXPECT_EQ(UseFusedBackward(large, kService, Problem(large, 16384), true),
            BackwardKernels::kHybrid);
  EXPECT_EQ(UseFusedBackward(large, off, Problem(large, 16384), true), BackwardKernels::kUnfused);
  off.backward = BackwardKernels::kFused;
  EXPECT_EQ(UseFusedBackward(s, off, Problem(s, 16), true), BackwardKernels::kFused);
}

// The FusedKernelsTest shape T=256, E=128, K=2, d=64, h=264 (cuda_engine_test.cc) is there to
// run the ping-pong kernel through the engine; this keeps it reaching it on a 132-SM GPU.
TEST(Sm90ChooseConfigTest, EngineTestShapeReachesThePingPongKernel) {
  Sm90ExpertProblem p;
  p.num_tokens = 256;
  p.top_k = 2;
  p.num_experts = 128;
  p.d_model = 64;
  p.d_hidden = 264;
  p.num_routed = 512;
  EXPECT_TRUE(Sm90ChooseConfig(p, Sm90Projection::kUpSwiGLU, 132).ping_pong);
  EXPECT_FALSE(Sm90ChooseConfig(p, Sm90Projection::kBackwardDA, 132).ping_pong);
}

// The up-projection's kernel by how much of the routed rows 128-row tiles pad (half a block an
// expert): the ping-pong kernel's 64-row tiles above 20% (deepseek-v3, 25%), the ws kernel
// between 10% and 20% (scale-8k, 12.5%), the ws kernel at h <= 256 and the plain one otherwise
// below 10% (sonic-7b, olmoe) (docs/decisions/0001-sm90-kernel-choice.md).
TEST(Sm90ChooseConfigTest, UpProjectionKernelFollowsThePaddedShare) {
  struct Want {
    const char* preset;
    bool ws, pp;
  };
  for (const Want& w : {Want{"deepseek-v3", false, true}, Want{"scale-8k", true, false},
                        Want{"sonic-7b", true, false}, Want{"olmoe", false, false}}) {
    const MeasuredPreset& p = FindPreset(w.preset);
    const kernels::Sm90GemmConfig c =
        Sm90ChooseConfig(Problem(PresetShape(p), p.T), Sm90Projection::kUpSwiGLU, 132);
    EXPECT_EQ(c.warp_specialized, w.ws) << w.preset;
    EXPECT_EQ(c.ping_pong, w.pp) << w.preset;
  }
}

// Weight gradients: 256-wide tiles where the gradient has more than 128 columns (dW2 [d, h]: h
// columns; dW13 [2h, d]: d), and the slot-order operand by TMA only with them, up to d = 2048.
TEST(Sm90ChooseConfigTest, WeightGradientTiles) {
  Sm90ExpertProblem p = Problem(SwiGluBf16(136, 128), 64);
  kernels::Sm90GemmConfig w2 = Sm90ChooseConfig(p, Sm90Projection::kWeightGradW2, 132);
  kernels::Sm90GemmConfig w13 = Sm90ChooseConfig(p, Sm90Projection::kWeightGradW13, 132);
  EXPECT_EQ(w2.block_n, 128);
  EXPECT_FALSE(w2.tma_weights);
  EXPECT_EQ(w13.block_n, 256);
  EXPECT_TRUE(w13.tma_weights);
  p = Problem(SwiGluBf16(7168, 2048), 64);  // deepseek-v3's widths: past the measured d
  w13 = Sm90ChooseConfig(p, Sm90Projection::kWeightGradW13, 132);
  EXPECT_EQ(w13.block_n, 256);
  EXPECT_FALSE(w13.tma_weights);
}

}  // namespace
}  // namespace moe::cuda
