// Benchmark of the fused Hopper forward (kernels/cuda/sm90_expert_forward.h) on the issue's
// presets, with the two ceilings it is judged against measured in the same process: the
// device-to-device copy bandwidth and cuBLAS's dense bf16 GEMM rate (8192^3, random data).
//
// Inputs are random (a counter hash on the device, so deepseek-v3's 22 GB of weights take no
// host time) and the routing is K distinct uniform experts per token, which is what
// torch_moe_reference.py's softmax-top-K of Gaussian logits gives on average. Times are
// medians of CUDA-event-timed repetitions after warm-up; the dispatch structures are built
// once on the host and are not part of the timed forward (the engine builds them on the device).
// Output: one JSON object a line (stdout, and --json FILE), then nothing else, so
// bench/sm90_compare.py can join it with torch_moe_reference.py's lines from the same run.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/dispatch.h"
#include "kernels/cuda/sm90_expert_forward.h"

namespace {

using moe::kernels::Sm90ExpertProblem;
using moe::kernels::Sm90GemmConfig;
using moe::kernels::Sm90Projection;

#define CHECK_CUDA(call)                                                 \
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
  int64_t T;
  int d, h, E, K;
};
// The same table as torch_moe_reference.py (scale-2m left out: its forward buffers, Y
// [T*K, d] included, exceed 80 GB without chunking over tokens).
const Preset kPresets[] = {
    {"sonic-7b", 24576, 1536, 256, 128, 8},    {"olmoe", 16384, 2048, 1024, 64, 8},
    {"qwen3-a3b", 16384, 2048, 768, 128, 8},   {"mixtral", 8192, 4096, 14336, 8, 2},
    {"deepseek-v3", 8192, 7168, 2048, 256, 8}, {"scale-8k", 8192, 2048, 1024, 64, 4},
    {"scale-32k", 32768, 2048, 1024, 64, 4},   {"scale-128k", 131072, 2048, 1024, 64, 4},
    {"scale-512k", 524288, 2048, 1024, 64, 4},
};

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

template <typename F>
float MedianMs(F&& fn, int warm = 3, int reps = 20) {
  for (int i = 0; i < warm; ++i) fn();
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    fn();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
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
  const size_t bytes = size_t{2} << 30;
  void *src, *dst;
  CHECK_CUDA(cudaMalloc(&src, bytes));
  CHECK_CUDA(cudaMalloc(&dst, bytes));
  FillRandom(src, bytes / 2, 1, 1.0f);
  const float copy_ms =
      MedianMs([&] { CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
  *copy_tbs = 2.0 * bytes / (copy_ms * 1e-3) / 1e12;
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));

  const int n = 8192;
  void *a, *b, *c;
  CHECK_CUDA(cudaMalloc(&a, size_t{2} * n * n));
  CHECK_CUDA(cudaMalloc(&b, size_t{2} * n * n));
  CHECK_CUDA(cudaMalloc(&c, size_t{2} * n * n));
  FillRandom(a, int64_t{n} * n, 2, 1.0f);
  FillRandom(b, int64_t{n} * n, 3, 1.0f);
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) std::exit(1);
  const float one = 1.0f, zero = 0.0f;
  const float gemm_ms = MedianMs([&] {
    if (cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b,
                     CUDA_R_16BF, n, &zero, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "cublasGemmEx failed\n");
      std::exit(1);
    }
  });
  *gemm_tflops = 2.0 * n * n * double{n} / (gemm_ms * 1e-3) / 1e12;
  cublasDestroy(handle);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(c));
}

void RunPreset(const Preset& ps, double copy_tbs, double gemm_tflops) {
  const int64_t T = ps.T, TK = ps.T * ps.K;
  const int d = ps.d, h = ps.h, E = ps.E, K = ps.K;
  std::mt19937_64 rng(7);
  std::vector<int32_t> idx(TK);
  std::uniform_int_distribution<int32_t> pick(0, E - 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      int32_t e;
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
  std::vector<float> p(TK);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (auto& v : p) v = unit(rng) / K;
  const int64_t N = offsets[E];

  uint16_t *x, *w1, *w3, *w2, *hbuf, *abuf, *y, *out;
  int32_t *doff, *dent, *dslot;
  float* dp;
  const size_t wsize = size_t{2} * E * h * d;
  CHECK_CUDA(cudaMalloc(&x, size_t{2} * T * d));
  CHECK_CUDA(cudaMalloc(&w1, wsize));
  CHECK_CUDA(cudaMalloc(&w3, wsize));
  CHECK_CUDA(cudaMalloc(&w2, wsize));
  CHECK_CUDA(cudaMalloc(&hbuf, size_t{2} * N * 2 * h));
  CHECK_CUDA(cudaMalloc(&abuf, size_t{2} * N * h));
  CHECK_CUDA(cudaMalloc(&y, size_t{2} * TK * d));
  CHECK_CUDA(cudaMalloc(&out, size_t{2} * T * d));
  CHECK_CUDA(cudaMalloc(&doff, 4 * (E + 1)));
  CHECK_CUDA(cudaMalloc(&dent, 4 * TK));
  CHECK_CUDA(cudaMalloc(&dslot, 4 * TK));
  CHECK_CUDA(cudaMalloc(&dp, 4 * TK));
  FillRandom(x, T * d, 11, 1.0f);
  FillRandom(w1, wsize / 2, 12, 1.0f / std::sqrt(static_cast<float>(d)));
  FillRandom(w3, wsize / 2, 13, 1.0f / std::sqrt(static_cast<float>(d)));
  FillRandom(w2, wsize / 2, 14, 1.0f / std::sqrt(static_cast<float>(h)));
  CHECK_CUDA(cudaMemcpy(doff, offsets.data(), 4 * (E + 1), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dent, entries.data(), 4 * TK, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dslot, slot_of.data(), 4 * TK, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dp, p.data(), 4 * TK, cudaMemcpyHostToDevice));

  Sm90ExpertProblem prob;
  prob.num_tokens = T;
  prob.top_k = K;
  prob.num_experts = E;
  prob.d_model = d;
  prob.d_hidden = h;
  prob.num_routed = N;
  if (const char* why = moe::kernels::Sm90CanImplement(prob)) {
    std::fprintf(stderr, "%s: refused: %s\n", ps.name, why);
    return;
  }
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Sm90GemmConfig up_cfg =
      moe::kernels::Sm90ChooseConfig(prob, Sm90Projection::kUpSwiGLU, sms);
  const Sm90GemmConfig down_cfg = moe::kernels::Sm90ChooseConfig(prob, Sm90Projection::kDown, sms);

  auto up = [&](const Sm90GemmConfig& c) {
    CHECK_CUDA(
        moe::kernels::LaunchSm90ExpertUp(prob, c, x, w1, w3, doff, dent, hbuf, abuf, nullptr));
  };
  auto down = [&](const Sm90GemmConfig& c) {
    CHECK_CUDA(moe::kernels::LaunchSm90ExpertDown(prob, c, abuf, w2, doff, dent, y, nullptr));
  };
  auto combine = [&] {
    CHECK_CUDA(moe::kernels::LaunchSm90Combine(prob, y, dp, dslot, out, nullptr));
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
      {{128, true, g_up, true}, {128, true, g_down, true}}};
  for (const auto& pair : sweep) {
    const Sm90GemmConfig c = pair.first, cd = pair.second;
    const float up_ms = MedianMs([&] { up(c); });
    const float down_ms = MedianMs([&] { down(cd); });
    std::snprintf(line, sizeof(line),
                  "{\"kind\":\"tile\",\"preset\":\"%s\",\"block_n\":%d,\"tma\":%d,\"ws\":%d,"
                  "\"group_m\":[%d,%d],\"up_ms\":%.4f,\"up_tflops\":%.1f,"
                  "\"down_ms\":%.4f,\"down_tflops\":%.1f}",
                  ps.name, c.block_n, c.tma_weights ? 1 : 0, c.warp_specialized ? 1 : 0, c.group_m,
                  cd.group_m, up_ms,
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
  for (void* ptr : {static_cast<void*>(x), static_cast<void*>(w1), static_cast<void*>(w3),
                    static_cast<void*>(w2), static_cast<void*>(hbuf), static_cast<void*>(abuf),
                    static_cast<void*>(y), static_cast<void*>(out), static_cast<void*>(doff),
                    static_cast<void*>(dent), static_cast<void*>(dslot), static_cast<void*>(dp)}) {
    CHECK_CUDA(cudaFree(ptr));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> names;
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
    std::fprintf(stderr, "usage: %s [--json FILE] (--all | PRESET...)\n", argv[0]);
    return 2;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 ||
      !moe::kernels::Sm90DeviceSupported(0)) {
    std::fprintf(stderr, "no sm_90 GPU\n");
    return 77;
  }
  double copy_tbs = 0, gemm_tflops = 0;
  MeasureCeilings(&copy_tbs, &gemm_tflops);
  char line[256];
  std::snprintf(line, sizeof(line),
                "{\"kind\":\"ceilings\",\"copy_tbs\":%.3f,\"cublas_bf16_tflops\":%.1f}", copy_tbs,
                gemm_tflops);
  Emit(line);
  for (const std::string& name : names) {
    const Preset* preset = nullptr;
    for (const Preset& p : kPresets) {
      if (name == p.name) preset = &p;
    }
    if (preset == nullptr) {
      std::fprintf(stderr, "unknown preset: %s\n", name.c_str());
      return 2;
    }
    RunPreset(*preset, copy_tbs, gemm_tflops);
  }
  if (g_json) std::fclose(g_json);
  return 0;
}
