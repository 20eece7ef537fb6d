// The CUDA layer (see cuda_layer.h).
#include "engine/cuda/cuda_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/host_memory.h"
#include "engine/cuda/expert_pipeline.h"
#include "engine/cuda/grouped_gemm.h"
#include "engine/cuda/host_staging.h"
#include "engine/cuda/tensor_io.h"
#include "engine/init.h"
#include "engine/routing.h"
#include "engine/state.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/routing_check.h"

namespace moe::cuda {
namespace {

using kernels::ElemType;

// Where a named tensor lives in the flat parameter layout: `blocks` runs of `run` floats, the
// b-th starting at offset + b * stride.
struct Segment {
  std::vector<int64_t> shape;
  int64_t offset = 0, blocks = 1, run = 0, stride = 0;
};

class CudaContext : public SavedContext {
 public:
  int64_t num_tokens() const override { return t; }
  int64_t bytes() const override {
    return static_cast<int64_t>(x.bytes() + h.bytes() + ids.bytes() + p.bytes() + logits.bytes() +
                                lse.bytes()) +
           plan.device_bytes();
  }

  const void* owner = nullptr;
  int64_t t = 0;
  DeviceBuffer x;       // [T, d] storage type
  DeviceBuffer h;       // [routed, g] storage type
  DeviceBuffer ids;     // [T, K] int32
  DeviceBuffer p;       // [T, K] fp32
  DeviceBuffer logits;  // [T, E] fp32, server routing
  DeviceBuffer lse;     // [T] fp32, server routing
  DispatchPlan plan;
  std::vector<float> aux_grad;  // [E] d aux / d s[t,e]; empty when no aux term here
  float z_scale = 0.f;
};

class CudaLayer : public Layer {
 public:
  CudaLayer(const LayerConfig& config, int device, const PipelineOptions& options)
      : cfg_(config), device_(device), options_(options) {}
  ~CudaLayer() override {
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_->get());
  }

  absl::Status Init();

  const LayerConfig& config() const override { return cfg_; }
  absl::StatusOr<ForwardResult> Forward(const ForwardRequest& request) override {
    absl::StatusOr<ForwardResult> res = ForwardImpl(request);
    if (!res.ok()) Settle();
    return res;
  }
  using Layer::Backward;
  absl::StatusOr<BackwardResult> Backward(std::unique_ptr<SavedContext> context,
                                          const BackwardRequest& request) override {
    absl::StatusOr<BackwardResult> res = BackwardImpl(std::move(context), request);
    if (!res.ok()) Settle();
    return res;
  }
  absl::StatusOr<StepResult> Step() override;
  absl::Status ZeroGrad() override;
  int64_t step() const override { return step_; }
  absl::StatusOr<std::map<std::string, Tensor>> ExportState(bool include_optimizer) const override;
  absl::Status ImportState(const std::map<std::string, Tensor>& state) override;
  int64_t resident_bytes() const override {
    return static_cast<int64_t>(master_.bytes() + storage_.bytes() + grad_.bytes() + m_.bytes() +
                                v_.bytes());
  }

 private:
  bool bf16() const { return cfg_.dtype == DType::kBFloat16; }
  ElemType type() const { return bf16() ? ElemType::kBFloat16 : ElemType::kFloat32; }
  int64_t elem() const { return bf16() ? 2 : 4; }
  bool server() const { return cfg_.routing == RoutingMode::kServer; }
  // Storage-type weights at flat offset `off` (what the GEMMs read).
  void* Weights(int64_t off) const {
    return bf16() ? static_cast<void*>(storage_.as<uint16_t>() + off)
                  : static_cast<void*>(master_.as<float>() + off);
  }
  absl::StatusOr<DeviceBuffer> Alloc(int64_t bytes, const char* what) const {
    return DeviceBuffer::Allocate(static_cast<size_t>(bytes), stream_, what);
  }
  absl::Status Upload(const void* src, int64_t bytes, DeviceBuffer* dst, const char* what);
  absl::Status EnsurePinned(int64_t bytes);
  const Segment* FindSegment(const std::string& name) const;
  absl::StatusOr<ForwardResult> ForwardImpl(const ForwardRequest& request);
  absl::StatusOr<BackwardResult> BackwardImpl(std::unique_ptr<SavedContext> context,
                                              const BackwardRequest& request);
  // A failed call has finished its work when it returns (engine/layer.h): nothing it enqueued
  // may still read or write a caller's memory.
  void Settle() {
    if (cudaSetDevice(device_) == cudaSuccess) cudaStreamSynchronize(stream_->get());
  }
  // Client routing, wherever the caller's ids and weights live, checked and copied into the
  // context on the GPU (kernels/cuda/routing_check.h); the fault record lands in pinned_ for
  // the dispatch's synchronisation to cover. ClientRoutingVerdict reads it after that.
  absl::Status TakeClientRouting(const ForwardRequest& request, int64_t t, CudaContext* ctx);
  absl::Status ClientRoutingVerdict(const ForwardRequest& request, int64_t t);
  absl::Status RouterForward(const void* x, int64_t t, CudaContext* ctx, DeviceBuffer* ids,
                             DeviceBuffer* p);
  // `aux_scale`: the caller's d loss / d aux, which the aux and z-loss gradients are scaled by.
  absl::Status RouterBackward(const CudaContext& ctx, const float* dp, double aux_scale,
                              float* dx);

  LayerConfig cfg_;
  int device_;
  PipelineOptions options_;
  std::shared_ptr<Stream> stream_;
  std::unique_ptr<GemmRunner> gemm_;
  std::unique_ptr<ExpertPipeline> pipeline_;
  std::map<std::string, Segment> segments_;
  int64_t n_w13_ = 0, n_w2_ = 0, n_router_ = 0, n_params_ = 0;
  DeviceBuffer master_, storage_, grad_, m_, v_;
  int64_t step_ = 0;
  bool grads_zero_ = true;  // gradients known to be zero (after init, Step, ZeroGrad)
  std::vector<int64_t> tokens_seen_;
  PinnedHostBuffer pinned_;  // host staging for router results and the gradient norm
};

absl::Status CudaLayer::Upload(const void* src, int64_t bytes, DeviceBuffer* dst,
                               const char* what) {
  absl::StatusOr<DeviceBuffer> b = Alloc(bytes, what);
  if (!b.ok()) return b.status();
  *dst = std::move(*b);
  return CopyToDevice(device_, dst->get(), src, static_cast<size_t>(bytes), stream_->get());
}

absl::Status CudaLayer::EnsurePinned(int64_t bytes) {
  if (static_cast<size_t>(bytes) <= pinned_.bytes()) return absl::OkStatus();
  MOE_CUDA_RETURN(cudaStreamSynchronize(stream_->get()));  // nothing may still target it
  return pinned_.Reserve(static_cast<size_t>(bytes));
}

absl::Status CudaLayer::Init() {
  MOE_CUDA_RETURN(cudaSetDevice(device_));
  absl::StatusOr<std::shared_ptr<Stream>> s = Stream::Create(device_, options_.poison_allocations);
  if (!s.ok()) return s.status();
  stream_ = std::move(*s);
  absl::StatusOr<std::unique_ptr<GemmRunner>> g = GemmRunner::Create(stream_);
  if (!g.ok()) return g.status();
  gemm_ = std::move(*g);

  const int64_t d = cfg_.d_model, h = cfg_.d_hidden, count = cfg_.local_experts();
  const int64_t gw = cfg_.gated() ? 2 * h : h;
  n_w13_ = count * gw * d;
  n_w2_ = count * d * h;
  n_router_ = server() ? d * cfg_.num_experts : 0;
  n_params_ = n_w13_ + n_w2_ + n_router_;
  segments_["w1"] = {{count, h, d}, 0, count, h * d, gw * d};
  if (cfg_.gated()) segments_["w3"] = {{count, h, d}, h * d, count, h * d, gw * d};
  segments_["w2"] = {{count, d, h}, n_w13_, 1, n_w2_, n_w2_};
  if (server())
    segments_["router"] = {{d, cfg_.num_experts}, n_w13_ + n_w2_, 1, n_router_, n_router_};

  ExpertShape shape;
  shape.d_model = d;
  shape.d_hidden = h;
  shape.top_k = cfg_.top_k;
  shape.expert_first = cfg_.expert_first;
  shape.expert_count = count;
  shape.activation = static_cast<int>(cfg_.activation);
  shape.type = type();
  pipeline_ = std::make_unique<ExpertPipeline>(shape, stream_, gemm_.get(), options_);

  // Initial weights: the shared seeded host init, laid out flat, uploaded once.
  std::vector<float> flat(static_cast<size_t>(n_params_));
  for (const auto& [name, seg] : segments_) {
    std::vector<float> w(static_cast<size_t>(NumElements(seg.shape)));
    MOE_RETURN_IF_ERROR(InitLayerWeight(cfg_, name, w.data()));
    for (int64_t b = 0; b < seg.blocks; ++b) {
      std::memcpy(&flat[seg.offset + b * seg.stride], &w[b * seg.run], seg.run * sizeof(float));
    }
  }
  const int64_t pbytes = n_params_ * 4;
  MOE_RETURN_IF_ERROR(Upload(flat.data(), pbytes, &master_, "weights"));
  if (bf16()) {
    absl::StatusOr<DeviceBuffer> b = Alloc(n_params_ * 2, "bf16 weights");
    if (!b.ok()) return b.status();
    storage_ = std::move(*b);
    MOE_CUDA_RETURN(kernels::LaunchFloatToBFloat16(master_.as<float>(), n_params_, storage_.get(),
                                                   stream_->get()));
  }
  for (DeviceBuffer* buf : {&grad_, &m_, &v_}) {
    if (buf == &v_ && cfg_.optimizer.kind != OptimizerKind::kAdamW) continue;
    absl::StatusOr<DeviceBuffer> b = Alloc(pbytes, "gradients and optimizer state");
    if (!b.ok()) return b.status();
    *buf = std::move(*b);
    MOE_CUDA_RETURN(cudaMemsetAsync(buf->get(), 0, static_cast<size_t>(pbytes), stream_->get()));
  }
  tokens_seen_.assign(count, 0);
  MOE_CUDA_RETURN(cudaStreamSynchronize(stream_->get()));  // `flat` is released on return
  return absl::OkStatus();
}

absl::Status CudaLayer::RouterForward(const void* x, int64_t t, CudaContext* ctx, DeviceBuffer* ids,
                                      DeviceBuffer* p) {
  const int64_t d = cfg_.d_model, ne = cfg_.num_experts, k = cfg_.top_k;
  cudaStream_t s = stream_->get();
  absl::StatusOr<DeviceBuffer> logits = Alloc(t * ne * 4, "router logits");
  if (!logits.ok()) return logits.status();
  absl::StatusOr<DeviceBuffer> lse = Alloc(t * 4, "router logsumexp");
  if (!lse.ok()) return lse.status();
  // logits^T [E, T] = Wr (col-major [E, d]) x x^T [d, T].
  MOE_RETURN_IF_ERROR(gemm_->Run(
      {CUBLAS_OP_N, CUBLAS_OP_N, type(), ElemType::kFloat32, 0.f},
      {{static_cast<int>(ne), static_cast<int>(t), static_cast<int>(d), Weights(n_w13_ + n_w2_),
        static_cast<int>(ne), x, static_cast<int>(d), logits->get(), static_cast<int>(ne)}}));
  absl::StatusOr<DeviceBuffer> b = Alloc(t * k * 4, "expert ids");
  if (!b.ok()) return b.status();
  *ids = std::move(*b);
  b = Alloc(t * k * 4, "routing weights");
  if (!b.ok()) return b.status();
  *p = std::move(*b);
  MOE_CUDA_RETURN(kernels::LaunchRouterTopK(
      logits->as<float>(), t, static_cast<int32_t>(ne), static_cast<int32_t>(k), cfg_.renormalize,
      ids->as<int32_t>(), p->as<float>(), lse->as<float>(), s));
  const size_t ws_bytes = kernels::RouterStatsWorkspaceBytes(t, static_cast<int32_t>(ne));
  absl::StatusOr<DeviceBuffer> ws = Alloc(static_cast<int64_t>(ws_bytes), "router statistics");
  if (!ws.ok()) return ws.status();
  absl::StatusOr<DeviceBuffer> stats = Alloc((ne + 1) * 8, "router statistics");
  if (!stats.ok()) return stats.status();
  MOE_CUDA_RETURN(kernels::LaunchRouterStats(logits->as<float>(), lse->as<float>(), t,
                                             static_cast<int32_t>(ne), ws->get(), ws_bytes,
                                             stats->as<double>(), stats->as<double>() + ne, s));
  // Stage ids, weights and statistics in pinned memory; the dispatch's one sync covers them.
  MOE_RETURN_IF_ERROR(EnsurePinned((ne + 1) * 8 + t * k * 8));
  char* pin = pinned_.as<char>();
  MOE_CUDA_RETURN(cudaMemcpyAsync(pin, stats->get(), (ne + 1) * 8, cudaMemcpyDeviceToHost, s));
  MOE_CUDA_RETURN(
      cudaMemcpyAsync(pin + (ne + 1) * 8, ids->get(), t * k * 4, cudaMemcpyDeviceToHost, s));
  MOE_CUDA_RETURN(cudaMemcpyAsync(pin + (ne + 1) * 8 + t * k * 4, p->get(), t * k * 4,
                                  cudaMemcpyDeviceToHost, s));
  if (ctx != nullptr) {
    ctx->logits = std::move(*logits);
    ctx->lse = std::move(*lse);
  }
  return absl::OkStatus();
}

absl::Status CudaLayer::TakeClientRouting(const ForwardRequest& request, int64_t t,
                                          CudaContext* ctx) {
  const int64_t k = cfg_.top_k;
  DeviceBuffer ids_own, w_own;
  MOE_ASSIGN_OR_RETURN(const void* ids, DeviceInput(request.expert_ids, /*keep=*/false, stream_,
                                                    &ids_own, "expert_ids"));
  MOE_ASSIGN_OR_RETURN(const void* w,
                       DeviceInput(request.weights, /*keep=*/false, stream_, &w_own, "weights"));
  MOE_ASSIGN_OR_RETURN(ctx->ids, Alloc(t * k * 4, "expert_ids"));
  MOE_ASSIGN_OR_RETURN(ctx->p, Alloc(t * k * 4, "routing weights"));
  MOE_ASSIGN_OR_RETURN(DeviceBuffer fault, Alloc(8, "routing fault record"));
  cudaStream_t s = stream_->get();
  MOE_CUDA_RETURN(cudaMemsetAsync(fault.get(), 0xff, 8, s));
  MOE_CUDA_RETURN(kernels::LaunchCheckClientRouting(
      static_cast<const int32_t*>(ids), w, request.weights.dtype == DType::kBFloat16, t,
      static_cast<int32_t>(k), static_cast<int32_t>(cfg_.num_experts), ctx->ids.as<int32_t>(),
      ctx->p.as<float>(), fault.as<unsigned long long>(), s));
  MOE_RETURN_IF_ERROR(EnsurePinned(8));
  MOE_CUDA_RETURN(cudaMemcpyAsync(pinned_.get(), fault.get(), 8, cudaMemcpyDeviceToHost, s));
  return absl::OkStatus();
}

absl::Status CudaLayer::ClientRoutingVerdict(const ForwardRequest& request, int64_t t) {
  unsigned long long record;
  std::memcpy(&record, pinned_.get(), 8);
  if (record == kernels::kNoRoutingFault) return absl::OkStatus();
  // A fault: the caller's values come to the host, where the CPU engine's check words the
  // error exactly as it would (the first fault in the same order).
  const auto to_host = [this](const TensorView& v) -> absl::StatusOr<Tensor> {
    Tensor h = Tensor::Uninitialized(v.dtype, v.shape);
    if (v.location.is_host()) {
      std::memcpy(h.bytes.data(), v.data, v.size_bytes);
    } else {
      MOE_RETURN_IF_ERROR(
          CopyToHost(device_, h.bytes.data(), v.data, v.size_bytes, stream_->get()));
    }
    return h;
  };
  MOE_ASSIGN_OR_RETURN(const Tensor ids, to_host(request.expert_ids));
  MOE_ASSIGN_OR_RETURN(const Tensor w, to_host(request.weights));
  MOE_RETURN_IF_ERROR(
      CheckClientRoutingValues(ids.view(), w.view(), t, cfg_.top_k, cfg_.num_experts));
  return absl::InternalError(absl::StrCat(
      "routing check: the GPU found a fault at pair ", kernels::RoutingFaultPair(record), " (kind ",
      static_cast<int>(kernels::RoutingFaultKind(record)), ") that the host does not"));
}

absl::StatusOr<ForwardResult> CudaLayer::ForwardImpl(const ForwardRequest& request) {
  LargeTensorMemoryScope pinned;  // out (and the routing) page-locked: one DMA each
  // Every view (shapes, destinations, locations) and host routing's values before any work.
  MOE_ASSIGN_OR_RETURN(const int64_t t, ValidateForwardShapes(cfg_, request));
  MOE_RETURN_IF_ERROR(ValidateForwardDestination(cfg_, request, t));
  MOE_RETURN_IF_ERROR(CheckViewLocations(RequestViews(request)));
  MOE_CUDA_RETURN(cudaSetDevice(device_));
  const int64_t d = cfg_.d_model, k = cfg_.top_k, ne = cfg_.num_experts;
  cudaStream_t s = stream_->get();
  MOE_RETURN_IF_ERROR(WaitForCaller(request.order, s));

  auto ctx = std::make_unique<CudaContext>();
  ctx->owner = this;
  ctx->t = t;
  // A training Forward keeps x for its Backward: in the layer's own memory, so the caller's may be
  // reused once the call is complete.
  MOE_ASSIGN_OR_RETURN(const void* x,
                       DeviceInput(request.x, request.training, stream_, &ctx->x, "x"));
  ForwardResult res;
  if (!server()) {
    MOE_RETURN_IF_ERROR(TakeClientRouting(request, t, ctx.get()));
  } else {
    MOE_RETURN_IF_ERROR(RouterForward(x, t, ctx.get(), &ctx->ids, &ctx->p));
  }
  MOE_RETURN_IF_ERROR(pipeline_->Dispatch(ctx->ids.as<int32_t>(), t, &ctx->plan));

  if (!server()) {
    // The dispatch's synchronisation completed the fault record's copy.
    MOE_RETURN_IF_ERROR(ClientRoutingVerdict(request, t));
  } else {
    res.expert_ids = Tensor::Zeros(DType::kInt32, {t, k});
    res.weights = Tensor::Zeros(DType::kFloat32, {t, k});
    // The dispatch's sync completed the staged router results.
    const char* pin = pinned_.as<const char>();
    std::vector<double> stats(ne + 1);
    std::memcpy(stats.data(), pin, (ne + 1) * 8);
    std::memcpy(res.expert_ids.as<int32_t>(), pin + (ne + 1) * 8, t * k * 4);
    std::memcpy(res.weights.as<float>(), pin + (ne + 1) * 8 + t * k * 4, t * k * 4);
    std::vector<double> f(ne, 0.0);
    const int32_t* idx = res.expert_ids.as<int32_t>();
    for (int64_t i = 0; i < t * k; ++i) f[idx[i]] += 1.0;
    double sum = 0.0;
    for (int64_t e = 0; e < ne; ++e) sum += (f[e] / (t * k)) * (stats[e] / t);
    res.aux_loss = cfg_.aux_loss_coef * ne * sum;
    res.z_loss = cfg_.z_loss_coef * stats[ne] / t;
    // The aux terms enter the gradients only on the shard owning expert 0 (engine/layer.h).
    if (cfg_.expert_first == 0 && cfg_.aux_loss_coef != 0.0) {
      ctx->aux_grad.resize(ne);
      for (int64_t e = 0; e < ne; ++e) {
        ctx->aux_grad[e] = static_cast<float>(cfg_.aux_loss_coef * ne * (f[e] / (t * k)) / t);
      }
    }
    if (cfg_.expert_first == 0 && cfg_.z_loss_coef != 0.0) {
      ctx->z_scale = static_cast<float>(2.0 * cfg_.z_loss_coef / t);
    }
  }
  res.tokens_per_local_expert = ctx->plan.tokens_per_expert;

  const int64_t g = cfg_.gated() ? 2 * cfg_.d_hidden : cfg_.d_hidden;
  // Recompute mode keeps no H: ctx->h stays empty and the backward recomputes it per chunk.
  if (request.training && !cfg_.recompute_h) {
    absl::StatusOr<DeviceBuffer> hb = Alloc(ctx->plan.total_routed * g * elem(), "saved H");
    if (!hb.ok()) return hb.status();
    ctx->h = std::move(*hb);
  }
  DeviceBuffer out_own;
  MOE_ASSIGN_OR_RETURN(void* out,
                       OutputTarget(request.out, t * d * elem(), stream_, &out_own, "out"));
  ExpertWeights w{Weights(0), Weights(n_w13_)};
  MOE_RETURN_IF_ERROR(pipeline_->Forward(ctx->plan, x, ctx->p.as<float>(), w, ctx->h.get(), out));
  bool synchronised = false;
  if (request.out.empty()) {
    res.out = Tensor::Uninitialized(cfg_.dtype, {t, d});  // the copy below writes every byte
    MOE_RETURN_IF_ERROR(CopyToHost(device_, res.out.bytes.data(), out, res.out.bytes.size(), s));
    synchronised = true;
  } else if (request.out.location.is_host()) {
    MOE_RETURN_IF_ERROR(CopyToHost(device_, request.out.data, out, request.out.size_bytes, s));
    synchronised = true;
  } else {
    MOE_RETURN_IF_ERROR(DeliverToDevice(out, request.out, *stream_));
  }
  MOE_RETURN_IF_ERROR(FinishCall(request.order, s, synchronised, /*host_pending=*/false));
  if (request.training) {
    if (!server()) ctx->aux_grad.clear();
    res.context = std::move(ctx);
  }
  return res;
}

absl::Status CudaLayer::RouterBackward(const CudaContext& ctx, const float* dp, double aux_scale,
                                       float* dx) {
  const int64_t t = ctx.t, d = cfg_.d_model, ne = cfg_.num_experts, k = cfg_.top_k;
  cudaStream_t s = stream_->get();
  DeviceBuffer aux;
  if (!ctx.aux_grad.empty()) {
    std::vector<float> scaled(ctx.aux_grad.size());
    for (size_t e = 0; e < scaled.size(); ++e) {
      scaled[e] = static_cast<float>(aux_scale * ctx.aux_grad[e]);
    }
    MOE_RETURN_IF_ERROR(Upload(scaled.data(), ne * 4, &aux, "aux gradient"));
  }
  const float z_scale = static_cast<float>(aux_scale * ctx.z_scale);
  absl::StatusOr<DeviceBuffer> dl = Alloc(t * ne * 4, "router dlogits");
  if (!dl.ok()) return dl.status();
  MOE_CUDA_RETURN(kernels::LaunchRouterBackward(
      ctx.logits.as<float>(), ctx.lse.as<float>(), ctx.ids.as<int32_t>(), dp, aux.as<float>(),
      z_scale, t, static_cast<int32_t>(ne), static_cast<int32_t>(k), cfg_.renormalize,
      dl->as<float>(), s));
  // The router GEMMs of the backward run in fp32, as the CPU engine's: x and the stored
  // (bf16-rounded) router weights widened to fp32.
  const float* xf = ctx.x.as<float>();
  const float* wr = master_.as<float>() + n_w13_ + n_w2_;
  DeviceBuffer xf_buf, wr_buf;
  if (bf16()) {
    absl::StatusOr<DeviceBuffer> b = Alloc(t * d * 4, "router x fp32");
    if (!b.ok()) return b.status();
    xf_buf = std::move(*b);
    MOE_CUDA_RETURN(kernels::LaunchBFloat16ToFloat(ctx.x.get(), t * d, xf_buf.as<float>(), s));
    xf = xf_buf.as<float>();
    b = Alloc(n_router_ * 4, "router weights fp32");
    if (!b.ok()) return b.status();
    wr_buf = std::move(*b);
    MOE_CUDA_RETURN(
        kernels::LaunchBFloat16ToFloat(Weights(n_w13_ + n_w2_), n_router_, wr_buf.as<float>(), s));
    wr = wr_buf.as<float>();
  }
  float* dwr = grad_.as<float>() + n_w13_ + n_w2_;
  // dWr (col-major [E, d]) += dl^T [E, T] x x [T, d].
  MOE_RETURN_IF_ERROR(
      gemm_->Run({CUBLAS_OP_N, CUBLAS_OP_T, ElemType::kFloat32, ElemType::kFloat32, 1.f},
                 {{static_cast<int>(ne), static_cast<int>(d), static_cast<int>(t), dl->get(),
                   static_cast<int>(ne), xf, static_cast<int>(d), dwr, static_cast<int>(ne)}}));
  // dx^T [d, T] += Wr [d, E] (col-major [E, d] transposed) x dl^T [E, T].
  MOE_RETURN_IF_ERROR(gemm_->Run(
      {CUBLAS_OP_T, CUBLAS_OP_N, ElemType::kFloat32, ElemType::kFloat32, 1.f},
      {{static_cast<int>(d), static_cast<int>(t), static_cast<int>(ne), wr, static_cast<int>(ne),
        dl->get(), static_cast<int>(ne), dx, static_cast<int>(d)}}));
  return absl::OkStatus();
}

absl::StatusOr<BackwardResult> CudaLayer::BackwardImpl(std::unique_ptr<SavedContext> context,
                                                       const BackwardRequest& request) {
  LargeTensorMemoryScope pinned;  // dx page-locked: one DMA
  auto* ctx = dynamic_cast<CudaContext*>(context.get());
  if (ctx == nullptr || ctx->owner != this) {
    return absl::InvalidArgumentError(
        "context: not a saved context from a training Forward of this layer");
  }
  const int64_t t = ctx->t, d = cfg_.d_model, k = cfg_.top_k;
  MOE_RETURN_IF_ERROR(ValidateBackwardRequest(cfg_, request, t));
  MOE_RETURN_IF_ERROR(CheckViewLocations(RequestViews(request)));
  MOE_CUDA_RETURN(cudaSetDevice(device_));
  cudaStream_t s = stream_->get();
  MOE_RETURN_IF_ERROR(WaitForCaller(request.order, s));
  DeviceBuffer dout_own, dx_own, dx32_own, dp_own;
  MOE_ASSIGN_OR_RETURN(const void* dout,
                       DeviceInput(request.dout, /*keep=*/false, stream_, &dout_own, "dout"));
  // dx in the layer dtype goes to `dx`. With server routing it accumulates the router path in
  // fp32 first, then one rounding pass writes `dx` (bf16) or it was `dx` all along (fp32).
  MOE_ASSIGN_OR_RETURN(void* dx, OutputTarget(request.dx, t * d * elem(), stream_, &dx_own, "dx"));
  const ElemType dx_type = server() ? ElemType::kFloat32 : type();
  void* dx_acc = dx;
  if (dx_type != type()) {
    MOE_ASSIGN_OR_RETURN(dx32_own, Alloc(t * d * 4, "dx fp32"));
    dx_acc = dx32_own.get();
  }
  MOE_ASSIGN_OR_RETURN(void* dp_out,
                       OutputTarget(request.dweights, t * k * 4, stream_, &dp_own, "dweights"));
  float* dp = static_cast<float*>(dp_out);
  ExpertWeights w{Weights(0), Weights(n_w13_)};
  ExpertGrads grads{grad_.as<float>(), grad_.as<float>() + n_w13_};
  MOE_RETURN_IF_ERROR(pipeline_->Backward(ctx->plan, ctx->x.get(), ctx->h.get(), ctx->p.as<float>(),
                                          dout, w, grads, dx_acc, dx_type, dp, grads_zero_));
  grads_zero_ = false;
  BackwardResult res;
  bool synchronised = false, host_pending = false;
  if (server()) {
    MOE_RETURN_IF_ERROR(
        RouterBackward(*ctx, dp, request.aux_grad_scale, static_cast<float*>(dx_acc)));
    if (dx_acc != dx) {
      MOE_CUDA_RETURN(kernels::LaunchFloatToBFloat16(static_cast<float*>(dx_acc), t * d, dx, s));
    }
  } else if (request.dweights.empty() || request.dweights.location.is_host()) {
    void* host = request.dweights.data;
    if (host == nullptr) {
      res.dweights = Tensor::Zeros(DType::kFloat32, {t, k});
      host = res.dweights.bytes.data();
    }
    MOE_CUDA_RETURN(cudaMemcpyAsync(host, dp, t * k * 4, cudaMemcpyDeviceToHost, s));
    host_pending = true;
  } else {
    MOE_RETURN_IF_ERROR(DeliverToDevice(dp, request.dweights, *stream_));
  }
  // After the dweights copy on the same stream, so that one has landed too.
  if (request.dx.empty() || request.dx.location.is_host()) {
    void* host = request.dx.data;
    if (host == nullptr) {
      res.dx = Tensor::Uninitialized(cfg_.dtype, {t, d});  // CopyToHost writes every byte
      host = res.dx.bytes.data();
    }
    MOE_RETURN_IF_ERROR(CopyToHost(device_, host, dx, static_cast<size_t>(t * d * elem()), s));
    synchronised = true;
  } else {
    MOE_RETURN_IF_ERROR(DeliverToDevice(dx, request.dx, *stream_));
  }
  MOE_RETURN_IF_ERROR(FinishCall(request.order, s, synchronised, host_pending));
  for (size_t l = 0; l < tokens_seen_.size(); ++l)
    tokens_seen_[l] += ctx->plan.tokens_per_expert[l];
  return res;
}

absl::StatusOr<StepResult> CudaLayer::Step() {
  MOE_CUDA_RETURN(cudaSetDevice(device_));
  cudaStream_t s = stream_->get();
  const OptimizerConfig& o = cfg_.optimizer;
  const size_t ws_bytes = kernels::SumSquaresWorkspaceBytes();
  absl::StatusOr<DeviceBuffer> ws = Alloc(static_cast<int64_t>(ws_bytes) + 8, "gradient norm");
  if (!ws.ok()) return ws.status();
  auto* sq_d = reinterpret_cast<double*>(static_cast<char*>(ws->get()) + ws_bytes);
  MOE_CUDA_RETURN(
      kernels::LaunchSumSquares(grad_.as<float>(), n_params_, ws->get(), ws_bytes, sq_d, s));
  MOE_RETURN_IF_ERROR(EnsurePinned(8));
  MOE_CUDA_RETURN(cudaMemcpyAsync(pinned_.get(), sq_d, 8, cudaMemcpyDeviceToHost, s));
  // Step's one sync: the norm is part of the result and decides the clipping factor.
  MOE_CUDA_RETURN(cudaStreamSynchronize(s));
  double sq;
  std::memcpy(&sq, pinned_.get(), 8);
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
  void* lowp = bf16() ? storage_.get() : nullptr;
  if (o.kind == OptimizerKind::kAdamW) {
    const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step_));
    const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step_));
    kernels::AdamWParams p;
    p.lr = static_cast<float>(o.learning_rate);
    p.beta1 = static_cast<float>(o.beta1);
    p.beta2 = static_cast<float>(o.beta2);
    p.eps = static_cast<float>(o.epsilon);
    p.weight_decay = static_cast<float>(o.weight_decay);
    p.step_size = static_cast<float>(o.learning_rate / bc1);
    p.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    p.grad_scale = static_cast<float>(clip);
    MOE_CUDA_RETURN(kernels::LaunchAdamW(master_.as<float>(), m_.as<float>(), v_.as<float>(),
                                         grad_.as<float>(), lowp, n_params_, p, s));
  } else {
    kernels::SgdParams p;
    p.lr = static_cast<float>(o.learning_rate);
    p.momentum = static_cast<float>(o.momentum);
    p.weight_decay = static_cast<float>(o.weight_decay);
    p.grad_scale = static_cast<float>(clip);
    MOE_CUDA_RETURN(kernels::LaunchSgd(master_.as<float>(), m_.as<float>(), grad_.as<float>(), lowp,
                                       n_params_, p, s));
  }
  grads_zero_ = true;  // the optimizer kernel zeroes every gradient it consumes
  StepResult res;
  res.step = step_;
  res.grad_norm = norm;
  res.tokens_per_expert = tokens_seen_;
  std::fill(tokens_seen_.begin(), tokens_seen_.end(), 0);
  return res;
}

absl::Status CudaLayer::ZeroGrad() {
  MOE_CUDA_RETURN(cudaSetDevice(device_));
  MOE_CUDA_RETURN(cudaMemsetAsync(grad_.get(), 0, grad_.bytes(), stream_->get()));
  grads_zero_ = true;
  std::fill(tokens_seen_.begin(), tokens_seen_.end(), 0);
  return absl::OkStatus();
}

const Segment* CudaLayer::FindSegment(const std::string& name) const {
  auto it = segments_.find(name);
  return it == segments_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::map<std::string, Tensor>> CudaLayer::ExportState(bool include_optimizer) const {
  MOE_CUDA_RETURN(cudaSetDevice(device_));
  cudaStream_t s = stream_->get();
  const bool adamw = cfg_.optimizer.kind == OptimizerKind::kAdamW;
  // Whole flat buffers to the host, then sliced into named tensors.
  std::vector<float> master(n_params_), m, v;
  MOE_CUDA_RETURN(
      cudaMemcpyAsync(master.data(), master_.get(), n_params_ * 4, cudaMemcpyDeviceToHost, s));
  if (include_optimizer) {
    m.resize(n_params_);
    MOE_CUDA_RETURN(cudaMemcpyAsync(m.data(), m_.get(), n_params_ * 4, cudaMemcpyDeviceToHost, s));
    if (adamw) {
      v.resize(n_params_);
      MOE_CUDA_RETURN(
          cudaMemcpyAsync(v.data(), v_.get(), n_params_ * 4, cudaMemcpyDeviceToHost, s));
    }
  }
  MOE_CUDA_RETURN(cudaStreamSynchronize(s));
  auto slice = [](const std::vector<float>& flat, const Segment& seg, DType dtype) {
    Tensor t = Tensor::Zeros(dtype, seg.shape);
    for (int64_t b = 0; b < seg.blocks; ++b) {
      const float* src = &flat[seg.offset + b * seg.stride];
      if (dtype == DType::kBFloat16) {
        uint16_t* dst = t.as<uint16_t>() + b * seg.run;
        for (int64_t i = 0; i < seg.run; ++i) dst[i] = FloatToBFloat16(src[i]);
      } else {
        std::memcpy(t.as<float>() + b * seg.run, src, seg.run * sizeof(float));
      }
    }
    return t;
  };
  std::map<std::string, Tensor> out;
  for (const auto& [name, seg] : segments_) {
    // The stored bf16 weights are exactly the rounding of the fp32 master.
    out[name] = slice(master, seg, cfg_.dtype);
    if (!include_optimizer) continue;
    if (adamw) {
      out[name + ".exp_avg"] = slice(m, seg, DType::kFloat32);
      out[name + ".exp_avg_sq"] = slice(v, seg, DType::kFloat32);
    } else {
      out[name + ".momentum"] = slice(m, seg, DType::kFloat32);
    }
    if (bf16()) out[name + ".master"] = slice(master, seg, DType::kFloat32);
  }
  if (include_optimizer) {
    Tensor st = Tensor::Zeros(DType::kInt64, {1});
    st.as<int64_t>()[0] = step_;
    out["step"] = std::move(st);
  }
  return out;
}

absl::Status CudaLayer::ImportState(const std::map<std::string, Tensor>& state) {
  // Validate everything first (the same rules and messages as the CPU engine), then apply.
  const auto shape_of = [this](const std::string& param) -> const std::vector<int64_t>* {
    const Segment* seg = FindSegment(param);
    return seg == nullptr ? nullptr : &seg->shape;
  };
  for (const auto& [name, tensor] : state) {
    if (absl::Status st = ValidateStateTensor(cfg_, name, tensor, shape_of); !st.ok()) return st;
  }
  MOE_CUDA_RETURN(cudaSetDevice(device_));
  cudaStream_t s = stream_->get();
  bool weights_changed = false;
  // Weights first, then masters: a master imported with its weight wins.
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& [name, tensor] : state) {
      const StateName parsed = ParseStateName(name);
      if (parsed.kind == StateKind::kStep) {
        if (pass == 0) step_ = tensor.as<int64_t>()[0];
        continue;
      }
      const Segment& seg = *FindSegment(parsed.param);
      DeviceBuffer* dst = nullptr;
      if (pass == 0 && parsed.kind == StateKind::kWeight) dst = &master_;
      if (pass == 1 && parsed.kind == StateKind::kMaster) dst = &master_;
      if (pass == 0 && (parsed.kind == StateKind::kExpAvg || parsed.kind == StateKind::kMomentum)) {
        dst = &m_;
      }
      if (pass == 0 && parsed.kind == StateKind::kExpAvgSq) dst = &v_;
      if (dst == nullptr) continue;
      if (dst == &master_) weights_changed = true;
      const std::vector<float> f = ToFloat(tensor.view());
      // Strided placement of blocks (w1 / w3 rows inside the stacked [W1; W3]).
      MOE_CUDA_RETURN(cudaMemcpy2DAsync(dst->as<float>() + seg.offset, seg.stride * 4, f.data(),
                                        seg.run * 4, seg.run * 4, seg.blocks,
                                        cudaMemcpyHostToDevice, s));
      MOE_CUDA_RETURN(cudaStreamSynchronize(s));  // `f` dies at the end of this iteration
    }
  }
  if (weights_changed && bf16()) {
    MOE_CUDA_RETURN(
        kernels::LaunchFloatToBFloat16(master_.as<float>(), n_params_, storage_.get(), s));
    MOE_CUDA_RETURN(cudaStreamSynchronize(s));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> CreateCudaLayer(const LayerConfig& config, int device,
                                                       const PipelineOptions& options) {
  if (absl::Status s = ValidateLayerConfig(config); !s.ok()) return s;
  auto layer = std::make_unique<CudaLayer>(config, device, options);
  if (absl::Status s = layer->Init(); !s.ok()) return s;
  return std::unique_ptr<Layer>(std::move(layer));
}

}  // namespace moe::cuda
