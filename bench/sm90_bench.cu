// Benchmark of the fused Hopper forward (kernels/cuda/sm90_expert_forward.h) on the benchmark
// presets, with the two ceilings it is judged against measured in the same process: the
// device-to-device copy bandwidth and cuBLAS's dense bf16 GEMM rate (8192^3, random data).
//
// Inputs are random (a counter hash on the device, so deepseek-v3's 22 GB of weights take no
// host time) and the routing is K distinct uniform experts per token, which is what
// torch_moe_reference.py's softmax-top-K of Gaussian logits gives on average. Times are
// medians of CUDA-event-timed repetitions after warm-up; the dispatch structures are built
// once on the host and are not part of the timed forward (the engine builds them on the device).
// Output: one JSON object a line (stdout, and --json FILE), then nothing else, so that it
// joins with torch_moe_reference.py's lines from the same run.
// Presets, routing, buffers and timing come from bench/sm90_bench_util.h, shared with the
// backward benches.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench/sm90_bench_util.h"
#include "engine/cuda/kernel_selection.h"
#include "kernels/cuda/sm90_expert_forward.h"

namespace {

using moe::bench::DeviceBuffer;
using moe::bench::kPresets;
using moe::bench::MedianMs;
using moe::bench::Preset;
using moe::kernels::Sm90ExpertProblem;
using moe::kernels::Sm90GemmConfig;
using moe::cuda::Sm90Projection;

#define CHECK_CUDA SM90_BENCH_CUDA

// Approximately N(0, scale^2) bf16 from a counter hash (sum of 4 uniforms, variance matched).
__global__ void fill_random_kernel(__nv_bfloat16* out, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float s = 0;
    for (int q = 0; q < 4; ++q) s += static_cast<float>((z >> (16 * q)) & 0xFFFF) / 65535.0f;
    out[i] = __float2bfloat16_rn((s - 2.0f) * 1.7320508f * scale);
  }
}

void FillRandom(void* ptr, int64_t n, uint64_t seed, float scale) {
  fill_random_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(ptr), n, seed, scale);
  CHECK_CUDA(cudaGetLastError());
}

FILE* g_json = nullptr;
void Emit(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  if (g_json) {
    std::fprintf(g_json, "%s\n", line.c_str());
    std::fflush(g_json);
  }
}

// Ceilings: copy bandwidth (bytes read + written) and cuBLAS dense bf16 TFLOP/s.
void MeasureCeilings(double* copy_tbs, double* gemm_tflops) {
  {
    const size_t bytes = size_t{2} << 30;
    DeviceBuffer<uint16_t> src(bytes / 2), dst(bytes / 2);
    FillRandom(src.ptr, bytes / 2, 1, 1.0f);
    const float copy_ms = MedianMs(
        [&] { CHECK_CUDA(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice)); });
    *copy_tbs = 2.0 * bytes / (copy_ms * 1e-3) / 1e12;
  }  // the copy buffers are freed before the GEMM's are taken

  const int n = 8192;
  DeviceBuffer<uint16_t> a(int64_t{n} * n), b(int64_t{n} * n), c(int64_t{n} * n);
  FillRandom(a.ptr, int64_t{n} * n, 2, 1.0f);
  FillRandom(b.ptr, int64_t{n} * n, 3, 1.0f);
  cublasHandle_t handle;
  SM90_BENCH_CUBLAS(cublasCreate(&handle));
  const float one = 1.0f, zero = 0.0f;
  const float gemm_ms = MedianMs([&] {
    SM90_BENCH_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a.ptr,
                                   CUDA_R_16BF, n, b.ptr, CUDA_R_16BF, n, &zero, c.ptr, CUDA_R_16BF,
                                   n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  });
  *gemm_tflops = 2.0 * n * n * double{n} / (gemm_ms * 1e-3) / 1e12;
  cublasDestroy(handle);
}

void RunPreset(const Preset& ps, double copy_tbs, double gemm_tflops) {
  const int64_t T = ps.tokens, TK = ps.tokens * ps.top_k;
  const int d = ps.d, h = ps.h, E = ps.experts, K = ps.top_k;
  std::mt19937_64 rng(7);
  const moe::bench::Routing routing = moe::bench::UniformRouting(ps, rng);
  std::vector<float> p(TK);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (auto& v : p) v = unit(rng) / K;
  const int64_t N = routing.routed;

  const size_t w_elems = size_t{1} * E * h * d;
  DeviceBuffer<uint16_t> x(T * d), w1(w_elems), w3(w_elems), w2(w_elems), hbuf(N * 2 * h),
      abuf(N * h), y(TK * d), out(T * d);
  DeviceBuffer<int32_t> doff(E + 1), dent(TK), dslot(TK);
  DeviceBuffer<float> dp(TK);
  FillRandom(x.ptr, T * d, 11, 1.0f);
  FillRandom(w1.ptr, w_elems, 12, 1.0f / std::sqrt(static_cast<float>(d)));
  FillRandom(w3.ptr, w_elems, 13, 1.0f / std::sqrt(static_cast<float>(d)));
  FillRandom(w2.ptr, w_elems, 14, 1.0f / std::sqrt(static_cast<float>(h)));
  CHECK_CUDA(cudaMemcpy(doff.ptr, routing.offsets.data(), 4 * (E + 1), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dent.ptr, routing.entries.data(), 4 * TK, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dslot.ptr, routing.slot_of.data(), 4 * TK, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dp.ptr, p.data(), 4 * TK, cudaMemcpyHostToDevice));

  const Sm90ExpertProblem prob = moe::kernels::testing::MakeProblem(T, K, E, d, h, N);
  if (const char* why = moe::kernels::Sm90CanImplement(prob)) {
    std::fprintf(stderr, "%s: refused: %s\n", ps.name, why);
    return;
  }
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Sm90GemmConfig up_cfg =
      moe::cuda::Sm90ChooseConfig(prob, Sm90Projection::kUpSwiGLU, sms);
  const Sm90GemmConfig down_cfg = moe::cuda::Sm90ChooseConfig(prob, Sm90Projection::kDown, sms);

  auto up = [&](const Sm90GemmConfig& c) {
    CHECK_CUDA(moe::kernels::LaunchSm90ExpertUp(prob, c, x.ptr, w1.ptr, w3.ptr, doff.ptr, dent.ptr,
                                                hbuf.ptr, abuf.ptr, nullptr));
  };
  auto down = [&](const Sm90GemmConfig& c) {
    CHECK_CUDA(moe::kernels::LaunchSm90ExpertDown(prob, c, abuf.ptr, w2.ptr, doff.ptr, dent.ptr,
                                                  y.ptr, nullptr));
  };
  auto combine = [&] {
    CHECK_CUDA(moe::kernels::LaunchSm90Combine(prob, y.ptr, dp.ptr, dslot.ptr, out.ptr, nullptr));
  };
  const double up_flop = 2.0 * N * d * 2.0 * h, down_flop = 2.0 * N * h * d;
  char line[1024];
  // Every tile config, so one run shows what the heuristics leave on the table.
  const int g_up = up_cfg.group_m, g_down = down_cfg.group_m;
  const std::vector<std::pair<Sm90GemmConfig, Sm90GemmConfig>> sweep = {
      {{256, true, g_up}, {256, true, g_down}},
      {{256, true, 1}, {256, true, 1}},
      {{128, true, g_up}, {128, true, g_down}},
      {{256, false, g_up}, {256, false, g_down}},
      {{256, true, g_up, true}, {256, true, g_down, true}},
      {{128, true, g_up, true}, {128, true, g_down, true}},
      // Ping-pong: 128x128 and 64x256 tiles per consumer warpgroup.
      {{128, true, g_up, false, true}, {128, true, g_down, false, true}},
      {{256, true, g_up, false, true}, {256, true, g_down, false, true}},
      // ... with the weight tile multicast over CTA pairs.
      {{128, true, g_up, false, true, true}, {128, true, g_down, false, true, true}},
      {{256, true, g_up, false, true, true}, {256, true, g_down, false, true, true}}};
  for (const auto& pair : sweep) {
    const Sm90GemmConfig c = pair.first, cd = pair.second;
    const float up_ms = MedianMs([&] { up(c); });
    const float down_ms = MedianMs([&] { down(cd); });
    std::snprintf(line, sizeof(line),
                  "{\"kind\":\"tile\",\"preset\":\"%s\",\"block_n\":%d,\"tma\":%d,\"ws\":%d,"
                  "\"pp\":%d,\"mc\":%d,"
                  "\"group_m\":[%d,%d],\"up_ms\":%.4f,\"up_tflops\":%.1f,"
                  "\"down_ms\":%.4f,\"down_tflops\":%.1f}",
                  ps.name, c.block_n, c.tma_weights ? 1 : 0, c.warp_specialized ? 1 : 0,
                  c.ping_pong ? 1 : 0, c.multicast_b ? 1 : 0, c.group_m, cd.group_m, up_ms,
                  up_flop / up_ms / 1e9, down_ms, down_flop / down_ms / 1e9);
    Emit(line);
  }
  const float up_ms = MedianMs([&] { up(up_cfg); });
  const float down_ms = MedianMs([&] { down(down_cfg); });
  const float comb_ms = MedianMs(combine);
  const float fwd_ms = MedianMs([&] {
    up(up_cfg);
    down(down_cfg);
    combine();
  });
  const double fwd_flop = up_flop + down_flop;
  // Fewest bytes this design must move: x, the three weight sets, H and A written, A read,
  // Y written and read, out written (index arrays ignored).
  const double bytes =
      2.0 * (T * d + 3.0 * E * h * d + N * 2.0 * h + 2.0 * N * h + 2.0 * N * d + T * d);
  std::snprintf(line, sizeof(line),
                "{\"kind\":\"fused\",\"preset\":\"%s\",\"T\":%lld,\"d\":%d,\"h\":%d,\"E\":%d,"
                "\"K\":%d,\"up_block_n\":%d,\"down_block_n\":%d,\"up_group_m\":%d,"
                "\"down_group_m\":%d,\"up_ms\":%.4f,\"down_ms\":%.4f,"
                "\"combine_ms\":%.4f,\"fwd_ms\":%.4f,\"fwd_tflops\":%.1f,"
                "\"up_tflops\":%.1f,\"down_tflops\":%.1f,\"flop_floor_ms\":%.4f,"
                "\"byte_floor_ms\":%.4f,\"cublas_tflops\":%.1f,\"copy_tbs\":%.2f}",
                ps.name, static_cast<long long>(T), d, h, E, K, up_cfg.block_n, down_cfg.block_n,
                up_cfg.group_m, down_cfg.group_m, up_ms, down_ms, comb_ms, fwd_ms,
                fwd_flop / fwd_ms / 1e9, up_flop / up_ms / 1e9, down_flop / down_ms / 1e9,
                fwd_flop / (gemm_tflops * 1e12) * 1e3, bytes / (copy_tbs * 1e12) * 1e3, gemm_tflops,
                copy_tbs);
  Emit(line);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> names;
  std::deque<std::string> shape_names;  // storage for the names of "T,d,h,E,K" shapes
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      g_json = std::fopen(argv[++i], "a");
    } else if (std::strcmp(argv[i], "--all") == 0) {
      for (const Preset& p : kPresets) names.push_back(p.name);
    } else {
      names.push_back(argv[i]);
    }
  }
  if (names.empty()) {
    std::fprintf(stderr, "usage: %s [--json FILE] (--all | PRESET... | T,d,h,E,K...)\n", argv[0]);
    return 2;
  }
  if (!moe::kernels::testing::HaveSm90Gpu(stderr)) return 77;
  double copy_tbs = 0, gemm_tflops = 0;
  MeasureCeilings(&copy_tbs, &gemm_tflops);
  char line[256];
  std::snprintf(line, sizeof(line),
                "{\"kind\":\"ceilings\",\"copy_tbs\":%.3f,\"cublas_bf16_tflops\":%.1f}", copy_tbs,
                gemm_tflops);
  Emit(line);
  for (const std::string& name : names) {
    // A shape "T,d,h,E,K" besides the named presets, e.g. "8192,8192,4096,1,1": one expert
    // and an identity gather, a dense GEMM to hold against cuBLAS's rate above.
    Preset shape{};
    long long t = 0;
    int d = 0, h = 0, e = 0, k = 0;
    const Preset* preset = moe::bench::FindPreset(name);
    if (preset == nullptr &&
        std::sscanf(name.c_str(), "%lld,%d,%d,%d,%d", &t, &d, &h, &e, &k) == 5 && t > 0 &&
        d > 0 && h > 0 && e > 0 && k > 0 && k <= e) {
      shape_names.push_back(name);
      shape = {shape_names.back().c_str(), t, d, h, e, k};
      preset = &shape;
    }
    if (preset == nullptr) {
      std::fprintf(stderr, "unknown preset (and not T,d,h,E,K): %s\n", name.c_str());
      return 2;
    }
    RunPreset(*preset, copy_tbs, gemm_tflops);
  }
  if (g_json) std::fclose(g_json);
  return 0;
}
