// The GPU router's fused softmax + top-K against the CPU reference (RouteTopKCpu): expert ids
// bitwise, weights and logsumexp within fp32 rounding, on fresh random logits, with outputs
// poisoned first. Includes exact ties (ties must go to the lower expert id). GPU only.
#include "kernels/cuda/router.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/router.h"

namespace moe::kernels {
namespace {

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

struct Case {
  int64_t tokens;
  int32_t experts, top_k;
  bool renormalize, ties;
};

class RouterTopKTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(RouterTopKTest, MatchesCpu) {
  const Case c = GetParam();
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> logits(c.tokens * c.experts);
  for (float& v : logits) v = c.ties ? std::round(nd(rng)) : nd(rng);  // rounding makes ties
  const int64_t n = c.tokens * c.top_k;
  std::vector<int32_t> idx(n);
  std::vector<float> p(n), lse(c.tokens), probs(c.tokens * c.experts);
  RouteTopKCpu(logits.data(), c.tokens, c.experts, c.top_k, c.renormalize, probs.data(), lse.data(),
               idx.data(), p.data());

  float *d_logits, *d_p, *d_lse;
  int32_t* d_idx;
  ASSERT_CUDA(cudaMalloc(&d_logits, logits.size() * 4));
  ASSERT_CUDA(cudaMalloc(&d_p, n * 4));
  ASSERT_CUDA(cudaMalloc(&d_lse, c.tokens * 4));
  ASSERT_CUDA(cudaMalloc(&d_idx, n * 4));
  ASSERT_CUDA(cudaMemcpy(d_logits, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemset(d_p, 0xff, n * 4));  // NaN
  ASSERT_CUDA(cudaMemset(d_lse, 0xff, c.tokens * 4));
  ASSERT_CUDA(cudaMemset(d_idx, 0x7f, n * 4));
  ASSERT_CUDA(LaunchRouterTopK(d_logits, c.tokens, c.experts, c.top_k, c.renormalize, d_idx, d_p,
                               d_lse, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> g_idx(n);
  std::vector<float> g_p(n), g_lse(c.tokens);
  ASSERT_CUDA(cudaMemcpy(g_idx.data(), d_idx, n * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(g_p.data(), d_p, n * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(g_lse.data(), d_lse, c.tokens * 4, cudaMemcpyDeviceToHost));
  cudaFree(d_logits);
  cudaFree(d_p);
  cudaFree(d_lse);
  cudaFree(d_idx);

  const std::string what = "T=" + std::to_string(c.tokens) + " E=" + std::to_string(c.experts) +
                           " K=" + std::to_string(c.top_k) +
                           " renorm=" + std::to_string(c.renormalize) +
                           " ties=" + std::to_string(c.ties) + " seed=" + std::to_string(seed);
  EXPECT_EQ(g_idx, idx) << what;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(g_p[i], p[i], 1e-5f * std::max(1.f, std::fabs(p[i]))) << what << " i=" << i;
  }
  for (int64_t t = 0; t < c.tokens; ++t) {
    ASSERT_NEAR(g_lse[t], lse[t], 1e-5f * std::max(1.f, std::fabs(lse[t]))) << what << " t=" << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RouterTopKTest,
                         ::testing::Values(Case{1, 1, 1, true, false}, Case{37, 5, 2, true, false},
                                           Case{200, 13, 13, false, false},
                                           Case{513, 64, 8, true, true},
                                           Case{300, 257, 4, false, true},
                                           Case{1000, 128, 8, true, false}));

}  // namespace
}  // namespace moe::kernels
