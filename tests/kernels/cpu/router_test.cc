// RouteTopKCpu: softmax and logsumexp against double, the top-K order (largest first, ties to
// the lower expert id) and renormalisation.
#include "kernels/cpu/router.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace moe::kernels {
namespace {

TEST(RouteTopKCpuTest, SoftmaxAndLogSumExpMatchDouble) {
  const int32_t e = 5;
  const std::vector<float> logits = {0.5f,   -1.0f, 3.0f,   2.0f, 0.0f,
                                     100.0f, 99.0f, -50.0f, 0.0f, 1.0f};
  std::vector<float> probs(10), lse(2), w(4);
  std::vector<int32_t> ids(4);
  RouteTopKCpu(logits.data(), 2, e, 2, false, probs.data(), lse.data(), ids.data(), w.data());
  for (int t = 0; t < 2; ++t) {
    double mx = -1e300, s = 0;
    for (int i = 0; i < e; ++i) mx = std::max(mx, static_cast<double>(logits[t * e + i]));
    for (int i = 0; i < e; ++i) s += std::exp(logits[t * e + i] - mx);
    EXPECT_NEAR(lse[t], mx + std::log(s), 1e-5 * std::abs(mx + std::log(s)) + 1e-6);
    for (int i = 0; i < e; ++i)
      EXPECT_NEAR(probs[t * e + i], std::exp(logits[t * e + i] - mx) / s, 1e-6);
  }
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 3);
  EXPECT_EQ(ids[2], 0);  // 100 > 99
  EXPECT_EQ(ids[3], 1);
  EXPECT_FLOAT_EQ(w[0], probs[2]);  // no renormalisation
}

TEST(RouteTopKCpuTest, TiesGoToTheLowerExpertId) {
  const std::vector<float> logits = {1.0f, 2.0f, 2.0f, 2.0f};
  std::vector<int32_t> ids(3);
  std::vector<float> w(3);
  RouteTopKCpu(logits.data(), 1, 4, 3, true, nullptr, nullptr, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_NEAR(w[0] + w[1] + w[2], 1.0f, 1e-6);
  EXPECT_FLOAT_EQ(w[0], w[2]);
}

TEST(RouteTopKCpuTest, RenormalisedWeightsSumToOne) {
  std::vector<float> logits(7 * 9);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(0.7f * i) * 3.0f;
  std::vector<int32_t> ids(7 * 4);
  std::vector<float> w(7 * 4);
  RouteTopKCpu(logits.data(), 7, 9, 4, true, nullptr, nullptr, ids.data(), w.data());
  for (int t = 0; t < 7; ++t) {
    float s = 0;
    for (int k = 0; k < 4; ++k) {
      s += w[t * 4 + k];
      if (k > 0) EXPECT_GE(w[t * 4 + k - 1], w[t * 4 + k]) << "token " << t;
    }
    EXPECT_NEAR(s, 1.0f, 1e-6) << "token " << t;
  }
}

}  // namespace
}  // namespace moe::kernels
