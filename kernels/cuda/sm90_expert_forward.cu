// Host side of the fused Hopper forward: the problem check and the two forward launchers, plus
// the combine kernel. Map encoding and the config-to-template switch live in sm90/launch.cuh,
// shared with the backward; which config a GEMM gets is the engine's choice
// (engine/cuda/kernel_selection.h).
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

// Lives here rather than in a header that several .cu files include: a non-template kernel
// defined in a header would be defined once per file.
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
