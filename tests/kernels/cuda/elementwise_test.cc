// The GPU elementwise ops against plain CPU loops on fresh random inputs, outputs poisoned
// (NaN) first: row gather (bitwise), combine, the fused activation forward and backward for
// all four activations (the CPU side uses kernels/cpu/activation.h, the formulas the CPU
// engine uses), and the fused AdamW / SGD / sum-of-squares kernels. fp32 throughout, so the
// bound is a normalised error of 1e-5 (the GPU uses fast exp/tanh and a different summation
// order). GPU only (ctest label "gpu").
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/activation.h"
#include "kernels/cuda/combine.h"
#include "kernels/cuda/expert_backward.h"
#include "kernels/cuda/expert_forward.h"
#include "kernels/cuda/gather.h"
#include "kernels/cuda/optimizer.h"

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

double NormErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? (num == 0 ? 0 : INFINITY) : std::sqrt(num / den);
}

// Device copy of a host vector; the buffer is freed by the owning test's Free().
class Gpu {
 public:
  ~Gpu() {
    for (void* p : ptrs_) cudaFree(p);
  }
  template <typename T>
  T* Put(const std::vector<T>& v) {
    T* p = Alloc<T>(v.size());
    cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    return p;
  }
  template <typename T>
  T* Alloc(size_t n) {  // poisoned: 0xFF bytes are NaN as floats
    void* p = nullptr;
    cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T));
    cudaMemset(p, 0xff, std::max<size_t>(n, 1) * sizeof(T));
    ptrs_.push_back(p);
    return static_cast<T*>(p);
  }
  template <typename T>
  static std::vector<T> Get(const T* p, size_t n) {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }

 private:
  std::vector<void*> ptrs_;
};

std::vector<float> Random(size_t n, std::mt19937_64& rng, float scale = 1.f) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

class ElementwiseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

TEST_F(ElementwiseTest, GatherAndCombineMatchLoops) {
  for (int64_t d : {1, 7, 40, 64, 129}) {
    const int64_t T = 53, K = 3, N = 120;  // N routed rows; some (t,k) unrouted
    std::vector<float> x = Random(T * d, rng_), y = Random(N * d, rng_), w = Random(T * K, rng_);
    std::vector<int32_t> entries(N), slot_of(T * K, -1);
    std::vector<int32_t> perm(T * K);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    for (int64_t n = 0; n < N; ++n) {
      entries[n] = perm[n];
      slot_of[perm[n]] = static_cast<int32_t>(n);
    }
    Gpu g;
    float* gx = g.Put(x);
    float* gy = g.Put(y);
    float* gw = g.Put(w);
    int32_t* ge = g.Put(entries);
    int32_t* gs = g.Put(slot_of);
    float* gout = g.Alloc<float>(N * d);
    float* gc = g.Alloc<float>(T * d);
    ASSERT_CUDA(LaunchGatherRows(gx, d * 4, ge, K, N, gout, nullptr));
    ASSERT_CUDA(
        LaunchCombine(gy, ElemType::kFloat32, gs, gw, T, K, d, gc, ElemType::kFloat32, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<float> gathered = Gpu::Get(gout, N * d), combined = Gpu::Get(gc, T * d);
    std::vector<float> want_g(N * d), want_c(T * d, 0.f);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < d; ++j) want_g[n * d + j] = x[(entries[n] / K) * d + j];
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        if (slot_of[t * K + k] >= 0)
          for (int64_t j = 0; j < d; ++j)
            want_c[t * d + j] += w[t * K + k] * y[slot_of[t * K + k] * d + j];
    EXPECT_EQ(gathered, want_g) << "d=" << d << " seed=" << seed_;
    EXPECT_LE(NormErr(combined, want_c), 1e-6) << "d=" << d << " seed=" << seed_;
  }
}

TEST_F(ElementwiseTest, ActivationForwardAndBackwardMatchLoops) {
  for (int act = 0; act < 4; ++act) {
    for (int64_t h : {5, 24, 64, 100}) {
      const bool gated = act == 0;
      const int64_t rows = 37, g = gated ? 2 * h : h, K = 2;
      std::vector<float> hb = Random(rows * g, rng_, 2.f), da = Random(rows * h, rng_);
      std::vector<float> p = Random(rows * K, rng_);
      std::vector<int32_t> entries(rows);
      for (int64_t r = 0; r < rows; ++r) entries[r] = static_cast<int32_t>((r * 7) % (rows * K));
      Gpu dev;
      float* gh = dev.Put(hb);
      float* gda = dev.Put(da);
      float* gp = dev.Put(p);
      int32_t* ge = dev.Put(entries);
      float* ga = dev.Alloc<float>(rows * h);
      float* gdh = dev.Alloc<float>(rows * g);
      float* gap = dev.Alloc<float>(rows * h);
      float* gdp = dev.Alloc<float>(rows * K);
      ASSERT_CUDA(LaunchActivationForward(gh, ElemType::kFloat32, act, rows, h, ga, nullptr));
      ASSERT_CUDA(LaunchActivationBackward(gh, gda, ge, gp, ElemType::kFloat32, act, rows, h, gdh,
                                           gap, gdp, nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const auto kind = static_cast<ActKind>(act);
      std::vector<float> a(rows * h), dh(rows * g), ap(rows * h), dp;
      std::vector<float> gdp_all = Gpu::Get(gdp, rows * K), gdp_rows(rows);
      for (int64_t r = 0; r < rows; ++r) {
        const float pw = p[entries[r]];
        double dot = 0;
        for (int64_t j = 0; j < h; ++j) {
          const float x = hb[r * g + j];
          const float f = ActForward(kind, x), u = gated ? hb[r * g + h + j] : 1.f;
          a[r * h + j] = f * u;
          dot += double(da[r * h + j]) * a[r * h + j];
          const float dav = pw * da[r * h + j];
          dh[r * g + j] = dav * u * ActBackward(kind, x);
          if (gated) dh[r * g + h + j] = dav * f;
          ap[r * h + j] = pw * a[r * h + j];
        }
        dp.push_back(static_cast<float>(dot));
        gdp_rows[r] = gdp_all[entries[r]];
      }
      const std::string what = "act=" + std::to_string(act) + " h=" + std::to_string(h) +
                               " seed=" + std::to_string(seed_);
      EXPECT_LE(NormErr(Gpu::Get(ga, rows * h), a), 1e-5) << "A " << what;
      EXPECT_LE(NormErr(Gpu::Get(gdh, rows * g), dh), 1e-5) << "dH " << what;
      EXPECT_LE(NormErr(Gpu::Get(gap, rows * h), ap), 1e-5) << "pA " << what;
      EXPECT_LE(NormErr(gdp_rows, dp), 1e-5) << "dp " << what;
    }
  }
}

TEST_F(ElementwiseTest, OptimizersAndNormMatchLoops) {
  const int64_t n = 100003;
  std::vector<float> w = Random(n, rng_), m = Random(n, rng_, 0.1f), g = Random(n, rng_);
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = std::fabs(Random(1, rng_)[0]) * 0.01f;
  Gpu dev;
  float* gw = dev.Put(w);
  float* gm = dev.Put(m);
  float* gv = dev.Put(v);
  float* gg = dev.Put(g);
  double* gsq = dev.Alloc<double>(1);
  void* ws = dev.Alloc<char>(SumSquaresWorkspaceBytes());
  ASSERT_CUDA(LaunchSumSquares(gg, n, ws, SumSquaresWorkspaceBytes(), gsq, nullptr));
  AdamWParams ap;
  ap.lr = 1e-2f;
  ap.beta1 = 0.9f;
  ap.beta2 = 0.999f;
  ap.eps = 1e-8f;
  ap.weight_decay = 0.1f;
  ap.step_size = ap.lr / (1.f - 0.9f * 0.9f);
  ap.inv_sqrt_bc2 = 1.f / std::sqrt(1.f - 0.999f * 0.999f);
  ap.grad_scale = 0.5f;
  ASSERT_CUDA(LaunchAdamW(gw, gm, gv, gg, nullptr, n, ap, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  double sq = 0;
  for (float x : g) sq += double(x) * x;
  EXPECT_NEAR(Gpu::Get(gsq, 1)[0], sq, 1e-9 * sq) << "seed=" << seed_;
  std::vector<float> ww = w, wm = m, wv = v;
  for (int64_t i = 0; i < n; ++i) {
    const float gr = g[i] * ap.grad_scale;
    ww[i] -= ap.lr * ap.weight_decay * ww[i];
    wm[i] = ap.beta1 * wm[i] + (1 - ap.beta1) * gr;
    wv[i] = ap.beta2 * wv[i] + (1 - ap.beta2) * gr * gr;
    ww[i] -= ap.step_size * wm[i] / (std::sqrt(wv[i]) * ap.inv_sqrt_bc2 + ap.eps);
  }
  EXPECT_LE(NormErr(Gpu::Get(gw, n), ww), 1e-6) << "seed=" << seed_;
  EXPECT_LE(NormErr(Gpu::Get(gm, n), wm), 1e-6) << "seed=" << seed_;
  EXPECT_LE(NormErr(Gpu::Get(gv, n), wv), 1e-6) << "seed=" << seed_;
  EXPECT_EQ(Gpu::Get(gg, n), std::vector<float>(n, 0.f)) << "gradients are zeroed";

  // SGD with momentum and weight decay, writing the bf16 copy too.
  std::vector<float> g2 = Random(n, rng_);
  float* gg2 = dev.Put(g2);
  uint16_t* gb = dev.Alloc<uint16_t>(n);
  SgdParams sp;
  sp.lr = 0.05f;
  sp.momentum = 0.9f;
  sp.weight_decay = 0.01f;
  sp.grad_scale = 2.f;
  std::vector<float> w0 = Gpu::Get(gw, n), m0 = Gpu::Get(gm, n);
  ASSERT_CUDA(LaunchSgd(gw, gm, gg2, gb, n, sp, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> w1 = Gpu::Get(gw, n);
  std::vector<uint16_t> b1 = Gpu::Get(gb, n);
  for (int64_t i = 0; i < n; ++i) {
    const float step = sp.momentum * m0[i] + (g2[i] * sp.grad_scale + sp.weight_decay * w0[i]);
    w0[i] -= sp.lr * step;
  }
  EXPECT_LE(NormErr(w1, w0), 1e-6) << "seed=" << seed_;
  // The bf16 copy is the round-to-nearest-even rounding of the new fp32 weight.
  for (int64_t i = 0; i < n; i += 997) {
    uint32_t u;
    std::memcpy(&u, &w1[i], 4);
    const uint16_t want = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    ASSERT_EQ(b1[i], want) << "i=" << i << " seed=" << seed_;
  }
}

}  // namespace
}  // namespace moe::kernels
