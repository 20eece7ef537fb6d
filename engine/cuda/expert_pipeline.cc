// The expert pipeline on device pointers (see expert_pipeline.h for the math and the chunking).
#include "engine/cuda/expert_pipeline.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/combine.h"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/expert_backward.h"
#include "kernels/cuda/expert_forward.h"
#include "kernels/cuda/gather.h"
#include "kernels/cuda/sm90_expert_backward.h"
#include "kernels/cuda/sm90_expert_forward.h"

namespace moe::cuda {
namespace {

using kernels::ElemType;

const char* Offset(const void* base, int64_t bytes) {
  return static_cast<const char*>(base) + bytes;
}
char* Offset(void* base, int64_t bytes) { return static_cast<char*>(base) + bytes; }
// bf16 as its raw 16 bits, for the sm90 launchers' uint16_t pointers.
const uint16_t* Bf16At(const void* base, int64_t bytes) {
  return reinterpret_cast<const uint16_t*>(Offset(base, bytes));
}
uint16_t* Bf16At(void* base, int64_t bytes) {
  return reinterpret_cast<uint16_t*>(Offset(base, bytes));
}

}  // namespace

ExpertPipeline::ExpertPipeline(const ExpertShape& shape, std::shared_ptr<Stream> stream,
                               GemmRunner* gemm, const PipelineOptions& options)
    : shape_(shape),
      options_(options),
      stream_(std::move(stream)),
      gemm_(gemm),
      max_chunk_rows_(options.max_chunk_rows > 0 ? options.max_chunk_rows : kMaxChunkRows) {
  const int device = stream_->device();
  device_sm90_ = kernels::Sm90DeviceSupported(device);
  if (cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    device_sm90_ = false;  // without an SM count the tile heuristics cannot run: stay unfused
  }
}

kernels::Sm90ExpertProblem ExpertPipeline::Sm90Problem(const ChunkPlan& chunk) const {
  kernels::Sm90ExpertProblem p;
  p.num_tokens = chunk.tokens;
  p.top_k = static_cast<int32_t>(shape_.top_k);
  p.num_experts = static_cast<int32_t>(shape_.expert_count);
  p.d_model = static_cast<int32_t>(shape_.d_model);
  p.d_hidden = static_cast<int32_t>(shape_.d_hidden);
  p.num_routed = chunk.routed;
  // The engine stacks [W1_e; W3_e] per expert: w1 = w13, w3 = w13 + h*d, stride 2*h*d.
  p.w13_expert_stride = 2 * shape_.d_hidden * shape_.d_model;
  return p;
}

ForwardKernels ExpertPipeline::ChunkForwardKernels(const ChunkPlan& chunk) const {
  return UseFusedForward(shape_, options_, Sm90Problem(chunk), device_sm90_);
}

BackwardKernels ExpertPipeline::ChunkBackwardKernels(const ChunkPlan& chunk) const {
  return UseFusedBackward(shape_, options_, Sm90Problem(chunk), device_sm90_);
}

const int32_t* ExpertPipeline::DeviceOffsets(const DispatchPlan& plan, const ChunkPlan& ch) const {
  return plan.counts.as<int32_t>() + (&ch - plan.chunks.data()) * (2 * shape_.expert_count + 1);
}

absl::StatusOr<DeviceBuffer> ExpertPipeline::Alloc(int64_t bytes, const char* what) {
  return DeviceBuffer::Allocate(static_cast<size_t>(bytes), stream_, what);
}

absl::StatusOr<ExpertPipeline::SideLane*> ExpertPipeline::Lane() {
  if (lane_ != nullptr) return lane_.get();
  auto lane = std::make_unique<SideLane>();
  MOE_ASSIGN_OR_RETURN(lane->stream,
                       Stream::Create(stream_->device(), stream_->poison_allocations()));
  MOE_ASSIGN_OR_RETURN(lane->gemm, GemmRunner::Create(lane->stream));
  lane->gemm->set_mode(gemm_->mode());
  for (Event* e : {&lane->start, &lane->done}) {
    MOE_ASSIGN_OR_RETURN(*e, Event::Create(stream_->device()));
  }
  lane_ = std::move(lane);
  return lane_.get();
}

int64_t ExpertPipeline::ChunkTokens(int64_t num_tokens) const {
  const int64_t e = static_cast<int64_t>(kernels::ElemSize(shape_.type));
  const int64_t d = shape_.d_model, h = shape_.d_hidden, g = shape_.gate_width();
  // The larger of the forward's and the backward's live temporaries per routed row.
  const int64_t fwd = e * (2 * d + g + h);
  const int64_t bwd = e * (d + h + g + h) + e * d;
  const int64_t per_row = std::max(fwd, bwd);
  const int64_t rows = std::clamp<int64_t>(kChunkBudgetBytes / per_row, 1, max_chunk_rows_);
  return std::clamp<int64_t>(rows / shape_.top_k, 1, std::max<int64_t>(num_tokens, 1));
}

absl::Status ExpertPipeline::Dispatch(const int32_t* ids, int64_t num_tokens, DispatchPlan* plan) {
  const int64_t K = shape_.top_k, count = shape_.expert_count;
  const int64_t chunk_tokens = ChunkTokens(num_tokens);
  const int64_t num_chunks = (num_tokens + chunk_tokens - 1) / chunk_tokens;
  const int64_t per_chunk = 2 * count + 1;
  plan->num_tokens = num_tokens;
  plan->chunks.assign(num_chunks, ChunkPlan{});
  absl::StatusOr<DeviceBuffer> b = Alloc(num_tokens * K * 4, "dispatch entries");
  if (!b.ok()) return b.status();
  plan->entries = std::move(*b);
  b = Alloc(num_tokens * K * 4, "dispatch slot_of");
  if (!b.ok()) return b.status();
  plan->slot_of = std::move(*b);
  b = Alloc(num_chunks * per_chunk * 4, "dispatch counts");
  if (!b.ok()) return b.status();
  plan->counts = std::move(*b);
  const size_t ws_bytes =
      kernels::DispatchWorkspaceBytes(chunk_tokens, static_cast<int32_t>(count));
  absl::StatusOr<DeviceBuffer> ws = Alloc(static_cast<int64_t>(ws_bytes), "dispatch workspace");
  if (!ws.ok()) return ws.status();

  for (int64_t c = 0; c < num_chunks; ++c) {
    ChunkPlan& ch = plan->chunks[c];
    ch.t0 = c * chunk_tokens;
    ch.tokens = std::min(chunk_tokens, num_tokens - ch.t0);
    int32_t* offsets = plan->counts.as<int32_t>() + c * per_chunk;
    int32_t* counts = offsets + count + 1;
    MOE_CUDA_RETURN(kernels::LaunchDispatch(
        ids + ch.t0 * K, ch.tokens, static_cast<int32_t>(K),
        static_cast<int32_t>(shape_.expert_first), static_cast<int32_t>(count), counts, offsets,
        plan->entries.as<int32_t>() + ch.t0 * K, plan->slot_of.as<int32_t>() + ch.t0 * K, ws->get(),
        ws_bytes, stream_->get()));
  }
  const int64_t ints = num_chunks * per_chunk;
  if (static_cast<size_t>(ints) * 4 > pinned_.bytes()) {
    MOE_CUDA_RETURN(cudaStreamSynchronize(stream_->get()));  // old staging may still be a target
    MOE_RETURN_IF_ERROR(pinned_.Reserve(static_cast<size_t>(ints) * 4));
  }
  MOE_CUDA_RETURN(cudaMemcpyAsync(pinned_.get(), plan->counts.get(), static_cast<size_t>(ints) * 4,
                                  cudaMemcpyDeviceToHost, stream_->get()));
  // The one host synchronisation of a forward: the grouped GEMMs need per-expert row counts
  // on the host.
  MOE_CUDA_RETURN(cudaStreamSynchronize(stream_->get()));

  plan->tokens_per_expert.assign(count, 0);
  int64_t row_base = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    ChunkPlan& ch = plan->chunks[c];
    const int32_t* src = pinned_.as<int32_t>() + c * per_chunk;
    ch.offsets.assign(src, src + count + 1);
    ch.counts.assign(src + count + 1, src + per_chunk);
    ch.routed = ch.offsets[count];
    ch.row_base = row_base;
    row_base += ch.routed;
    for (int64_t l = 0; l < count; ++l) plan->tokens_per_expert[l] += ch.counts[l];
  }
  plan->total_routed = row_base;
  return absl::OkStatus();
}

absl::Status ExpertPipeline::ExpertUpProjection(const ChunkPlan& chunk, const void* xg,
                                                const void* w13, void* h) {
  const int64_t e = static_cast<int64_t>(kernels::ElemSize(shape_.type));
  const int64_t d = shape_.d_model, g = shape_.gate_width();
  std::vector<GemmProblem> probs;
  probs.reserve(chunk.counts.size());
  for (size_t l = 0; l < chunk.counts.size(); ++l) {
    const int64_t off = chunk.offsets[l];
    // H_l^T [g, m] = W13_l [g, d] (col-major [d, g], transposed) x Xg_l^T [d, m].
    probs.push_back({static_cast<int>(g), chunk.counts[l], static_cast<int>(d),
                     Offset(w13, static_cast<int64_t>(l) * g * d * e), static_cast<int>(d),
                     Offset(xg, off * d * e), static_cast<int>(d), Offset(h, off * g * e),
                     static_cast<int>(g)});
  }
  return gemm_->Run({CUBLAS_OP_T, CUBLAS_OP_N, shape_.type, shape_.type, 0.f}, probs);
}

absl::Status ExpertPipeline::ChunkUp(const DispatchPlan& plan, const ChunkPlan& ch,
                                     ForwardKernels kernels_used, const void* x,
                                     const ExpertWeights& w, void* hb, void* a) {
  const int64_t e = static_cast<int64_t>(kernels::ElemSize(shape_.type));
  const int64_t d = shape_.d_model, h = shape_.d_hidden, K = shape_.top_k, n = ch.routed;
  const int32_t* entries = plan.entries.as<int32_t>() + ch.t0 * K;
  cudaStream_t s = stream_->get();
  if (kernels_used == ForwardKernels::kUnfused) {
    absl::StatusOr<DeviceBuffer> xg = Alloc(n * d * e, "gathered x");
    if (!xg.ok()) return xg.status();
    MOE_CUDA_RETURN(kernels::LaunchGatherRows(Offset(x, ch.t0 * d * e), d * e, entries,
                                              static_cast<int32_t>(K), n, xg->get(), s));
    MOE_RETURN_IF_ERROR(ExpertUpProjection(ch, xg->get(), w.w13, hb));
    xg->Reset();
    if (a == nullptr) return absl::OkStatus();
    MOE_CUDA_RETURN(
        kernels::LaunchActivationForward(hb, shape_.type, shape_.activation, n, h, a, s));
    return absl::OkStatus();
  }
  // One persistent launch: rows of x gathered on load, [W1;W3] tiles, SwiGLU in the epilogue;
  // H lands directly in `hb` (the saved-H rows of this chunk when H is kept).
  const kernels::Sm90ExpertProblem prob = Sm90Problem(ch);
  const int32_t* offsets = DeviceOffsets(plan, ch);
  const uint16_t* w13 = Bf16At(w.w13, 0);
  MOE_CUDA_RETURN(kernels::LaunchSm90ExpertUp(
      prob, Sm90ChooseConfig(prob, Sm90Projection::kUpSwiGLU, num_sms_), Bf16At(x, ch.t0 * d * e),
      w13, w13 + h * d, offsets, entries, Bf16At(hb, 0), static_cast<uint16_t*>(a), s));
  return absl::OkStatus();
}

absl::Status ExpertPipeline::Forward(const DispatchPlan& plan, const void* x, const float* p,
                                     const ExpertWeights& w, void* h_saved, void* out) {
  const int64_t e = static_cast<int64_t>(kernels::ElemSize(shape_.type));
  const int64_t d = shape_.d_model, h = shape_.d_hidden, g = shape_.gate_width();
  const int64_t K = shape_.top_k;
  cudaStream_t s = stream_->get();
  for (const ChunkPlan& ch : plan.chunks) {
    const int64_t n = ch.routed;
    const int32_t* entries = plan.entries.as<int32_t>() + ch.t0 * K;
    const int32_t* slots = plan.slot_of.as<int32_t>() + ch.t0 * K;
    const ForwardKernels kernels_used = n > 0 ? ChunkForwardKernels(ch) : ForwardKernels::kUnfused;
    DeviceBuffer y;
    if (n > 0) {
      DeviceBuffer h_tmp;
      void* hb;
      if (h_saved != nullptr) {
        hb = Offset(h_saved, ch.row_base * g * e);
      } else {
        // Skewed to the address modulo 256 the rows would have in a saved-H buffer, as in the
        // recompute backward (see there): the same cuBLAS kernels whether H is kept or not.
        const int64_t skew = (ch.row_base * g * e) % 256;
        absl::StatusOr<DeviceBuffer> t = Alloc(n * g * e + skew, "H");
        if (!t.ok()) return t.status();
        h_tmp = std::move(*t);
        hb = Offset(h_tmp.get(), skew);
      }
      absl::StatusOr<DeviceBuffer> a = Alloc(n * h * e, "A");
      if (!a.ok()) return a.status();
      MOE_RETURN_IF_ERROR(ChunkUp(plan, ch, kernels_used, x, w, hb, a->get()));
      if (kernels_used != ForwardKernels::kUnfused) {
        const kernels::Sm90ExpertProblem prob = Sm90Problem(ch);
        const int32_t* offsets = DeviceOffsets(plan, ch);
        if (kernels_used == ForwardKernels::kFusedUpDown) {
          h_tmp.Reset();
          // Y per (token, k) row of the chunk; rows of entries outside the shard stay unwritten
          // and the combine never reads them.
          absl::StatusOr<DeviceBuffer> yb = Alloc(ch.tokens * K * d * e, "Y");
          if (!yb.ok()) return yb.status();
          MOE_CUDA_RETURN(kernels::LaunchSm90ExpertDown(
              prob, Sm90ChooseConfig(prob, Sm90Projection::kDown, num_sms_), a->as<uint16_t>(),
              Bf16At(w.w2, 0), offsets, entries, yb->as<uint16_t>(), s));
          a->Reset();
          MOE_CUDA_RETURN(kernels::LaunchSm90Combine(prob, yb->as<uint16_t>(), p + ch.t0 * K, slots,
                                                     Bf16At(out, ch.t0 * d * e), s));
          continue;
        }
      }
      h_tmp.Reset();
      absl::StatusOr<DeviceBuffer> yb = Alloc(n * d * e, "Y");
      if (!yb.ok()) return yb.status();
      y = std::move(*yb);
      std::vector<GemmProblem> probs;
      for (size_t l = 0; l < ch.counts.size(); ++l) {
        const int64_t off = ch.offsets[l];
        // Y_l^T [d, m] = W2_l [d, h] (col-major [h, d], transposed) x A_l^T [h, m].
        probs.push_back({static_cast<int>(d), ch.counts[l], static_cast<int>(h),
                         Offset(w.w2, static_cast<int64_t>(l) * d * h * e), static_cast<int>(h),
                         Offset(a->get(), off * h * e), static_cast<int>(h),
                         Offset(y.get(), off * d * e), static_cast<int>(d)});
      }
      MOE_RETURN_IF_ERROR(
          gemm_->Run({CUBLAS_OP_T, CUBLAS_OP_N, shape_.type, shape_.type, 0.f}, probs));
    }
    MOE_CUDA_RETURN(kernels::LaunchCombine(y.get(), shape_.type, slots, p + ch.t0 * K, ch.tokens,
                                           static_cast<int32_t>(K), d, Offset(out, ch.t0 * d * e),
                                           shape_.type, s));
  }
  return absl::OkStatus();
}

absl::Status ExpertPipeline::Backward(const DispatchPlan& plan, const void* x, const void* h_saved,
                                      const float* p, const void* dout, const ExpertWeights& w,
                                      const ExpertGrads& grads, void* dx, kernels::ElemType dx_type,
                                      float* dp, bool grads_are_zero) {
  const ElemType type = shape_.type;
  const int64_t e = static_cast<int64_t>(kernels::ElemSize(type));
  const int64_t dxe = static_cast<int64_t>(kernels::ElemSize(dx_type));
  const int64_t d = shape_.d_model, h = shape_.d_hidden, g = shape_.gate_width();
  const int64_t K = shape_.top_k;
  cudaStream_t s = stream_->get();
  MOE_CUDA_RETURN(cudaMemsetAsync(dp, 0, plan.num_tokens * K * sizeof(float), s));
  for (const ChunkPlan& ch : plan.chunks) {
    const int64_t n = ch.routed;
    const int32_t* slots = plan.slot_of.as<int32_t>() + ch.t0 * K;
    // Overwrite only in the first chunk; an expert with no rows there keeps its zeros, since
    // the runner skips k = 0 problems.
    const float beta = grads_are_zero && &ch == &plan.chunks.front() ? 0.f : 1.f;
    void* dx_rows = Offset(dx, ch.t0 * d * dxe);
    if (n == 0) {
      // No rows routed here: the combine writes the chunk's dx rows as zeros.
      MOE_CUDA_RETURN(kernels::LaunchCombine(nullptr, type, slots, nullptr, ch.tokens,
                                             static_cast<int32_t>(K), d, dx_rows, dx_type, s));
    } else {
      DeviceBuffer h_tmp;
      const void* hb;
      if (h_saved != nullptr) {
        hb = Offset(h_saved, ch.row_base * g * e);
      } else {
        // Recompute mode: this chunk's H by the forward's own kernels on the same plan, so it
        // is the forward's H bit for bit. The fused kernel also writes A; that scratch is
        // dropped at once (the activation backward recomputes A from H anyway). The rows start
        // at the same address modulo 256 as this chunk's rows in a saved-H buffer would (both
        // buffers come 256-byte aligned from the pool), so that cuBLAS, whose kernel choice may
        // depend on pointer alignment, picks what it picked in the keep-H forward.
        const int64_t skew = (ch.row_base * g * e) % 256;
        absl::StatusOr<DeviceBuffer> t = Alloc(n * g * e + skew, "recomputed H");
        if (!t.ok()) return t.status();
        h_tmp = std::move(*t);
        const ForwardKernels kernels_used = ChunkForwardKernels(ch);
        DeviceBuffer a_tmp;
        if (kernels_used != ForwardKernels::kUnfused) {
          absl::StatusOr<DeviceBuffer> a = Alloc(n * h * e, "recomputed A");
          if (!a.ok()) return a.status();
          a_tmp = std::move(*a);
        }
        void* h_rows = Offset(h_tmp.get(), skew);
        MOE_RETURN_IF_ERROR(ChunkUp(plan, ch, kernels_used, x, w, h_rows, a_tmp.get()));
        hb = h_rows;
      }
      MOE_RETURN_IF_ERROR(ChunkBackward(plan, ch, ChunkBackwardKernels(ch), x, hb, p, dout, w,
                                        grads, beta == 0.f, dp, &h_tmp, dx_rows, dx_type));
    }
  }
  return absl::OkStatus();
}

namespace {

// Which of the backward's four GEMMs a path runs as sm90 kernels; the others are per-expert
// cuBLAS calls on rows gathered into a buffer first.
struct FusedGemms {
  bool da = false;
  bool dw2 = false;
  bool dw13 = false;
  bool dx = false;
};

FusedGemms FusedGemmsOf(BackwardKernels path) {
  switch (path) {
    case BackwardKernels::kFused:
      return {true, true, true, true};
    case BackwardKernels::kHybrid:
      return {true, true, false, false};
    default:
      return {};
  }
}

}  // namespace

absl::Status ExpertPipeline::ChunkBackward(const DispatchPlan& plan, const ChunkPlan& ch,
                                           BackwardKernels path, const void* x, const void* hb,
                                           const float* p, const void* dout, const ExpertWeights& w,
                                           const ExpertGrads& grads, bool overwrite, float* dp,
                                           DeviceBuffer* h_tmp, void* dx_rows, ElemType dx_type) {
  const FusedGemms fused = FusedGemmsOf(path);
  const ElemType type = shape_.type;
  const int64_t e = static_cast<int64_t>(kernels::ElemSize(type));
  const int64_t d = shape_.d_model, h = shape_.d_hidden, g = shape_.gate_width();
  const int64_t K = shape_.top_k, n = ch.routed;
  const int32_t* entries = plan.entries.as<int32_t>() + ch.t0 * K;
  const size_t nl = ch.counts.size();
  cudaStream_t s = stream_->get();
  const float beta = overwrite ? 0.f : 1.f;
  // The sm90 kernels read the per-expert offsets on the device and gather rows while loading
  // (bf16 only: UseFusedBackward admits nothing else for a fused GEMM).
  const int32_t* offsets = DeviceOffsets(plan, ch);
  const kernels::Sm90ExpertProblem prob = Sm90Problem(ch);
  auto config = [&](Sm90Projection projection) {
    return Sm90ChooseConfig(prob, projection, num_sms_);
  };
  const uint16_t* dout_rows = Bf16At(dout, ch.t0 * d * e);
  std::vector<GemmProblem> probs;

  // G = dout[entries], stored only when a cuBLAS GEMM (dA or dW2) reads it.
  DeviceBuffer gbuf;
  if (!fused.da || !fused.dw2) {
    absl::StatusOr<DeviceBuffer> b = Alloc(n * d * e, "gathered dout");
    if (!b.ok()) return b.status();
    gbuf = std::move(*b);
    MOE_CUDA_RETURN(kernels::LaunchGatherRows(Offset(dout, ch.t0 * d * e), d * e, entries,
                                              static_cast<int32_t>(K), n, gbuf.get(), s));
  }
  absl::StatusOr<DeviceBuffer> dh = Alloc(n * g * e, "dH");
  if (!dh.ok()) return dh.status();
  absl::StatusOr<DeviceBuffer> ap = Alloc(n * h * e, "p*A");
  if (!ap.ok()) return ap.status();
  if (options_.lane_delay != nullptr) options_.lane_delay(LaneTestPoint::kLayerBeforeDA, s);
  {
    absl::StatusOr<DeviceBuffer> dau = Alloc(n * h * e, "dA");
    if (!dau.ok()) return dau.status();
    if (fused.da) {
      // dA_u = G W2 with G's rows gathered from dout while loading.
      MOE_CUDA_RETURN(kernels::LaunchSm90BackwardDA(prob, config(Sm90Projection::kBackwardDA),
                                                    dout_rows, Bf16At(w.w2, 0), offsets, entries,
                                                    dau->as<uint16_t>(), s));
    } else {
      for (size_t l = 0; l < nl; ++l) {
        const int64_t off = ch.offsets[l];
        // dA_l^T [h, m] = W2_l^T (col-major view of row-major [d, h]) x G_l^T [d, m].
        probs.push_back({static_cast<int>(h), ch.counts[l], static_cast<int>(d),
                         Offset(w.w2, static_cast<int64_t>(l) * d * h * e), static_cast<int>(h),
                         Offset(gbuf.get(), off * d * e), static_cast<int>(d),
                         Offset(dau->get(), off * h * e), static_cast<int>(h)});
      }
      MOE_RETURN_IF_ERROR(gemm_->Run({CUBLAS_OP_N, CUBLAS_OP_N, type, type, 0.f}, probs));
      probs.clear();
    }
    MOE_CUDA_RETURN(kernels::LaunchActivationBackward(hb, dau->get(), entries, p + ch.t0 * K, type,
                                                      shape_.activation, n, h, dh->get(), ap->get(),
                                                      dp + ch.t0 * K, s));
  }
  h_tmp->Reset();  // the recomputed H (recompute mode) is read for the last time above

  const void* gathered_dout = gbuf.get();
  // The three GEMMs left: the weight gradients on `on` through `runner` (dW13's gathered x in
  // `xg` when cuBLAS runs it), then dXg and its combine on the layer's stream.
  auto weight_grad_w2 = [&](cudaStream_t on, GemmRunner* runner) -> absl::Status {
    if (fused.dw2) {
      MOE_CUDA_RETURN(kernels::LaunchSm90WeightGradW2(prob, config(Sm90Projection::kWeightGradW2),
                                                      dout_rows, ap->as<uint16_t>(), offsets,
                                                      entries, grads.dw2, !overwrite, on));
      return absl::OkStatus();
    }
    for (size_t l = 0; l < nl; ++l) {
      const int64_t off = ch.offsets[l];
      // dW2_l (col-major [h, d]) += (pA)_l^T [h, m] x G_l [m, d].
      probs.push_back({static_cast<int>(h), static_cast<int>(d), ch.counts[l],
                       Offset(ap->get(), off * h * e), static_cast<int>(h),
                       Offset(gathered_dout, off * d * e), static_cast<int>(d),
                       grads.dw2 + static_cast<int64_t>(l) * d * h, static_cast<int>(h)});
    }
    absl::Status st =
        runner->Run({CUBLAS_OP_N, CUBLAS_OP_T, type, ElemType::kFloat32, beta}, probs);
    probs.clear();
    return st;
  };
  auto weight_grad_w13 = [&](cudaStream_t on, GemmRunner* runner, void* xg) -> absl::Status {
    if (fused.dw13) {
      MOE_CUDA_RETURN(kernels::LaunchSm90WeightGradW13(
          prob, config(Sm90Projection::kWeightGradW13), dh->as<uint16_t>(),
          Bf16At(x, ch.t0 * d * e), offsets, entries, grads.dw13, !overwrite, on));
      return absl::OkStatus();
    }
    MOE_CUDA_RETURN(kernels::LaunchGatherRows(Offset(x, ch.t0 * d * e), d * e, entries,
                                              static_cast<int32_t>(K), n, xg, on));
    for (size_t l = 0; l < nl; ++l) {
      const int64_t off = ch.offsets[l];
      // dW13_l (col-major [d, g]) += Xg_l^T [d, m] x dH_l [m, g].
      probs.push_back({static_cast<int>(d), static_cast<int>(g), ch.counts[l],
                       Offset(xg, off * d * e), static_cast<int>(d), Offset(dh->get(), off * g * e),
                       static_cast<int>(g), grads.dw13 + static_cast<int64_t>(l) * g * d,
                       static_cast<int>(d)});
    }
    absl::Status st =
        runner->Run({CUBLAS_OP_N, CUBLAS_OP_T, type, ElemType::kFloat32, beta}, probs);
    probs.clear();
    return st;
  };
  auto data_grad = [&](void* dxg) -> absl::Status {
    if (fused.dx) {
      MOE_CUDA_RETURN(kernels::LaunchSm90BackwardDX(prob, config(Sm90Projection::kBackwardDX),
                                                    dh->as<uint16_t>(), Bf16At(w.w13, 0), offsets,
                                                    static_cast<uint16_t*>(dxg), s));
    } else {
      for (size_t l = 0; l < nl; ++l) {
        const int64_t off = ch.offsets[l];
        // dXg_l^T [d, m] = W13_l^T (col-major view of row-major [g, d]) x dH_l^T [g, m].
        probs.push_back({static_cast<int>(d), ch.counts[l], static_cast<int>(g),
                         Offset(w.w13, static_cast<int64_t>(l) * g * d * e), static_cast<int>(d),
                         Offset(dh->get(), off * g * e), static_cast<int>(g),
                         Offset(dxg, off * d * e), static_cast<int>(d)});
      }
      absl::Status st = gemm_->Run({CUBLAS_OP_N, CUBLAS_OP_N, type, type, 0.f}, probs);
      probs.clear();
      MOE_RETURN_IF_ERROR(st);
    }
    MOE_CUDA_RETURN(kernels::LaunchCombine(dxg, type, plan.slot_of.as<int32_t>() + ch.t0 * K,
                                           nullptr, ch.tokens, static_cast<int32_t>(K), d, dx_rows,
                                           dx_type, s));
    return absl::OkStatus();
  };

  // With the lane, dW13's gathered x and dXg are allocated before it starts and live beside dH
  // and pA until it is done: one [routed, d] buffer more than the serial order's peak. Where the
  // pool cannot give them (or the lane itself), this chunk runs in the serial order instead, so
  // the lane never lowers the largest batch that fits.
  DeviceBuffer xg, dxg;
  bool overlap = options_.overlap_weight_grads;
  SideLane* lane = nullptr;
  if (overlap) {
    // Out of memory for the lane's own stream, cuBLAS runner or buffers: the serial order.
    absl::StatusOr<SideLane*> made = Lane();
    if (made.ok()) {
      lane = *made;
    } else if (absl::IsResourceExhausted(made.status())) {
      overlap = false;
    } else {
      return made.status();
    }
  }
  if (overlap) {
    auto reserve = [&](DeviceBuffer* b, const char* what) -> absl::Status {
      absl::StatusOr<DeviceBuffer> got = Alloc(n * d * e, what);
      if (got.ok()) {
        *b = std::move(*got);
      } else if (absl::IsResourceExhausted(got.status())) {
        overlap = false;
      } else {
        return got.status();
      }
      return absl::OkStatus();
    };
    if (!fused.dw13 && gbuf.get() == nullptr) MOE_RETURN_IF_ERROR(reserve(&xg, "gathered x"));
    if (overlap) MOE_RETURN_IF_ERROR(reserve(&dxg, "dXg"));
    if (!overlap) {
      xg.Reset();
      dxg.Reset();
    }
  }
  if (overlap) {
    // Every buffer the lane reads exists before it starts: the lane waits for the layer's
    // stream, and the layer's stream waits for the lane before any of them is freed (`join`,
    // declared after them, is destroyed first, also on an error).
    if (!fused.dw13 && gbuf.get() != nullptr) {
      xg = std::move(gbuf);  // same size; the x gather is ordered after dW2's reads of dout
    }
    struct LaneJoin {
      SideLane* lane = nullptr;
      cudaStream_t main = nullptr;
      absl::Status Join() {
        SideLane* l = std::exchange(lane, nullptr);
        return l == nullptr ? absl::OkStatus() : StreamWaitFor(main, l->stream->get(), l->done);
      }
      ~LaneJoin() { Join().IgnoreError(); }
    } join;
    const cudaStream_t ls = lane->stream->get();
    MOE_RETURN_IF_ERROR(StreamWaitFor(ls, s, lane->start));
    join.lane = lane;
    join.main = s;
    if (options_.lane_delay != nullptr) options_.lane_delay(LaneTestPoint::kLaneStart, ls);
    MOE_RETURN_IF_ERROR(weight_grad_w2(ls, lane->gemm.get()));
    MOE_RETURN_IF_ERROR(weight_grad_w13(ls, lane->gemm.get(), xg.get()));
    MOE_RETURN_IF_ERROR(data_grad(dxg.get()));
    return join.Join();
  }
  // The serial order frees each buffer after its last reader, as early as it can.
  if (options_.lane_delay != nullptr) options_.lane_delay(LaneTestPoint::kLaneStart, s);
  MOE_RETURN_IF_ERROR(weight_grad_w2(s, gemm_));
  ap->Reset();
  if (!fused.dw13) {
    if (gbuf.get() != nullptr) {
      xg = std::move(gbuf);  // same size; the x gather is ordered after dW2's reads of dout
    } else {
      absl::StatusOr<DeviceBuffer> b = Alloc(n * d * e, "gathered x");
      if (!b.ok()) return b.status();
      xg = std::move(*b);
    }
  }
  gbuf.Reset();
  MOE_RETURN_IF_ERROR(weight_grad_w13(s, gemm_, xg.get()));
  xg.Reset();
  absl::StatusOr<DeviceBuffer> dxb = Alloc(n * d * e, "dXg");
  if (!dxb.ok()) return dxb.status();
  dxg = std::move(*dxb);
  return data_grad(dxg.get());
}

}  // namespace moe::cuda
