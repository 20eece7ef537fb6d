// The CPU reference engine: every part of the layer contract in fp32 host code.
//
// Forward, per local expert e (rows = the (t,k) entries the dispatch assigns to e, in
// expert order):   X = x[rows]; H = [X W1_e^T | X W3_e^T]; A = act(H1) * H3; Y = A W2_e^T;
// then out[t] = sum_k p[t,k] Y[slot(t,k)], k ascending. Only x and H are saved for the backward
// (SonicMoE): A is recomputed from H, and dp[t,k] = <dout[t], Y> is computed as <dout W2_e, A>,
// so expert outputs are never stored. With LayerConfig::recompute_h only x is saved and the
// backward recomputes H per expert by UpProject, the very function the forward ran, on the same
// rows in the same order: H is bitwise the forward's, so every result is too. Backward, per expert:
//   G = dO W2_e; dp = rowdot(G, A); dW2 += (p dO)^T A; dA = p G;
//   dH1 = dA * act'(H1) * H3, dH3 = dA * act(H1); dW1 += dH1^T X; dW3 += dH3^T X;
//   dX = dH1 W1_e + dH3 W3_e, summed per token over k in ascending order.
// All GEMMs are the blocked SGEMM of kernels/cpu, threaded over output tiles; element-wise
// passes are threaded over row chunks. Every reduction has a fixed order, so results do not
// depend on the thread count. With bf16 storage, values are rounded to bf16 at the points a GPU
// engine writes bf16 (H, A, Y, out, dH, dx; see docs/CONTRACT.md); everything else is fp32.
// Inputs are read where they lie and outputs written straight into a caller's host destination
// when the request names one (a shared-memory region's bytes: no copy on either side), else into
// new tensors. Device memory and stream events are refused: this engine has no device.
#include "engine/cpu_engine.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/cpu_layer.h"
#include "engine/init.h"
#include "engine/routing.h"
#include "engine/state.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/thread_pool.h"
namespace moe {
namespace {

using cpu_engine_internal::CpuContext;
using cpu_engine_internal::CpuLayer;
using cpu_engine_internal::EmitOutput;
using cpu_engine_internal::ParallelChunks;
using cpu_engine_internal::RoundBf16;
using cpu_engine_internal::RoundBf16InPlace;
using cpu_engine_internal::ToFloatParallel;
using kernels::ActKind;
using kernels::Sgemm;
using kernels::ThreadPool;

// This engine computes in host memory and runs no CUDA stream: a view of device memory or a
// stream event is refused (InvalidArgument / FailedPrecondition naming it) before any work.
absl::Status RequireHostOnly(const std::vector<NamedView>& views, const StreamOrder& order) {
  for (const NamedView& v : views) {
    if (v.location.is_host()) continue;
    return absl::InvalidArgumentError(
        absl::StrCat(v.field, ": on ", v.location.DebugString(), "; the cpu engine ",
                     v.destination ? "writes" : "reads", " host memory"));
  }
  for (const auto& [field, event] :
       {std::pair<const char*, void*>{"order.wait_event", order.wait_event},
        std::pair<const char*, void*>{"order.done_event", order.done_event}}) {
    if (event != nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(field,
                       ": the cpu engine runs no CUDA stream to order; stream events need a CUDA "
                       "engine"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

namespace cpu_engine_internal {

void CpuLayer::UpProject(int64_t l, const float* xl, int64_t n, float* hb) {
  const int64_t d = cfg_.d_model, h = cfg_.d_hidden, w = hw();
  Sgemm(false, true, n, h, d, 1.0f, xl, d, w1_->w.data() + l * h * d, d, 0.0f, hb, w, pool_);
  if (w3_ != nullptr) {
    Sgemm(false, true, n, h, d, 1.0f, xl, d, w3_->w.data() + l * h * d, d, 0.0f, hb + h, w, pool_);
  }
  if (bf16()) RoundBf16InPlace(pool_, hb, n * w);
}

void CpuLayer::Activate(const float* h, int64_t n, float* a) {
  const int64_t dh = cfg_.d_hidden, w = hw();
  const bool gated = cfg_.gated(), round = bf16();
  const ActKind kind = act();
  ParallelChunks(pool_, n, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* h1 = h + r * w;
      float* ar = a + r * dh;
      if (gated) {
        const float* h3 = h1 + dh;
        for (int64_t j = 0; j < dh; ++j) ar[j] = kernels::ActForward(kind, h1[j]) * h3[j];
      } else {
        for (int64_t j = 0; j < dh; ++j) ar[j] = kernels::ActForward(kind, h1[j]);
      }
      if (round)
        for (int64_t j = 0; j < dh; ++j) ar[j] = RoundBf16(ar[j]);
    }
  });
}

void CpuLayer::RouteServer(const float* xf, int64_t t, int32_t* idx, float* p, double* aux,
                           double* z) {
  const int64_t d = cfg_.d_model, ne = cfg_.num_experts, k = cfg_.top_k;
  std::vector<float> logits(t * ne), probs(t * ne), lse(t);
  Sgemm(false, false, t, ne, d, 1.0f, xf, d, router_->w.data(), ne, 0.0f, logits.data(), ne, pool_);
  ParallelChunks(pool_, t, 256, [&](int64_t b, int64_t e) {
    kernels::RouteTopKCpu(logits.data() + b * ne, e - b, static_cast<int32_t>(ne),
                          static_cast<int32_t>(k), cfg_.renormalize, probs.data() + b * ne,
                          lse.data() + b, idx + b * k, p + b * k);
  });
  // aux = coef * E * sum_e f_e P_e;  z = coef * mean_t lse_t^2 (double, fixed order).
  std::vector<double> f(ne, 0.0), pe(ne, 0.0);
  double zsum = 0.0;
  for (int64_t i = 0; i < t * k; ++i) f[idx[i]] += 1.0;
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t e = 0; e < ne; ++e) pe[e] += probs[r * ne + e];
    zsum += static_cast<double>(lse[r]) * lse[r];
  }
  double s = 0.0;
  for (int64_t e = 0; e < ne; ++e) s += (f[e] / (t * k)) * (pe[e] / t);
  *aux = cfg_.aux_loss_coef * ne * s;
  *z = cfg_.z_loss_coef * zsum / t;
}

absl::StatusOr<ForwardResult> CpuLayer::ForwardImpl(const ForwardRequest& request) {
  MOE_RETURN_IF_ERROR(RequireHostOnly(RequestViews(request), request.order));
  absl::StatusOr<int64_t> t_or = ValidateForwardRequest(cfg_, request);
  if (!t_or.ok()) return t_or.status();
  MOE_RETURN_IF_ERROR(ValidateForwardDestination(cfg_, request, *t_or));
  const int64_t t = *t_or, d = cfg_.d_model, h = cfg_.d_hidden, k = cfg_.top_k;
  const int64_t count = cfg_.local_experts(), w = hw();

  std::vector<float> xf(t * d);
  ToFloatParallel(pool_, request.x, xf.data());

  ForwardResult res;
  // The routing used: the caller's, or the router's (the only one the result returns).
  std::vector<int32_t> routed_ids(t * k);
  std::vector<float> routed_p(t * k);
  int32_t* idx = routed_ids.data();
  float* p = routed_p.data();
  if (cfg_.routing == RoutingMode::kClient) {
    std::memcpy(idx, request.expert_ids.data, t * k * sizeof(int32_t));
    ToFloat(request.weights, p);
  } else {
    RouteServer(xf.data(), t, idx, p, &res.aux_loss, &res.z_loss);
  }

  std::vector<int32_t> counts(count), offsets(count + 1), entries(t * k), slot_of(t * k);
  kernels::DispatchCpu(idx, t, static_cast<int32_t>(k), static_cast<int32_t>(cfg_.expert_first),
                       static_cast<int32_t>(count), counts.data(), offsets.data(), entries.data(),
                       slot_of.data());
  const int64_t n_routed = offsets[count];
  entries.resize(n_routed);
  res.tokens_per_local_expert.assign(counts.begin(), counts.end());

  std::unique_ptr<CpuContext> ctx;
  if (request.training) {
    ctx = std::make_unique<CpuContext>();
    ctx->owner = this;
    ctx->t = t;
    ctx->recompute_h = cfg_.recompute_h;
    if (cfg_.recompute_h) {
      // Keep x and the index arrays only; the backward recomputes H.
    } else if (bf16()) {
      ctx->h16.resize(n_routed * w);
    } else {
      ctx->h32.resize(n_routed * w);
    }
  }

  const int64_t max_rows = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  std::vector<float> xl(max_rows * d), a(max_rows * h), y(n_routed * d);
  // H goes straight into the saved fp32 buffer when there is one; else through a scratch.
  const bool h_into_ctx = ctx && !cfg_.recompute_h && !bf16();
  std::vector<float> hs;
  if (!h_into_ctx) hs.resize(max_rows * w);
  for (int64_t l = 0; l < count; ++l) {
    const int64_t n = counts[l], s0 = offsets[l];
    if (n == 0) continue;
    ParallelChunks(pool_, n, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        std::memcpy(&xl[r * d], &xf[(entries[s0 + r] / k) * d], d * sizeof(float));
    });
    float* hb = h_into_ctx ? ctx->h32.data() + s0 * w : hs.data();
    UpProject(l, xl.data(), n, hb);
    if (bf16()) {
      if (ctx && !cfg_.recompute_h) {
        uint16_t* dst = ctx->h16.data() + s0 * w;
        ParallelChunks(pool_, n * w, 1 << 16, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) dst[i] = FloatToBFloat16(hb[i]);
        });
      }
    }
    Activate(hb, n, a.data());
    float* yl = y.data() + s0 * d;
    Sgemm(false, true, n, d, h, 1.0f, a.data(), h, w2_->w.data() + l * d * h, h, 0.0f, yl, d,
          pool_);
    if (bf16()) RoundBf16InPlace(pool_, yl, n * d);
  }

  // Combine: out[t] = sum_k p[t,k] Y[slot(t,k)], k ascending, fp32; zero for tokens routed
  // entirely outside the shard.
  std::vector<float> out(t * d, 0.0f);
  ParallelChunks(pool_, t, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* o = &out[r * d];
      for (int64_t j = 0; j < k; ++j) {
        const int32_t slot = slot_of[r * k + j];
        if (slot < 0) continue;
        const float pw = p[r * k + j];
        const float* yr = &y[static_cast<int64_t>(slot) * d];
        for (int64_t c = 0; c < d; ++c) o[c] += pw * yr[c];
      }
    }
  });
  EmitOutput(pool_, out.data(), cfg_.dtype, {t, d}, request.out, &res.out);
  if (cfg_.routing == RoutingMode::kServer) {
    res.expert_ids = Tensor::Uninitialized(DType::kInt32, {t, k});
    std::memcpy(res.expert_ids.bytes.data(), idx, t * k * sizeof(int32_t));
    res.weights = Tensor::Uninitialized(DType::kFloat32, {t, k});
    std::memcpy(res.weights.bytes.data(), p, t * k * sizeof(float));
  }

  if (ctx) {
    const auto* xb = static_cast<const std::byte*>(request.x.data);
    ctx->x.assign(xb, xb + request.x.size_bytes);
    ctx->x_dtype = request.x.dtype;
    ctx->idx = std::move(routed_ids);
    ctx->p = std::move(routed_p);
    ctx->counts = std::move(counts);
    ctx->offsets = std::move(offsets);
    ctx->entries = std::move(entries);
    ctx->slot_of = std::move(slot_of);
    res.context = std::move(ctx);
  }
  return res;
}

void CpuLayer::RouterBackward(const CpuContext& ctx, const float* xf, const float* dp,
                              double aux_scale, float* dxf) {
  const int64_t t = ctx.t, d = cfg_.d_model, ne = cfg_.num_experts, k = cfg_.top_k;
  // Recompute softmax and logsumexp from x and the router (only x is saved).
  std::vector<float> logits(t * ne), probs(t * ne), lse(t);
  Sgemm(false, false, t, ne, d, 1.0f, xf, d, router_->w.data(), ne, 0.0f, logits.data(), ne, pool_);
  {
    std::vector<int32_t> idx_tmp(t * k);
    std::vector<float> p_tmp(t * k);
    ParallelChunks(pool_, t, 256, [&](int64_t b, int64_t e) {
      kernels::RouteTopKCpu(logits.data() + b * ne, e - b, static_cast<int32_t>(ne),
                            static_cast<int32_t>(k), cfg_.renormalize, probs.data() + b * ne,
                            lse.data() + b, idx_tmp.data() + b * k, p_tmp.data() + b * k);
    });
  }
  // The aux terms enter only on the shard that owns expert 0, so shard gradients sum to one;
  // each times the caller's d loss / d aux (`aux_scale`).
  const bool aux_here = cfg_.expert_first == 0;
  std::vector<double> aux_grad(ne, 0.0);  // d aux / d s[t,e] = scale * coef * E * f_e / T
  if (aux_here && cfg_.aux_loss_coef != 0.0) {
    for (int64_t i = 0; i < t * k; ++i) aux_grad[ctx.idx[i]] += 1.0;
    for (int64_t e = 0; e < ne; ++e)
      aux_grad[e] = aux_scale * cfg_.aux_loss_coef * ne * (aux_grad[e] / (t * k)) / t;
  }
  const double z_scale =
      (aux_here && cfg_.z_loss_coef != 0.0) ? aux_scale * 2.0 * cfg_.z_loss_coef / t : 0.0;
  std::vector<float>& dl = logits;  // reuse: dlogits [T, E]
  ParallelChunks(pool_, t, 256, [&](int64_t b, int64_t e_end) {
    std::vector<double> ds(ne);
    for (int64_t r = b; r < e_end; ++r) {
      const float* s = &probs[r * ne];
      for (int64_t e = 0; e < ne; ++e) ds[e] = aux_grad[e];
      const int32_t* ir = &ctx.idx[r * k];
      const float* pr = &ctx.p[r * k];
      const float* gr = dp + r * k;
      if (cfg_.renormalize) {
        // p_j = s_j / S  =>  dL/ds_j = (g_j - sum_i g_i p_i) / S.
        double ssum = 0.0, dot = 0.0;
        for (int64_t j = 0; j < k; ++j) {
          ssum += s[ir[j]];
          dot += static_cast<double>(gr[j]) * pr[j];
        }
        for (int64_t j = 0; j < k; ++j) ds[ir[j]] += (gr[j] - dot) / ssum;
      } else {
        for (int64_t j = 0; j < k; ++j) ds[ir[j]] += gr[j];
      }
      double sdot = 0.0;
      for (int64_t e = 0; e < ne; ++e) sdot += ds[e] * s[e];
      for (int64_t e = 0; e < ne; ++e) {
        dl[r * ne + e] = static_cast<float>(s[e] * (ds[e] - sdot) + z_scale * lse[r] * s[e]);
      }
    }
  });
  Sgemm(true, false, d, ne, t, 1.0f, xf, d, dl.data(), ne, 1.0f, router_->grad.data(), ne, pool_);
  Sgemm(false, true, t, d, ne, 1.0f, dl.data(), ne, router_->w.data(), ne, 1.0f, dxf, d, pool_);
}

absl::StatusOr<BackwardResult> CpuLayer::BackwardImpl(std::unique_ptr<SavedContext> context,
                                                      const BackwardRequest& request) {
  const TensorView& dout = request.dout;
  auto* ctx = dynamic_cast<CpuContext*>(context.get());
  if (ctx == nullptr || ctx->owner != this) {
    return absl::InvalidArgumentError(
        "context: not a saved context from a training Forward of this layer");
  }
  const int64_t t = ctx->t, d = cfg_.d_model, h = cfg_.d_hidden, k = cfg_.top_k;
  const int64_t count = cfg_.local_experts(), w = hw();
  MOE_RETURN_IF_ERROR(RequireHostOnly(RequestViews(request), request.order));
  MOE_RETURN_IF_ERROR(ValidateBackwardRequest(cfg_, request, t));

  std::vector<float> xf(t * d), dof(t * d);
  ToFloatParallel(pool_, TensorView{ctx->x_dtype, {t, d}, ctx->x.data(), ctx->x.size(), {}},
                  xf.data());
  ToFloatParallel(pool_, dout, dof.data());

  const std::vector<int32_t>& counts = ctx->counts;
  const std::vector<int32_t>& entries = ctx->entries;
  const int64_t n_routed = ctx->offsets[count];
  const int64_t max_rows = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  std::vector<float> dp(t * k, 0.0f), dxe(n_routed * d);
  std::vector<float> xl(max_rows * d), dol(max_rows * d), a(max_rows * h), g(max_rows * h),
      dh(max_rows * w), pl(max_rows);
  const bool recompute = ctx->recompute_h;
  std::vector<float> hs;
  if (bf16() || recompute) hs.resize(max_rows * w);
  const bool gated = cfg_.gated(), round = bf16();
  const ActKind kind = act();

  for (int64_t l = 0; l < count; ++l) {
    const int64_t n = counts[l], s0 = ctx->offsets[l];
    if (n == 0) continue;
    ParallelChunks(pool_, n, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t tok = entries[s0 + r] / k;
        std::memcpy(&xl[r * d], &xf[tok * d], d * sizeof(float));
        std::memcpy(&dol[r * d], &dof[tok * d], d * sizeof(float));
        pl[r] = ctx->p[entries[s0 + r]];
      }
    });
    const float* hb;
    if (recompute) {
      // Recompute mode: the forward's H, bit for bit (same gathered rows, same UpProject).
      UpProject(l, xl.data(), n, hs.data());
      hb = hs.data();
    } else if (bf16()) {
      const uint16_t* src = ctx->h16.data() + s0 * w;
      ParallelChunks(pool_, n * w, 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hs[i] = BFloat16ToFloat(src[i]);
      });
      hb = hs.data();
    } else {
      hb = ctx->h32.data() + s0 * w;
    }
    Activate(hb, n, a.data());
    const float* w1l = w1_->w.data() + l * h * d;
    const float* w2l = w2_->w.data() + l * d * h;
    // G = dO W2 ([n, d] x [d, h]); dp = <G, A> per row; then scale dO rows by p.
    Sgemm(false, false, n, h, d, 1.0f, dol.data(), d, w2l, h, 0.0f, g.data(), h, pool_);
    ParallelChunks(pool_, n, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        float acc = 0.0f;
        const float* gr = &g[r * h];
        const float* ar = &a[r * h];
        for (int64_t j = 0; j < h; ++j) acc += gr[j] * ar[j];
        dp[entries[s0 + r]] = acc;
        const float pw = pl[r];
        float* dr = &dol[r * d];
        for (int64_t c = 0; c < d; ++c) dr[c] *= pw;
        // dA = p G;  dH1 = dA act'(H1) [H3];  dH3 = dA act(H1).
        const float* h1 = hb + r * w;
        float* dhr = &dh[r * w];
        for (int64_t j = 0; j < h; ++j) {
          const float da = pw * gr[j];
          if (gated) {
            dhr[j] = da * kernels::ActBackward(kind, h1[j]) * h1[h + j];
            dhr[h + j] = da * kernels::ActForward(kind, h1[j]);
          } else {
            dhr[j] = da * kernels::ActBackward(kind, h1[j]);
          }
        }
        if (round)
          for (int64_t j = 0; j < w; ++j) dhr[j] = RoundBf16(dhr[j]);
      }
    });
    // Weight gradients, accumulated: dW2 += (p dO)^T A, dW1 += dH1^T X, dW3 += dH3^T X.
    Sgemm(true, false, d, h, n, 1.0f, dol.data(), d, a.data(), h, 1.0f,
          w2_->grad.data() + l * d * h, h, pool_);
    Sgemm(true, false, h, d, n, 1.0f, dh.data(), w, xl.data(), d, 1.0f,
          w1_->grad.data() + l * h * d, d, pool_);
    // dX rows = dH1 W1 (+ dH3 W3).
    float* dxl = dxe.data() + s0 * d;
    Sgemm(false, false, n, d, h, 1.0f, dh.data(), w, w1l, d, 0.0f, dxl, d, pool_);
    if (gated) {
      const float* w3l = w3_->w.data() + l * h * d;
      Sgemm(true, false, h, d, n, 1.0f, dh.data() + h, w, xl.data(), d, 1.0f,
            w3_->grad.data() + l * h * d, d, pool_);
      Sgemm(false, false, n, d, h, 1.0f, dh.data() + h, w, w3l, d, 1.0f, dxl, d, pool_);
    }
  }

  // dx[t] = sum_k dX[slot(t,k)], k ascending (reuses dof's storage).
  std::vector<float>& dxf = dof;
  ParallelChunks(pool_, t, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* o = &dxf[r * d];
      std::fill(o, o + d, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t slot = ctx->slot_of[r * k + j];
        if (slot < 0) continue;
        const float* src = &dxe[static_cast<int64_t>(slot) * d];
        for (int64_t c = 0; c < d; ++c) o[c] += src[c];
      }
    }
  });
  if (cfg_.routing == RoutingMode::kServer) {
    RouterBackward(*ctx, xf.data(), dp.data(), request.aux_grad_scale, dxf.data());
  }

  for (int64_t l = 0; l < count; ++l) tokens_seen_[l] += counts[l];
  BackwardResult res;
  EmitOutput(pool_, dxf.data(), cfg_.dtype, {t, d}, request.dx, &res.dx);
  if (cfg_.routing == RoutingMode::kClient) {
    EmitOutput(pool_, dp.data(), DType::kFloat32, {t, k}, request.dweights, &res.dweights);
  }
  return res;
}

}  // namespace cpu_engine_internal

namespace {

class CpuEngine : public Engine {
 public:
  explicit CpuEngine(int num_threads)
      : memory_(std::make_shared<std::atomic<int64_t>>(0)),
        pool_(num_threads > 0 ? std::make_shared<ThreadPool>(num_threads) : nullptr) {}
  std::string name() const override { return "cpu"; }
  absl::StatusOr<std::unique_ptr<Layer>> CreateLayer(const LayerConfig& config) override {
    MOE_RETURN_IF_ERROR(ValidateLayerConfig(config));
    try {
      auto layer = std::make_unique<CpuLayer>(config, memory_, pool_);
      MOE_RETURN_IF_ERROR(layer->Init());
      return std::unique_ptr<Layer>(std::move(layer));
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("layer config: weights do not fit in host memory");
    }
  }
  // Per parameter, fp32 each: the weight, its gradient, the first moment (AdamW) or momentum
  // (SGD), the second moment (AdamW) and the master copy (bf16 storage): Param::bytes().
  absl::StatusOr<int64_t> LayerStateBytes(const LayerConfig& config) const override {
    const int64_t per_param = 4 * (3 + (config.optimizer.kind == OptimizerKind::kAdamW ? 1 : 0) +
                                   (config.dtype == DType::kBFloat16 ? 1 : 0));
    return LayerStateBytesFor(config, per_param);
  }
  // Every buffer ForwardImpl / BackwardImpl allocates, counting every expert's rows as the
  // largest (n = T * K routed rows at most), in fp32 (4 bytes) unless noted.
  absl::StatusOr<int64_t> HostWorkingBytes(const LayerConfig& config, int64_t tokens,
                                           EngineCall call) const override {
    const double t = static_cast<double>(tokens), k = static_cast<double>(config.top_k),
                 d = static_cast<double>(config.d_model), h = static_cast<double>(config.d_hidden),
                 e = static_cast<double>(config.num_experts), n = t * k,
                 w = config.gated() ? 2 * h : h;
    const bool server = config.routing == RoutingMode::kServer;
    double floats = 0;
    if (call == EngineCall::kBackward) {
      // x and dout in fp32, dp, the routed rows' dx, their x, dout, A, G, dH and H, p, the
      // result dx and dweights; with server routing the recomputed router and its gradient.
      floats = 3 * t * d + 4 * t * k + n * (3 * d + 2 * h + 2 * w + 1) +
               (server ? 3 * t * e + t + d * e : 0);
    } else {
      // x in fp32, routing and dispatch arrays, the routed rows' x, A, H scratch and Y, out in
      // fp32 and in the layer dtype; a training Forward's context adds x, routing and H.
      floats = 4 * t * d + 6 * t * k + n * (2 * d + h + w) + (server ? 2 * t * e + t : 0);
      if (call == EngineCall::kTrainingForward) floats += t * d + 2 * t * k + n * w;
    }
    return EstimatedBytes(4 * floats, "the call's working memory");
  }
  absl::StatusOr<DeviceMemoryInfo> DeviceMemory() const override {
    const long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES),
               page = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || avail < 0 || page <= 0) {
      return absl::UnavailableError("host memory: sysconf does not report the physical pages");
    }
    DeviceMemoryInfo info;
    info.total_bytes = static_cast<int64_t>(pages) * page;
    info.free_bytes = static_cast<int64_t>(avail) * page;
    info.host = true;
    return info;
  }
  int64_t memory_in_use_bytes() const override { return memory_->load(); }
  int64_t memory_total_bytes() const override {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  }

 private:
  std::shared_ptr<std::atomic<int64_t>> memory_;
  std::shared_ptr<ThreadPool> pool_;  // layers share it and keep it alive
};

}  // namespace

std::unique_ptr<Engine> CreateCpuEngine(int num_threads) {
  return std::make_unique<CpuEngine>(num_threads);
}

}  // namespace moe
