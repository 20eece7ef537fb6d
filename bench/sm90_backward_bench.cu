// Benchmark of the fused Hopper backward's data gradients (LaunchSm90BackwardDA/DX in
// kernels/cuda/sm90_expert_backward.h) on the issue's presets, against the path they replace:
// one cublasGemmEx per expert, over operands already in slot order (for dA that means dout
// pre-gathered; the gather's own time is printed beside it, since the fused kernel does it
// while loading), both on one stream and the way engine/cuda/grouped_gemm.cc issues them by
// default (experts dealt round-robin to the layer's stream and 3 side streams, forked from and
// joined back to it with events).
//
// Each preset also cross-checks the fused results against cuBLAS's at full size (normalised
// error, fp64 sums on the device), which catches layout errors that only show past the test's
// sizes. Routing is K distinct uniform experts per token; inputs come from a counter hash on
// the device (deepseek-v3's 22 GB of weights would take minutes from the host). Times are the
// median of 20 CUDA-event-timed runs after 3 warm-ups. One JSON object a line on stdout.
//
// With --dh as the first argument it times instead the dA GEMM with the SwiGLU backward in its
// epilogue (LaunchSm90BackwardDH) against the two launches it replaces, LaunchSm90BackwardDA
// and then LaunchActivationBackward (kernels/cuda/expert_backward.cu), with each part's time,
// and checks the two paths' dH, pA and dp against each other at full size (they differ only in
// that the unfused pass reads dA_u rounded to bf16).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string_view>
#include <vector>

#include "kernels/cpu/dispatch.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/expert_backward.h"
#include "kernels/cuda/sm90_expert_backward.h"
#include "kernels/cuda/sm90_expert_forward.h"
#include "kernels/cuda/types.h"

namespace {

using moe::kernels::Sm90ExpertProblem;
using moe::kernels::Sm90GemmConfig;
using moe::kernels::Sm90Projection;

void Die(const char* file, int line, const char* what, const char* why) {
  std::fprintf(stderr, "%s:%d: %s: %s\n", file, line, what, why);
  std::exit(1);
}
#define BENCH_CUDA(call)                                                           \
  do {                                                                             \
    const cudaError_t e_ = (call);                                                 \
    if (e_ != cudaSuccess) Die(__FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
  } while (0)
#define BENCH_CUBLAS(call)                                                               \
  do {                                                                                   \
    if ((call) != CUBLAS_STATUS_SUCCESS) Die(__FILE__, __LINE__, #call, "cuBLAS error"); \
  } while (0)

struct Preset {
  const char* name;
  int64_t tokens;
  int d, h, experts, top_k;
};
const Preset kPresets[] = {
    {"sonic-7b", 24576, 1536, 256, 128, 8},    {"olmoe", 16384, 2048, 1024, 64, 8},
    {"qwen3-a3b", 16384, 2048, 768, 128, 8},   {"scale-8k", 8192, 2048, 1024, 64, 4},
    {"deepseek-v3", 8192, 7168, 2048, 256, 8},
};

__device__ __forceinline__ void StoreValue(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void StoreValue(float* p, float v) { *p = v; }
__device__ __forceinline__ double LoadValue(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ double LoadValue(const float* p) { return *p; }

// Uniform values of variance scale^2 plus `bias` from a 64-bit index hash (murmur-style
// finaliser).
template <typename T>
__global__ void bench_fill_kernel(T* out, int64_t n, uint32_t seed, float scale, float bias) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    uint32_t x =
        static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u;
    x ^= seed * 0xC2B2AE3Du;
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    const float u = static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f;
    StoreValue(out + i, u * 3.4641016f * scale + bias);
  }
}

// out[s] = src[entries[s] / top_k], 16 bytes a thread: what the cuBLAS path must do first.
__global__ void bench_gather_kernel(const uint4* src, const int32_t* entries, uint4* out,
                                    int64_t rows, int top_k, int chunks) {
  const int64_t total = rows * chunks;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += step) {
    const int64_t s = i / chunks;
    const int c = static_cast<int>(i - s * chunks);
    out[i] = src[static_cast<int64_t>(entries[s] / top_k) * chunks + c];
  }
}

// sums[0] += sum (a - b)^2, sums[1] += sum b^2.
template <typename T>
__global__ void bench_diff_kernel(const T* a, const T* b, int64_t n, double* sums) {
  double num = 0, den = 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += step) {
    const double x = LoadValue(a + i), y = LoadValue(b + i);
    num += (x - y) * (x - y);
    den += y * y;
  }
  for (int o = 16; o > 0; o >>= 1) {
    num += __shfl_down_sync(0xffffffffu, num, o);
    den += __shfl_down_sync(0xffffffffu, den, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&sums[0], num);
    atomicAdd(&sums[1], den);
  }
}

// bf16 (T = __nv_bfloat16, the default) or fp32 buffers.
template <typename T = __nv_bfloat16>
void Fill(void* p, int64_t n, uint32_t seed, float scale, float bias = 0.0f) {
  bench_fill_kernel<T><<<2048, 256>>>(static_cast<T*>(p), n, seed, scale, bias);
  BENCH_CUDA(cudaGetLastError());
}

template <typename T = __nv_bfloat16>
double RelError(const void* got, const void* ref, int64_t n, double* scratch) {
  BENCH_CUDA(cudaMemset(scratch, 0, 2 * sizeof(double)));
  bench_diff_kernel<T>
      <<<1024, 256>>>(static_cast<const T*>(got), static_cast<const T*>(ref), n, scratch);
  double h[2];
  BENCH_CUDA(cudaMemcpy(h, scratch, sizeof(h), cudaMemcpyDeviceToHost));
  return h[1] > 0 ? std::sqrt(h[0] / h[1]) : INFINITY;
}

template <typename F>
float MedianMs(F&& fn) {
  for (int i = 0; i < 3; ++i) fn();
  BENCH_CUDA(cudaDeviceSynchronize());
  constexpr int kReps = 20;
  cudaEvent_t ev[kReps + 1];
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  // Back-to-back runs with an event between each: no host sync inside the timed span, the way
  // the engine issues them.
  BENCH_CUDA(cudaEventRecord(ev[0]));
  for (int i = 0; i < kReps; ++i) {
    fn();
    BENCH_CUDA(cudaEventRecord(ev[i + 1]));
  }
  BENCH_CUDA(cudaEventSynchronize(ev[kReps]));
  std::vector<float> ms(kReps);
  for (int i = 0; i < kReps; ++i) BENCH_CUDA(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
  for (auto& e : ev) BENCH_CUDA(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms[kReps / 2];
}

// Four cuBLAS handles on four streams; lane 0 is the legacy default stream the timing events
// are recorded on.
struct Lanes {
  static constexpr int kLanes = 4;
  cublasHandle_t blas[kLanes];
  cudaStream_t stream[kLanes];
  cudaEvent_t fork, join[kLanes];
};

// Runs gemm(handle, e) for every expert e with rows, spread over the lanes like the engine.
template <typename G>
void RunOnLanes(Lanes& lanes, int experts, const std::vector<int32_t>& offsets, G&& gemm) {
  BENCH_CUDA(cudaEventRecord(lanes.fork, lanes.stream[0]));
  for (int i = 1; i < Lanes::kLanes; ++i) {
    BENCH_CUDA(cudaStreamWaitEvent(lanes.stream[i], lanes.fork, 0));
  }
  int j = 0;
  for (int e = 0; e < experts; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    gemm(lanes.blas[j++ % Lanes::kLanes], e);
  }
  for (int i = 1; i < Lanes::kLanes; ++i) {
    BENCH_CUDA(cudaEventRecord(lanes.join[i], lanes.stream[i]));
    BENCH_CUDA(cudaStreamWaitEvent(lanes.stream[0], lanes.join[i], 0));
  }
}

// K distinct uniform experts per token, through the CPU dispatch: offsets [E+1], entries [N].
void Route(const Preset& ps, std::vector<int32_t>* offsets, std::vector<int32_t>* entries) {
  const int64_t T = ps.tokens, TK = ps.tokens * ps.top_k;
  const int E = ps.experts, K = ps.top_k;
  std::mt19937_64 rng(1234);
  std::vector<int32_t> idx(TK);
  std::uniform_int_distribution<int32_t> pick(0, E - 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      bool dup;
      do {
        idx[t * K + k] = pick(rng);
        dup = false;
        for (int j = 0; j < k; ++j) dup |= idx[t * K + j] == idx[t * K + k];
      } while (dup);
    }
  }
  std::vector<int32_t> counts(E), slot_of(TK);
  offsets->resize(E + 1);
  entries->resize(TK);
  moe::kernels::DispatchCpu(idx.data(), T, K, 0, E, counts.data(), offsets->data(), entries->data(),
                            slot_of.data());
}

void RunPreset(const Preset& ps, Lanes& lanes, double* scratch, bool* all_close) {
  cublasHandle_t blas = lanes.blas[0];
  const int64_t T = ps.tokens, TK = ps.tokens * ps.top_k;
  const int d = ps.d, h = ps.h, E = ps.experts, K = ps.top_k;
  std::vector<int32_t> offsets, entries;
  Route(ps, &offsets, &entries);
  const int64_t N = offsets[E];

  const size_t w_elems = static_cast<size_t>(E) * d * h;
  uint16_t *dout, *w2, *dh, *w13, *da, *dx, *dout_g, *da_ref, *dx_ref;
  int32_t *doff, *dent;
  BENCH_CUDA(cudaMalloc(&dout, 2 * T * d));
  BENCH_CUDA(cudaMalloc(&w2, 2 * w_elems));
  BENCH_CUDA(cudaMalloc(&dh, 2 * N * 2 * h));
  BENCH_CUDA(cudaMalloc(&w13, 2 * 2 * w_elems));
  BENCH_CUDA(cudaMalloc(&da, 2 * N * h));
  BENCH_CUDA(cudaMalloc(&dx, 2 * N * d));
  BENCH_CUDA(cudaMalloc(&dout_g, 2 * N * d));
  BENCH_CUDA(cudaMalloc(&da_ref, 2 * N * h));
  BENCH_CUDA(cudaMalloc(&dx_ref, 2 * N * d));
  BENCH_CUDA(cudaMalloc(&doff, 4 * (E + 1)));
  BENCH_CUDA(cudaMalloc(&dent, 4 * TK));
  Fill(dout, T * d, 1, 1.0f);
  Fill(w2, w_elems, 2, 1.0f / std::sqrt(static_cast<float>(d)));
  Fill(dh, N * 2 * h, 3, 1.0f);
  Fill(w13, 2 * w_elems, 4, 1.0f / std::sqrt(2.0f * h));
  BENCH_CUDA(cudaMemcpy(doff, offsets.data(), 4 * (E + 1), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(dent, entries.data(), 4 * TK, cudaMemcpyHostToDevice));

  Sm90ExpertProblem prob;
  prob.num_tokens = T;
  prob.top_k = K;
  prob.num_experts = E;
  prob.d_model = d;
  prob.d_hidden = h;
  prob.num_routed = N;
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Sm90GemmConfig da_cfg =
      moe::kernels::Sm90ChooseConfig(prob, Sm90Projection::kBackwardDA, sms);
  const Sm90GemmConfig dx_cfg =
      moe::kernels::Sm90ChooseConfig(prob, Sm90Projection::kBackwardDX, sms);

  // The cuBLAS path, column-major view of the row-major tensors: dA_e^T [h, n_e] =
  // W2_e^T [h, d] (the stored [d, h] read as column-major) x dout_g_e^T [d, n_e]; likewise
  // dX_e^T [d, n_e] = W13_e^T [d, 2h] x dH_e^T [2h, n_e].
  auto gather = [&] {
    bench_gather_kernel<<<2048, 256>>>(reinterpret_cast<const uint4*>(dout), dent,
                                       reinterpret_cast<uint4*>(dout_g), N, K, d / 8);
  };
  const float one = 1.0f, zero = 0.0f;
  auto gemm_da = [&](cublasHandle_t handle, int e) {
    const int rows = offsets[e + 1] - offsets[e];
    BENCH_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, h, rows, d, &one,
                              w2 + static_cast<size_t>(e) * d * h, CUDA_R_16BF, h,
                              dout_g + static_cast<size_t>(offsets[e]) * d, CUDA_R_16BF, d, &zero,
                              da_ref + static_cast<size_t>(offsets[e]) * h, CUDA_R_16BF, h,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  auto gemm_dx = [&](cublasHandle_t handle, int e) {
    const int rows = offsets[e + 1] - offsets[e];
    BENCH_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, d, rows, 2 * h, &one,
                              w13 + static_cast<size_t>(e) * 2 * h * d, CUDA_R_16BF, d,
                              dh + static_cast<size_t>(offsets[e]) * 2 * h, CUDA_R_16BF, 2 * h,
                              &zero, dx_ref + static_cast<size_t>(offsets[e]) * d, CUDA_R_16BF, d,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  auto blas_da = [&] {
    for (int e = 0; e < E; ++e) {
      if (offsets[e + 1] > offsets[e]) gemm_da(blas, e);
    }
  };
  auto blas_dx = [&] {
    for (int e = 0; e < E; ++e) {
      if (offsets[e + 1] > offsets[e]) gemm_dx(blas, e);
    }
  };
  auto fused_da = [&](const Sm90GemmConfig& c) {
    BENCH_CUDA(moe::kernels::LaunchSm90BackwardDA(prob, c, dout, w2, doff, dent, da, nullptr));
  };
  auto fused_dx = [&](const Sm90GemmConfig& c) {
    BENCH_CUDA(moe::kernels::LaunchSm90BackwardDX(prob, c, dh, w13, doff, dx, nullptr));
  };

  gather();
  blas_da();
  blas_dx();
  fused_da(da_cfg);
  fused_dx(dx_cfg);
  BENCH_CUDA(cudaDeviceSynchronize());
  const double err_da = RelError(da, da_ref, N * h, scratch);
  const double err_dx = RelError(dx, dx_ref, N * d, scratch);
  // The comparison must be able to fail: against the reference moved by one row it must not
  // pass (fused and cuBLAS results can be bit-identical: both sum k in the same order).
  const double err_shifted = RelError(da, da_ref + h, (N - 1) * h, scratch);
  const bool close = err_da < 1e-2 && err_dx < 1e-2 && err_shifted > 0.5;
  *all_close &= close;

  const float gather_ms = MedianMs(gather);
  const float blas_da_ms = MedianMs(blas_da);
  const float blas_dx_ms = MedianMs(blas_dx);
  const float lanes_da_ms = MedianMs([&] { RunOnLanes(lanes, E, offsets, gemm_da); });
  const float lanes_dx_ms = MedianMs([&] { RunOnLanes(lanes, E, offsets, gemm_dx); });
  const float da_ms = MedianMs([&] { fused_da(da_cfg); });
  const float dx_ms = MedianMs([&] { fused_dx(dx_cfg); });
  // The other tile width, so a run shows what the heuristic leaves behind.
  Sm90GemmConfig da_alt = da_cfg, dx_alt = dx_cfg;
  da_alt.block_n = da_cfg.block_n == 256 ? 128 : 256;
  dx_alt.block_n = dx_cfg.block_n == 256 ? 128 : 256;
  const float da_alt_ms = MedianMs([&] { fused_da(da_alt); });
  const float dx_alt_ms = MedianMs([&] { fused_dx(dx_alt); });
  // And the warp-specialised kernel at the heuristic's tile width.
  Sm90GemmConfig da_ws = da_cfg, dx_ws = dx_cfg;
  da_ws.warp_specialized = dx_ws.warp_specialized = true;
  const float da_ws_ms = MedianMs([&] { fused_da(da_ws); });
  const float dx_ws_ms = MedianMs([&] { fused_dx(dx_ws); });
  BENCH_CUDA(cudaDeviceSynchronize());
  const double err_ws = std::max(RelError(da, da_ref, N * h, scratch),  // ws wrote both last
                                 RelError(dx, dx_ref, N * d, scratch));
  const bool ws_close = err_ws < 1e-2;
  *all_close &= ws_close;
  const double flop = 2.0 * N * d * h;  // dA; dX's reduction is 2h, twice the work
  const double flop_dx = 2.0 * flop;
  std::printf(
      "{\"preset\":\"%s\",\"T\":%lld,\"d\":%d,\"h\":%d,\"E\":%d,\"K\":%d,\"N\":%lld,"
      "\"check\":\"%s\",\"err_da_vs_cublas\":%.2e,\"err_dx_vs_cublas\":%.2e,"
      "\"err_da_vs_shifted_rows\":%.2f,"
      "\"da_block_n\":%d,\"da_group_m\":%d,\"da_ms\":%.4f,\"da_tflops\":%.1f,"
      "\"da_alt_block_n\":%d,\"da_alt_ms\":%.4f,\"cublas_da_ms\":%.4f,"
      "\"cublas4_da_ms\":%.4f,\"gather_ms\":%.4f,\"ws_check\":\"%s\",\"da_ws_ms\":%.4f,"
      "\"dx_ws_ms\":%.4f,"
      "\"dx_block_n\":%d,\"dx_group_m\":%d,\"dx_ms\":%.4f,\"dx_tflops\":%.1f,"
      "\"dx_alt_block_n\":%d,\"dx_alt_ms\":%.4f,\"cublas_dx_ms\":%.4f,\"cublas4_dx_ms\":%.4f,"
      "\"speedup_da\":%.2f,\"speedup_da_incl_gather\":%.2f,\"speedup_dx\":%.2f,"
      "\"speedup_da_vs_best_cublas\":%.2f,\"speedup_dx_vs_best_cublas\":%.2f}\n",
      ps.name, static_cast<long long>(T), d, h, E, K, static_cast<long long>(N),
      close ? "PASS" : "FAIL", err_da, err_dx, err_shifted, da_cfg.block_n, da_cfg.group_m, da_ms,
      flop / da_ms / 1e9, da_alt.block_n, da_alt_ms, blas_da_ms, lanes_da_ms, gather_ms,
      ws_close ? "PASS" : "FAIL", da_ws_ms, dx_ws_ms, dx_cfg.block_n, dx_cfg.group_m, dx_ms,
      flop_dx / dx_ms / 1e9, dx_alt.block_n, dx_alt_ms, blas_dx_ms, lanes_dx_ms, blas_da_ms / da_ms,
      (blas_da_ms + gather_ms) / da_ms, blas_dx_ms / dx_ms,
      std::min(blas_da_ms, lanes_da_ms) / da_ms, std::min(blas_dx_ms, lanes_dx_ms) / dx_ms);
  std::fflush(stdout);
  for (void* p : {static_cast<void*>(dout), static_cast<void*>(w2), static_cast<void*>(dh),
                  static_cast<void*>(w13), static_cast<void*>(da), static_cast<void*>(dx),
                  static_cast<void*>(dout_g), static_cast<void*>(da_ref),
                  static_cast<void*>(dx_ref), static_cast<void*>(doff), static_cast<void*>(dent)}) {
    BENCH_CUDA(cudaFree(p));
  }
}

// LaunchSm90BackwardDH vs LaunchSm90BackwardDA + LaunchActivationBackward on one preset.
void RunDHPreset(const Preset& ps, double* scratch, bool* all_close) {
  const int64_t T = ps.tokens, TK = ps.tokens * ps.top_k;
  const int d = ps.d, h = ps.h, E = ps.experts, K = ps.top_k;
  std::vector<int32_t> offsets, entries;
  Route(ps, &offsets, &entries);
  const int64_t N = offsets[E];
  const size_t w_elems = static_cast<size_t>(E) * d * h;

  Sm90ExpertProblem prob;
  prob.num_tokens = T;
  prob.top_k = K;
  prob.num_experts = E;
  prob.d_model = d;
  prob.d_hidden = h;
  prob.num_routed = N;
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Sm90GemmConfig cfg = moe::kernels::Sm90ChooseConfig(prob, Sm90Projection::kBackwardDA, sms);
  Sm90GemmConfig alt = cfg;
  alt.block_n = cfg.block_n == 256 ? 128 : 256;
  const size_t ws_bytes = std::max(moe::kernels::Sm90BackwardDHWorkspaceBytes(prob, cfg),
                                   moe::kernels::Sm90BackwardDHWorkspaceBytes(prob, alt));

  uint16_t *dout, *w2, *saved_h, *da, *dh_u, *pa_u, *dh_f, *pa_f;
  float *weights, *dp_u, *dp_f;
  int32_t *doff, *dent;
  void* ws = nullptr;
  BENCH_CUDA(cudaMalloc(&dout, 2 * T * d));
  BENCH_CUDA(cudaMalloc(&w2, 2 * w_elems));
  BENCH_CUDA(cudaMalloc(&saved_h, 2 * N * 2 * h));
  BENCH_CUDA(cudaMalloc(&da, 2 * N * h));
  BENCH_CUDA(cudaMalloc(&dh_u, 2 * N * 2 * h));
  BENCH_CUDA(cudaMalloc(&dh_f, 2 * N * 2 * h));
  BENCH_CUDA(cudaMalloc(&pa_u, 2 * N * h));
  BENCH_CUDA(cudaMalloc(&pa_f, 2 * N * h));
  BENCH_CUDA(cudaMalloc(&weights, 4 * TK));
  BENCH_CUDA(cudaMalloc(&dp_u, 4 * TK));
  BENCH_CUDA(cudaMalloc(&dp_f, 4 * TK));
  BENCH_CUDA(cudaMalloc(&doff, 4 * (E + 1)));
  BENCH_CUDA(cudaMalloc(&dent, 4 * TK));
  if (ws_bytes > 0) BENCH_CUDA(cudaMalloc(&ws, ws_bytes));
  Fill(dout, T * d, 1, 1.0f);
  Fill(w2, w_elems, 2, 1.0f / std::sqrt(static_cast<float>(d)));
  Fill(saved_h, N * 2 * h, 5, 1.5f);
  Fill<float>(weights, TK, 6, 0.25f, 0.5f);  // positive, in [0.07, 0.93]
  BENCH_CUDA(cudaMemset(dp_u, 0, 4 * TK));
  BENCH_CUDA(cudaMemset(dp_f, 0, 4 * TK));
  BENCH_CUDA(cudaMemcpy(doff, offsets.data(), 4 * (E + 1), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(dent, entries.data(), 4 * TK, cudaMemcpyHostToDevice));

  auto da_only = [&] {
    BENCH_CUDA(moe::kernels::LaunchSm90BackwardDA(prob, cfg, dout, w2, doff, dent, da, nullptr));
  };
  auto act_only = [&] {
    BENCH_CUDA(moe::kernels::LaunchActivationBackward(
        saved_h, da, dent, weights, moe::kernels::ElemType::kBFloat16,
        moe::kernels::detail::kActSwiGLU, N, h, dh_u, pa_u, dp_u, nullptr));
  };
  auto fused = [&](const Sm90GemmConfig& c) {
    BENCH_CUDA(moe::kernels::LaunchSm90BackwardDH(prob, c, dout, w2, saved_h, weights, doff, dent,
                                                  dh_f, pa_f, dp_f, ws, ws_bytes, nullptr));
  };
  da_only();
  act_only();
  fused(cfg);
  BENCH_CUDA(cudaDeviceSynchronize());
  const double err_dh = RelError(dh_f, dh_u, N * 2 * h, scratch);
  const double err_pa = RelError(pa_f, pa_u, N * h, scratch);
  const double err_dp = RelError<float>(dp_f, dp_u, TK, scratch);
  // Must be able to fail: dH against the unfused one moved by a row.
  const double err_shifted = RelError(dh_f, dh_u + 2 * h, (N - 1) * 2 * h, scratch);
  fused(alt);
  BENCH_CUDA(cudaDeviceSynchronize());
  const double err_alt =
      std::max(RelError(dh_f, dh_u, N * 2 * h, scratch), RelError<float>(dp_f, dp_u, TK, scratch));
  const bool close =
      err_dh < 1e-2 && err_pa < 1e-2 && err_dp < 1e-2 && err_alt < 1e-2 && err_shifted > 0.5;
  *all_close &= close;

  const float da_ms = MedianMs(da_only);
  const float act_ms = MedianMs(act_only);
  const float unfused_ms = MedianMs([&] {
    da_only();
    act_only();
  });
  const float dh_ms = MedianMs([&] { fused(cfg); });
  const float dh_alt_ms = MedianMs([&] { fused(alt); });
  Sm90GemmConfig ws_cfg = cfg;
  ws_cfg.warp_specialized = true;
  const float dh_ws_ms = MedianMs([&] { fused(ws_cfg); });
  BENCH_CUDA(cudaDeviceSynchronize());
  const double err_ws = std::max(RelError(dh_f, dh_u, N * 2 * h, scratch),  // ws wrote last
                                 RelError<float>(dp_f, dp_u, TK, scratch));
  const bool ws_close = err_ws < 1e-2;
  *all_close &= ws_close;
  std::printf(
      "{\"preset\":\"%s\",\"mode\":\"dh\",\"T\":%lld,\"d\":%d,\"h\":%d,\"E\":%d,\"K\":%d,"
      "\"N\":%lld,\"check\":\"%s\",\"err_dh_vs_unfused\":%.2e,\"err_pa_vs_unfused\":%.2e,"
      "\"err_dp_vs_unfused\":%.2e,\"err_alt_vs_unfused\":%.2e,\"err_dh_vs_shifted_rows\":%.2f,"
      "\"block_n\":%d,\"group_m\":%d,\"column_tiles\":%lld,\"dh_ms\":%.4f,"
      "\"alt_block_n\":%d,\"dh_alt_ms\":%.4f,\"ws_check\":\"%s\",\"dh_ws_ms\":%.4f,"
      "\"da_ms\":%.4f,\"act_bwd_ms\":%.4f,"
      "\"da_plus_act_ms\":%.4f,\"speedup\":%.2f,\"dh_tflops\":%.1f}\n",
      ps.name, static_cast<long long>(T), d, h, E, K, static_cast<long long>(N),
      close ? "PASS" : "FAIL", err_dh, err_pa, err_dp, err_alt, err_shifted, cfg.block_n,
      cfg.group_m, static_cast<long long>((h + cfg.block_n - 1) / cfg.block_n), dh_ms, alt.block_n,
      dh_alt_ms, ws_close ? "PASS" : "FAIL", dh_ws_ms, da_ms, act_ms, unfused_ms,
      unfused_ms / dh_ms, 2.0 * N * d * h / dh_ms / 1e9);
  std::fflush(stdout);
  for (void* p : {static_cast<void*>(dout), static_cast<void*>(w2), static_cast<void*>(saved_h),
                  static_cast<void*>(da), static_cast<void*>(dh_u), static_cast<void*>(dh_f),
                  static_cast<void*>(pa_u), static_cast<void*>(pa_f), static_cast<void*>(weights),
                  static_cast<void*>(dp_u), static_cast<void*>(dp_f), static_cast<void*>(doff),
                  static_cast<void*>(dent), ws}) {
    BENCH_CUDA(cudaFree(p));
  }
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 ||
      !moe::kernels::Sm90DeviceSupported(0)) {
    std::printf("SKIP: no sm_90 GPU\n");
    return 77;
  }
  Lanes lanes;
  BENCH_CUDA(cudaEventCreateWithFlags(&lanes.fork, cudaEventDisableTiming));
  for (int i = 0; i < Lanes::kLanes; ++i) {
    lanes.stream[i] = nullptr;
    if (i > 0) BENCH_CUDA(cudaStreamCreateWithFlags(&lanes.stream[i], cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreateWithFlags(&lanes.join[i], cudaEventDisableTiming));
    BENCH_CUBLAS(cublasCreate(&lanes.blas[i]));
    BENCH_CUBLAS(cublasSetStream(lanes.blas[i], lanes.stream[i]));
  }
  double* scratch;
  BENCH_CUDA(cudaMalloc(&scratch, 2 * sizeof(double)));
  bool all_close = true;
  // [--dh] [preset]
  const bool dh_mode = argc > 1 && std::string_view(argv[1]) == "--dh";
  const int name_arg = dh_mode ? 2 : 1;
  for (const Preset& ps : kPresets) {
    if (argc > name_arg && std::string_view(argv[name_arg]) != ps.name) continue;
    if (dh_mode) {
      RunDHPreset(ps, scratch, &all_close);
    } else {
      RunPreset(ps, lanes, scratch, &all_close);
    }
  }
  BENCH_CUDA(cudaFree(scratch));
  for (int i = 0; i < Lanes::kLanes; ++i) cublasDestroy(lanes.blas[i]);
  return all_close ? 0 : 1;
}
