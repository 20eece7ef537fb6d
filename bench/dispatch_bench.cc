// Dispatch-only benchmark: the MoEBlaze dispatch (kernels/cuda/dispatch.h) against the CUB
// radix-sort baseline (bench_kernels.h) on the routing shapes of the presets, without the
// expert GEMMs that make moe_bench slow at large T. It times the default (heuristic) tiling,
// the legacy global-bitmap path and a sweep of tilings, and checks every one bitwise against
// the CUB result (counts, offsets, routed entries, slot_of).
//
// Routing: K distinct experts per token drawn uniformly (the bench's softmax of random logits
// gives the same law), on the host, fixed seed per preset. Timing: each sample is kBatch
// dispatches back to back between two events (device time, not launch latency), as in
// moe_bench; median over --reps samples after warm-up.
//
//   moe_dispatch_bench [--preset NAME]... [--reps N] [--sweep]
// Prints one line per preset: cub_ms, legacy_ms, ms of the default path, and cub / default;
// then per preset the default tiling four ways (plain, staged entries, PDL, both; see
// DispatchConfig), each timed and checked in the same run.
// With --sweep also one line per (preset, tiling). Exit status 1 if any result differs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_kernels.h"
#include "kernels/cuda/dispatch.h"

namespace moe::bench {
namespace {

struct Shape {
  const char* name;
  int64_t T;
  int32_t E, K;
};

constexpr Shape kShapes[] = {
    {"sonic-7b", 24576, 128, 8},  {"olmoe", 16384, 64, 8},       {"qwen3-a3b", 16384, 128, 8},
    {"mixtral", 8192, 8, 2},      {"deepseek-v3", 8192, 256, 8}, {"scale-8k", 8192, 64, 4},
    {"scale-32k", 32768, 64, 4},  {"scale-128k", 131072, 64, 4}, {"scale-512k", 524288, 64, 4},
    {"scale-2m", 2097152, 64, 4},
};

#define CHECK_CUDA(expr)                                                 \
  do {                                                                   \
    const cudaError_t err_ = (expr);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                            \
      std::exit(2);                                                      \
    }                                                                    \
  } while (0)

constexpr int kBatch = 20;

struct Outputs {
  int32_t *counts, *offsets, *entries, *slot_of;
  void* ws;
  size_t ws_bytes;
};

Outputs Alloc(int64_t n, int32_t E, size_t ws_bytes) {
  Outputs o{};
  CHECK_CUDA(cudaMalloc(&o.counts, E * 4));
  CHECK_CUDA(cudaMalloc(&o.offsets, (E + 1) * 4));
  CHECK_CUDA(cudaMalloc(&o.entries, n * 4));
  CHECK_CUDA(cudaMalloc(&o.slot_of, n * 4));
  CHECK_CUDA(cudaMalloc(&o.ws, std::max<size_t>(ws_bytes, 256)));
  o.ws_bytes = ws_bytes;
  return o;
}

void Free(Outputs& o) {
  for (void* p : {static_cast<void*>(o.counts), static_cast<void*>(o.offsets),
                  static_cast<void*>(o.entries), static_cast<void*>(o.slot_of), o.ws}) {
    cudaFree(p);
  }
}

std::vector<int32_t> Fetch(const int32_t* d, int64_t n) {
  std::vector<int32_t> v(n);
  CHECK_CUDA(cudaMemcpy(v.data(), d, n * 4, cudaMemcpyDeviceToHost));
  return v;
}

// Median ms per dispatch of `launch`, kBatch launches per sample.
template <typename F>
double TimeMs(cudaStream_t s, int reps, F launch) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3 * kBatch; ++i) CHECK_CUDA(launch());
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(a, s));
    for (int i = 0; i < kBatch; ++i) CHECK_CUDA(launch());
    CHECK_CUDA(cudaEventRecord(b, s));
    CHECK_CUDA(cudaEventSynchronize(b));
    float m = 0;
    CHECK_CUDA(cudaEventElapsedTime(&m, a, b));
    ms.push_back(m / kBatch);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  using namespace moe::bench;
  using moe::kernels::DispatchConfig;
  std::vector<const Shape*> todo;
  int reps = 30;
  bool sweep = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--preset" && i + 1 < argc) {
      const std::string name = argv[++i];
      const Shape* found = nullptr;
      for (const Shape& s : kShapes)
        if (name == s.name) found = &s;
      if (found == nullptr) {
        std::fprintf(stderr, "moe_dispatch_bench: unknown preset %s\n", name.c_str());
        return 2;
      }
      todo.push_back(found);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--sweep") {
      sweep = true;
    } else {
      std::fprintf(stderr, "usage: moe_dispatch_bench [--preset NAME]... [--reps N] [--sweep]\n");
      return 2;
    }
  }
  if (todo.empty())
    for (const Shape& s : kShapes) todo.push_back(&s);
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("# moe_dispatch_bench on %s, ms per dispatch (median of %d samples of %d)\n",
              prop.name, reps, kBatch);
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int failures = 0;
  std::vector<std::string> table, ab;
  for (const Shape* p : todo) {
    const int64_t n = p->T * p->K;
    std::vector<int32_t> ids(n);
    std::mt19937_64 rng(0x5eed + p->T * 31 + p->E);
    std::vector<int32_t> pool(p->E);
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t t = 0; t < p->T; ++t) {
      for (int32_t k = 0; k < p->K; ++k) {
        std::uniform_int_distribution<int32_t> pick(k, p->E - 1);
        std::swap(pool[k], pool[pick(rng)]);
        ids[t * p->K + k] = pool[k];
      }
    }
    int32_t* d_ids;
    CHECK_CUDA(cudaMalloc(&d_ids, n * 4));
    CHECK_CUDA(cudaMemcpy(d_ids, ids.data(), n * 4, cudaMemcpyHostToDevice));

    Outputs cub = Alloc(n, p->E, CubSortDispatchWorkspaceBytes(p->T, p->K, p->E));
    const double cub_ms = TimeMs(s, reps, [&] {
      return CubSortDispatch(d_ids, p->T, p->K, p->E, cub.counts, cub.offsets, cub.entries,
                             cub.slot_of, cub.ws, cub.ws_bytes, s);
    });
    CHECK_CUDA(cudaStreamSynchronize(s));
    const std::vector<int32_t> ref_counts = Fetch(cub.counts, p->E),
                               ref_offsets = Fetch(cub.offsets, p->E + 1),
                               ref_entries = Fetch(cub.entries, n),
                               ref_slot = Fetch(cub.slot_of, n);

    // One MoEBlaze variant: time it, then compare with CUB (outputs poisoned before the
    // comparison run so an unwritten element shows).
    auto run = [&](const DispatchConfig& c, bool use_default, bool* equal) {
      const size_t ws_bytes = use_default ? moe::kernels::DispatchWorkspaceBytes(p->T, p->E)
                                          : moe::kernels::DispatchWorkspaceBytes(p->T, p->E, c);
      Outputs o = Alloc(n, p->E, ws_bytes);
      auto launch = [&] {
        return use_default
                   ? moe::kernels::LaunchDispatch(d_ids, p->T, p->K, 0, p->E, o.counts, o.offsets,
                                                  o.entries, o.slot_of, o.ws, o.ws_bytes, s)
                   : moe::kernels::LaunchDispatch(d_ids, p->T, p->K, 0, p->E, o.counts, o.offsets,
                                                  o.entries, o.slot_of, c, o.ws, o.ws_bytes, s);
      };
      const double ms = TimeMs(s, reps, launch);
      CHECK_CUDA(cudaMemsetAsync(o.counts, 0x7f, p->E * 4, s));
      CHECK_CUDA(cudaMemsetAsync(o.offsets, 0x7f, (p->E + 1) * 4, s));
      CHECK_CUDA(cudaMemsetAsync(o.entries, 0x7f, n * 4, s));
      CHECK_CUDA(cudaMemsetAsync(o.slot_of, 0x7f, n * 4, s));
      CHECK_CUDA(launch());
      CHECK_CUDA(cudaStreamSynchronize(s));
      *equal = Fetch(o.counts, p->E) == ref_counts && Fetch(o.offsets, p->E + 1) == ref_offsets &&
               Fetch(o.entries, n) == ref_entries && Fetch(o.slot_of, n) == ref_slot;
      Free(o);
      return ms;
    };
    bool eq_default = false, eq_legacy = false;
    const double default_ms = run(DispatchConfig{}, true, &eq_default);
    const double legacy_ms = run(DispatchConfig{0, 0, true}, false, &eq_legacy);
    const DispatchConfig h = moe::kernels::DispatchHeuristic(p->T, p->K, p->E);
    char line[256];
    std::snprintf(line, sizeof line,
                  "%-12s %8lld %4d %2d %9.4f %9.4f %9.4f %7.2fx %7.2fx  w%-2d cells=%-6lld %s",
                  p->name, static_cast<long long>(p->T), p->E, p->K, cub_ms, legacy_ms, default_ms,
                  cub_ms / default_ms, cub_ms / legacy_ms, h.warps_per_tile,
                  static_cast<long long>(h.tile_cells), eq_default && eq_legacy ? "yes" : "NO");
    table.push_back(line);
    std::printf("%s\n", line);
    std::fflush(stdout);
    failures += !eq_default + !eq_legacy;
    {
      // A/B of the default tiling with and without PDL and staged entries, same call.
      char ab_line[256];
      int n_ab = std::snprintf(ab_line, sizeof ab_line, "%-12s", p->name);
      for (int pdl : {1, 2}) {
        for (int staged : {1, 2}) {
          bool eq = false;
          const double ms =
              run(DispatchConfig{h.warps_per_tile, h.tile_cells, false, pdl, staged}, false, &eq);
          failures += !eq;
          n_ab += std::snprintf(ab_line + n_ab, sizeof ab_line - n_ab, " %9.4f %6.2fx%s", ms,
                                cub_ms / ms, eq ? "" : " NO");
        }
      }
      ab.push_back(ab_line);
      std::printf("ab %s\n", ab_line);
      std::fflush(stdout);
    }
    if (sweep) {
      for (int w : {4, 8, 16, 32}) {
        if (w == 32 && p->E > 128) continue;
        for (int64_t cells : {2048, 4096, 8192, 16384, 32768}) {
          bool eq = false;
          const double ms = run(DispatchConfig{w, cells, false}, false, &eq);
          std::printf("sweep %-12s w%-2d cells=%-6lld %9.4f ms  cub/this %6.2fx %s\n", p->name, w,
                      static_cast<long long>(cells), ms, cub_ms / ms, eq ? "yes" : "NO");
          failures += !eq;
        }
      }
      std::fflush(stdout);
    }
    Free(cub);
    cudaFree(d_ids);
  }
  std::printf("\n%-12s %8s %4s %2s %9s %9s %9s %8s %8s  %s\n", "preset", "T", "E", "K", "cub_ms",
              "legacy_ms", "disp_ms", "cub/disp", "cub/leg", "default tiling, equal");
  for (const std::string& l : table) std::printf("%s\n", l.c_str());
  std::printf("\n%-12s %17s %17s %17s %17s   (ms, cub/this)\n", "preset", "plain", "staged", "pdl",
              "pdl+staged");
  for (const std::string& l : ab) std::printf("%s\n", l.c_str());
  std::printf("moe_dispatch_bench: %s\n", failures == 0 ? "all equal to CUB" : "MISMATCH");
  return failures == 0 ? 0 : 1;
}
