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
// the launchers at both block_n, and other instantiations (the drain-each-step ring)
// launched directly.
// Usage: sm90_weight_grad_bench [preset ...] (default: all five).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/dispatch.h"
#include "kernels/cuda/sm90_expert_backward.h"
// Also the kernel header itself, to time instantiations the launchers do not choose.
#include "kernels/cuda/sm90_weight_grad.cuh"

namespace {

using moe::kernels::Sm90ExpertProblem;
using moe::kernels::Sm90GemmConfig;

#define CUDA_OK(call)                                                    \
  do {                                                                   \
    const cudaError_t err_ = (call);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(err_));                            \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

struct Preset {
  const char* name;
  int64_t tokens;
  int d, h, experts, top_k;
};

constexpr Preset kPresets[] = {
    {"sonic-7b", 24576, 1536, 256, 128, 8},    {"olmoe", 16384, 2048, 1024, 64, 8},
    {"qwen3-a3b", 16384, 2048, 768, 128, 8},   {"scale-8k", 8192, 2048, 1024, 64, 4},
    {"deepseek-v3", 8192, 7168, 2048, 256, 8},
};

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

// rows[s] = src[index(s)], index = entries[s] / top_k: what the cuBLAS path needs first.
__global__ void gather_rows_kernel(const uint4* src, const int32_t* entries, int top_k,
                                   int64_t rows, int chunks, uint4* dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = i / chunks;
    dst[i] = src[static_cast<int64_t>(entries[s] / top_k) * chunks + (i - s * chunks)];
  }
}

double MedianMs(const std::function<void()>& fn) {
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < 10; ++i) {
    CUDA_OK(cudaEventRecord(a));
    fn();
    CUDA_OK(cudaEventRecord(b));
    CUDA_OK(cudaEventSynchronize(b));
    float t = 0;
    CUDA_OK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CUDA_OK(cudaEventDestroy(a));
  CUDA_OK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return 0.5 * (ms[4] + ms[5]);
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

void RunPreset(const Preset& ps, cublasHandle_t handle) {
  const int64_t T = ps.tokens, TK = T * ps.top_k;
  const int d = ps.d, h = ps.h, E = ps.experts, K = ps.top_k;
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> pick(0, E - 1);
  std::vector<int32_t> idx(TK);
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      int e;
      bool again;
      do {
        e = pick(rng);
        again = false;
        for (int j = 0; j < k; ++j) again |= idx[t * K + j] == e;
      } while (again);
      idx[t * K + k] = e;
    }
  }
  std::vector<int32_t> counts(E), offsets(E + 1), entries(TK), slot_of(TK);
  moe::kernels::DispatchCpu(idx.data(), T, K, 0, E, counts.data(), offsets.data(), entries.data(),
                            slot_of.data());
  const int64_t N = offsets[E];

  __nv_bfloat16 *dout, *x, *pa, *dh, *dout_g, *x_g;
  float *dw2, *dw13;
  int32_t *d_off, *d_ent;
  CUDA_OK(cudaMalloc(&dout, T * d * 2));
  CUDA_OK(cudaMalloc(&x, T * d * 2));
  CUDA_OK(cudaMalloc(&pa, N * h * 2));
  CUDA_OK(cudaMalloc(&dh, N * 2 * h * 2));
  CUDA_OK(cudaMalloc(&dout_g, N * d * 2));
  CUDA_OK(cudaMalloc(&x_g, N * d * 2));
  CUDA_OK(cudaMalloc(&dw2, static_cast<int64_t>(E) * d * h * 4));
  CUDA_OK(cudaMalloc(&dw13, static_cast<int64_t>(E) * 2 * h * d * 4));
  CUDA_OK(cudaMalloc(&d_off, (E + 1) * 4));
  CUDA_OK(cudaMalloc(&d_ent, TK * 4));
  fill_bf16_kernel<<<1024, 256>>>(dout, T * d, 1);
  fill_bf16_kernel<<<1024, 256>>>(x, T * d, 2);
  fill_bf16_kernel<<<1024, 256>>>(pa, N * h, 3);
  fill_bf16_kernel<<<1024, 256>>>(dh, N * 2 * h, 4);
  CUDA_OK(cudaMemcpy(d_off, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_ent, entries.data(), N * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize());

  Sm90ExpertProblem prob;
  prob.num_tokens = T;
  prob.top_k = K;
  prob.num_experts = E;
  prob.d_model = d;
  prob.d_hidden = h;
  prob.num_routed = N;

  auto gather = [&]() {
    gather_rows_kernel<<<2048, 256>>>(reinterpret_cast<const uint4*>(dout), d_ent, K, N, d / 8,
                                      reinterpret_cast<uint4*>(dout_g));
    gather_rows_kernel<<<2048, 256>>>(reinterpret_cast<const uint4*>(x), d_ent, K, N, d / 8,
                                      reinterpret_cast<uint4*>(x_g));
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
      if (cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, n, m, rows, &one, b + s0 * n, CUDA_R_16BF,
                       n, a + s0 * m, CUDA_R_16BF, m, &zero, c + static_cast<int64_t>(e) * m * n,
                       CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
        std::fprintf(stderr, "cublasGemmEx failed\n");
        std::exit(1);
      }
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
    for (int block_n : {256, 128}) {
      Sm90GemmConfig cfg;
      cfg.block_n = block_n;
      CUDA_OK(cudaMemset(g.c, 0xFF, block * E * 4));  // NaN: unwritten elements show
      CUDA_OK(g.fused(cfg, false));
      CUDA_OK(cudaDeviceSynchronize());
      const double diff = NormalisedDiff(Sample(g.c, probe, block), want);
      const double ms = MedianMs([&] { CUDA_OK(g.fused(cfg, false)); });
      const double acc_ms = MedianMs([&] { CUDA_OK(g.fused(cfg, true)); });
      std::printf(
          "{\"kind\":\"wgrad\",\"preset\":\"%s\",\"grad\":\"%s\",\"impl\":\"fused\","
          "\"block_n\":%d,\"N\":%lld,\"ms\":%.4f,\"tflops\":%.1f,\"accumulate_ms\":%.4f,"
          "\"vs_cublas\":%.2f,\"diff_vs_cublas\":%.3g,\"check\":\"%s\"}\n",
          ps.name, g.name, block_n, static_cast<long long>(N), ms, flop / ms * 1e-9, acc_ms,
          cublas_ms / ms, diff, diff < 1e-3 ? "ok" : "MISMATCH");
      std::fflush(stdout);
    }
    // Other slab heights, launched directly (same checks as above).
    moe::kernels::sm90::WeightGradParams params = {};
    params.a = g.gather_a ? dout : dh;
    params.b = g.gather_a ? pa : x;
    params.offsets = d_off;
    params.entries = d_ent;
    params.c = g.c;
    params.num_experts = E;
    params.m_dim = g.m;
    params.n_dim = g.n;
    params.top_k = moe::kernels::sm90::MakeFastDivisor(K);
    struct Variant {
      const char* name;
      cudaError_t (*launch)(const moe::kernels::sm90::WeightGradParams&, cudaStream_t);
    };
    using moe::kernels::sm90::LaunchWeightGradKernel;
    const Variant variants[] = {
        // 32-row slabs (n256, n128, with and without drain) measured 15-30% slower than
        // 64 on every preset (bench/results/2026-11-21-h100-weight-grad-run2).
        {"n256_slab64_drain", g.gather_a ? LaunchWeightGradKernel<256, 64, true, true>
                                         : LaunchWeightGradKernel<256, 64, false, true>},
    };
    for (const Variant& v : variants) {
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
  for (void* p : {static_cast<void*>(dout), static_cast<void*>(x), static_cast<void*>(pa),
                  static_cast<void*>(dh), static_cast<void*>(dout_g), static_cast<void*>(x_g),
                  static_cast<void*>(dw2), static_cast<void*>(dw13), static_cast<void*>(d_off),
                  static_cast<void*>(d_ent)}) {
    CUDA_OK(cudaFree(p));
  }
}

}  // namespace

int main(int argc, char** argv) {
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 1;
  for (const Preset& ps : kPresets) {
    bool want = argc == 1;
    for (int i = 1; i < argc; ++i) want |= std::strcmp(argv[i], ps.name) == 0;
    if (want) RunPreset(ps, handle);
  }
  cublasDestroy(handle);
  return 0;
}
