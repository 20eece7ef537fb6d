// The CUDA engine's size-dependent choices (see kernel_selection.h for the rules' records).
#include "engine/cuda/kernel_selection.h"

#include <algorithm>
#include <cstdint>

namespace moe::cuda {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of a plain or warp-specialised kernel's tile (two consumer warpgroups of 64 rows).
constexpr int64_t kTileRows = 128;

int64_t RoutedRows(const kernels::Sm90ExpertProblem& problem) {
  return problem.num_routed >= 0 ? problem.num_routed : problem.num_tokens * problem.top_k;
}

// Average multiply-adds of one expert's GEMM of one projection: routed rows / experts * d * h.
double WorkPerExpert(const ExpertShape& shape, const kernels::Sm90ExpertProblem& problem) {
  return static_cast<double>(RoutedRows(problem)) / std::max<int64_t>(shape.expert_count, 1) *
         static_cast<double>(shape.d_model) * static_cast<double>(shape.d_hidden);
}

// Whether the sm90 kernels can run this problem at all: SwiGLU (Activation::kSwiGLU == 0,
// engine/layer.h), bf16 storage, an sm_90 device, sizes Sm90CanImplement accepts.
bool FusedKernelsTake(const ExpertShape& shape, const kernels::Sm90ExpertProblem& problem,
                      bool device_sm90) {
  return shape.activation == 0 && shape.type == kernels::ElemType::kBFloat16 && device_sm90 &&
         kernels::Sm90CanImplement(problem) == nullptr;
}

}  // namespace

const char* ForwardKernelsName(ForwardKernels k) {
  switch (k) {
    case ForwardKernels::kAuto:
      return "auto";
    case ForwardKernels::kUnfused:
      return "unfused";
    case ForwardKernels::kFusedUp:
      return "fused-up";
    case ForwardKernels::kFusedUpDown:
      return "fused-up-down";
  }
  return "?";
}

const char* BackwardKernelsName(BackwardKernels k) {
  switch (k) {
    case BackwardKernels::kAuto:
      return "auto";
    case BackwardKernels::kUnfused:
      return "unfused";
    case BackwardKernels::kFused:
      return "fused";
    case BackwardKernels::kHybrid:
      return "hybrid";
  }
  return "?";
}

ForwardKernels UseFusedForward(const ExpertShape& shape, const PipelineOptions& options,
                               const kernels::Sm90ExpertProblem& problem, bool device_sm90) {
  ForwardKernels k = options.forward;
  if (k == ForwardKernels::kAuto) {
    if (!options.fused_kernels) {
      k = ForwardKernels::kUnfused;  // the operator turned the fused kernels off
    } else if (WorkPerExpert(shape, problem) <= kFusedMaxWorkPerExpert) {
      k = kDefaultFusedForward;  // [0002] small per-expert GEMMs: fused up and down
    } else {
      // [0002] large ones: the fused up-projection up to its width bound, else cuBLAS
      k = shape.d_hidden <= kFusedUpMaxHidden ? ForwardKernels::kFusedUp : ForwardKernels::kUnfused;
    }
  }
  if (k == ForwardKernels::kUnfused) return k;
  return FusedKernelsTake(shape, problem, device_sm90) ? k : ForwardKernels::kUnfused;
}

BackwardKernels UseFusedBackward(const ExpertShape& shape, const PipelineOptions& options,
                                 const kernels::Sm90ExpertProblem& problem, bool device_sm90) {
  BackwardKernels k = options.backward;
  if (k == BackwardKernels::kAuto) {
    if (!options.fused_kernels) {
      k = BackwardKernels::kUnfused;  // the operator turned the fused kernels off
    } else if (WorkPerExpert(shape, problem) <= kFusedBackwardMaxWorkPerExpert) {
      k = BackwardKernels::kFused;  // [0002] small per-expert GEMMs: the fused backward
    } else {
      // [0003] large ones: the hybrid up to its width bound, else cuBLAS
      k = shape.d_hidden <= kHybridBackwardMaxHidden ? BackwardKernels::kHybrid
                                                     : BackwardKernels::kUnfused;
    }
  }
  if (k == BackwardKernels::kUnfused) return k;
  return FusedKernelsTake(shape, problem, device_sm90) ? k : BackwardKernels::kUnfused;
}

kernels::Sm90GemmConfig Sm90ChooseConfig(const kernels::Sm90ExpertProblem& problem,
                                         Sm90Projection projection, int num_sms) {
  kernels::Sm90GemmConfig config;
  config.tma_weights = true;
  const int64_t d = problem.d_model, h = problem.d_hidden;
  if (projection == Sm90Projection::kWeightGradW2 || projection == Sm90Projection::kWeightGradW13) {
    // [0001] Weight gradients: the tile spans the gradient's columns (dW2 [d, h]: h; dW13
    // [2h, d]: d); 256 wide only with more than 128 of them, to be worth its registers.
    const int64_t cols = projection == Sm90Projection::kWeightGradW2 ? h : d;
    config.block_n = cols > 128 ? 256 : 128;
    // [0001] The slot-order operand (pA or dH) by TMA with 256-wide tiles, up to the widest d
    // measured (2048).
    config.tma_weights = config.block_n == 256 && d <= 2048;
    return config;
  }
  const int64_t routed = RoutedRows(problem);
  // Expected row blocks: full blocks plus about half a ragged block per expert.
  const int64_t row_blocks = CeilDiv(routed, kTileRows) + problem.num_experts / 2;
  // Output columns (n) and reduction (k) of each row-gathered GEMM. Up-projection tiles cover
  // block_n/2 of h (W1 and W3 halves).
  int64_t n = d, k = h;
  switch (projection) {
    case Sm90Projection::kUpSwiGLU:
      n = h;
      k = d;
      break;
    case Sm90Projection::kBackwardDA:  // dA_u [N, h] = dout [N, d] W2_e
      n = h;
      k = d;
      break;
    case Sm90Projection::kBackwardDX:  // dXg [N, d] = dH [N, 2h] W13_e
      n = d;
      k = 2 * h;
      break;
    default:  // kDown
      break;
  }
  const int wide_cols = projection == Sm90Projection::kUpSwiGLU ? 128 : 256;
  // [0001] Wide tiles (wgmma N = 256) read each A tile once per 256 weight rows, halving the
  // gather traffic per flop; narrow ones only where n cannot fill them (up: h <= 64) or where
  // wide ones would leave SMs idle on the single persistent wave.
  if (n <= wide_cols / 2) {
    config.block_n = 128;
  } else if (row_blocks * CeilDiv(n, wide_cols) < num_sms) {
    config.block_n = 128;
  } else {
    config.block_n = 256;
  }
  // [0001] Rasterisation band: as many row blocks as keep their A rows (128 x k bf16 each)
  // within ~24 MB of the 50 MB L2, at most 16, so weights stream from memory once per band.
  config.group_m = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(16, (int64_t{24} << 20) / (kTileRows * k * 2))));
  // [0001] The warp-specialised kernel for narrow experts (h <= 256) in the up- and
  // down-projections and dXg: its producer keeps loading through the short tiles' epilogues.
  // Wider experts, and dA (reducing over d), keep the plain kernel, as fast or faster there.
  config.warp_specialized =
      (projection == Sm90Projection::kUpSwiGLU || projection == Sm90Projection::kDown ||
       projection == Sm90Projection::kBackwardDX) &&
      h <= 256;
  // [0001] The up-projection by how many of the routed rows 128-row tiles would pad (half a
  // block per expert, E * 64 of N): above 10% the warp-specialised kernel; above 20% the
  // ping-pong kernel, whose 64 x 256 consumer tiles halve the padding. Only where the wide tile
  // was chosen anyway (block_n 256); every other GEMM keeps the kernels above.
  const int64_t padding_rows = problem.num_experts * int64_t{64};
  if (projection == Sm90Projection::kUpSwiGLU && padding_rows * 10 > routed &&
      config.block_n == 256) {
    config.warp_specialized = true;
  }
  if (projection == Sm90Projection::kUpSwiGLU && padding_rows * 5 > routed &&
      config.block_n == 256) {
    config.ping_pong = true;
    config.warp_specialized = false;
  }
  return config;
}

}  // namespace moe::cuda
