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
//   On an sm_90 GPU, for bf16 SwiGLU problems the fused Hopper kernels take (see
//   UseFusedForward), the gather, up-projection and SwiGLU are one persistent launch that
//   writes H (into the saved-H buffer) and A; with ForwardKernels::kFusedUpDown the
//   down-projection writes Y per (token, k) row and the fused combine sums it. H holds the same
//   bits either way (A is computed from the bf16-rounded H), so the backward is unchanged.
// Backward, per chunk:  G = dout[entries]; dA_u = G W2 (grouped); one fused pass recomputes A
//   from H and gives dH, p*A and dp = <dA_u, A>; dW2 += (pA)^T G; Xg = x[entries] again;
//   d[W1;W3] += dH^T Xg; dXg = dH [W1;W3]; dx = sum_k dXg[slot_of].
//   On an sm_90 GPU (UseFusedBackward) the four GEMMs are the fused sm90 kernels of
//   kernels/cuda/sm90_expert_backward.h instead: G and Xg are never materialised (rows are
//   gathered while loading) and each GEMM is one launch over all experts. On every path the
//   weight gradients run on a second stream of the pipeline beside dXg and the combine
//   (ExpertShape::overlap_weight_grads), ordered by events, never by the host.
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
#include "kernels/cuda/sm90_expert_forward.h"
#include "kernels/cuda/types.h"

namespace moe::cuda {

// Which kernels run the expert forward. kAuto is what the service uses: kDefaultFusedForward
// where UseFusedForward allows it and the per-expert GEMM work is at most
// kFusedMaxWorkPerExpert, else kUnfused; MOE_DISABLE_FUSED=1 in the environment (read once per
// process) makes it always kUnfused. The others force a path (the benchmark runs them side by
// side); a fused one still falls back to kUnfused where the device or the sizes do not allow it.
enum class ForwardKernels {
  kAuto = 0,
  kUnfused = 1,     // gather + cuBLAS grouped GEMM + activation pass + cuBLAS + combine
  kFusedUp = 2,     // sm90 gather+GEMM+SwiGLU, then cuBLAS down + the engine's combine
  kFusedUpDown = 3  // sm90 gather+GEMM+SwiGLU, sm90 down (Y per (t,k) row), sm90 combine
};
const char* ForwardKernelsName(ForwardKernels k);

// Which kernels run the expert backward. kAuto is what the service uses: by the per-expert GEMM
// work, kFused, then kHybrid, then kUnfused (UseFusedBackward has the thresholds);
// MOE_DISABLE_FUSED=1 makes it kUnfused.
//   kUnfused: gather dout + cuBLAS dA + SwiGLU backward pass + cuBLAS dW2 + gather x + cuBLAS
//             dW13 + cuBLAS dXg + combine, per-expert cuBLAS calls over 4 streams;
//   kFused:   sm90 dA (dout rows gathered on load, W2 read as stored) + the same SwiGLU
//             backward pass + sm90 dW2 and dW13 (one persistent launch each, per-expert
//             reduction lengths, x and dout rows gathered on load) + sm90 dXg + combine:
//             five launches per chunk whatever the number of experts, nothing gathered stored;
//   kFusedEpilogue: kFused with the SwiGLU backward in the dA kernel's epilogue
//             (LaunchSm90BackwardDH: dA_u never reaches memory). Correct, but within 1-4% of the
//             two launches it replaces, either way (docs/PERFORMANCE.md), so only a forced
//             option: kAuto never picks it.
//   kHybrid:  sm90 dA and dW2 (dout rows gathered on load, never stored) + the SwiGLU backward
//             pass, then gather x + cuBLAS dW13 + cuBLAS dXg + combine: for large per-expert
//             GEMMs, where cuBLAS's dW13 and dXg kernels ran as fast as or faster than the sm90
//             ones but the sm90 dA beat cuBLAS's plus the dout gather it needs.
enum class BackwardKernels {
  kAuto = 0,
  kUnfused = 1,
  kFused = 2,
  kFusedEpilogue = 3,
  kHybrid = 4,
};
const char* BackwardKernelsName(BackwardKernels k);

struct ExpertShape {
  int64_t d_model = 0;
  int64_t d_hidden = 0;
  int64_t top_k = 0;
  int64_t expert_first = 0;
  int64_t expert_count = 0;
  int activation = 0;  // moe::Activation value
  kernels::ElemType type = kernels::ElemType::kBFloat16;
  ForwardKernels forward = ForwardKernels::kAuto;
  BackwardKernels backward = BackwardKernels::kAuto;
  // The backward runs a chunk's weight gradients (dW2, dW13 and the x gather they may need) on
  // a second stream, beside its dXg GEMM and dx combine, instead of before them on the layer's
  // stream: they only read what the SwiGLU backward pass has written. The persistent GEMMs do
  // not share SMs, so what this buys is their last waves, the launch gaps and the combine
  // under them: 1-3% of sonic-7b's and scale-8k's backward on an H100 (docs/PERFORMANCE.md).
  // The results are the same bits either way (each GEMM and its accumulation order is
  // unchanged).
  // It holds one more [routed rows, d] buffer at once than the serial order; a chunk for which
  // the device has no room for it runs serially, so the largest batch that fits is the same.
  bool overlap_weight_grads = true;

  bool gated() const { return activation == 0; }
  int64_t gate_width() const { return gated() ? 2 * d_hidden : d_hidden; }
};

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

// The one place that decides the forward's kernels for one chunk. `requested` (the shape's
// `forward`) is resolved first: kAuto -> kUnfused under MOE_DISABLE_FUSED=1; else by the
// average per-expert GEMM work (routed rows / experts * d * h): kDefaultFusedForward up to
// kFusedMaxWorkPerExpert, above it kFusedUp where d_hidden <= kFusedUpMaxHidden and kUnfused
// where it is wider. A fused result is then reduced to kUnfused unless the activation is
// SwiGLU, the storage bf16, the device sm_90 (`device_sm90`, Sm90DeviceSupported) and
// Sm90CanImplement(problem) accepts the sizes.
ForwardKernels UseFusedForward(const ExpertShape& shape, const kernels::Sm90ExpertProblem& problem,
                               bool device_sm90);

// Chosen by measurement (H100, bench/results/2026-11-21-h100-942d63f, docs/PERFORMANCE.md):
// the fused down-projection + combine beat cuBLAS down + the engine's combine wherever the fused
// up-projection beat cuBLAS (sonic-7b 1.42 vs 1.78 ms forward, qwen3-a3b 2.74 vs 3.11, scale-8k
// 1.08 vs 1.33). The fused path wins where per-expert cuBLAS calls are small and many (their
// host launch cost dominates: sonic-7b 1.42 vs 3.24 ms unfused); with large per-expert GEMMs
// cuBLAS runs closer to the tensor-core rate than the fused kernels (mixtral 8.51 unfused vs
// 10.06 fused, scale-128k 12.95 vs 13.81, deepseek-v3 13.96 vs 14.47; olmoe and scale-32k, at
// 4.3 G multiply-adds per expert, tie within 2%). The threshold sits between the largest
// preset where fused won (qwen3-a3b, 1.6 G) and the smallest where it lost (deepseek-v3, 3.8 G).
inline constexpr ForwardKernels kDefaultFusedForward = ForwardKernels::kFusedUpDown;
inline constexpr double kFusedMaxWorkPerExpert = 2147483648.0;  // 2^31 multiply-adds
// Above that work, the sm90 up-projection with cuBLAS's down-projection (kFusedUp) since silu
// takes the approximate reciprocal (H100, bench/results/2026-11-22-h100-caa32a1-fast-silu, fwd
// ms fused-up / fused-up-down / unfused): olmoe 2.93 / 2.94 / 3.28, scale-32k 3.02 / 3.03 /
// 3.35, deepseek-v3 13.23 / 13.39 / 14.01 (fused-up had won there in the run before too, 13.32
// vs 13.90), scale-128k 12.64 / 13.17 / 13.10, scale-512k 50.28 / 51.53 / 52.12, scale-2m
// 204.3 / 211.1 / 213.1. cuBLAS keeps mixtral (9.06 / 10.06 / 8.79), whose 2h = 28672-wide
// per-expert GEMMs run near its dense rate; the bound sits between the widest h where fused-up
// won (deepseek-v3, 2048) and mixtral's 14336.
inline constexpr int64_t kFusedUpMaxHidden = 4096;

// The one place that decides the backward's kernels for one chunk, like UseFusedForward:
// `shape.backward` kAuto -> kUnfused under MOE_DISABLE_FUSED=1; else by the average per-expert
// GEMM work: kFused up to kFusedBackwardMaxWorkPerExpert, above it kHybrid where d_hidden <=
// kHybridBackwardMaxHidden and kUnfused where it is wider. A result that runs any sm90 kernel
// (kFused, kHybrid, a forced kFusedEpilogue) is then reduced to kUnfused unless the fused kernels
// take the problem (SwiGLU, bf16, sm_90, Sm90CanImplement). The backward path does not depend on
// the forward's: both read and write the same buffers.
BackwardKernels UseFusedBackward(const ExpertShape& shape,
                                 const kernels::Sm90ExpertProblem& problem, bool device_sm90);

// Chosen by measurement (H100, bench/results/2026-11-21-h100-6674063-fused-backward and
// -3556f45-final): the fused backward won where the per-expert GEMMs are small and many
// (sonic-7b 2.47 vs 5.84 ms, qwen3-a3b 5.52 vs 6.91 at 1.6 G multiply-adds per expert, scale-8k
// 2.17 vs 3.13 at 1.07 G) and lost or tied where cuBLAS runs large per-expert GEMMs closer to
// the tensor-core rate (olmoe at 4.3 G: 7.18 vs 6.83; scale-32k at 4.3 G: within 2%, either
// way in two runs; deepseek-v3 at 3.8 G: 37.7 vs 35.0). The forward's threshold separates them.
inline constexpr double kFusedBackwardMaxWorkPerExpert = 2147483648.0;  // 2^31 multiply-adds
// Above that, the hybrid (sm90 dA and dW2: no gathered copy of dout; cuBLAS dW13 and dXg)
// measured faster than both others at 3.8-4.3 G multiply-adds per expert (H100,
// bench/results/2026-11-21-h100-50d6cf3-hybrid: olmoe 6.58 vs 6.65 unfused and 7.16 fused,
// scale-32k 6.43 vs 6.77 and 6.84, deepseek-v3 34.68 vs 35.01 and 37.31), and slower than the
// unfused path on mixtral (19.93 vs 18.43: with h = 14336, cuBLAS's dA is as fast and the sm90
// dW2 slower). Up to 2^33 multiply-adds it was at first, with the hybrid's lead over unfused at
// 17-270 G (scale-128k to 2m) within run-to-run spread (0.3-1.4%, -8feb5c1-final; 0.5-0.8%,
// -f5b0b6d-final). Since the weight gradients run on their own stream
// (ExpertShape::overlap_weight_grads) the lead is larger and the same each time: scale-128k
// 24.97 vs 25.87 ms, scale-512k 100.48 vs 103.59, scale-2m 412.38 vs 420.94
// (-ec42bec-overlap), scale-128k 25.36 vs 26.22 (-ec42bec-overlap-ab2), while mixtral stays
// unfused's (20.08 vs 18.18, 20.29 vs 18.30). So the width, not the work, now separates them:
// the hybrid where h is at most the fused up-projection's bound (deepseek-v3's 2048 and below,
// every preset but mixtral), cuBLAS where it is wider.
inline constexpr int64_t kHybridBackwardMaxHidden = kFusedUpMaxHidden;

// Test hooks: pipelines created afterwards take these as their shape's `forward` / `backward`
// when not kAuto (the engine tests force each path through the CUDA layer). kAuto restores the
// default.
void SetForwardKernelsForTesting(ForwardKernels k);
void SetBackwardKernelsForTesting(BackwardKernels k);

// Test hook: pipelines created afterwards run the weight gradients on the layer's stream
// (overlap_weight_grads off) while `serial` is true.
void SetSerialWeightGradsForTesting(bool serial);

// Test hook: the two places where the weight-gradient lane's ordering against the layer's
// stream matters. The backward calls `delay` (when set) with the stream about to run there, so
// a test can enqueue a wait on the GPU and make a missing stream wait show deterministically:
//   kLayerBeforeDA: the layer's stream, dH and pA allocated, before the dA GEMM (and the
//                   SwiGLU backward after it) write them;
//   kLaneStart:     the lane (or the layer's stream when serial), before its first GEMM.
// nullptr removes it.
enum class LaneTestPoint { kLayerBeforeDA, kLaneStart };
using LaneDelayForTesting = void (*)(LaneTestPoint point, cudaStream_t stream);
void SetLaneDelayForTesting(LaneDelayForTesting delay);

// Test hook: pipelines created afterwards use at most `rows` routed rows per chunk, so small
// test shapes run through several chunks. 0 restores the default.
void SetMaxChunkRowsForTesting(int64_t rows);

class ExpertPipeline {
 public:
  // Per-chunk temporaries stay under this many bytes.
  static constexpr int64_t kChunkBudgetBytes = int64_t{6} << 30;
  static constexpr int64_t kMaxChunkRows = int64_t{1} << 19;

  // max_chunk_rows: routed rows per chunk at most; <= 0 takes kMaxChunkRows (or the test
  // override below).
  ExpertPipeline(const ExpertShape& shape, std::shared_ptr<Stream> stream, GemmRunner* gemm,
                 int64_t max_chunk_rows = 0);
  ExpertPipeline(const ExpertPipeline&) = delete;
  ExpertPipeline& operator=(const ExpertPipeline&) = delete;

  const ExpertShape& shape() const { return shape_; }
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

  // What the forward of `chunk` runs (UseFusedForward on this pipeline's shape and device).
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
