// Helpers shared by the CPU engine tests: small configs, random inputs, tensor <-> double.
#ifndef MOE_TESTS_ENGINE_CPU_TEST_UTIL_H_
#define MOE_TESTS_ENGINE_CPU_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/tensor.h"
#include "engine/cpu_engine.h"
#include "engine/layer.h"
#include "tests/engine/cpu/reference.h"

namespace moe::testing {

inline LayerConfig SmallConfig(Activation act, RoutingMode routing) {
  LayerConfig c;
  c.num_experts = 4;
  c.top_k = 2;
  c.d_model = 8;
  c.d_hidden = 5;
  c.activation = act;
  c.routing = routing;
  c.seed = 7;
  c.optimizer.kind = OptimizerKind::kSgd;  // lr = 1, no momentum: delta w = -grad
  c.optimizer.learning_rate = 1.0;
  return c;
}

inline std::unique_ptr<Layer> MakeLayer(const LayerConfig& c) {
  static std::unique_ptr<Engine> engine = CreateCpuEngine();
  auto layer = engine->CreateLayer(c);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

inline std::vector<double> RandomVec(int64_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

// Rounds values to what `dtype` can hold, so fp32 and bf16 layers can see the same input.
inline std::vector<double> Representable(std::vector<double> v, DType dtype) {
  for (double& x : v) {
    x = static_cast<float>(x);
    if (dtype == DType::kBFloat16) x = BFloat16ToFloat(FloatToBFloat16(static_cast<float>(x)));
  }
  return v;
}

inline Tensor MakeTensor(const std::vector<double>& v, DType dtype, std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kBFloat16) {
      t.as<uint16_t>()[i] = FloatToBFloat16(static_cast<float>(v[i]));
    } else {
      t.as<float>()[i] = static_cast<float>(v[i]);
    }
  }
  return t;
}

inline std::vector<double> ToDouble(const Tensor& t) {
  std::vector<double> v(t.num_elements());
  for (size_t i = 0; i < v.size(); ++i) v[i] = LoadFloat(t.view(), i);
  return v;
}

// T tokens, K distinct experts each out of E.
inline std::vector<int32_t> RandomIds(int64_t t, int64_t k, int64_t e, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> perm(e), ids;
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t i = 0; i < t; ++i) {
    std::shuffle(perm.begin(), perm.end(), rng);
    ids.insert(ids.end(), perm.begin(), perm.begin() + k);
  }
  return ids;
}

inline Tensor IdTensor(const std::vector<int32_t>& ids, int64_t t, int64_t k) {
  Tensor r = Tensor::Zeros(DType::kInt32, {t, k});
  std::memcpy(r.as<int32_t>(), ids.data(), ids.size() * sizeof(int32_t));
  return r;
}

// The layer's weights (ExportState without optimizer) as doubles.
inline RefParams ParamsOf(const Layer& layer) {
  RefParams p;
  auto state = layer.ExportState(false);
  EXPECT_TRUE(state.ok()) << state.status();
  for (const auto& [name, t] : *state) p.w[name] = ToDouble(t);
  return p;
}

// One exported state tensor as doubles.
inline std::vector<double> StateOf(const Layer& layer, const std::string& name) {
  auto state = layer.ExportState(true);
  EXPECT_TRUE(state.ok()) << state.status();
  auto it = state->find(name);
  EXPECT_TRUE(it != state->end()) << name;
  return it == state->end() ? std::vector<double>{} : ToDouble(it->second);
}

// One call's inputs: x and dout [t, d] and, with client routing, ids and weights [t, K]
// (weights at least 0.2 in magnitude).
struct Inputs {
  int64_t t = 0;
  Tensor x, dout, ids, w;
};

inline Inputs MakeInputs(const LayerConfig& c, int64_t t, uint32_t seed) {
  Inputs in;
  in.t = t;
  in.x = MakeTensor(RandomVec(t * c.d_model, seed), c.dtype, {t, c.d_model});
  in.dout = MakeTensor(RandomVec(t * c.d_model, seed + 1), c.dtype, {t, c.d_model});
  if (c.routing == RoutingMode::kClient) {
    in.ids = IdTensor(RandomIds(t, c.top_k, c.num_experts, seed + 2), t, c.top_k);
    std::vector<double> p = RandomVec(t * c.top_k, seed + 3, 0.5);
    for (double& v : p) v = 0.2 + std::abs(v);
    in.w = MakeTensor(p, DType::kFloat32, {t, c.top_k});
  }
  return in;
}

// A training Forward of `in`.
inline ForwardRequest RequestOf(const LayerConfig& c, const Inputs& in) {
  ForwardRequest r;
  r.x = in.x.view();
  if (c.routing == RoutingMode::kClient) {
    r.expert_ids = in.ids.view();
    r.weights = in.w.view();
  }
  return r;
}

}  // namespace moe::testing

#endif  // MOE_TESTS_ENGINE_CPU_TEST_UTIL_H_
