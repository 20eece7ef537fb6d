// Helpers shared by the CUDA engine's tests (cuda_engine_test.cc, recompute_test.cc and
// weight_grad_overlap_test.cc, one binary): random inputs, the normalised error the GPU's
// tensors are held to, and a training sequence that records everything a layer produces.
#ifndef MOE_TESTS_ENGINE_CUDA_ENGINE_TEST_UTIL_H_
#define MOE_TESTS_ENGINE_CUDA_ENGINE_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/tensor.h"
#include "engine/layer.h"

namespace moe::testing {

// AdamW's epsilon for the fp32 layers of the tests that hold a GPU layer's stepped weights to a
// CPU layer's. Its first step moves each weight by about lr * g / (|g| + epsilon), a sign
// function of g wherever epsilon is far below |g| (the default 1e-8 is). A gradient element that
// is zero up to rounding (its terms cancel) can then land on opposite signs in the two engines
// and move by +lr in one and -lr in the other: at lr = 1e-2, about 1e-3 of a whole weight's norm
// in these shapes, ten times the fp32 tolerance (seen once in gpu-check, recompute_test's
// "state w3", 1.09e-3, with every gradient and moment within 5e-7). At 1e-4 the step is smooth
// at rounding scale and the bias-corrected moments and the update are still tested; the moments
// are compared directly. bf16 layers keep the default: such a flip is inside their 2e-2, and
// with 1e-4 the step follows the engines' differently rounded gradients closely enough that
// more near-ties of server routing flipped after it (seen once: 7 of 96 tokens, 5% allowed).
constexpr double kAdamTestEpsilon = 1e-4;

// Every element as a double, whatever the tensor's dtype.
inline std::vector<double> AsDouble(const Tensor& t) {
  std::vector<double> v(t.num_elements());
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    if (t.dtype == DType::kInt32) {
      v[i] = t.as<int32_t>()[i];
    } else if (t.dtype == DType::kInt64) {
      v[i] = static_cast<double>(t.as<int64_t>()[i]);
    } else {
      v[i] = LoadFloat(t.view(), i);
    }
  }
  return v;
}

// ||a - b|| / ||b||; infinity for any NaN or a shape mismatch.
inline double NormErr(const Tensor& a, const Tensor& b) {
  if (a.shape != b.shape || a.dtype != b.dtype) return INFINITY;
  const std::vector<double> x = AsDouble(a), y = AsDouble(b);
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return INFINITY;
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

// Normal(0, scale) values, rounded to bf16 for bf16 tensors.
inline Tensor RandomFloat(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng,
                          float scale) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  std::normal_distribution<float> nd(0.f, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    const float v = nd(rng);
    if (dtype == DType::kBFloat16) {
      t.as<uint16_t>()[i] = FloatToBFloat16(v);
    } else {
      t.as<float>()[i] = v;
    }
  }
  return t;
}

// One training round's inputs: x and dout [T, d], client routing ids and weights [T, K].
struct Round {
  Tensor x, ids, w, dout;
};

// `n` rounds of Normal inputs; each token's K experts are distinct and uniformly drawn.
inline std::vector<Round> RandomRounds(int n, DType dtype, int64_t T, int64_t d, int64_t K,
                                       int64_t experts, std::mt19937_64& rng) {
  std::vector<Round> rounds(n);
  for (Round& r : rounds) {
    r.x = RandomFloat(dtype, {T, d}, rng, 1.f);
    r.dout = RandomFloat(dtype, {T, d}, rng, 1.f);
    r.ids = Tensor::Zeros(DType::kInt32, {T, K});
    r.w = RandomFloat(DType::kFloat32, {T, K}, rng, 0.5f);
    std::vector<int32_t> pool(experts);
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        std::uniform_int_distribution<int64_t> pick(k, experts - 1);
        std::swap(pool[k], pool[pick(rng)]);
        r.ids.as<int32_t>()[t * K + k] = pool[k];
      }
    }
  }
  return rounds;
}

// Everything one layer produces over the sequence, by name, plus its saved-context sizes.
struct Trace {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<int64_t> context_bytes;
  int64_t routed = 0;  // (t,k) rows routed to local experts, round 0
};

// Per round a training Forward and its Backward (gradients accumulate), then a Step and the
// full state export; records out, dx, dp, the gradient norm and every state tensor.
inline void RunSequence(Layer& layer, const std::vector<Round>& rounds, const std::string& what,
                        Trace* tr) {
  for (size_t r = 0; r < rounds.size(); ++r) {
    ForwardRequest req;
    req.x = rounds[r].x.view();
    if (layer.config().routing == RoutingMode::kClient) {
      req.expert_ids = rounds[r].ids.view();
      req.weights = rounds[r].w.view();
    }
    absl::StatusOr<ForwardResult> f = layer.Forward(req);
    ASSERT_TRUE(f.ok()) << f.status() << " " << what;
    ASSERT_NE(f->context, nullptr) << what;
    tr->context_bytes.push_back(f->context->bytes());
    if (r == 0) {
      for (int64_t n : f->tokens_per_local_expert) tr->routed += n;
    }
    const std::string k = std::to_string(r);
    tr->tensors.push_back({"out " + k, f->out});
    absl::StatusOr<BackwardResult> b = layer.Backward(std::move(f->context), rounds[r].dout.view());
    ASSERT_TRUE(b.ok()) << b.status() << " " << what;
    tr->tensors.push_back({"dx " + k, b->dx});
    if (layer.config().routing == RoutingMode::kClient)
      tr->tensors.push_back({"dp " + k, b->dweights});
  }
  absl::StatusOr<StepResult> s = layer.Step();
  ASSERT_TRUE(s.ok()) << s.status() << " " << what;
  Tensor norm = Tensor::Zeros(DType::kFloat32, {1});
  norm.as<float>()[0] = static_cast<float>(s->grad_norm);
  tr->tensors.push_back({"grad norm", norm});
  absl::StatusOr<std::map<std::string, Tensor>> st = layer.ExportState(true);
  ASSERT_TRUE(st.ok()) << st.status() << " " << what;
  for (const auto& [name, t] : *st) {
    if (t.dtype == DType::kInt64) continue;  // "step": equal by construction
    tr->tensors.push_back({"state " + name, t});
  }
}

}  // namespace moe::testing

#endif  // MOE_TESTS_ENGINE_CUDA_ENGINE_TEST_UTIL_H_
