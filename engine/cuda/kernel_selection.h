// Every size-dependent choice of the CUDA engine, in one place: which path runs a chunk's expert
// forward and backward (the fused sm90 kernels, cuBLAS, or the hybrid of both), which sm90
// kernel and tiles run each fused GEMM, and when a host tensor is copied through pinned staging.
//
// Each rule is written as the candidates it chooses among plus a one-line reason, and points at
// the decision record that holds the measurement behind it:
//   [0001] docs/decisions/0001-sm90-kernel-choice.md   sm90 kernel and tiles per GEMM
//   [0002] docs/decisions/0002-fused-path-bounds.md    fused forward and backward bounds
//   [0003] docs/decisions/0003-hybrid-backward.md      the hybrid backward
//   [0004] docs/decisions/0004-host-staging.md         host <-> device copies
// A rule changes only with a new measurement, recorded there. The rules read sizes only, so
// the same shapes always get the same kernels (and the same bits); kernel_selection_test.cc
// pins each rule's answer on the benchmark presets without a GPU.
//
// No Abseil here: the sm90 kernel tests link this to run the configs the engine would choose.
#ifndef MOE_ENGINE_CUDA_KERNEL_SELECTION_H_
#define MOE_ENGINE_CUDA_KERNEL_SELECTION_H_

#include <cstddef>
#include <cstdint>

#include "engine/cuda/pipeline_options.h"
#include "kernels/cuda/sm90_expert_forward.h"

namespace moe::cuda {

// ---- Paths: fused sm90 kernels or cuBLAS, per chunk ----------------------------------------

// Per-expert GEMM work, routed rows / experts * d * h multiply-adds, separates the paths: the
// fused kernels win where per-expert cuBLAS calls are small and many (their launch cost
// dominates), cuBLAS where large per-expert GEMMs run near its dense rate.
// [0002] kAuto forward: both fused projections up to 2^31 multiply-adds per expert.
inline constexpr ForwardKernels kDefaultFusedForward = ForwardKernels::kFusedUpDown;
inline constexpr double kFusedMaxWorkPerExpert = 2147483648.0;
// [0002] Above it, the fused up-projection with cuBLAS's down-projection while h <= 4096;
// wider experts (2h-wide GEMMs near cuBLAS's dense rate) stay unfused.
inline constexpr int64_t kFusedUpMaxHidden = 4096;
// [0002] kAuto backward: the fused backward up to the forward's work bound.
inline constexpr double kFusedBackwardMaxWorkPerExpert = 2147483648.0;
// [0003] Above it, the hybrid (sm90 dA and dW2, cuBLAS dW13 and dXg) while h is within the
// fused up-projection's bound; wider experts stay unfused.
inline constexpr int64_t kHybridBackwardMaxHidden = kFusedUpMaxHidden;

// The forward's kernels for one chunk. `options.forward` is resolved first: kAuto -> kUnfused
// when options.fused_kernels is off, else by the work and width rules above. A fused result is
// then reduced to kUnfused unless the activation is SwiGLU, the storage bf16, the device sm_90
// (`device_sm90`, Sm90DeviceSupported) and Sm90CanImplement(problem) accepts the sizes.
ForwardKernels UseFusedForward(const ExpertShape& shape, const PipelineOptions& options,
                               const kernels::Sm90ExpertProblem& problem, bool device_sm90);

// The backward's kernels for one chunk, like UseFusedForward: kAuto -> kFused, kHybrid or
// kUnfused by the rules above; any result running an sm90 kernel falls back to kUnfused where
// the fused kernels do not take the problem. Independent of the forward's path: both read and
// write the same buffers.
BackwardKernels UseFusedBackward(const ExpertShape& shape, const PipelineOptions& options,
                                 const kernels::Sm90ExpertProblem& problem, bool device_sm90);

// ---- sm90 kernel and tiles, per fused GEMM --------------------------------------------------

// The GEMMs whose tiles Sm90ChooseConfig picks: the forward's two projections, the backward's
// data gradients (dA_u = dout W2_e, dXg = dH W13_e) and its weight gradients (dW2, dW13).
enum class Sm90Projection {
  kUpSwiGLU = 0,
  kDown = 1,
  kBackwardDA = 2,
  kBackwardDX = 3,
  kWeightGradW2 = 4,
  kWeightGradW13 = 5,
};

// The config of one fused GEMM on a GPU of `num_sms` SMs. Candidates: block_n 128 or 256; the
// plain, warp-specialised or ping-pong kernel; group_m 1 to 16; weights by TMA.
kernels::Sm90GemmConfig Sm90ChooseConfig(const kernels::Sm90ExpertProblem& problem,
                                         Sm90Projection projection, int num_sms);

// ---- Host <-> device copies (host_staging.h) ------------------------------------------------

// [0004] Pageable transfers of at least 4 MiB go through pinned staging, whose copies by
// threads overlap the DMAs; smaller ones, and page-locked buffers at any size, are copied
// directly.
inline constexpr size_t kMinStagedBytes = size_t{4} << 20;
// [0004] The staging buffer per device, at most 256 MiB; larger transfers go through it in
// pieces.
inline constexpr size_t kMaxStagingBytes = size_t{256} << 20;
// [0004] Pieces of 2 MiB: the DMA of one piece runs while the threads copy later ones.
inline constexpr size_t kPipelineBytes = size_t{2} << 20;

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_KERNEL_SELECTION_H_
