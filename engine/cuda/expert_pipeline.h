// The expert part of a layer on the GPU, on device pointers: dispatch, forward and backward.
//
// The CUDA layer (cuda_layer.cc) and the kernel benchmark (bench/) both drive this, so the
// benchmark times exactly what the service runs, minus the host<->device copies.
//
// Forward, per token chunk:  Xg = x[entries]; H = Xg [W1;W3]^T (grouped GEMM, the seam
//   ExpertUpProjection below); A = act(H1) (* H3) (one fused pass); Y = A W2^T (grouped GEMM);
//   out = sum_k p Y[slot_of] (per-token gather-sum). Only x and H are kept for the backward;
//   in recompute mode (LayerConfig::recompute_h) only x, and the backward reruns the chunk's
//   up-projection (ChunkUp) to get H back.
//   On an sm_90 GPU, for bf16 SwiGLU problems the fused Hopper kernels take (UseFusedForward
//   in kernel_selection.h), the gather, up-projection and SwiGLU are one persistent launch that
//   writes H (into the saved-H buffer) and A; with ForwardKernels::kFusedUpDown the
//   down-projection writes Y per (token, k) row and the fused combine sums it. H holds the same
//   bits either way (A is computed from the bf16-rounded H), so the backward is unchanged.
// Backward, per chunk:  G = dout[entries]; dA_u = G W2 (grouped); one fused pass recomputes A
//   from H and gives dH, p*A and dp = <dA_u, A>; dW2 += (pA)^T G; Xg = x[entries] again;
//   d[W1;W3] += dH^T Xg; dXg = dH [W1;W3]; dx = sum_k dXg[slot_of].
//   On an sm_90 GPU (UseFusedBackward) the four GEMMs, or the hybrid's two, are the sm90 kernels of
//   kernels/cuda/sm90_expert_backward.h instead: G and Xg are never materialised (rows are
//   gathered while loading) and each GEMM is one launch over all experts. On every path the
//   weight gradients run on a second stream of the pipeline beside dXg and the combine
//   (PipelineOptions::overlap_weight_grads), ordered by events, never by the host.
//
// Chunks: tokens are processed in chunks small enough that the per-chunk temporaries stay
// under a fixed budget (kChunkBudgetBytes), so T = 2M tokens fits next to its saved H. Each
// chunk has its own dispatch (entries and slot_of are chunk-local), all enqueued up front.
//
// Host synchronisation: exactly one per Forward, in Dispatch(): the per-expert counts of
// every chunk are copied to the host, because the grouped GEMMs take their row counts as host
// arrays. Backward reuses those counts and does not synchronise.
#ifndef MOE_ENGINE_CUDA_EXPERT_PIPELINE_H_
#define MOE_ENGINE_CUDA_EXPERT_PIPELINE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "engine/cuda/device.h"
#include "engine/cuda/grouped_gemm.h"
#include "engine/cuda/kernel_selection.h"
#include "engine/cuda/pipeline_options.h"
#include "kernels/cuda/sm90_expert_forward.h"
#include "kernels/cuda/types.h"

namespace moe::cuda {

// Storage-type weights: w13 [count, g, d] (per expert W1's h rows, then W3's for SwiGLU),
// w2 [count, d, h]. Gradients are fp32 in the same layouts, accumulated.
struct ExpertWeights {
  const void* w13 = nullptr;
  const void* w2 = nullptr;
};
struct ExpertGrads {
  float* dw13 = nullptr;
  float* dw2 = nullptr;
};

struct ChunkPlan {
  int64_t t0 = 0;  // first token
  int64_t tokens = 0;
  int64_t row_base = 0;          // first row of this chunk in the saved H
  int64_t routed = 0;            // (t,k) rows routed to local experts
  std::vector<int32_t> counts;   // [count]
  std::vector<int32_t> offsets;  // [count + 1]
};

struct DispatchPlan {
  int64_t num_tokens = 0;
  int64_t total_routed = 0;
  std::vector<ChunkPlan> chunks;
  std::vector<int64_t> tokens_per_expert;  // summed over chunks
  DeviceBuffer entries;  // [T*K] int32: chunk c's list at t0*K, chunk-local entry values
  DeviceBuffer slot_of;  // [T*K] int32: chunk-local slots
  DeviceBuffer counts;   // [chunks, count + 1 + count] int32: offsets then counts per chunk

  int64_t device_bytes() const { return entries.bytes() + slot_of.bytes() + counts.bytes(); }
};

class ExpertPipeline {
 public:
  // Per-chunk temporaries stay under this many bytes.
  static constexpr int64_t kChunkBudgetBytes = int64_t{6} << 30;
  static constexpr int64_t kMaxChunkRows = int64_t{1} << 19;

  // `options`: the paths a caller forces, the weight-gradient lane, the chunk size and the test
  // hooks (pipeline_options.h); the defaults are what the service runs.
  ExpertPipeline(const ExpertShape& shape, std::shared_ptr<Stream> stream, GemmRunner* gemm,
                 const PipelineOptions& options = {});
  ExpertPipeline(const ExpertPipeline&) = delete;
  ExpertPipeline& operator=(const ExpertPipeline&) = delete;

  const ExpertShape& shape() const { return shape_; }
  const PipelineOptions& options() const { return options_; }
  int64_t ChunkTokens(int64_t num_tokens) const;

  // Enqueues the MoEBlaze dispatch of every chunk of ids [T, K] (device), then synchronises
  // the stream once (the documented sync) and fills the plan's host counts. Work the caller
  // enqueued before (router, copies into pinned memory) completes with it.
  absl::Status Dispatch(const int32_t* ids, int64_t num_tokens, DispatchPlan* plan);

  // x [T, d], out [T, d] of the storage type; p [T, K] fp32. h_saved: [total_routed, g] to
  // keep H for the backward, or null (inference, or training in recompute mode).
  absl::Status Forward(const DispatchPlan& plan, const void* x, const float* p,
                       const ExpertWeights& w, void* h_saved, void* out);

  // dout [T, d] storage type; dx [T, d] of dx_type (storage type, or fp32 when the router
  // path is added afterwards); dp [T, K] fp32, fully written (0 for (t,k) outside the shard).
  // h_saved null: recompute mode; each chunk's H is recomputed from x by ChunkUp, the
  // forward's own kernels on the same plan, so the results equal the keep-H backward's bit for
  // bit (weights unchanged since the forward). Costs one up-projection GEMM per chunk and an
  // [routed rows, g] temporary, live until the activation backward has read it. Chunking is
  // the same in both modes (it must be, for the weight-gradient sums to match bitwise), so this
  // temporary is not in ChunkTokens' budget: the recompute backward peaks at e (d + 2h + 2g) per
  // routed row against the budgeted e (2d + 2h + g), over it by e (g - d) where g > d.
  // grads_are_zero: the caller knows the gradient buffers hold zeros (first backward after a
  // step), so the first chunk's weight-gradient GEMMs write instead of read-add-write: the
  // fp32 gradients are the largest tensors this touches.
  absl::Status Backward(const DispatchPlan& plan, const void* x, const void* h_saved,
                        const float* p, const void* dout, const ExpertWeights& w,
                        const ExpertGrads& grads, void* dx, kernels::ElemType dx_type, float* dp,
                        bool grads_are_zero = false);

  // The unfused up-projection: H [rows, g] = Xg W13^T for every local expert of one chunk by
  // cuBLAS, on the already gathered Xg. The fused sm90 path does not come here: Forward calls
  // LaunchSm90ExpertUp instead (gather, GEMM and SwiGLU in one launch) when
  // ChunkForwardKernels says so.
  absl::Status ExpertUpProjection(const ChunkPlan& chunk, const void* xg, const void* w13, void* h);

  // What the forward of `chunk` runs (UseFusedForward on this pipeline's shape, options and
  // device).
  ForwardKernels ChunkForwardKernels(const ChunkPlan& chunk) const;
  // What the backward of `chunk` runs (UseFusedBackward likewise).
  BackwardKernels ChunkBackwardKernels(const ChunkPlan& chunk) const;

 private:
  kernels::Sm90ExpertProblem Sm90Problem(const ChunkPlan& chunk) const;
  // The chunk's per-expert offsets [count + 1] on the device (in plan.counts).
  const int32_t* DeviceOffsets(const DispatchPlan& plan, const ChunkPlan& ch) const;
  // The backward of one chunk with routed rows by `path` (each of its four GEMMs by the sm90
  // kernel or per-expert cuBLAS, see BackwardKernels), after its H rows `hb` (saved, or
  // recomputed into *h_tmp, which is released once read) are at hand: dp rows, the weight
  // gradients (`overwrite`: write them, else add to them), dXg [routed, d] in slot order and
  // its combine into the chunk's dx rows `dx_rows`. Gathered copies of dout or x exist only
  // while a cuBLAS GEMM needs them. With overlap_weight_grads the weight gradients run on the
  // side lane, and the layer's stream waits for them before this returns (also on an error),
  // so every buffer it frees afterwards is free of the lane's reads; a chunk whose extra
  // buffer for that the pool cannot give runs in the serial order instead.
  absl::Status ChunkBackward(const DispatchPlan& plan, const ChunkPlan& ch, BackwardKernels path,
                             const void* x, const void* hb, const float* p, const void* dout,
                             const ExpertWeights& w, const ExpertGrads& grads, bool overwrite,
                             float* dp, DeviceBuffer* h_tmp, void* dx_rows,
                             kernels::ElemType dx_type);
  // The forward's up-projection of one chunk by `kernels_used`: H [routed, g] into hb and, when
  // `a` is not null, A [routed, h] (the fused kernel always needs `a`). Forward and the
  // recompute-mode Backward both run this.
  absl::Status ChunkUp(const DispatchPlan& plan, const ChunkPlan& ch, ForwardKernels kernels_used,
                       const void* x, const ExpertWeights& w, void* hb, void* a);

  absl::StatusOr<DeviceBuffer> Alloc(int64_t bytes, const char* what);

  // The second stream the weight gradients run on (overlap_weight_grads), with its own cuBLAS
  // runner and the events that order it against the layer's stream; made on first use.
  struct SideLane {
    std::shared_ptr<Stream> stream;
    std::unique_ptr<GemmRunner> gemm;
    Event start;  // the lane waits for the layer's stream (dH and pA written)
    Event done;   // the layer's stream waits for the lane
  };
  absl::StatusOr<SideLane*> Lane();

  ExpertShape shape_;
  PipelineOptions options_;
  std::shared_ptr<Stream> stream_;
  GemmRunner* gemm_;
  int64_t max_chunk_rows_;
  bool device_sm90_ = false;
  int num_sms_ = 0;
  PinnedHostBuffer pinned_;  // host staging for the counts
  std::unique_ptr<SideLane> lane_;
};

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_EXPERT_PIPELINE_H_
