// Benchmark of the fused Hopper backward's data gradients (LaunchSm90BackwardDA/DX in
// kernels/cuda/sm90_expert_backward.h) on the benchmark presets, against the path they replace:
// one cublasGemmEx per expert, over operands already in slot order (for dA that means dout
// pre-gathered; the gather's own time is printed beside it, since the fused kernel does it
// while loading), both on one stream and the way engine/cuda/grouped_gemm.cc issues them by
// default (experts dealt round-robin to the layer's stream and 3 side streams, forked from and
// joined back to it with events).
//
// Each preset also cross-checks the fused results against cuBLAS's at full size (normalised
// error, fp64 sums on the device), which catches layout errors that only show past the test's
// sizes. Routing is K distinct uniform experts per token; inputs come from a counter hash on
// the device (deepseek-v3's 22 GB of weights would take minutes from the host), not from the
// tests' host-side normal draws. Times are the median of 20 CUDA-event-timed runs issued back to
// back after 3 warm-ups (MedianBackToBackMs: no host wait between runs, as the engine issues
// them). One JSON object a line on stdout.
//
// It also times the warp-specialised and ping-pong kernels (64x256 and 128x128 consumer tiles,
// with and without the weight multicast over CTA pairs), each cross-checked as above, beside
// the config the engine chooses (engine/cuda/kernel_selection.h).
//
// The presets, routing, problem, device buffers, gather, CUDA/cuBLAS checks and timing are
// the other benches' (bench/sm90_bench_util.h); what stays here is the benchmark's own input
// hash, the device-side error it checks by, and the engine's four cuBLAS lanes.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string_view>
#include <vector>

#include "bench/sm90_bench_util.h"
#include "engine/cuda/kernel_selection.h"
#include "kernels/cuda/sm90_expert_backward.h"
#include "kernels/cuda/sm90_expert_forward.h"

namespace {

using moe::bench::DeviceBuffer;
using moe::bench::MedianBackToBackMs;
using moe::bench::Preset;
using moe::bench::Routing;
using moe::kernels::Sm90ExpertProblem;
using moe::kernels::Sm90GemmConfig;
using moe::cuda::Sm90Projection;

__device__ __forceinline__ void StoreValue(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}
__device__ __forceinline__ double LoadValue(const __nv_bfloat16* p) { return __bfloat162float(*p); }

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

// bf16 buffers, filled on the device by the hash above (deepseek-v3's weights would take
// minutes from the host).
template <typename T = __nv_bfloat16>
void Fill(void* p, int64_t n, uint32_t seed, float scale, float bias = 0.0f) {
  bench_fill_kernel<T><<<2048, 256>>>(static_cast<T*>(p), n, seed, scale, bias);
  SM90_BENCH_CUDA(cudaGetLastError());
}

// ||got - ref|| / ||ref|| with fp64 sums on the device: the tests' host-side NormalisedError
// would copy each full-size result (gigabytes for deepseek-v3) back first.
template <typename T = __nv_bfloat16>
double RelError(const void* got, const void* ref, int64_t n, double* scratch) {
  SM90_BENCH_CUDA(cudaMemset(scratch, 0, 2 * sizeof(double)));
  bench_diff_kernel<T>
      <<<1024, 256>>>(static_cast<const T*>(got), static_cast<const T*>(ref), n, scratch);
  double h[2];
  SM90_BENCH_CUDA(cudaMemcpy(h, scratch, sizeof(h), cudaMemcpyDeviceToHost));
  return h[1] > 0 ? std::sqrt(h[0] / h[1]) : INFINITY;
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
  SM90_BENCH_CUDA(cudaEventRecord(lanes.fork, lanes.stream[0]));
  for (int i = 1; i < Lanes::kLanes; ++i) {
    SM90_BENCH_CUDA(cudaStreamWaitEvent(lanes.stream[i], lanes.fork, 0));
  }
  int j = 0;
  for (int e = 0; e < experts; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    gemm(lanes.blas[j++ % Lanes::kLanes], e);
  }
  for (int i = 1; i < Lanes::kLanes; ++i) {
    SM90_BENCH_CUDA(cudaEventRecord(lanes.join[i], lanes.stream[i]));
    SM90_BENCH_CUDA(cudaStreamWaitEvent(lanes.stream[0], lanes.join[i], 0));
  }
}

void RunPreset(const Preset& ps, Lanes& lanes, double* scratch, bool* all_close) {
  cublasHandle_t blas = lanes.blas[0];
  const int64_t T = ps.tokens, TK = ps.tokens * ps.top_k;
  const int d = ps.d, h = ps.h, E = ps.experts, K = ps.top_k;
  std::mt19937_64 rng(1234);
  const Routing routing = moe::bench::UniformRouting(ps, rng);
  const std::vector<int32_t>& offsets = routing.offsets;
  const int64_t N = routing.routed;

  const size_t w_elems = static_cast<size_t>(E) * d * h;
  DeviceBuffer<uint16_t> dout(T * d), w2(w_elems), dh(N * 2 * h), w13(2 * w_elems), da(N * h),
      dx(N * d), dout_g(N * d), da_ref(N * h), dx_ref(N * d);
  DeviceBuffer<int32_t> doff(E + 1), dent(TK);
  Fill(dout.ptr, T * d, 1, 1.0f);
  Fill(w2.ptr, w_elems, 2, 1.0f / std::sqrt(static_cast<float>(d)));
  Fill(dh.ptr, N * 2 * h, 3, 1.0f);
  Fill(w13.ptr, 2 * w_elems, 4, 1.0f / std::sqrt(2.0f * h));
  SM90_BENCH_CUDA(cudaMemcpy(doff.ptr, offsets.data(), 4 * (E + 1), cudaMemcpyHostToDevice));
  SM90_BENCH_CUDA(cudaMemcpy(dent.ptr, routing.entries.data(), 4 * TK, cudaMemcpyHostToDevice));

  const Sm90ExpertProblem prob = moe::kernels::testing::MakeProblem(T, K, E, d, h, N);
  int sms = 0;
  SM90_BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Sm90GemmConfig da_cfg =
      moe::cuda::Sm90ChooseConfig(prob, Sm90Projection::kBackwardDA, sms);
  const Sm90GemmConfig dx_cfg =
      moe::cuda::Sm90ChooseConfig(prob, Sm90Projection::kBackwardDX, sms);

  // The cuBLAS path, column-major view of the row-major tensors: dA_e^T [h, n_e] =
  // W2_e^T [h, d] (the stored [d, h] read as column-major) x dout_g_e^T [d, n_e]; likewise
  // dX_e^T [d, n_e] = W13_e^T [d, 2h] x dH_e^T [2h, n_e].
  auto gather = [&] { moe::bench::GatherRowsByToken(dout.ptr, dent.ptr, K, N, d, dout_g.ptr); };
  const float one = 1.0f, zero = 0.0f;
  auto gemm_da = [&](cublasHandle_t handle, int e) {
    const int rows = offsets[e + 1] - offsets[e];
    SM90_BENCH_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, h, rows, d, &one,
                                   w2.ptr + static_cast<size_t>(e) * d * h, CUDA_R_16BF, h,
                                   dout_g.ptr + static_cast<size_t>(offsets[e]) * d, CUDA_R_16BF, d,
                                   &zero, da_ref.ptr + static_cast<size_t>(offsets[e]) * h,
                                   CUDA_R_16BF, h, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  auto gemm_dx = [&](cublasHandle_t handle, int e) {
    const int rows = offsets[e + 1] - offsets[e];
    SM90_BENCH_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, d, rows, 2 * h, &one,
                                   w13.ptr + static_cast<size_t>(e) * 2 * h * d, CUDA_R_16BF, d,
                                   dh.ptr + static_cast<size_t>(offsets[e]) * 2 * h, CUDA_R_16BF,
                                   2 * h, &zero, dx_ref.ptr + static_cast<size_t>(offsets[e]) * d,
                                   CUDA_R_16BF, d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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
    SM90_BENCH_CUDA(moe::kernels::LaunchSm90BackwardDA(prob, c, dout.ptr, w2.ptr, doff.ptr,
                                                       dent.ptr, da.ptr, nullptr));
  };
  auto fused_dx = [&](const Sm90GemmConfig& c) {
    SM90_BENCH_CUDA(
        moe::kernels::LaunchSm90BackwardDX(prob, c, dh.ptr, w13.ptr, doff.ptr, dx.ptr, nullptr));
  };

  gather();
  blas_da();
  blas_dx();
  fused_da(da_cfg);
  fused_dx(dx_cfg);
  SM90_BENCH_CUDA(cudaDeviceSynchronize());
  const double err_da = RelError(da.ptr, da_ref.ptr, N * h, scratch);
  const double err_dx = RelError(dx.ptr, dx_ref.ptr, N * d, scratch);
  // The comparison must be able to fail: against the reference moved by one row it must not
  // pass (fused and cuBLAS results can be bit-identical: both sum k in the same order).
  const double err_shifted = RelError(da.ptr, da_ref.ptr + h, (N - 1) * h, scratch);
  const bool close = err_da < 1e-2 && err_dx < 1e-2 && err_shifted > 0.5;
  *all_close &= close;

  const float gather_ms = MedianBackToBackMs(gather);
  const float blas_da_ms = MedianBackToBackMs(blas_da);
  const float blas_dx_ms = MedianBackToBackMs(blas_dx);
  const float lanes_da_ms = MedianBackToBackMs([&] { RunOnLanes(lanes, E, offsets, gemm_da); });
  const float lanes_dx_ms = MedianBackToBackMs([&] { RunOnLanes(lanes, E, offsets, gemm_dx); });
  const float da_ms = MedianBackToBackMs([&] { fused_da(da_cfg); });
  const float dx_ms = MedianBackToBackMs([&] { fused_dx(dx_cfg); });
  // The other tile width, so a run shows what the heuristic leaves behind.
  Sm90GemmConfig da_alt = da_cfg, dx_alt = dx_cfg;
  da_alt.block_n = da_cfg.block_n == 256 ? 128 : 256;
  dx_alt.block_n = dx_cfg.block_n == 256 ? 128 : 256;
  const float da_alt_ms = MedianBackToBackMs([&] { fused_da(da_alt); });
  const float dx_alt_ms = MedianBackToBackMs([&] { fused_dx(dx_alt); });
  // And the warp-specialised kernel at the heuristic's tile width.
  Sm90GemmConfig da_ws = da_cfg, dx_ws = dx_cfg;
  da_ws.warp_specialized = dx_ws.warp_specialized = true;
  const float da_ws_ms = MedianBackToBackMs([&] { fused_da(da_ws); });
  const float dx_ws_ms = MedianBackToBackMs([&] { fused_dx(dx_ws); });
  SM90_BENCH_CUDA(cudaDeviceSynchronize());
  const double err_ws =
      std::max(RelError(da.ptr, da_ref.ptr, N * h, scratch),  // ws wrote both last
               RelError(dx.ptr, dx_ref.ptr, N * d, scratch));
  const bool ws_close = err_ws < 1e-2;
  *all_close &= ws_close;
  // The ping-pong kernel, both consumer tiles (128x128: block_n 128; 64x256: block_n 256),
  // without and with the weight multicast over CTA pairs, each checked against cuBLAS after its
  // timed runs.
  float pp_ms[2][4];  // [dA, dX][block_n 128, 256, multicast 128, multicast 256]
  double err_pp = 0;
  for (int w = 0; w < 4; ++w) {
    Sm90GemmConfig da_pp = da_cfg, dx_pp = dx_cfg;
    da_pp.block_n = dx_pp.block_n = w % 2 == 0 ? 128 : 256;
    da_pp.ping_pong = dx_pp.ping_pong = true;
    da_pp.multicast_b = dx_pp.multicast_b = w >= 2;
    pp_ms[0][w] = MedianBackToBackMs([&] { fused_da(da_pp); });
    pp_ms[1][w] = MedianBackToBackMs([&] { fused_dx(dx_pp); });
    SM90_BENCH_CUDA(cudaDeviceSynchronize());
    err_pp = std::max({err_pp, RelError(da.ptr, da_ref.ptr, N * h, scratch),
                       RelError(dx.ptr, dx_ref.ptr, N * d, scratch)});
  }
  const bool pp_close = err_pp < 1e-2;
  *all_close &= pp_close;
  const double flop = 2.0 * N * d * h;  // dA; dX's reduction is 2h, twice the work
  const double flop_dx = 2.0 * flop;
  std::printf(
      "{\"preset\":\"%s\",\"T\":%lld,\"d\":%d,\"h\":%d,\"E\":%d,\"K\":%d,\"N\":%lld,"
      "\"check\":\"%s\",\"err_da_vs_cublas\":%.2e,\"err_dx_vs_cublas\":%.2e,"
      "\"err_da_vs_shifted_rows\":%.2f,"
      "\"da_block_n\":%d,\"da_group_m\":%d,\"da_ms\":%.4f,\"da_tflops\":%.1f,"
      "\"da_alt_block_n\":%d,\"da_alt_ms\":%.4f,\"cublas_da_ms\":%.4f,"
      "\"cublas4_da_ms\":%.4f,\"gather_ms\":%.4f,\"ws_check\":\"%s\",\"da_ws_ms\":%.4f,"
      "\"dx_ws_ms\":%.4f,\"pp_check\":\"%s\",\"da_pp128_ms\":%.4f,\"da_pp256_ms\":%.4f,"
      "\"dx_pp128_ms\":%.4f,\"dx_pp256_ms\":%.4f,\"da_ppmc128_ms\":%.4f,"
      "\"da_ppmc256_ms\":%.4f,\"dx_ppmc128_ms\":%.4f,\"dx_ppmc256_ms\":%.4f,"
      "\"dx_block_n\":%d,\"dx_group_m\":%d,\"dx_ms\":%.4f,\"dx_tflops\":%.1f,"
      "\"dx_alt_block_n\":%d,\"dx_alt_ms\":%.4f,\"cublas_dx_ms\":%.4f,\"cublas4_dx_ms\":%.4f,"
      "\"speedup_da\":%.2f,\"speedup_da_incl_gather\":%.2f,\"speedup_dx\":%.2f,"
      "\"speedup_da_vs_best_cublas\":%.2f,\"speedup_dx_vs_best_cublas\":%.2f}\n",
      ps.name, static_cast<long long>(T), d, h, E, K, static_cast<long long>(N),
      close ? "PASS" : "FAIL", err_da, err_dx, err_shifted, da_cfg.block_n, da_cfg.group_m, da_ms,
      flop / da_ms / 1e9, da_alt.block_n, da_alt_ms, blas_da_ms, lanes_da_ms, gather_ms,
      ws_close ? "PASS" : "FAIL", da_ws_ms, dx_ws_ms, pp_close ? "PASS" : "FAIL", pp_ms[0][0],
      pp_ms[0][1], pp_ms[1][0], pp_ms[1][1], pp_ms[0][2], pp_ms[0][3], pp_ms[1][2], pp_ms[1][3],
      dx_cfg.block_n, dx_cfg.group_m, dx_ms, flop_dx / dx_ms / 1e9, dx_alt.block_n, dx_alt_ms,
      blas_dx_ms, lanes_dx_ms, blas_da_ms / da_ms, (blas_da_ms + gather_ms) / da_ms,
      blas_dx_ms / dx_ms, std::min(blas_da_ms, lanes_da_ms) / da_ms,
      std::min(blas_dx_ms, lanes_dx_ms) / dx_ms);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  // The SKIP line on stdout, where this bench has always printed it (the other benches use
  // stderr).
  if (!moe::kernels::testing::HaveSm90Gpu(stdout)) return 77;
  Lanes lanes;
  SM90_BENCH_CUDA(cudaEventCreateWithFlags(&lanes.fork, cudaEventDisableTiming));
  for (int i = 0; i < Lanes::kLanes; ++i) {
    lanes.stream[i] = nullptr;
    if (i > 0) SM90_BENCH_CUDA(cudaStreamCreateWithFlags(&lanes.stream[i], cudaStreamNonBlocking));
    SM90_BENCH_CUDA(cudaEventCreateWithFlags(&lanes.join[i], cudaEventDisableTiming));
    SM90_BENCH_CUBLAS(cublasCreate(&lanes.blas[i]));
    SM90_BENCH_CUBLAS(cublasSetStream(lanes.blas[i], lanes.stream[i]));
  }
  DeviceBuffer<double> scratch(2);
  bool all_close = true;
  // [preset]
  for (std::string_view name : moe::bench::kBackwardPresets) {
    if (argc > 1 && std::string_view(argv[1]) != name) continue;
    RunPreset(*moe::bench::FindPreset(name), lanes, scratch.ptr, &all_close);
  }
  for (int i = 0; i < Lanes::kLanes; ++i) cublasDestroy(lanes.blas[i]);
  return all_close ? 0 : 1;
}
