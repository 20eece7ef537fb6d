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

using kernels::ActKind;
using kernels::Sgemm;
using kernels::ThreadPool;

// Same rounding as FloatToBFloat16 (RNE, NaN kept), inline so the element-wise loops vectorise.
inline float RoundBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

// Calls fn(begin, end) over [0, n) in chunks of `grain`, spread over the pool.
void ParallelChunks(ThreadPool* pool, int64_t n, int64_t grain,
                    const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  pool->ParallelFor(chunks, [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); });
}

void RoundBf16InPlace(ThreadPool* pool, float* p, int64_t n) {
  ParallelChunks(pool, n, 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) p[i] = RoundBf16(p[i]);
  });
}

void ToFloatParallel(ThreadPool* pool, const TensorView& v, float* out) {
  const int64_t n = v.num_elements();
  ParallelChunks(pool, n, 1 << 16, [&](int64_t b, int64_t e) {
    if (v.dtype == DType::kBFloat16) {
      const uint16_t* src = v.as<uint16_t>();
      for (int64_t i = b; i < e; ++i) out[i] = BFloat16ToFloat(src[i]);
    } else {
      std::memcpy(out + b, v.as<float>() + b, (e - b) * sizeof(float));
    }
  });
}

// n fp32 values -> `dst` as `dtype` (bf16: RNE rounding).
void WriteFromFloat(ThreadPool* pool, const float* src, DType dtype, int64_t n, void* dst) {
  if (dtype == DType::kBFloat16) {
    uint16_t* d16 = static_cast<uint16_t*>(dst);
    ParallelChunks(pool, n, 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) d16[i] = FloatToBFloat16(src[i]);
    });
  } else if (n > 0) {
    std::memcpy(dst, src, n * sizeof(float));
  }
}

// fp32 values -> a tensor of `dtype`.
Tensor FromFloat(ThreadPool* pool, const float* src, DType dtype, std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  WriteFromFloat(pool, src, dtype, t.num_elements(), t.bytes.data());
  return t;
}

// An output: into the caller's destination `dst` when it names one (its shape and dtype already
// checked), else into a new tensor `*out`.
void EmitOutput(ThreadPool* pool, const float* src, DType dtype, std::vector<int64_t> shape,
                const MutableTensorView& dst, Tensor* out) {
  if (dst.empty()) {
    *out = FromFloat(pool, src, dtype, std::move(shape));
  } else {
    WriteFromFloat(pool, src, dtype, NumElements(shape), dst.data);
  }
}

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

// One trainable tensor: the values the GEMMs use, the fp32 master (bf16 storage only), the
// accumulated gradient and the optimizer state (AdamW: m = exp_avg, v = exp_avg_sq; SGD: m =
// momentum buffer).
struct Param {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> w;
  std::vector<float> master;
  std::vector<float> grad;
  std::vector<float> m;
  std::vector<float> v;

  int64_t size() const { return static_cast<int64_t>(w.size()); }
  int64_t bytes() const {
    return static_cast<int64_t>(w.size() + master.size() + grad.size() + m.size() + v.size()) * 4;
  }
};

class CpuContext : public SavedContext {
 public:
  int64_t num_tokens() const override { return t; }
  int64_t bytes() const override {
    return static_cast<int64_t>(x.size() +
                                4 * (idx.size() + p.size() + counts.size() + offsets.size() +
                                     entries.size() + slot_of.size() + h32.size()) +
                                2 * h16.size());
  }

  const void* owner = nullptr;
  int64_t t = 0;
  DType x_dtype = DType::kFloat32;
  std::vector<std::byte> x;                                // [T, d], layer dtype, as received
  std::vector<int32_t> idx;                                // [T, K] routing used
  std::vector<float> p;                                    // [T, K]
  std::vector<int32_t> counts, offsets, entries, slot_of;  // dispatch
  std::vector<float> h32;                                  // [N, hw] with fp32 storage
  std::vector<uint16_t> h16;                               // [N, hw] with bf16 storage
  bool recompute_h = false;  // h32 and h16 empty: the backward recomputes H
};

class CpuLayer : public Layer {
 public:
  CpuLayer(const LayerConfig& config, std::shared_ptr<std::atomic<int64_t>> memory,
           std::shared_ptr<ThreadPool> own_pool)
      : cfg_(config),
        memory_(std::move(memory)),
        own_pool_(std::move(own_pool)),
        pool_(own_pool_ ? own_pool_.get() : &ThreadPool::Default()) {}
  ~CpuLayer() override { memory_->fetch_sub(accounted_bytes_); }

  absl::Status Init();

  const LayerConfig& config() const override { return cfg_; }
  absl::StatusOr<ForwardResult> Forward(const ForwardRequest& request) override {
    try {
      return ForwardImpl(request);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("forward: out of host memory");
    }
  }
  using Layer::Backward;
  absl::StatusOr<BackwardResult> Backward(std::unique_ptr<SavedContext> context,
                                          const BackwardRequest& request) override {
    try {
      return BackwardImpl(std::move(context), request);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError("backward: out of host memory");
    }
  }
  absl::StatusOr<StepResult> Step() override;
  absl::Status ZeroGrad() override;
  int64_t step() const override { return step_; }
  absl::StatusOr<std::map<std::string, Tensor>> ExportState(bool include_optimizer) const override;
  absl::Status ImportState(const std::map<std::string, Tensor>& state) override;
  int64_t resident_bytes() const override {
    int64_t b = 0;
    for (const Param& p : params_) b += p.bytes();
    return b;
  }

 private:
  absl::StatusOr<ForwardResult> ForwardImpl(const ForwardRequest& request);
  absl::StatusOr<BackwardResult> BackwardImpl(std::unique_ptr<SavedContext> context,
                                              const BackwardRequest& request);
  void RouteServer(const float* xf, int64_t t, int32_t* idx, float* p, double* aux, double* z);
  void RouterBackward(const CpuContext& ctx, const float* xf, const float* dp, float* dxf);
  // H [n, hw] = [X W1_l^T | X W3_l^T] for local expert l on the gathered rows xl [n, d],
  // rounded to bf16 with bf16 storage. Forward and recompute-mode Backward both call this, which
  // is what makes the two modes bitwise equal.
  void UpProject(int64_t l, const float* xl, int64_t n, float* hb);
  // A = act(H1) (* H3), rounded to bf16 with bf16 storage.
  void Activate(const float* h, int64_t n, float* a);
  Param* Find(const std::string& name);

  int64_t hw() const { return cfg_.gated() ? 2 * cfg_.d_hidden : cfg_.d_hidden; }
  bool bf16() const { return cfg_.dtype == DType::kBFloat16; }
  ActKind act() const { return static_cast<ActKind>(static_cast<int>(cfg_.activation)); }

  LayerConfig cfg_;
  std::shared_ptr<std::atomic<int64_t>> memory_;
  std::shared_ptr<ThreadPool> own_pool_;  // null: the process-wide pool
  ThreadPool* pool_;
  std::vector<Param> params_;  // w1, [w3], w2, [router]
  Param* w1_ = nullptr;
  Param* w3_ = nullptr;
  Param* w2_ = nullptr;
  Param* router_ = nullptr;
  int64_t step_ = 0;
  std::vector<int64_t> tokens_seen_;
  int64_t accounted_bytes_ = 0;  // what Init added to the engine's memory counter
};

absl::Status CpuLayer::Init() {
  const int64_t d = cfg_.d_model, h = cfg_.d_hidden, count = cfg_.local_experts();
  params_.reserve(4);
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    Param p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    params_.push_back(std::move(p));
  };
  add("w1", {count, h, d});
  if (cfg_.gated()) add("w3", {count, h, d});
  add("w2", {count, d, h});
  if (cfg_.routing == RoutingMode::kServer) add("router", {d, cfg_.num_experts});
  const bool adamw = cfg_.optimizer.kind == OptimizerKind::kAdamW;
  for (Param& p : params_) {
    const size_t n = static_cast<size_t>(NumElements(p.shape));
    p.w.resize(n);
    if (absl::Status s = InitLayerWeight(cfg_, p.name, p.w.data()); !s.ok()) return s;
    if (bf16()) {
      p.master = p.w;
      for (float& v : p.w) v = RoundBf16(v);
    }
    p.grad.assign(n, 0.0f);
    p.m.assign(n, 0.0f);
    if (adamw) p.v.assign(n, 0.0f);
  }
  w1_ = Find("w1");
  w3_ = Find("w3");
  w2_ = Find("w2");
  router_ = Find("router");
  tokens_seen_.assign(count, 0);
  accounted_bytes_ = resident_bytes();
  memory_->fetch_add(accounted_bytes_);
  return absl::OkStatus();
}

Param* CpuLayer::Find(const std::string& name) {
  for (Param& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

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
  res.expert_ids = Tensor::Zeros(DType::kInt32, {t, k});
  res.weights = Tensor::Zeros(DType::kFloat32, {t, k});
  int32_t* idx = res.expert_ids.as<int32_t>();
  float* p = res.weights.as<float>();
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

  if (ctx) {
    const auto* xb = static_cast<const std::byte*>(request.x.data);
    ctx->x.assign(xb, xb + request.x.size_bytes);
    ctx->x_dtype = request.x.dtype;
    ctx->idx.assign(idx, idx + t * k);
    ctx->p.assign(p, p + t * k);
    ctx->counts = std::move(counts);
    ctx->offsets = std::move(offsets);
    ctx->entries = std::move(entries);
    ctx->slot_of = std::move(slot_of);
    res.context = std::move(ctx);
  }
  return res;
}

void CpuLayer::RouterBackward(const CpuContext& ctx, const float* xf, const float* dp, float* dxf) {
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
  // The aux terms enter only on the shard that owns expert 0, so shard gradients sum to one.
  const bool aux_here = cfg_.expert_first == 0;
  std::vector<double> aux_grad(ne, 0.0);  // d aux / d s[t,e] = coef * E * f_e / T
  if (aux_here && cfg_.aux_loss_coef != 0.0) {
    for (int64_t i = 0; i < t * k; ++i) aux_grad[ctx.idx[i]] += 1.0;
    for (int64_t e = 0; e < ne; ++e)
      aux_grad[e] = cfg_.aux_loss_coef * ne * (aux_grad[e] / (t * k)) / t;
  }
  const double z_scale = (aux_here && cfg_.z_loss_coef != 0.0) ? 2.0 * cfg_.z_loss_coef / t : 0.0;
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
  if (cfg_.routing == RoutingMode::kServer) RouterBackward(*ctx, xf.data(), dp.data(), dxf.data());

  for (int64_t l = 0; l < count; ++l) tokens_seen_[l] += counts[l];
  BackwardResult res;
  EmitOutput(pool_, dxf.data(), cfg_.dtype, {t, d}, request.dx, &res.dx);
  if (cfg_.routing == RoutingMode::kClient) {
    EmitOutput(pool_, dp.data(), DType::kFloat32, {t, k}, request.dweights, &res.dweights);
  }
  return res;
}

absl::StatusOr<StepResult> CpuLayer::Step() {
  const OptimizerConfig& o = cfg_.optimizer;
  // Global L2 norm over every gradient, in double with a fixed chunk order.
  double sq = 0.0;
  for (const Param& p : params_) {
    constexpr int64_t kChunk = 1 << 16;
    const int64_t n = p.size(), chunks = (n + kChunk - 1) / kChunk;
    std::vector<double> part(chunks, 0.0);
    pool_->ParallelFor(chunks, [&](int64_t c) {
      double s = 0.0;
      for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i)
        s += static_cast<double>(p.grad[i]) * p.grad[i];
      part[c] = s;
    });
    for (double s : part) sq += s;
  }
  const double norm = std::sqrt(sq);
  if (!std::isfinite(norm)) {
    (void)ZeroGrad();
    return absl::FailedPreconditionError(
        absl::StrCat("gradients: global norm is ", norm, "; step skipped and gradients cleared"));
  }
  // torch.nn.utils.clip_grad_norm_: scale by max / (norm + 1e-6) when that is below 1.
  double clip = 1.0;
  if (o.max_grad_norm > 0.0) clip = std::min(1.0, o.max_grad_norm / (norm + 1e-6));
  ++step_;
  const bool adamw = o.kind == OptimizerKind::kAdamW;
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step_));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step_));
  const float lr = static_cast<float>(o.learning_rate);
  const float wd = static_cast<float>(o.weight_decay);
  const float b1 = static_cast<float>(o.beta1), b2 = static_cast<float>(o.beta2);
  const float eps = static_cast<float>(o.epsilon), mom = static_cast<float>(o.momentum);
  const float step_size = static_cast<float>(o.learning_rate / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float fclip = static_cast<float>(clip);
  const bool round = bf16();
  for (Param& p : params_) {
    float* mw = round ? p.master.data() : p.w.data();
    ParallelChunks(pool_, p.size(), 1 << 15, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float g = p.grad[i] * fclip;
        float x = mw[i];
        if (adamw) {
          x -= lr * wd * x;  // decoupled weight decay
          p.m[i] = b1 * p.m[i] + (1.0f - b1) * g;
          p.v[i] = b2 * p.v[i] + (1.0f - b2) * g * g;
          x -= step_size * p.m[i] / (std::sqrt(p.v[i]) * inv_sqrt_bc2 + eps);
        } else {
          const float gd = g + wd * x;  // L2 weight decay, as torch.optim.SGD
          p.m[i] = mom * p.m[i] + gd;
          x -= lr * p.m[i];
        }
        mw[i] = x;
        if (round) p.w[i] = RoundBf16(x);
        p.grad[i] = 0.0f;
      }
    });
  }
  StepResult res;
  res.step = step_;
  res.grad_norm = norm;
  res.tokens_per_expert = tokens_seen_;
  std::fill(tokens_seen_.begin(), tokens_seen_.end(), 0);
  return res;
}

absl::Status CpuLayer::ZeroGrad() {
  for (Param& p : params_) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
  std::fill(tokens_seen_.begin(), tokens_seen_.end(), 0);
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, Tensor>> CpuLayer::ExportState(bool include_optimizer) const {
  std::map<std::string, Tensor> out;
  for (const Param& p : params_) {
    out[p.name] = FromFloat(pool_, p.w.data(), cfg_.dtype, p.shape);
    if (!include_optimizer) continue;
    if (cfg_.optimizer.kind == OptimizerKind::kAdamW) {
      out[p.name + ".exp_avg"] = FromFloat(pool_, p.m.data(), DType::kFloat32, p.shape);
      out[p.name + ".exp_avg_sq"] = FromFloat(pool_, p.v.data(), DType::kFloat32, p.shape);
    } else {
      out[p.name + ".momentum"] = FromFloat(pool_, p.m.data(), DType::kFloat32, p.shape);
    }
    if (bf16())
      out[p.name + ".master"] = FromFloat(pool_, p.master.data(), DType::kFloat32, p.shape);
  }
  if (include_optimizer) {
    Tensor s = Tensor::Zeros(DType::kInt64, {1});
    s.as<int64_t>()[0] = step_;
    out["step"] = std::move(s);
  }
  return out;
}

absl::Status CpuLayer::ImportState(const std::map<std::string, Tensor>& state) {
  // Pass 1: validate everything; pass 2: apply. A rejected import changes nothing.
  const auto shape_of = [this](const std::string& param) -> const std::vector<int64_t>* {
    const Param* p = Find(param);
    return p == nullptr ? nullptr : &p->shape;
  };
  for (const auto& [name, tensor] : state) {
    if (absl::Status s = ValidateStateTensor(cfg_, name, tensor, shape_of); !s.ok()) return s;
  }
  // Weights first, then masters: a bf16 weight import resets its master to the imported value
  // unless the master is imported too.
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& [name, tensor] : state) {
      const StateName parsed = ParseStateName(name);
      if (parsed.kind == StateKind::kStep) {
        if (pass == 0) step_ = tensor.as<int64_t>()[0];
        continue;
      }
      Param* p = Find(parsed.param);
      const TensorView v = tensor.view();
      if (pass == 0 && parsed.kind == StateKind::kWeight) {
        ToFloat(v, p->w.data());
        if (bf16()) p->master = p->w;
      } else if (pass == 1 && parsed.kind == StateKind::kMaster) {
        ToFloat(v, p->master.data());
        for (int64_t i = 0; i < p->size(); ++i) p->w[i] = RoundBf16(p->master[i]);
      } else if (pass == 0 &&
                 (parsed.kind == StateKind::kExpAvg || parsed.kind == StateKind::kMomentum)) {
        ToFloat(v, p->m.data());
      } else if (pass == 0 && parsed.kind == StateKind::kExpAvgSq) {
        ToFloat(v, p->v.data());
      }
    }
  }
  return absl::OkStatus();
}

class CpuEngine : public Engine {
 public:
  explicit CpuEngine(int num_threads)
      : memory_(std::make_shared<std::atomic<int64_t>>(0)),
        pool_(num_threads > 0 ? std::make_shared<ThreadPool>(num_threads) : nullptr) {}
  std::string name() const override { return "cpu"; }
  absl::StatusOr<std::unique_ptr<Layer>> CreateLayer(const LayerConfig& config) override {
    if (absl::Status s = ValidateLayerConfig(config); !s.ok()) return s;
    try {
      auto layer = std::make_unique<CpuLayer>(config, memory_, pool_);
      if (absl::Status s = layer->Init(); !s.ok()) return s;
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
