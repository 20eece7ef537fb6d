// Shared helpers for the client tests: an in-process moe-server on loopback and random inputs.
#ifndef MOE_TESTS_CLIENT_TEST_UTIL_H_
#define MOE_TESTS_CLIENT_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "server/server.h"

namespace moe::testing_util {

inline server::ServerOptions LoopbackOptions() {
  static int counter = 0;
  server::ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.metrics_port = -1;
  o.device = "cpu";
  o.checkpoint_dir = absl::StrCat(::testing::TempDir(), "/moe_client_", ::getpid(), "_", counter++);
  ::mkdir(o.checkpoint_dir.c_str(), 0755);
  return o;
}

inline std::unique_ptr<server::Server> StartServer(server::ServerOptions o = LoopbackOptions()) {
  auto s = server::Server::Start(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

inline std::string Target(const server::Server& s) { return absl::StrCat("127.0.0.1:", s.port()); }

// A small layer that routes on the server: 4 experts, top 2.
inline LayerConfig ServerRoutedConfig(int64_t d_model, int64_t d_hidden) {
  LayerConfig c;
  c.num_experts = 4;
  c.top_k = 2;
  c.d_model = d_model;
  c.d_hidden = d_hidden;
  c.routing = RoutingMode::kServer;
  return c;
}

inline Tensor RandomFloat(std::mt19937& rng, std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(DType::kFloat32, std::move(shape));
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.as<float>()[i] = dist(rng);
  return t;
}

// Distinct expert ids per token drawn from [lo, hi), positive weights.
inline void RandomRouting(std::mt19937& rng, int64_t tokens, int64_t k, int32_t lo, int32_t hi,
                          Tensor* ids, Tensor* weights) {
  *ids = Tensor::Zeros(DType::kInt32, {tokens, k});
  *weights = Tensor::Zeros(DType::kFloat32, {tokens, k});
  std::uniform_real_distribution<float> u(0.1f, 1.f);
  std::vector<int32_t> all;
  for (int32_t e = lo; e < hi; ++e) all.push_back(e);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t j = 0; j < k; ++j) {
      ids->as<int32_t>()[t * k + j] = all[j];
      weights->as<float>()[t * k + j] = u(rng);
    }
  }
}

// ||a - b|| / ||b|| over float32 tensors (DeepGEMM-style normalised error).
inline double RelError(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < b.num_elements(); ++i) {
    const double d = static_cast<double>(a.as<float>()[i]) - b.as<float>()[i];
    num += d * d;
    den += static_cast<double>(b.as<float>()[i]) * b.as<float>()[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace moe::testing_util

#endif  // MOE_TESTS_CLIENT_TEST_UTIL_H_
