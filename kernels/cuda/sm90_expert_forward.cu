// Host side of the fused Hopper forward: problem checks, the tile heuristics (for the
// backward's projections too, so one function owns every tile choice) and the two forward
// launchers. Map encoding and the config-to-template switch live in sm90_launch.cuh, shared
// with the backward.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "kernels/cuda/sm90/launch.cuh"
#include "kernels/cuda/sm90_expert_forward.h"

namespace moe::kernels {
namespace {

using sm90::Aligned16;
using sm90::CeilDiv;
using sm90::DispatchGemm;
using sm90::GemmParams;
using sm90::GemmVariant;
using sm90::MakeGemmParams;

// Lives here rather than in sm90_grouped_gemm.cuh, which several .cu files include: a
// non-template kernel defined in a header would be defined once per file.
// out[t] = sum over k with slot_of[t*K+k] >= 0 of w[t*K+k] * y[t*K+k]; 8 columns a thread,
// 16-byte loads and stores, fp32 sums. Tokens with no local entry get zeros.
__global__ void sm90_combine_kernel(const __nv_bfloat16* __restrict__ y,
                                    const float* __restrict__ w,
                                    const int32_t* __restrict__ slot_of,
                                    __nv_bfloat16* __restrict__ out, int64_t num_tokens, int top_k,
                                    int d) {
  const int chunks = d / 8;
  const int64_t total = num_tokens * chunks;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks;
    const int c = static_cast<int>(i - t * chunks);
    float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < top_k; ++k) {
      const int64_t e = t * top_k + k;
      if (slot_of[e] < 0) continue;
      const float pw = w[e];
      const uint4 v = *reinterpret_cast<const uint4*>(y + e * d + c * 8);
      const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(v2[q]);
        sum[2 * q] += pw * f.x;
        sum[2 * q + 1] += pw * f.y;
      }
    }
    uint4 o;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int q = 0; q < 4; ++q) o2[q] = __floats2bfloat162_rn(sum[2 * q], sum[2 * q + 1]);
    *reinterpret_cast<uint4*>(out + t * d + c * 8) = o;
  }
}

}  // namespace

const char* Sm90CanImplement(const Sm90ExpertProblem& problem) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (problem.num_tokens <= 0) return "num_tokens must be positive";
  if (problem.top_k <= 0) return "top_k must be positive";
  if (problem.num_experts <= 0 || problem.num_experts > sm90::kMaxExperts) {
    return "num_experts must be in [1, 512]";
  }
  if (problem.d_model <= 0 || problem.d_model % 8 != 0) {
    return "d_model must be a positive multiple of 8 (16-byte rows)";
  }
  if (problem.d_hidden <= 0 || problem.d_hidden % 8 != 0) {
    return "d_hidden must be a positive multiple of 8 (16-byte rows)";
  }
  if (problem.num_tokens * problem.top_k > kInt32Max) {
    return "num_tokens * top_k exceeds the int32 range of entries";
  }
  // Row-block counts are int32 tile ids: (N / 128 + experts) * column blocks must fit.
  const int64_t row_blocks =
      CeilDiv(problem.num_tokens * problem.top_k, sm90::kMinBlockM) + problem.num_experts;
  const int64_t col_blocks =
      CeilDiv(2 * static_cast<int64_t>(problem.d_hidden) + problem.d_model, 64);
  if (row_blocks * col_blocks > kInt32Max) return "num_tokens too large for int32 tile ids";
  const int64_t block = static_cast<int64_t>(problem.d_hidden) * problem.d_model;
  if (problem.w13_expert_stride >= 0 &&
      (problem.w13_expert_stride < block || problem.w13_expert_stride % 8 != 0)) {
    return "w13_expert_stride must be -1 or a multiple of 8 no less than d_hidden * d_model";
  }
  return nullptr;
}

bool Sm90DeviceSupported(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
}

Sm90GemmConfig Sm90ChooseConfig(const Sm90ExpertProblem& problem, Sm90Projection projection,
                                int num_sms) {
  Sm90GemmConfig config;
  config.tma_weights = true;
  const int64_t d = problem.d_model, h = problem.d_hidden;
  // Weight gradients: the output tile spans the gradient's columns (dW2 [d, h]: h; dW13
  // [2h, d]: d), and a 256-wide tile needs more than 128 of them to be worth its registers.
  if (projection == Sm90Projection::kWeightGradW2 || projection == Sm90Projection::kWeightGradW13) {
    const int64_t cols = projection == Sm90Projection::kWeightGradW2 ? h : d;
    config.block_n = cols > 128 ? 256 : 128;
    // The slot-order operand (pA or dH) by TMA: 1.4-12.5% faster on 14 of 16 preset cases at
    // d <= 2048, within noise on the other two (bench/results/2026-11-21-h100-402c3e4-weight-
    // grad-overlap); never run at deepseek-v3's d = 7168, so only up to the measured width.
    config.tma_weights = config.block_n == 256 && d <= 2048;
    return config;
  }
  const int64_t routed =
      problem.num_routed >= 0 ? problem.num_routed : problem.num_tokens * problem.top_k;
  // Expected row blocks: full blocks plus about half a ragged block per expert.
  const int64_t row_blocks = CeilDiv(routed, sm90::kMinBlockM) + problem.num_experts / 2;
  // Output columns (n) and reduction (k) of each row-gathered GEMM. Up-projection tiles cover
  // block_n/2 of h (W1 and W3 halves).
  int64_t n = d, k = h;
  switch (projection) {
    case Sm90Projection::kUpSwiGLU:
      n = h;
      k = d;
      break;
    case Sm90Projection::kBackwardDA:  // dA_u [N, h] = dout [N, d] W2_e
    case Sm90Projection::kBackwardDH:  // the same GEMM, SwiGLU backward epilogue
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
  // Wide tiles (wgmma N = 256) read each A tile once per 256 weight rows, halving the gather
  // traffic per flop; narrow ones only when n is too small to fill them (up: h <= 64) or when
  // wide tiles would leave SMs idle on the single persistent wave.
  if (n <= wide_cols / 2) {
    config.block_n = 128;
  } else if (row_blocks * CeilDiv(n, wide_cols) < num_sms) {
    config.block_n = 128;
  } else {
    config.block_n = 256;
  }
  // Rasterisation band: as many row blocks as keep their A rows (128 x k bf16 each) within
  // ~24 MB of the 50 MB L2, at most 16, so weights stream once per band.
  config.group_m = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(16, (int64_t{24} << 20) / (sm90::kMinBlockM * k * 2))));
  // The warp-specialised kernel for the forward of narrow experts (h <= 256): its producer keeps
  // loading while the consumers run a tile's epilogue, which pays where tiles are short (the
  // down-projection reduces over h alone). Measured on both GPUs for sonic-7b (h = 256):
  // H100 (bench/results/2026-11-21-h100-b77ef57-tile-sweep) up 0.712 vs 0.853 ms, down 0.381 vs
  // 0.492; H200 (docs/FUSED.md) 0.70 vs 0.84 and 0.37 vs 0.50. At h = 768 and 1024 (qwen3-a3b,
  // olmoe) the plain kernel was as fast or faster on the H100, and the two GPUs disagreed at
  // scale-8k, so the rule stops at 256 (since the fourteenth session the padding rule below
  // gives scale-8k's up-projection the ws kernel). The backward's dXg (dH [N, 2h] times W13_e,
  // reducing over 2h) follows the same rule: at h = 256 the ws kernel beat the plain one by
  // 6.5-7.2% in five interleaved timings (sonic-7b 0.630-0.637 vs 0.675-0.684 ms,
  // bench/results/2026-11-22-h100-8673a05-ws-multicast) and lost 6-9% at h = 768-1024; dA
  // (reducing over d) stays plain, within 1.5% there.
  config.warp_specialized =
      (projection == Sm90Projection::kUpSwiGLU || projection == Sm90Projection::kDown ||
       projection == Sm90Projection::kBackwardDX) &&
      h <= 256;
  // The ping-pong kernel with 64 x 256 consumer tiles (bench/results/
  // 2026-11-21-h100-36b98f9-ping-pong, H100 runs 1, 3 and 4 resp. 3 and 4, in ms):
  //  - up-projection, where 128-row tiles would pad more than ~20% of the routed rows (half a
  //    block per expert: E * 64 > N / 5), which 64-row tiles halve: deepseek-v3 (25%)
  //    9.24/8.88/9.18 vs 9.92/9.49/9.82 plain. At 3-6% padding (sonic-7b, qwen3-a3b, olmoe,
  //    mixtral) it measured slower (run 4: 11-37%), as it did for the down-projection (a tie
  //    on deepseek-v3), dA and dX; those keep the other kernels. Between 10% and 20% (scale-8k,
  //    12.5%) it beat the plain kernel then (0.691/0.683/0.688 vs 0.724/0.722/0.732), but in
  //    six later sweeps over three calls it lost to the plain and ws kernels alike: ws
  //    0.548-0.582 ms (ten timings; two more timed last in their sweep, after its slowest
  //    variants, 0.617 and 0.625), plain 0.557-0.644 (six), ping-pong 0.601-0.631 (six)
  //    (bench/results/2026-11-26-h100-overlap-epilogue, call1/ and call2/, and -ws-padded-up,
  //    kernels.jsonl), while at 25% the ws kernel was the slowest (deepseek-v3 13.6-13.9 ms,
  //    ping-pong 8.84-8.89). So the up-projection takes the ws kernel at 10-20% padding
  //    (scale-8k's forward 0.969-0.975 -> 0.895 ms through the engine, -ws-padded-up);
  //  - the dA GEMM with the SwiGLU backward epilogue where h <= 768: sonic-7b 0.511/0.518 vs
  //    0.567/0.570 plain, qwen3-a3b 1.187/1.208 vs 1.244/1.259; at h = 1024 (olmoe, scale-8k)
  //    and 2048 it lost or split.
  // The sweeps time the old kernels first on each preset and the ping-pong ones later, and a
  // config timed again at the end of a preset measured up to 20% slower than its first timing
  // (drift within one process, cause not established), so these wins are if anything understated.
  // Only where the wide tile was chosen anyway (block_n 256: n large enough to fill it).
  const int64_t padding_rows = problem.num_experts * int64_t{64};
  if (projection == Sm90Projection::kUpSwiGLU && padding_rows * 10 > routed &&
      config.block_n == 256) {
    config.warp_specialized = true;
  }
  const bool pp_up = projection == Sm90Projection::kUpSwiGLU && padding_rows * 5 > routed;
  const bool pp_dh = projection == Sm90Projection::kBackwardDH && h <= 768;
  if ((pp_up || pp_dh) && config.block_n == 256) {
    config.ping_pong = true;
    config.warp_specialized = false;
  }
  return config;
}

cudaError_t LaunchSm90ExpertUp(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                               const uint16_t* x, const uint16_t* w1, const uint16_t* w3,
                               const int32_t* offsets, const int32_t* entries, uint16_t* h,
                               uint16_t* a, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!Aligned16(x) || !Aligned16(w1) || !Aligned16(w3) || !Aligned16(h) || !Aligned16(a) ||
      offsets == nullptr || entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  GemmParams params = MakeGemmParams(
      problem, x, w1, w3, offsets, entries, h, problem.d_model, problem.d_hidden,
      problem.w13_expert_stride >= 0 ? problem.w13_expert_stride
                                     : static_cast<int64_t>(problem.d_hidden) * problem.d_model);
  params.out1 = reinterpret_cast<__nv_bfloat16*>(a);
  return DispatchGemm(GemmVariant<true, true, false, false>{}, config, params, w1, w3, stream);
}

cudaError_t LaunchSm90ExpertDown(const Sm90ExpertProblem& problem, const Sm90GemmConfig& config,
                                 const uint16_t* a, const uint16_t* w2, const int32_t* offsets,
                                 const int32_t* entries, uint16_t* y, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!Aligned16(a) || !Aligned16(w2) || !Aligned16(y) || offsets == nullptr ||
      entries == nullptr) {
    return cudaErrorInvalidValue;
  }
  GemmParams params =
      MakeGemmParams(problem, a, w2, w2, offsets, entries, y, problem.d_hidden, problem.d_model,
                     static_cast<int64_t>(problem.d_model) * problem.d_hidden);
  return DispatchGemm(GemmVariant<false, false, false, false>{}, config, params, w2, w2, stream);
}

cudaError_t LaunchSm90Combine(const Sm90ExpertProblem& problem, const uint16_t* y, const float* p,
                              const int32_t* slot_of, uint16_t* out, cudaStream_t stream) {
  if (Sm90CanImplement(problem) != nullptr) return cudaErrorInvalidValue;
  if (!Aligned16(y) || !Aligned16(out) || p == nullptr || slot_of == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t work = problem.num_tokens * (problem.d_model / 8);
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(CeilDiv(work, threads), 1 << 20));
  sm90_combine_kernel<<<blocks, threads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(y), p, slot_of, reinterpret_cast<__nv_bfloat16*>(out),
      problem.num_tokens, problem.top_k, problem.d_model);
  return cudaGetLastError();
}

}  // namespace moe::kernels
