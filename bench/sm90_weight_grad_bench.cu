// Times the fused Hopper weight gradients (LaunchSm90WeightGradW2/W13) on the benchmark
// presets against what the engine does today: one cublasGemmEx per expert (bf16 in, fp32 out,
// beta 0) over operands already gathered into slot order. The gather that cuBLAS needs is
// timed on its own and NOT included in its GEMM time, so the ratio favours cuBLAS.
//
// Routing is uniform random top-K (K distinct experts per token). Inputs are filled on the
// device with a hash, so a 45 GB deepseek-v3 problem needs no host-side generation. Each timing
// is the median of 10 CUDA-event timed launches after 2 warm-ups. Before timing, the fused
// result of three experts (first, middle, last) is compared with cuBLAS's (normalised error),
// so a fast wrong kernel cannot pass unnoticed. One JSON line per (preset, gradient, variant):
// the launchers' three kernels (block_n 256 with tma_weights off and on, block_n 128: see
// kernels/cuda/sm90_weight_grad.cu), then other instantiations launched directly (two CTAs an
// SM, with 64- or 48-row slabs or TMA).
// Usage: [WGRAD_ONLY=s] [WGRAD_SKIP=s] sm90_weight_grad_bench [preset ...] (default: the five
// of kBackwardPresets); the two variables filter the directly launched variants by name.
// Presets, routing, buffers, the gather and timing come from bench/sm90_bench_util.h.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string_view>
#include <vector>

#include "bench/sm90_bench_util.h"
#include "kernels/cuda/sm90_expert_backward.h"
// Also the kernel header itself, to time instantiations the launchers do not choose.
#include "kernels/cuda/sm90/impls/weight_grad.cuh"

namespace {

using moe::bench::DeviceBuffer;
using moe::bench::Preset;
using moe::kernels::Sm90ExpertProblem;
using moe::kernels::Sm90GemmConfig;

#define CUDA_OK SM90_BENCH_CUDA

__global__ void fill_bf16_kernel(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t v = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32);
    v ^= v >> 15;
    v *= 2246822519u;
    v ^= v >> 13;
    p[i] = __float2bfloat16((static_cast<float>(v & 0xFFFF) / 65536.0f - 0.5f) * 2.0f);
  }
}

// The median of 10 timed launches after 2 warm-ups, as the mean of the middle two.
double MedianMs(const std::function<void()>& fn) {
  const std::vector<float> ms = moe::bench::SortedEventTimesMs(fn, /*warm=*/2, /*reps=*/10);
  return 0.5 * (static_cast<double>(ms[4]) + ms[5]);
}

// Copies experts `which` of an [E, m, n] fp32 tensor to the host.
std::vector<float> Sample(const float* dev, const std::vector<int>& which, int64_t block) {
  std::vector<float> out(which.size() * block);
  for (size_t i = 0; i < which.size(); ++i) {
    CUDA_OK(cudaMemcpy(out.data() + i * block, dev + which[i] * block, block * 4,
                       cudaMemcpyDeviceToHost));
  }
  return out;
}

double NormalisedDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The directly launched variants to time: all, or those whose name contains $WGRAD_ONLY, less
// those whose name contains $WGRAD_SKIP (so an experimental one can run in its own process).
bool WantVariant(std::string_view name) {
  const char* only = std::getenv("WGRAD_ONLY");
  const char* skip = std::getenv("WGRAD_SKIP");
  if (only != nullptr && *only != '\0' && name.find(only) == std::string_view::npos) return false;
  if (skip != nullptr && *skip != '\0' && name.find(skip) != std::string_view::npos) return false;
  return true;
}

void RunPreset(const Preset& ps, cublasHandle_t handle) {
  const int64_t T = ps.tokens, TK = T * ps.top_k;
  const int d = ps.d, h = ps.h, E = ps.experts, K = ps.top_k;
  std::mt19937_64 rng(7);
  const moe::bench::Routing routing = moe::bench::UniformRouting(ps, rng);
  const std::vector<int32_t>& counts = routing.counts;
  const std::vector<int32_t>& offsets = routing.offsets;
  const int64_t N = routing.routed;

  DeviceBuffer<__nv_bfloat16> dout_buf(T * d), x_buf(T * d), pa_buf(N * h), dh_buf(N * 2 * h),
      dout_g_buf(N * d), x_g_buf(N * d);
  DeviceBuffer<float> dw2_buf(int64_t{E} * d * h), dw13_buf(int64_t{E} * 2 * h * d);
  DeviceBuffer<int32_t> d_off_buf(E + 1), d_ent_buf(TK);
  __nv_bfloat16 *dout = dout_buf.ptr, *x = x_buf.ptr, *pa = pa_buf.ptr, *dh = dh_buf.ptr,
                *dout_g = dout_g_buf.ptr, *x_g = x_g_buf.ptr;
  float *dw2 = dw2_buf.ptr, *dw13 = dw13_buf.ptr;
  int32_t *d_off = d_off_buf.ptr, *d_ent = d_ent_buf.ptr;
  fill_bf16_kernel<<<1024, 256>>>(dout, T * d, 1);
  fill_bf16_kernel<<<1024, 256>>>(x, T * d, 2);
  fill_bf16_kernel<<<1024, 256>>>(pa, N * h, 3);
  fill_bf16_kernel<<<1024, 256>>>(dh, N * 2 * h, 4);
  CUDA_OK(cudaMemcpy(d_off, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_ent, routing.entries.data(), N * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize());

  const Sm90ExpertProblem prob = moe::kernels::testing::MakeProblem(T, K, E, d, h, N);

  auto gather = [&]() {
    moe::bench::GatherRowsByToken(dout, d_ent, K, N, d, dout_g);
    moe::bench::GatherRowsByToken(x, d_ent, K, N, d, x_g);
  };
  gather();
  CUDA_OK(cudaDeviceSynchronize());
  const double gather_ms = MedianMs(gather);

  // Row-major C_e[M, N] = sum_s A[s]^T B[s] is column-major C_e^T[N, M] = B^T A, with
  // B^T an (N x rows) column-major view of row-major B and A used transposed.
  const float one = 1.0f, zero = 0.0f;
  auto cublas_loop = [&](const __nv_bfloat16* a, int m, const __nv_bfloat16* b, int n, float* c) {
    for (int e = 0; e < E; ++e) {
      const int rows = counts[e];
      if (rows == 0) continue;
      const int64_t s0 = offsets[e];
      SM90_BENCH_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, n, m, rows, &one, b + s0 * n,
                                     CUDA_R_16BF, n, a + s0 * m, CUDA_R_16BF, m, &zero,
                                     c + static_cast<int64_t>(e) * m * n, CUDA_R_32F, n,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  };
  const std::vector<int> probe = {0, E / 2, E - 1};
  struct Grad {
    const char* name;
    int m, n;
    const __nv_bfloat16* a_slot;  // A in slot order, for cuBLAS
    const __nv_bfloat16* b_slot;
    float* c;
    std::function<cudaError_t(const Sm90GemmConfig&, bool)> fused;
    bool gather_a;
  };
  const Grad grads[] = {
      {"dW2", d, h, dout_g, pa, dw2,
       [&](const Sm90GemmConfig& cfg, bool acc) {
         return moe::kernels::LaunchSm90WeightGradW2(
             prob, cfg, reinterpret_cast<const uint16_t*>(dout),
             reinterpret_cast<const uint16_t*>(pa), d_off, d_ent, dw2, acc, nullptr);
       },
       true},
      {"dW13", 2 * h, d, dh, x_g, dw13,
       [&](const Sm90GemmConfig& cfg, bool acc) {
         return moe::kernels::LaunchSm90WeightGradW13(
             prob, cfg, reinterpret_cast<const uint16_t*>(dh), reinterpret_cast<const uint16_t*>(x),
             d_off, d_ent, dw13, acc, nullptr);
       },
       false},
  };
  for (const Grad& g : grads) {
    const double flop = 2.0 * N * g.m * g.n;
    const int64_t block = static_cast<int64_t>(g.m) * g.n;
    cublas_loop(g.a_slot, g.m, g.b_slot, g.n, g.c);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> want = Sample(g.c, probe, block);
    const double cublas_ms = MedianMs([&] { cublas_loop(g.a_slot, g.m, g.b_slot, g.n, g.c); });
    std::printf(
        "{\"kind\":\"wgrad\",\"preset\":\"%s\",\"grad\":\"%s\",\"impl\":\"cublas_per_expert\","
        "\"N\":%lld,\"M\":%d,\"Ncols\":%d,\"ms\":%.4f,\"tflops\":%.1f,\"gather_ms\":%.4f}\n",
        ps.name, g.name, static_cast<long long>(N), g.m, g.n, cublas_ms, flop / cublas_ms * 1e-9,
        gather_ms);
    // The launchers: block_n 256 with and without the slot-order operand by TMA
    // (tma_weights), block_n 128.
    for (int config_i = 0; config_i < 3; ++config_i) {
      const int block_n = config_i < 2 ? 256 : 128;
      const bool tma = config_i == 1;
      Sm90GemmConfig cfg;
      cfg.block_n = block_n;
      cfg.tma_weights = tma;
      CUDA_OK(cudaMemset(g.c, 0xFF, block * E * 4));  // NaN: unwritten elements show
      CUDA_OK(g.fused(cfg, false));
      CUDA_OK(cudaDeviceSynchronize());
      const double diff = NormalisedDiff(Sample(g.c, probe, block), want);
      const double ms = MedianMs([&] { CUDA_OK(g.fused(cfg, false)); });
      const double acc_ms = MedianMs([&] { CUDA_OK(g.fused(cfg, true)); });
      std::printf(
          "{\"kind\":\"wgrad\",\"preset\":\"%s\",\"grad\":\"%s\",\"impl\":\"fused\","
          "\"block_n\":%d,\"tma\":%d,\"N\":%lld,\"ms\":%.4f,\"tflops\":%.1f,"
          "\"accumulate_ms\":%.4f,"
          "\"vs_cublas\":%.2f,\"diff_vs_cublas\":%.3g,\"check\":\"%s\"}\n",
          ps.name, g.name, block_n, tma ? 1 : 0, static_cast<long long>(N), ms, flop / ms * 1e-9,
          acc_ms, cublas_ms / ms, diff, diff < 1e-3 ? "ok" : "MISMATCH");
      std::fflush(stdout);
    }
    // Other slab heights, launched directly (same checks as above).
    moe::kernels::sm90::WeightGradParams params = moe::kernels::sm90::MakeWeightGradParams(
        reinterpret_cast<const uint16_t*>(g.gather_a ? dout : dh),
        reinterpret_cast<const uint16_t*>(g.gather_a ? pa : x), d_off, d_ent, g.c, E, g.m, g.n, K,
        static_cast<int32_t>(N), /*accumulate=*/false);
    struct Variant {
      const char* name;
      cudaError_t (*launch)(const moe::kernels::sm90::WeightGradParams&, cudaStream_t);
    };
    using moe::kernels::sm90::LaunchWeightGradKernel;
    // 64-row slabs: 32-row slabs of the one-CTA kernel measured slower on every preset, and
    // drain-each-step no better; two CTAs an SM only with drain and 64-row slabs
    // (docs/decisions/0001-sm90-kernel-choice.md). Here: 2cta = two CTAs an SM (96 KB ring
    // each), _tma = the slot-order operand by TMA. The same list is in
    // tests/kernels/cuda/sm90_weight_grad_variants.cu.
    const Variant variants[] = {
        {"2cta_n128_s64_drain", g.gather_a ? LaunchWeightGradKernel<128, 64, true, true, 2>
                                           : LaunchWeightGradKernel<128, 64, false, true, 2>},
        {"2cta_n128_s48_drain", g.gather_a ? LaunchWeightGradKernel<128, 48, true, true, 2>
                                           : LaunchWeightGradKernel<128, 48, false, true, 2>},
        {"2cta_n128_tma", g.gather_a ? LaunchWeightGradKernel<128, 64, true, true, 2, true>
                                     : LaunchWeightGradKernel<128, 64, false, true, 2, true>},
    };
    for (const Variant& v : variants) {
      if (!WantVariant(v.name)) continue;
      params.accumulate = 0;
      CUDA_OK(cudaMemset(g.c, 0xFF, block * E * 4));
      CUDA_OK(v.launch(params, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const double diff = NormalisedDiff(Sample(g.c, probe, block), want);
      const double ms = MedianMs([&] { CUDA_OK(v.launch(params, nullptr)); });
      params.accumulate = 1;
      const double acc_ms = MedianMs([&] { CUDA_OK(v.launch(params, nullptr)); });
      std::printf(
          "{\"kind\":\"wgrad\",\"preset\":\"%s\",\"grad\":\"%s\",\"impl\":\"%s\","
          "\"ms\":%.4f,\"tflops\":%.1f,\"accumulate_ms\":%.4f,\"vs_cublas\":%.2f,"
          "\"diff_vs_cublas\":%.3g,\"check\":\"%s\"}\n",
          ps.name, g.name, v.name, ms, flop / ms * 1e-9, acc_ms, cublas_ms / ms, diff,
          diff < 1e-3 ? "ok" : "MISMATCH");
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!moe::kernels::testing::HaveSm90Gpu(stderr)) return 77;
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 1;
  {  // the two-CTA variant must really get two CTAs an SM
    auto* kernel = moe::kernels::sm90::sm90_weight_grad_kernel<128, 64, true, true, 2>;
    constexpr int kSmem = moe::kernels::sm90::WgradSmemBytes<128, 64, 2>();
    CUDA_OK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    CUDA_OK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared));
    int blocks = 0;
    CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, kernel, moe::kernels::sm90::kWgradThreads, kSmem));
    std::printf("{\"kind\":\"occupancy\",\"impl\":\"2cta_n128_s64_drain\",\"ctas_per_sm\":%d}\n",
                blocks);
  }
  for (std::string_view name : moe::bench::kBackwardPresets) {
    bool want = argc == 1;
    for (int i = 1; i < argc; ++i) want |= name == argv[i];
    if (want) RunPreset(*moe::bench::FindPreset(name), handle);
  }
  cublasDestroy(handle);
  return 0;
}
