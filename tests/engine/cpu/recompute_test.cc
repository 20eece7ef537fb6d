// The recompute memory mode (LayerConfig::recompute_h) of the CPU engine against its default
// keep-H mode: outputs, dx, dp, accumulated gradients and stepped optimizer state must be
// bitwise equal (the backward recomputes H with the forward's own code on the same rows), and
// the saved context must shrink to x plus the routing and dispatch index arrays.
//
// Two layers with the same config and seed differ only in recompute_h; each runs the same
// sequence (two overlapping training forwards, their backwards in reverse order, a step, and
// one more forward/backward), so accumulation across calls and interleaved contexts are covered.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/engine/cpu/test_util.h"

namespace moe::testing {
namespace {

// Everything observable the sequence produces, as raw bytes, in a fixed order; plus the saved
// context sizes.
struct Trace {
  std::vector<std::pair<std::string, TensorBytes>> blobs;
  std::vector<int64_t> context_bytes;
};

Trace RunSequence(const LayerConfig& c) {
  Trace tr;
  auto layer = MakeLayer(c);
  if (layer == nullptr) return tr;
  const Inputs a = MakeInputs(c, 37, 100), b = MakeInputs(c, 53, 200), z = MakeInputs(c, 29, 300);
  auto fa = layer->Forward(RequestOf(c, a));
  auto fb = layer->Forward(RequestOf(c, b));
  EXPECT_TRUE(fa.ok()) << fa.status();
  EXPECT_TRUE(fb.ok()) << fb.status();
  if (!fa.ok() || !fb.ok()) return tr;
  tr.context_bytes = {fa->context->bytes(), fb->context->bytes()};
  tr.blobs.push_back({"out a", fa->out.bytes});
  tr.blobs.push_back({"out b", fb->out.bytes});
  // Backwards in reverse order: each context carries everything its backward needs.
  auto bb = layer->Backward(std::move(fb->context), b.dout.view());
  auto ba = layer->Backward(std::move(fa->context), a.dout.view());
  EXPECT_TRUE(bb.ok()) << bb.status();
  EXPECT_TRUE(ba.ok()) << ba.status();
  if (!ba.ok() || !bb.ok()) return tr;
  tr.blobs.push_back({"dx a", ba->dx.bytes});
  tr.blobs.push_back({"dx b", bb->dx.bytes});
  if (c.routing == RoutingMode::kClient) {  // server routing returns no dp
    tr.blobs.push_back({"dp a", ba->dweights.bytes});
    tr.blobs.push_back({"dp b", bb->dweights.bytes});
  }
  auto step = layer->Step();
  EXPECT_TRUE(step.ok()) << step.status();
  if (!step.ok()) return tr;
  double norm = step->grad_norm;
  TensorBytes nb(sizeof(norm));
  std::memcpy(nb.data(), &norm, sizeof(norm));
  tr.blobs.push_back({"grad norm", nb});
  auto fz = layer->Forward(RequestOf(c, z));
  EXPECT_TRUE(fz.ok()) << fz.status();
  if (!fz.ok()) return tr;
  tr.blobs.push_back({"out z", fz->out.bytes});
  auto bz = layer->Backward(std::move(fz->context), z.dout.view());
  EXPECT_TRUE(bz.ok()) << bz.status();
  if (!bz.ok()) return tr;
  tr.blobs.push_back({"dx z", bz->dx.bytes});
  EXPECT_TRUE(layer->Step().ok());
  auto state = layer->ExportState(true);
  EXPECT_TRUE(state.ok()) << state.status();
  if (!state.ok()) return tr;
  for (const auto& [name, t] : *state) tr.blobs.push_back({"state " + name, t.bytes});
  return tr;
}

using Param = std::tuple<Activation, RoutingMode, DType, bool /*sharded*/>;

class RecomputeTest : public ::testing::TestWithParam<Param> {
 protected:
  LayerConfig Config() const {
    const auto [act, routing, dtype, sharded] = GetParam();
    LayerConfig c = SmallConfig(act, routing);
    c.num_experts = 6;
    c.top_k = 2;
    c.d_model = 24;
    c.d_hidden = 40;
    c.dtype = dtype;
    c.optimizer = OptimizerConfig{};  // AdamW: the stepped state depends on every gradient bit
    if (routing == RoutingMode::kServer) {
      c.aux_loss_coef = 0.1;
      c.z_loss_coef = 0.01;
    }
    if (sharded) {
      c.expert_first = 2;
      c.expert_count = 3;
    }
    return c;
  }
  std::string Describe(const LayerConfig& c) const {
    return absl::StrCat("act=", static_cast<int>(c.activation),
                        " routing=", static_cast<int>(c.routing),
                        " dtype=", static_cast<int>(c.dtype), " E=", c.num_experts, " K=", c.top_k,
                        " d=", c.d_model, " h=", c.d_hidden, " shard=[", c.expert_first, ",+",
                        c.local_experts(), ")");
  }
};

TEST_P(RecomputeTest, EveryResultIsBitwiseTheKeepHResult) {
  LayerConfig keep = Config();
  LayerConfig recompute = keep;
  recompute.recompute_h = true;
  const Trace a = RunSequence(keep), b = RunSequence(recompute);
  ASSERT_FALSE(a.blobs.empty()) << Describe(keep);
  ASSERT_EQ(a.blobs.size(), b.blobs.size()) << Describe(keep);
  for (size_t i = 0; i < a.blobs.size(); ++i) {
    ASSERT_EQ(a.blobs[i].first, b.blobs[i].first);
    EXPECT_FALSE(a.blobs[i].second.empty()) << a.blobs[i].first;
    EXPECT_TRUE(a.blobs[i].second == b.blobs[i].second)
        << a.blobs[i].first << " differs between keep-H and recompute; " << Describe(keep);
  }
}

TEST_P(RecomputeTest, SavedContextKeepsOnlyXAndTheIndexArrays) {
  LayerConfig keep = Config();
  LayerConfig recompute = keep;
  recompute.recompute_h = true;
  auto lk = MakeLayer(keep), lr = MakeLayer(recompute);
  ASSERT_NE(lk, nullptr);
  ASSERT_NE(lr, nullptr);
  const int64_t t = 41, k = keep.top_k, d = keep.d_model;
  const Inputs in = MakeInputs(keep, t, 400);
  auto fk = lk->Forward(RequestOf(keep, in));
  auto fr = lr->Forward(RequestOf(recompute, in));
  ASSERT_TRUE(fk.ok()) << fk.status();
  ASSERT_TRUE(fr.ok()) << fr.status();
  int64_t routed = 0;
  for (int64_t n : fr->tokens_per_local_expert) routed += n;
  ASSERT_GT(routed, 0) << Describe(keep);
  const int64_t elem = keep.dtype == DType::kBFloat16 ? 2 : 4;
  const int64_t hw = keep.gated() ? 2 * keep.d_hidden : keep.d_hidden;
  const int64_t count = keep.local_experts();
  // x in the layer dtype; idx, p, slot_of [T, K]; entries [routed]; counts, offsets.
  const int64_t expected = t * d * elem + 4 * (3 * t * k + routed + count + (count + 1));
  EXPECT_EQ(fr->context->bytes(), expected) << Describe(keep);
  EXPECT_EQ(fk->context->bytes() - fr->context->bytes(), routed * hw * elem) << Describe(keep);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, RecomputeTest,
    ::testing::Combine(::testing::Values(Activation::kSwiGLU, Activation::kGeLUTanh),
                       ::testing::Values(RoutingMode::kClient, RoutingMode::kServer),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16), ::testing::Bool()));

}  // namespace
}  // namespace moe::testing
