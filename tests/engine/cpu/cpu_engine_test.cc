// The CPU engine against the float64 reference: forward outputs, every gradient by central
// finite differences of L = <dout, out> + aux + z, accumulation, sharding, optimizers,
// clipping, state export/import, bf16 storage, and request validation.
//
// Weight gradients are read through the optimizer: the layers here use SGD with lr = 1 and no
// momentum, so one Step() moves each weight by exactly -grad (or, for bf16, its fp32 master).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "tests/engine/cpu/test_util.h"

namespace moe::testing {
namespace {

struct Batch {
  int64_t t = 0;
  std::vector<double> x, p, dout;
  std::vector<int32_t> idx;
};

Batch MakeBatch(const LayerConfig& c, int64_t t, uint32_t seed) {
  Batch b;
  b.t = t;
  b.x = Representable(RandomVec(t * c.d_model, seed), c.dtype);
  b.dout = Representable(RandomVec(t * c.d_model, seed + 1), c.dtype);
  b.idx = RandomIds(t, c.top_k, c.num_experts, seed + 2);
  b.p = RandomVec(t * c.top_k, seed + 3, 0.5);
  for (double& v : b.p) v = static_cast<float>(0.2 + std::abs(v));
  return b;
}

struct FwdBwd {
  ForwardResult fwd;
  BackwardResult bwd;
};

ForwardRequest Request(const LayerConfig& c, const Batch& b, Tensor* x, Tensor* ids, Tensor* w,
                       bool training = true) {
  *x = MakeTensor(b.x, c.dtype, {b.t, c.d_model});
  ForwardRequest r;
  r.x = x->view();
  r.training = training;
  if (c.routing == RoutingMode::kClient) {
    *ids = IdTensor(b.idx, b.t, c.top_k);
    *w = MakeTensor(b.p, DType::kFloat32, {b.t, c.top_k});
    r.expert_ids = ids->view();
    r.weights = w->view();
  }
  return r;
}

FwdBwd ForwardBackward(Layer& layer, const Batch& b) {
  const LayerConfig& c = layer.config();
  Tensor x, ids, w;
  FwdBwd run;
  auto fwd = layer.Forward(Request(c, b, &x, &ids, &w));
  EXPECT_TRUE(fwd.ok()) << fwd.status();
  if (!fwd.ok()) return run;
  run.fwd = std::move(*fwd);
  const Tensor dout = MakeTensor(b.dout, c.dtype, {b.t, c.d_model});
  auto bwd = layer.Backward(std::move(run.fwd.context), dout.view());
  EXPECT_TRUE(bwd.ok()) << bwd.status();
  if (bwd.ok()) run.bwd = std::move(*bwd);
  return run;
}

// w_before - w_after for every weight (= the gradient, with SGD lr = 1).
std::map<std::string, std::vector<double>> Deltas(const RefParams& before, const Layer& after) {
  std::map<std::string, std::vector<double>> d;
  const RefParams now = ParamsOf(after);
  for (const auto& [name, w] : before.w) {
    std::vector<double>& v = d[name];
    for (size_t i = 0; i < w.size(); ++i) v.push_back(w[i] - now.w.at(name)[i]);
  }
  return d;
}

std::string Name(Activation a) {
  switch (a) {
    case Activation::kSwiGLU:
      return "SwiGLU";
    case Activation::kSiLU:
      return "SiLU";
    case Activation::kGeLUTanh:
      return "GeLUTanh";
    case Activation::kReLU:
      return "ReLU";
  }
  return "Unknown";
}

class CpuLayerMathTest : public ::testing::TestWithParam<std::tuple<Activation, RoutingMode>> {
 protected:
  LayerConfig Config() const {
    LayerConfig c = SmallConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
    if (c.routing == RoutingMode::kServer) {
      c.aux_loss_coef = 0.3;
      c.z_loss_coef = 0.05;
    }
    return c;
  }
};

TEST_P(CpuLayerMathTest, ForwardMatchesFloat64Reference) {
  const LayerConfig c = Config();
  auto layer = MakeLayer(c);
  const Batch b = MakeBatch(c, 9, 100);
  const RefParams params = ParamsOf(*layer);
  Tensor x, ids, w;
  auto fwd = layer->Forward(Request(c, b, &x, &ids, &w));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const RefResult ref = RefForward(c, params, b.x, b.t, b.idx, b.p);
  EXPECT_LT(RelError(ToDouble(fwd->out), ref.out), 1e-5);
  if (c.routing == RoutingMode::kServer) {
    const int32_t* got_ids = fwd->expert_ids.as<int32_t>();
    for (size_t i = 0; i < ref.idx.size(); ++i) ASSERT_EQ(got_ids[i], ref.idx[i]) << "entry " << i;
    EXPECT_LT(RelError(ToDouble(fwd->weights), ref.p), 1e-6);
  } else {
    // The caller's routing is not echoed (engine/layer.h).
    EXPECT_TRUE(fwd->expert_ids.bytes.empty());
    EXPECT_TRUE(fwd->weights.bytes.empty());
  }
  EXPECT_NEAR(fwd->aux_loss, ref.aux, 1e-6 * (1 + std::abs(ref.aux)));
  EXPECT_NEAR(fwd->z_loss, ref.z, 1e-6 * (1 + std::abs(ref.z)));
  int64_t routed = 0;
  for (int64_t n : fwd->tokens_per_local_expert) routed += n;
  EXPECT_EQ(routed, b.t * c.top_k);
  ASSERT_NE(fwd->context, nullptr);
  EXPECT_GT(fwd->context->bytes(), 0);
}

// Every gradient the engine returns or accumulates, against central differences of the
// float64 reference loss. Bound: 1e-5 relative (fp32 engine; observed <= 2e-7).
void CheckGradients(const LayerConfig& c, const Batch& b) {
  auto layer = MakeLayer(c);
  const RefParams params = ParamsOf(*layer);
  const FwdBwd run = ForwardBackward(*layer, b);
  auto step = layer->Step();
  ASSERT_TRUE(step.ok()) << step.status();
  const auto deltas = Deltas(params, *layer);
  constexpr double kEps = 1e-6, kBound = 1e-5;
  auto loss = [&](const RefParams& pp, const std::vector<double>& x, const std::vector<double>& p) {
    return RefLoss(c, pp, x, b.t, b.idx, p, b.dout);
  };
  double norm_sq = 0.0, worst = 0.0;
  for (const auto& [name, w] : params.w) {
    std::vector<double> fd(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      RefParams hi = params, lo = params;
      hi.w[name][i] += kEps;
      lo.w[name][i] -= kEps;
      fd[i] = (loss(hi, b.x, b.p) - loss(lo, b.x, b.p)) / (2 * kEps);
      norm_sq += fd[i] * fd[i];
    }
    const double err = RelError(deltas.at(name), fd);
    EXPECT_LT(err, kBound) << "d" << name;
    worst = std::max(worst, err);
  }
  EXPECT_NEAR(step->grad_norm, std::sqrt(norm_sq), 1e-4 * std::sqrt(norm_sq)) << "grad_norm";
  std::vector<double> fdx(b.x.size());
  for (size_t i = 0; i < b.x.size(); ++i) {
    std::vector<double> hi = b.x, lo = b.x;
    hi[i] += kEps;
    lo[i] -= kEps;
    fdx[i] = (loss(params, hi, b.p) - loss(params, lo, b.p)) / (2 * kEps);
  }
  const double dx_err = RelError(ToDouble(run.bwd.dx), fdx);
  EXPECT_LT(dx_err, kBound) << "dx";
  worst = std::max(worst, dx_err);
  if (c.routing == RoutingMode::kClient) {
    std::vector<double> fdp(b.p.size());
    for (size_t i = 0; i < b.p.size(); ++i) {
      std::vector<double> hi = b.p, lo = b.p;
      hi[i] += kEps;
      lo[i] -= kEps;
      fdp[i] = (loss(params, b.x, hi) - loss(params, b.x, lo)) / (2 * kEps);
    }
    const double dp_err = RelError(ToDouble(run.bwd.dweights), fdp);
    EXPECT_LT(dp_err, kBound) << "dp";
    worst = std::max(worst, dp_err);
  } else {
    EXPECT_TRUE(run.bwd.dweights.empty());
  }
  std::cout << "worst gradient relative error vs finite differences: " << worst << "\n";
}

TEST_P(CpuLayerMathTest, GradientsMatchFiniteDifferences) {
  const LayerConfig c = Config();
  CheckGradients(c, MakeBatch(c, 7, 200));
}

INSTANTIATE_TEST_SUITE_P(
    AllActivationsAndRoutings, CpuLayerMathTest,
    ::testing::Combine(::testing::Values(Activation::kSwiGLU, Activation::kSiLU,
                                         Activation::kGeLUTanh, Activation::kReLU),
                       ::testing::Values(RoutingMode::kClient, RoutingMode::kServer)),
    [](const auto& info) {
      return Name(std::get<0>(info.param)) +
             (std::get<1>(info.param) == RoutingMode::kClient ? "Client" : "Server");
    });

TEST(CpuLayerTest, RouterLossGradientsAloneMatchFiniteDifferences) {
  // dout = 0: the only gradient is that of aux + z, which would otherwise be small next to
  // <dout, out>; checks the load-balancing and z-loss terms of dWr and dx on their own.
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  c.aux_loss_coef = 1.0;
  c.z_loss_coef = 0.5;
  Batch b = MakeBatch(c, 6, 300);
  std::fill(b.dout.begin(), b.dout.end(), 0.0);
  CheckGradients(c, b);
}

// BackwardRequest::aux_grad_scale (d loss / d aux) scales the aux and z-loss gradients alone:
// the router gradient and dx are affine in it, and the aux terms make a difference.
TEST(CpuLayerTest, AuxGradScaleScalesTheRouterLossGradientsLinearly) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  c.aux_loss_coef = 0.5;
  c.z_loss_coef = 0.2;
  const Batch b = MakeBatch(c, 12, 350);
  // The gradients (dx, dWr) of one Forward + Backward with `scale`.
  auto run = [&](double scale) {
    std::vector<std::vector<double>> grads;
    auto layer = MakeLayer(c);
    const RefParams before = ParamsOf(*layer);
    Tensor x, ids, w;
    auto fwd = layer->Forward(Request(c, b, &x, &ids, &w));
    EXPECT_TRUE(fwd.ok()) << fwd.status();
    if (!fwd.ok()) return grads;
    const Tensor dout = MakeTensor(b.dout, c.dtype, {b.t, c.d_model});
    BackwardRequest request;
    request.dout = dout.view();
    request.aux_grad_scale = scale;
    auto bwd = layer->Backward(std::move(fwd->context), request);
    EXPECT_TRUE(bwd.ok()) << bwd.status();
    if (!bwd.ok() || !layer->Step().ok()) return grads;
    grads.push_back(ToDouble(bwd->dx));
    grads.push_back(Deltas(before, *layer).at("router"));
    return grads;
  };
  const auto g0 = run(0.0), g1 = run(1.0), g3 = run(0.3), gn = run(-2.5);
  ASSERT_EQ(g0.size(), 2u);
  ASSERT_EQ(g1.size(), 2u);
  ASSERT_EQ(g3.size(), 2u);
  ASSERT_EQ(gn.size(), 2u);
  for (int which = 0; which < 2; ++which) {
    const char* name = which == 0 ? "dx" : "dWr";
    double aux_part = 0.0, scale = 0.0;
    for (size_t i = 0; i < g0[which].size(); ++i) {
      aux_part = std::max(aux_part, std::abs(g1[which][i] - g0[which][i]));
      scale = std::max(scale, std::abs(g1[which][i]));
    }
    EXPECT_GT(aux_part, 1e-3 * scale) << name << ": the aux terms add nothing to check";
    for (size_t i = 0; i < g0[which].size(); ++i) {
      const double aux = g1[which][i] - g0[which][i];
      EXPECT_NEAR(g3[which][i], g0[which][i] + 0.3 * aux, 1e-5 * scale) << name << "[" << i << "]";
      EXPECT_NEAR(gn[which][i], g0[which][i] - 2.5 * aux, 1e-5 * scale) << name << "[" << i << "]";
    }
  }
}

TEST(CpuLayerTest, ServerRoutingWithoutRenormalisation) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  c.top_k = 3;
  c.renormalize = false;
  c.aux_loss_coef = 0.2;
  CheckGradients(c, MakeBatch(c, 6, 400));
}

TEST(CpuLayerTest, ShardGradientsMatchFiniteDifferences) {
  LayerConfig c = SmallConfig(Activation::kGeLUTanh, RoutingMode::kClient);
  c.expert_first = 1;
  c.expert_count = 2;
  CheckGradients(c, MakeBatch(c, 8, 500));
}

TEST(CpuLayerTest, ForwardHandlesAdversarialRoutings) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
  struct Case {
    std::string name;
    int64_t t, k;
    std::vector<int32_t> ids;
  };
  std::vector<Case> cases = {
      {"all tokens on expert 2", 10, 1, std::vector<int32_t>(10, 2)},
      {"K = E", 5, 4, RandomIds(5, 4, 4, 9)},
      {"T = 1", 1, 2, {3, 0}},
      {"experts 1 and 3 empty", 6, 2, {0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2, 0}},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    LayerConfig cc = c;
    cc.top_k = cs.k;
    auto layer = MakeLayer(cc);
    Batch b = MakeBatch(cc, cs.t, 600);
    b.idx = cs.ids;
    const RefParams params = ParamsOf(*layer);
    const FwdBwd run = ForwardBackward(*layer, b);
    EXPECT_LT(RelError(ToDouble(run.fwd.out), RefForward(cc, params, b.x, b.t, b.idx, b.p).out),
              1e-5);
    std::vector<int64_t> want(4, 0);
    for (int32_t e : cs.ids) ++want[e];
    EXPECT_EQ(run.fwd.tokens_per_local_expert, want);
  }
}

TEST(CpuLayerTest, TokensRoutedOutsideTheShardContributeNothing) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
  c.expert_first = 2;
  c.expert_count = 2;
  auto layer = MakeLayer(c);
  Batch b = MakeBatch(c, 4, 700);
  b.idx = {0, 1, 1, 0, 0, 2, 3, 1};  // tokens 0, 1 entirely elsewhere
  const FwdBwd run = ForwardBackward(*layer, b);
  const std::vector<double> out = ToDouble(run.fwd.out), dx = ToDouble(run.bwd.dx);
  const std::vector<double> dp = ToDouble(run.bwd.dweights);
  for (int64_t i = 0; i < 2 * c.d_model; ++i) {
    EXPECT_EQ(out[i], 0.0) << i;
    EXPECT_EQ(dx[i], 0.0) << i;
  }
  for (int i : {0, 1, 2, 3, 4, 7}) EXPECT_EQ(dp[i], 0.0) << "dp entry " << i;
  EXPECT_NE(dp[5], 0.0);
  EXPECT_EQ(run.fwd.tokens_per_local_expert, (std::vector<int64_t>{1, 1}));
}

TEST(CpuLayerTest, ShardedServerLayersSumToTheFullLayer) {
  LayerConfig full = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  full.aux_loss_coef = 0.3;
  full.z_loss_coef = 0.1;
  LayerConfig a = full, b2 = full;
  a.expert_first = 0;
  a.expert_count = 2;
  b2.expert_first = 2;
  b2.expert_count = 2;
  auto lf = MakeLayer(full), la = MakeLayer(a), lb = MakeLayer(b2);
  const Batch b = MakeBatch(full, 8, 800);
  const RefParams pf = ParamsOf(*lf), pa = ParamsOf(*la), pb = ParamsOf(*lb);
  // A shard's initial weights are the slice of the full layer's (counter-based init).
  const size_t half = pf.w.at("w1").size() / 2;
  EXPECT_EQ(pa.w.at("w1"),
            std::vector<double>(pf.w.at("w1").begin(), pf.w.at("w1").begin() + half));
  EXPECT_EQ(pb.w.at("w2"), std::vector<double>(pf.w.at("w2").begin() + half, pf.w.at("w2").end()));
  const FwdBwd rf = ForwardBackward(*lf, b), ra = ForwardBackward(*la, b),
               rb = ForwardBackward(*lb, b);
  auto sum = [](const Tensor& x, const Tensor& y) {
    std::vector<double> s = ToDouble(x), t = ToDouble(y);
    for (size_t i = 0; i < s.size(); ++i) s[i] += t[i];
    return s;
  };
  EXPECT_LT(RelError(sum(ra.fwd.out, rb.fwd.out), ToDouble(rf.fwd.out)), 1e-5);
  EXPECT_LT(RelError(sum(ra.bwd.dx, rb.bwd.dx), ToDouble(rf.bwd.dx)), 1e-5);
  EXPECT_DOUBLE_EQ(ra.fwd.aux_loss, rf.fwd.aux_loss);
  ASSERT_TRUE(lf->Step().ok());
  ASSERT_TRUE(la->Step().ok());
  ASSERT_TRUE(lb->Step().ok());
  const auto df = Deltas(pf, *lf), da = Deltas(pa, *la), db = Deltas(pb, *lb);
  std::vector<double> router_sum = da.at("router");
  for (size_t i = 0; i < router_sum.size(); ++i) router_sum[i] += db.at("router")[i];
  EXPECT_LT(RelError(router_sum, df.at("router")), 1e-4);
}

TEST(CpuLayerTest, GradientsAccumulateAcrossBackwardCalls) {
  const LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
  auto both = MakeLayer(c), first = MakeLayer(c), second = MakeLayer(c);
  const Batch b1 = MakeBatch(c, 5, 900), b2 = MakeBatch(c, 7, 910);
  const RefParams p0 = ParamsOf(*both);
  ForwardBackward(*both, b1);
  ForwardBackward(*both, b2);
  ForwardBackward(*first, b1);
  ForwardBackward(*second, b2);
  auto s = both->Step();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->tokens_per_expert.size(), 4u);
  int64_t tokens = 0;
  for (int64_t n : s->tokens_per_expert) tokens += n;
  EXPECT_EQ(tokens, (5 + 7) * c.top_k);
  ASSERT_TRUE(first->Step().ok());
  ASSERT_TRUE(second->Step().ok());
  const auto d = Deltas(p0, *both), d1 = Deltas(p0, *first), d2 = Deltas(p0, *second);
  for (const auto& [name, v] : d) {
    std::vector<double> want = d1.at(name);
    for (size_t i = 0; i < want.size(); ++i) want[i] += d2.at(name)[i];
    EXPECT_LT(RelError(v, want), 1e-5) << name;
  }
  // Step consumed the gradients: a second step without backward moves nothing (SGD, wd 0).
  const RefParams p1 = ParamsOf(*both);
  ASSERT_TRUE(both->Step().ok());
  EXPECT_EQ(ParamsOf(*both).w, p1.w);
}

TEST(CpuLayerTest, NonFiniteGradientsSkipTheStep) {
  const LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
  auto layer = MakeLayer(c);
  const RefParams p0 = ParamsOf(*layer);
  Batch b = MakeBatch(c, 4, 960);
  b.dout[5] = NAN;
  ForwardBackward(*layer, b);
  auto s = layer->Step();
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_NE(s.status().message().find("gradients"), std::string::npos);
  EXPECT_EQ(layer->step(), 0);
  EXPECT_EQ(ParamsOf(*layer).w, p0.w);
  // The bad gradients were dropped: the next clean micro-batch steps normally.
  ForwardBackward(*layer, MakeBatch(c, 4, 961));
  auto s2 = layer->Step();
  ASSERT_TRUE(s2.ok()) << s2.status();
  EXPECT_TRUE(std::isfinite(s2->grad_norm));
}

TEST(CpuLayerTest, ZeroGradDropsGradients) {
  const LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
  auto layer = MakeLayer(c);
  const RefParams p0 = ParamsOf(*layer);
  ForwardBackward(*layer, MakeBatch(c, 5, 950));
  ASSERT_TRUE(layer->ZeroGrad().ok());
  auto s = layer->Step();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->grad_norm, 0.0);
  EXPECT_EQ(ParamsOf(*layer).w, p0.w);
  EXPECT_EQ(s->tokens_per_expert, std::vector<int64_t>(4, 0));
}

// Gradients of `layer` for batch `b`, at its current weights, via an SGD (lr = 1) twin.
std::map<std::string, std::vector<double>> GradOf(const Layer& layer, const Batch& b) {
  LayerConfig tc = layer.config();
  tc.optimizer = OptimizerConfig{};
  tc.optimizer.kind = OptimizerKind::kSgd;
  tc.optimizer.learning_rate = 1.0;
  auto twin = MakeLayer(tc);
  auto weights = layer.ExportState(false);
  EXPECT_TRUE(weights.ok());
  EXPECT_TRUE(twin->ImportState(*weights).ok());
  const RefParams p0 = ParamsOf(*twin);
  ForwardBackward(*twin, b);
  EXPECT_TRUE(twin->Step().ok());
  return Deltas(p0, *twin);
}

TEST(CpuLayerTest, AdamWStepsMatchHandComputation) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
  c.optimizer = OptimizerConfig{};
  c.optimizer.kind = OptimizerKind::kAdamW;
  c.optimizer.learning_rate = 0.01;
  c.optimizer.beta1 = 0.8;
  c.optimizer.beta2 = 0.95;
  c.optimizer.epsilon = 1e-6;
  c.optimizer.weight_decay = 0.1;
  auto layer = MakeLayer(c);
  RefParams w = ParamsOf(*layer);
  std::map<std::string, std::vector<double>> m, v;
  const OptimizerConfig& o = c.optimizer;
  for (int step = 1; step <= 2; ++step) {
    const Batch b = MakeBatch(c, 6, 1000 + step);
    const auto g = GradOf(*layer, b);
    ForwardBackward(*layer, b);
    auto s = layer->Step();
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->step, step);
    for (auto& [name, wv] : w.w) {
      auto& mv = m[name];
      auto& vv = v[name];
      mv.resize(wv.size(), 0.0);
      vv.resize(wv.size(), 0.0);
      for (size_t i = 0; i < wv.size(); ++i) {
        const double gi = g.at(name)[i];
        wv[i] *= 1 - o.learning_rate * o.weight_decay;
        mv[i] = o.beta1 * mv[i] + (1 - o.beta1) * gi;
        vv[i] = o.beta2 * vv[i] + (1 - o.beta2) * gi * gi;
        const double mh = mv[i] / (1 - std::pow(o.beta1, step));
        const double vh = vv[i] / (1 - std::pow(o.beta2, step));
        wv[i] -= o.learning_rate * mh / (std::sqrt(vh) + o.epsilon);
      }
      EXPECT_LT(RelError(ParamsOf(*layer).w.at(name), wv), 1e-5) << name << " step " << step;
      EXPECT_LT(RelError(StateOf(*layer, name + ".exp_avg"), mv), 1e-4) << name;
      EXPECT_LT(RelError(StateOf(*layer, name + ".exp_avg_sq"), vv), 1e-4) << name;
    }
  }
}

TEST(CpuLayerTest, SgdMomentumStepsMatchHandComputation) {
  LayerConfig c = SmallConfig(Activation::kReLU, RoutingMode::kClient);
  c.optimizer.learning_rate = 0.1;
  c.optimizer.momentum = 0.9;
  c.optimizer.weight_decay = 0.01;
  auto layer = MakeLayer(c);
  RefParams w = ParamsOf(*layer);
  std::map<std::string, std::vector<double>> buf;
  for (int step = 1; step <= 2; ++step) {
    const Batch b = MakeBatch(c, 6, 1100 + step);
    const auto g = GradOf(*layer, b);
    ForwardBackward(*layer, b);
    ASSERT_TRUE(layer->Step().ok());
    for (auto& [name, wv] : w.w) {
      auto& bv = buf[name];
      bv.resize(wv.size(), 0.0);
      for (size_t i = 0; i < wv.size(); ++i) {
        bv[i] = 0.9 * bv[i] + g.at(name)[i] + 0.01 * wv[i];
        wv[i] -= 0.1 * bv[i];
      }
      EXPECT_LT(RelError(ParamsOf(*layer).w.at(name), wv), 1e-5) << name << " step " << step;
      EXPECT_LT(RelError(StateOf(*layer, name + ".momentum"), bv), 1e-4) << name;
    }
  }
}

TEST(CpuLayerTest, ClippingScalesByTheGlobalNorm) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  auto plain = MakeLayer(c);
  const Batch b = MakeBatch(c, 6, 1200);
  const RefParams p0 = ParamsOf(*plain);
  ForwardBackward(*plain, b);
  auto s = plain->Step();
  ASSERT_TRUE(s.ok());
  const double norm = s->grad_norm;
  ASSERT_GT(norm, 0.0);
  c.optimizer.max_grad_norm = 0.25 * norm;
  auto clipped = MakeLayer(c);
  ForwardBackward(*clipped, b);
  auto sc = clipped->Step();
  ASSERT_TRUE(sc.ok());
  EXPECT_NEAR(sc->grad_norm, norm, 1e-6 * norm);  // reported before clipping
  const double scale = c.optimizer.max_grad_norm / (norm + 1e-6);
  const auto d = Deltas(p0, *plain), dc = Deltas(p0, *clipped);
  for (const auto& [name, v] : d) {
    std::vector<double> want = v;
    for (double& x : want) x *= scale;
    EXPECT_LT(RelError(dc.at(name), want), 1e-5) << name;
  }
  // A norm under the threshold is left alone.
  c.optimizer.max_grad_norm = 2 * norm;
  auto loose = MakeLayer(c);
  ForwardBackward(*loose, b);
  ASSERT_TRUE(loose->Step().ok());
  const auto dl = Deltas(p0, *loose);
  for (const auto& [name, v] : d) EXPECT_LT(RelError(dl.at(name), v), 1e-6) << name;
}

TEST(CpuLayerTest, ResultsDoNotDependOnTheThreadCount) {
  // Shapes large enough that the GEMMs split into many tiles and the element-wise passes into
  // many chunks; outputs, gradients and the stepped weights must be bit-identical.
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  c.num_experts = 6;
  c.d_model = 96;
  c.d_hidden = 200;
  c.aux_loss_coef = 0.1;
  c.z_loss_coef = 0.01;
  c.dtype = DType::kBFloat16;
  c.optimizer = OptimizerConfig{};
  const Batch b = MakeBatch(c, 300, 1250);
  std::vector<TensorBytes> results[2];
  int i = 0;
  for (int threads : {1, 3}) {
    auto engine = CreateCpuEngine(threads);
    auto layer = engine->CreateLayer(c);
    ASSERT_TRUE(layer.ok()) << layer.status();
    const FwdBwd r = ForwardBackward(**layer, b);
    ASSERT_TRUE((*layer)->Step().ok());
    auto state = (*layer)->ExportState(true);
    ASSERT_TRUE(state.ok());
    results[i].push_back(r.fwd.out.bytes);
    results[i].push_back(r.bwd.dx.bytes);
    for (const auto& [name, t] : *state) results[i].push_back(t.bytes);
    ++i;
  }
  ASSERT_EQ(results[0].size(), results[1].size());
  for (size_t j = 0; j < results[0].size(); ++j) EXPECT_EQ(results[0][j], results[1][j]) << j;
}

TEST(CpuLayerTest, InferenceForwardKeepsNoContext) {
  const LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
  auto layer = MakeLayer(c);
  const Batch b = MakeBatch(c, 3, 1300);
  Tensor x, ids, w;
  auto fwd = layer->Forward(Request(c, b, &x, &ids, &w, /*training=*/false));
  ASSERT_TRUE(fwd.ok());
  EXPECT_EQ(fwd->context, nullptr);
  const RefParams params = ParamsOf(*layer);
  EXPECT_LT(RelError(ToDouble(fwd->out), RefForward(c, params, b.x, b.t, b.idx, b.p).out), 1e-5);
}

TEST(CpuLayerTest, Bf16StorageStaysWithinToleranceOfFp32) {
  // Same seed: the bf16 layer's weights are the bf16 rounding of the fp32 layer's. Inputs are
  // bf16-representable. Bound: 2e-2 normalised error (a few bf16 roundings of ~4e-3 each).
  for (RoutingMode routing : {RoutingMode::kClient, RoutingMode::kServer}) {
    LayerConfig c32 = SmallConfig(Activation::kSwiGLU, routing);
    c32.d_model = 64;
    c32.d_hidden = 48;
    LayerConfig c16 = c32;
    c16.dtype = DType::kBFloat16;
    auto l32 = MakeLayer(c32), l16 = MakeLayer(c16);
    const Batch b = MakeBatch(c16, 16, 1400);
    const RefParams p32 = ParamsOf(*l32);
    const std::vector<double> m0 = StateOf(*l16, "w1.master");
    EXPECT_EQ(m0, p32.w.at("w1")) << "bf16 master = fp32 init";
    const FwdBwd r32 = ForwardBackward(*l32, b), r16 = ForwardBackward(*l16, b);
    EXPECT_EQ(r16.fwd.out.dtype, DType::kBFloat16);
    EXPECT_EQ(r16.bwd.dx.dtype, DType::kBFloat16);
    const double out_err = RelError(ToDouble(r16.fwd.out), ToDouble(r32.fwd.out));
    const double dx_err = RelError(ToDouble(r16.bwd.dx), ToDouble(r32.bwd.dx));
    EXPECT_LT(out_err, 2e-2);
    EXPECT_LT(dx_err, 2e-2);
    if (routing == RoutingMode::kClient) {
      EXPECT_LT(RelError(ToDouble(r16.bwd.dweights), ToDouble(r32.bwd.dweights)), 2e-2);
    }
    ASSERT_TRUE(l32->Step().ok());
    ASSERT_TRUE(l16->Step().ok());
    const auto d32 = Deltas(p32, *l32);
    std::vector<double> d16 = m0;
    const std::vector<double> m1 = StateOf(*l16, "w1.master");
    for (size_t i = 0; i < d16.size(); ++i) d16[i] -= m1[i];
    EXPECT_LT(RelError(d16, d32.at("w1")), 2e-2) << "dW1 through the fp32 master";
    // Stored weights are the bf16 rounding of the master.
    const std::vector<double> w1 = ParamsOf(*l16).w.at("w1");
    for (size_t i = 0; i < w1.size(); ++i)
      ASSERT_EQ(w1[i], BFloat16ToFloat(FloatToBFloat16(static_cast<float>(m1[i])))) << i;
    std::cout << "bf16 vs fp32 (" << (routing == RoutingMode::kClient ? "client" : "server")
              << "): out " << out_err << ", dx " << dx_err << "\n";
  }
}

TEST(CpuLayerTest, Bf16RoundsAtTheContractsRoundingPoints) {
  // Against a float64 reference that rounds to bf16 at H1, H3, A, Y and out, the bf16 engine
  // differs only where fp32 accumulation order flips a rounding (rare, one bf16 ulp); against
  // the unrounded reference it differs by every rounding. Bound 1e-3 separates the two.
  for (Activation act : {Activation::kSwiGLU, Activation::kGeLUTanh}) {
    LayerConfig c = SmallConfig(act, RoutingMode::kClient);
    c.d_model = 64;
    c.d_hidden = 96;
    c.dtype = DType::kBFloat16;
    auto layer = MakeLayer(c);
    const Batch b = MakeBatch(c, 24, 1450);
    const RefParams params = ParamsOf(*layer);  // the bf16 weights, exactly
    Tensor x, ids, w;
    auto fwd = layer->Forward(Request(c, b, &x, &ids, &w, /*training=*/false));
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    const std::vector<double> out = ToDouble(fwd->out);
    const double rounded = RelError(out, RefForward(c, params, b.x, b.t, b.idx, b.p, true).out);
    const double plain = RelError(out, RefForward(c, params, b.x, b.t, b.idx, b.p, false).out);
    std::cout << Name(act) << " bf16 out vs rounded reference " << rounded
              << ", vs unrounded reference " << plain << "\n";
    EXPECT_LT(rounded, 1e-3) << Name(act);
    EXPECT_LT(rounded, 0.25 * plain) << Name(act);
  }
}

TEST(CpuLayerTest, ExportImportRoundTrip) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  c.dtype = DType::kBFloat16;
  c.optimizer = OptimizerConfig{};
  auto a = MakeLayer(c);
  ForwardBackward(*a, MakeBatch(c, 6, 1500));
  ASSERT_TRUE(a->Step().ok());
  c.seed = 99;
  auto b = MakeLayer(c);
  auto sa = a->ExportState(true);
  ASSERT_TRUE(sa.ok());
  for (const char* name :
       {"w1", "w3", "w2", "router", "w1.exp_avg", "w1.exp_avg_sq", "router.master", "step"}) {
    EXPECT_TRUE(sa->count(name)) << name;
  }
  EXPECT_EQ(sa->at("w1").dtype, DType::kBFloat16);
  EXPECT_EQ(sa->at("w1.master").dtype, DType::kFloat32);
  ASSERT_TRUE(b->ImportState(*sa).ok());
  EXPECT_EQ(b->step(), 1);
  auto sb = b->ExportState(true);
  ASSERT_TRUE(sb.ok());
  for (const auto& [name, t] : *sa) EXPECT_EQ(sb->at(name).bytes, t.bytes) << name;
  // Same state, same next step.
  const Batch next = MakeBatch(c, 5, 1501);
  ForwardBackward(*a, next);
  ForwardBackward(*b, next);
  ASSERT_TRUE(a->Step().ok());
  ASSERT_TRUE(b->Step().ok());
  EXPECT_EQ(ParamsOf(*a).w, ParamsOf(*b).w);

  // A rejected import (one bad tensor among good ones) changes nothing.
  auto before = b->ExportState(true);
  std::map<std::string, Tensor> bad;
  bad["w1"] = sa->at("w1");
  bad["w2"] = Tensor::Zeros(DType::kBFloat16, {1, 2, 3});
  absl::Status st = b->ImportState(bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("w2"), std::string::npos) << st;
  auto after = b->ExportState(true);
  for (const auto& [name, t] : *before) EXPECT_EQ(after->at(name).bytes, t.bytes) << name;
  std::map<std::string, Tensor> unknown;
  unknown["w1.momentum"] = sa->at("w1.exp_avg");  // AdamW layer has no momentum
  EXPECT_EQ(b->ImportState(unknown).code(), absl::StatusCode::kInvalidArgument);
  std::map<std::string, Tensor> nan_state;
  nan_state["w1.master"] = sa->at("w1.master");
  nan_state["w1.master"].as<float>()[3] = NAN;
  st = b->ImportState(nan_state);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("w1.master"), std::string::npos) << st;
}

TEST(CpuLayerTest, WeightOnlyExportIsInTheLayerDtype) {
  LayerConfig c = SmallConfig(Activation::kReLU, RoutingMode::kClient);
  c.dtype = DType::kBFloat16;
  auto layer = MakeLayer(c);
  auto s = layer->ExportState(false);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->size(), 2u);  // w1, w2: no w3 (not gated), no router (client routing)
  EXPECT_EQ(s->at("w2").shape, (std::vector<int64_t>{4, 8, 5}));
  EXPECT_EQ(s->at("w2").dtype, DType::kBFloat16);
  EXPECT_GT(layer->resident_bytes(), 0);
}

}  // namespace
}  // namespace moe::testing
