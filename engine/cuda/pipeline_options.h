// The expert pipeline's plain inputs: the shape of a layer's experts, the kernel paths it can
// run, and PipelineOptions, how every pipeline of a CUDA engine runs them.
//
// Plain C++ (no CUDA or Abseil headers), so that cuda_engine.h, which the engine factory and
// the server compile with g++ alone, can take PipelineOptions. The service sets only
// fused_kernels (from EngineOptions); the other fields are what tests and benchmarks force,
// passed down the same way instead of through process-wide switches.
#ifndef MOE_ENGINE_CUDA_PIPELINE_OPTIONS_H_
#define MOE_ENGINE_CUDA_PIPELINE_OPTIONS_H_

#include <cstdint>

#include "kernels/cuda/types.h"

struct CUstream_st;  // cudaStream_t is a CUstream_st*

namespace moe::cuda {

// Which kernels run the expert forward (kernel_selection.h decides kAuto per chunk).
enum class ForwardKernels {
  kAuto = 0,
  kUnfused = 1,     // gather + cuBLAS grouped GEMM + activation pass + cuBLAS + combine
  kFusedUp = 2,     // sm90 gather+GEMM+SwiGLU, then cuBLAS down + the engine's combine
  kFusedUpDown = 3  // sm90 gather+GEMM+SwiGLU, sm90 down (Y per (t,k) row), sm90 combine
};
const char* ForwardKernelsName(ForwardKernels k);

// Which kernels run the expert backward (kernel_selection.h decides kAuto per chunk).
//   kUnfused: gather dout + cuBLAS dA + SwiGLU backward pass + cuBLAS dW2 + gather x + cuBLAS
//             dW13 + cuBLAS dXg + combine, per-expert cuBLAS calls over 4 streams;
//   kFused:   sm90 dA (dout rows gathered on load, W2 read as stored) + the same SwiGLU
//             backward pass + sm90 dW2 and dW13 (one persistent launch each, per-expert
//             reduction lengths, x and dout rows gathered on load) + sm90 dXg + combine:
//             five launches per chunk whatever the number of experts, nothing gathered stored;
//   kHybrid:  sm90 dA and dW2 (dout rows gathered on load, never stored) + the SwiGLU backward
//             pass, then gather x + cuBLAS dW13 + cuBLAS dXg + combine.
enum class BackwardKernels {
  kAuto = 0,
  kUnfused = 1,
  kFused = 2,
  kHybrid = 3,
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

  bool gated() const { return activation == 0; }
  int64_t gate_width() const { return gated() ? 2 * d_hidden : d_hidden; }
};

// The two places where the weight-gradient lane's ordering against the layer's stream matters
// (PipelineOptions::lane_delay):
//   kLayerBeforeDA: the layer's stream, dH and pA allocated, before the dA GEMM (and the
//                   SwiGLU backward after it) write them;
//   kLaneStart:     the lane (or the layer's stream when serial), before its first GEMM.
enum class LaneTestPoint { kLayerBeforeDA, kLaneStart };
using LaneDelay = void (*)(LaneTestPoint point, CUstream_st* stream);

struct PipelineOptions {
  // false: kAuto resolves to kUnfused in both directions (EngineOptions::fused_kernels, the
  // operator's switch); a path forced below is kept.
  bool fused_kernels = true;
  // kAuto: the rules of kernel_selection.h choose per chunk. Another value forces that path (a
  // benchmark times them side by side, a test runs each); a fused one still falls back to
  // kUnfused where the device or the sizes do not allow it.
  ForwardKernels forward = ForwardKernels::kAuto;
  BackwardKernels backward = BackwardKernels::kAuto;
  // The backward runs a chunk's weight gradients (dW2, dW13 and the x gather they may need) on
  // a second stream, beside its dXg GEMM and dx combine, instead of before them on the layer's
  // stream: they only read what the SwiGLU backward pass has written. The persistent GEMMs do
  // not share SMs, so what this buys is their last waves, the launch gaps and the combine
  // under them, a few percent of the backward. The results are the same bits either way (each
  // GEMM and its accumulation order is unchanged). It holds one more [routed rows, d] buffer at
  // once than the serial order; a chunk for which the device has no room for it runs serially,
  // so the largest batch that fits is the same.
  bool overlap_weight_grads = true;
  // Routed rows per dispatch chunk at most; 0 takes ExpertPipeline::kMaxChunkRows. Tests set
  // small values so that small shapes run through several chunks.
  int64_t max_chunk_rows = 0;
  // Every device allocation of the layer is filled with 0xFF bytes (NaN for fp32 and bf16)
  // first, so that an output element a kernel forgot to write shows up in comparisons.
  bool poison_allocations = false;
  // Called (when set) with the stream about to run at each LaneTestPoint, so that a test can
  // enqueue a wait on the GPU and make a missing stream wait show deterministically.
  LaneDelay lane_delay = nullptr;
};

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_PIPELINE_OPTIONS_H_
