// Float64 reference of the MoE layer (see reference.h): one token and one expert at a time,
// in the most literal form of the contract's formulas.
#include "tests/engine/cpu/reference.h"

#include <algorithm>
#include <cmath>

#include "common/tensor.h"

namespace moe::testing {
namespace {

double Act(Activation a, double x) {
  switch (a) {
    case Activation::kSwiGLU:
    case Activation::kSiLU:
      return x / (1.0 + std::exp(-x));
    case Activation::kGeLUTanh:
      return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case Activation::kReLU:
      return x > 0 ? x : 0.0;
  }
  return 0.0;
}

}  // namespace

RefResult RefForward(const LayerConfig& c, const RefParams& params, const std::vector<double>& x,
                     int64_t t, const std::vector<int32_t>& idx, const std::vector<double>& p,
                     bool round_bf16) {
  auto rnd = [&](double v) {
    return round_bf16 ? static_cast<double>(BFloat16ToFloat(FloatToBFloat16(static_cast<float>(v))))
                      : v;
  };
  const int64_t d = c.d_model, h = c.d_hidden, k = c.top_k, ne = c.num_experts;
  RefResult r;
  if (c.routing == RoutingMode::kClient) {
    r.idx = idx;
    r.p = p;
  } else {
    const std::vector<double>& wr = params.w.at("router");
    std::vector<double> count(ne, 0.0), mean_s(ne, 0.0);
    double zsum = 0.0;
    for (int64_t i = 0; i < t; ++i) {
      std::vector<double> logit(ne, 0.0), s(ne);
      for (int64_t e = 0; e < ne; ++e)
        for (int64_t j = 0; j < d; ++j) logit[e] += x[i * d + j] * wr[j * ne + e];
      const double mx = *std::max_element(logit.begin(), logit.end());
      double sum = 0.0;
      for (int64_t e = 0; e < ne; ++e) sum += std::exp(logit[e] - mx);
      for (int64_t e = 0; e < ne; ++e) s[e] = std::exp(logit[e] - mx) / sum;
      const double lse = mx + std::log(sum);
      zsum += lse * lse;
      std::vector<bool> taken(ne, false);
      double total = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) {
        int64_t best = -1;
        for (int64_t e = 0; e < ne; ++e)
          if (!taken[e] && (best < 0 || s[e] > s[best])) best = e;
        taken[best] = true;
        r.idx.push_back(static_cast<int32_t>(best));
        r.p.push_back(s[best]);
        total += s[best];
        count[best] += 1.0;
      }
      if (c.renormalize)
        for (int64_t kk = 0; kk < k; ++kk) r.p[i * k + kk] /= total;
      for (int64_t e = 0; e < ne; ++e) mean_s[e] += s[e] / t;
    }
    double s = 0.0;
    for (int64_t e = 0; e < ne; ++e) s += count[e] / (t * k) * mean_s[e];
    r.aux = c.aux_loss_coef * ne * s;
    r.z = c.z_loss_coef * zsum / t;
  }
  const std::vector<double>& w1 = params.w.at("w1");
  const std::vector<double>& w2 = params.w.at("w2");
  const std::vector<double>* w3 = c.gated() ? &params.w.at("w3") : nullptr;
  r.out.assign(t * d, 0.0);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t kk = 0; kk < k; ++kk) {
      const int64_t l = r.idx[i * k + kk] - c.expert_first;
      if (l < 0 || l >= c.local_experts()) continue;
      std::vector<double> a(h);
      for (int64_t j = 0; j < h; ++j) {
        double h1 = 0.0, h3 = 0.0;
        for (int64_t q = 0; q < d; ++q) {
          h1 += w1[(l * h + j) * d + q] * x[i * d + q];
          if (w3) h3 += (*w3)[(l * h + j) * d + q] * x[i * d + q];
        }
        h1 = rnd(h1);
        h3 = rnd(h3);
        a[j] = rnd(Act(c.activation, h1) * (w3 ? h3 : 1.0));
      }
      for (int64_t q = 0; q < d; ++q) {
        double y = 0.0;
        for (int64_t j = 0; j < h; ++j) y += w2[(l * d + q) * h + j] * a[j];
        r.out[i * d + q] += r.p[i * k + kk] * rnd(y);
      }
    }
  }
  for (double& v : r.out) v = rnd(v);
  return r;
}

double RefLoss(const LayerConfig& c, const RefParams& params, const std::vector<double>& x,
               int64_t t, const std::vector<int32_t>& idx, const std::vector<double>& p,
               const std::vector<double>& dout) {
  const RefResult r = RefForward(c, params, x, t, idx, p);
  double loss = 0.0;
  for (size_t i = 0; i < r.out.size(); ++i) loss += dout[i] * r.out[i];
  if (c.routing == RoutingMode::kServer && c.expert_first == 0) loss += r.aux + r.z;
  return loss;
}

double RelError(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

}  // namespace moe::testing
