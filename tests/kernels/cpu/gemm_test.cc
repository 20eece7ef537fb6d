// Sgemm against a float64 triple loop for every transpose combination and awkward sizes
// (edges smaller than the register tile, K across several KC blocks), beta = 0 over a
// NaN-poisoned C and beta = 1 accumulation; and bitwise independence of the thread count.
#include "kernels/cpu/gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace moe::kernels {
namespace {

struct Case {
  bool ta, tb;
  int64_t m, n, k;
  float alpha, beta;
};

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// ||got - want|| / ||want|| over C, with C = alpha op(A) op(B) + beta C0 in double.
double RunCase(const Case& c, ThreadPool* pool, std::vector<float>* out = nullptr,
               SgemmKernel kernel = SgemmKernel::kBest) {
  const int64_t lda = c.ta ? c.m : c.k, ldb = c.tb ? c.k : c.n, ldc = c.n + 3;
  const auto a = Random(c.m * c.k, 1), b = Random(c.k * c.n, 2);
  std::vector<float> cm = Random(c.m * ldc, 3);
  const std::vector<float> c0 = cm;
  if (c.beta == 0.0f) std::fill(cm.begin(), cm.end(), std::numeric_limits<float>::quiet_NaN());
  Sgemm(c.ta, c.tb, c.m, c.n, c.k, c.alpha, a.data(), lda, b.data(), ldb, c.beta, cm.data(), ldc,
        pool, kernel);
  double num = 0, den = 0;
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < c.k; ++p) {
        const double av = c.ta ? a[p * lda + i] : a[i * lda + p];
        const double bv = c.tb ? b[j * ldb + p] : b[p * ldb + j];
        s += av * bv;
      }
      const double want = c.alpha * s + (c.beta == 0.0f ? 0.0 : c.beta * c0[i * ldc + j]);
      const double got = cm[i * ldc + j];
      if (!std::isfinite(got)) return std::numeric_limits<double>::infinity();
      num += (got - want) * (got - want);
      den += want * want;
    }
    // Columns past n (the ldc padding) must be untouched.
    for (int64_t j = c.n; j < ldc; ++j) {
      const float want = c.beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : c0[i * ldc + j];
      if (!(std::isnan(want) ? std::isnan(cm[i * ldc + j]) : cm[i * ldc + j] == want))
        return std::numeric_limits<double>::infinity();
    }
  }
  if (out) *out = cm;
  return std::sqrt(num / den);
}

TEST(SgemmTest, MatchesFloat64ForAllLayouts) {
  ThreadPool pool(3);
  for (SgemmKernel kernel : {SgemmKernel::kGeneric, SgemmKernel::kAvx2, SgemmKernel::kAvx512}) {
    if (!SgemmKernelSupported(kernel)) {
      std::cout << "kernel " << SgemmKernelName(kernel) << " not supported here, skipped\n";
      continue;
    }
    const int64_t shapes[][3] = {
        {1, 1, 1}, {7, 33, 5}, {37, 129, 300}, {130, 17, 513}, {5, 300, 64}};
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (const auto& s : shapes) {
          for (float beta : {0.0f, 1.0f}) {
            const Case c{ta, tb, s[0], s[1], s[2], 0.75f, beta};
            const double err = RunCase(c, &pool, nullptr, kernel);
            // fp32 accumulation over k <= 513 terms: ~1e-7 * sqrt(k); 1e-5 leaves margin.
            EXPECT_LT(err, 1e-5) << "ta=" << ta << " tb=" << tb << " m=" << c.m << " n=" << c.n
                                 << " k=" << c.k << " beta=" << beta << " kernel "
                                 << SgemmKernelName(kernel);
          }
        }
      }
    }
  }
}

// A kernel this CPU does not run is never run: the caller gets the best one instead.
TEST(SgemmTest, KernelNamesAndSupport) {
  EXPECT_TRUE(SgemmKernelSupported(SgemmKernel::kBest));
  EXPECT_TRUE(SgemmKernelSupported(SgemmKernel::kGeneric));
  EXPECT_STREQ(SgemmKernelName(SgemmKernel::kGeneric), "generic");
  for (SgemmKernel kernel : {SgemmKernel::kAvx2, SgemmKernel::kAvx512}) {
    if (!SgemmKernelSupported(kernel)) {
      EXPECT_STREQ(SgemmKernelName(kernel), SgemmKernelName(SgemmKernel::kBest));
    }
  }
  EXPECT_STREQ(SgemmKernelName(SgemmKernel::kAvx2),
               SgemmKernelSupported(SgemmKernel::kAvx2) ? "avx2" : SgemmKernelName());
}

TEST(SgemmTest, GeneralBetaScalesC) {
  const Case c{false, true, 9, 20, 30, 1.0f, 0.5f};
  EXPECT_LT(RunCase(c, nullptr), 1e-5);
}

TEST(SgemmTest, ResultDoesNotDependOnThreadCount) {
  const Case c{true, false, 200, 300, 700, 1.0f, 1.0f};
  std::vector<float> one, four;
  ThreadPool p1(1), p4(4);
  ASSERT_LT(RunCase(c, &p1, &one), 1e-5);
  ASSERT_LT(RunCase(c, &p4, &four), 1e-5);
  EXPECT_EQ(one, four);
}

TEST(ThreadPoolTest, RunsEveryIndexOnceIncludingNested) {
  ThreadPool pool(4);
  std::vector<int> hits(1000, 0);
  pool.ParallelFor(10, [&](int64_t outer) {
    // A nested ParallelFor runs inline instead of deadlocking.
    pool.ParallelFor(100, [&](int64_t inner) { ++hits[outer * 100 + inner]; });
  });
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(hits[i], 1) << "index " << i;
}

}  // namespace
}  // namespace moe::kernels
