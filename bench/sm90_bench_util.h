// Helpers shared by the fused Hopper kernels' benchmarks (sm90_bench.cu, sm90_weight_grad_bench.cu,
// and made to serve sm90_backward_bench.cu too): a CUDA/cuBLAS check that ends the process, the
// preset table, uniform random routing with its dispatch structures, a device buffer, a
// row gather by token, and CUDA-event timing (each call alone, or back to back).
//
// Header-only and free of Abseil and GoogleTest: each bench is one standalone binary that runs
// on a bare GPU machine. The bf16 conversion, the device buffer, the routing generator and the
// problem builder are the tests' own (tests/kernels/cuda/sm90_test_util.h), reused rather than
// copied, so a bench and a test given the same seed route the same way. Include it from a .cu
// file only (it defines a __global__ kernel) and from one translation unit per binary.
#ifndef MOE_BENCH_SM90_BENCH_UTIL_H_
#define MOE_BENCH_SM90_BENCH_UTIL_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string_view>
#include <vector>

#include "kernels/cpu/dispatch.h"
#include "kernels/cuda/sm90_expert_forward.h"
#include "tests/kernels/cuda/sm90_test_util.h"

namespace moe::bench {

// A failed call ends the process: a bench has nothing to fall back on, and carrying on would
// print numbers for a run that did not happen.
[[noreturn]] inline void Die(const char* file, int line, const char* what, const char* why) {
  std::fprintf(stderr, "%s:%d: %s: %s\n", file, line, what, why);
  std::exit(1);
}
#define SM90_BENCH_CUDA(call)                                                                      \
  do {                                                                                             \
    const cudaError_t err_ = (call);                                                               \
    if (err_ != cudaSuccess) moe::bench::Die(__FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
  } while (0)
#define SM90_BENCH_CUBLAS(call)                                   \
  do {                                                            \
    if ((call) != CUBLAS_STATUS_SUCCESS)                          \
      moe::bench::Die(__FILE__, __LINE__, #call, "cuBLAS error"); \
  } while (0)

struct Preset {
  const char* name;
  int64_t tokens;  // T
  int d, h;        // d_model, d_hidden
  int experts;     // E, all local
  int top_k;       // K
};
// The same table as torch_moe_reference.py (scale-2m left out: its forward buffers, Y [T*K, d]
// included, exceed 80 GB without chunking over tokens).
inline constexpr Preset kPresets[] = {
    {"sonic-7b", 24576, 1536, 256, 128, 8},    {"olmoe", 16384, 2048, 1024, 64, 8},
    {"qwen3-a3b", 16384, 2048, 768, 128, 8},   {"mixtral", 8192, 4096, 14336, 8, 2},
    {"deepseek-v3", 8192, 7168, 2048, 256, 8}, {"scale-8k", 8192, 2048, 1024, 64, 4},
    {"scale-32k", 32768, 2048, 1024, 64, 4},   {"scale-128k", 131072, 2048, 1024, 64, 4},
    {"scale-512k", 524288, 2048, 1024, 64, 4},
};
// The presets the backward benches (weight and data gradients) run, in the order they print.
inline constexpr std::string_view kBackwardPresets[] = {"sonic-7b", "olmoe", "qwen3-a3b",
                                                        "scale-8k", "deepseek-v3"};

// nullptr for a name not in kPresets.
inline const Preset* FindPreset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

// A preset's routing and its dispatch structures (DispatchCpu's outputs, all experts local).
struct Routing {
  std::vector<int32_t> counts, offsets, entries, slot_of;
  int64_t routed = 0;  // N = offsets[experts]
};

// K distinct uniform experts per token: what torch_moe_reference.py's softmax-top-K of
// Gaussian logits gives on average. Built on the host, outside any timed span. The environment
// variable MOE_BENCH_ROUTING changes it, to read each kernel against moe_bench --ceiling's
// cuBLAS GEMMs (which assume T*K/E rows an expert):
//   balanced         entry i = t*K + k goes to expert i mod E: every expert gets T*K/E rows, and
//                    a token's K experts are K consecutive ones, so neighbouring experts share
//                    their tokens and one expert's gathered rows are still in L2 for the next;
//   balanced-random  every expert gets T*K/E rows, each token K distinct experts at random:
//                    balance without that locality.
inline Routing UniformRouting(const Preset& ps, std::mt19937_64& rng) {
  const int64_t tk = ps.tokens * ps.top_k;
  const char* env = std::getenv("MOE_BENCH_ROUTING");
  const std::string_view mode = env != nullptr ? env : "";
  std::vector<int32_t> idx;
  if (mode == "balanced" || mode == "balanced-random") {
    idx.resize(tk);
    for (int64_t i = 0; i < tk; ++i) idx[i] = static_cast<int32_t>(i % ps.experts);
  }
  if (mode == "balanced-random") {
    std::shuffle(idx.begin(), idx.end(), rng);
    // A token that drew an expert twice swaps the second copy with a random entry of another
    // token, when neither token then holds that expert twice (few repeats: K << E).
    auto holds = [&](int64_t t, int32_t e, int64_t skip) {
      for (int64_t k = 0; k < ps.top_k; ++k) {
        if (t * ps.top_k + k != skip && idx[t * ps.top_k + k] == e) return true;
      }
      return false;
    };
    std::uniform_int_distribution<int64_t> any(0, tk - 1);
    for (int64_t i = 0; i < tk; ++i) {
      const int64_t t = i / ps.top_k;
      while (holds(t, idx[i], i)) {
        const int64_t j = any(rng);
        const int64_t u = j / ps.top_k;
        if (u != t && !holds(u, idx[i], j) && !holds(t, idx[j], i)) std::swap(idx[i], idx[j]);
      }
    }
  } else if (mode != "balanced") {
    idx = kernels::testing::RandomRouting(ps.tokens, ps.top_k, ps.experts, /*empty=*/-1,
                                          /*hot=*/-1, rng);
  }
  Routing r;
  r.counts.resize(ps.experts);
  r.offsets.resize(ps.experts + 1);
  r.entries.resize(tk);
  r.slot_of.resize(tk);
  kernels::DispatchCpu(idx.data(), ps.tokens, ps.top_k, 0, ps.experts, r.counts.data(),
                       r.offsets.data(), r.entries.data(), r.slot_of.data());
  r.routed = r.offsets[ps.experts];
  return r;
}

// The tests' device buffer, but an allocation failure ends the process (see SM90_BENCH_CUDA).
template <typename T>
struct DeviceBuffer : kernels::testing::DeviceBuffer<T> {
  explicit DeviceBuffer(size_t count) : kernels::testing::DeviceBuffer<T>(count) {
    if (this->ptr == nullptr) {
      Die(__FILE__, __LINE__, "cudaMalloc", cudaGetErrorString(cudaGetLastError()));
    }
  }
};

// dst[s] = src[entries[s] / top_k] for rows of `chunks` 16-byte pieces: the gather the cuBLAS
// paths need before their GEMMs (the fused kernels gather while loading).
__global__ void sm90_bench_gather_rows_kernel(const uint4* src, const int32_t* entries, int top_k,
                                              int64_t rows, int chunks, uint4* dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = i / chunks;
    dst[i] = src[static_cast<int64_t>(entries[s] / top_k) * chunks + (i - s * chunks)];
  }
}

// Gathers `rows` bf16 rows of `width` elements (a multiple of 8) by token, on the legacy stream.
inline void GatherRowsByToken(const void* src, const int32_t* entries, int top_k, int64_t rows,
                              int width, void* dst) {
  sm90_bench_gather_rows_kernel<<<2048, 256>>>(static_cast<const uint4*>(src), entries, top_k, rows,
                                               width / 8, static_cast<uint4*>(dst));
}

// `reps` CUDA-event-timed calls of fn() on the legacy stream after `warm` untimed ones, each
// timed alone (events around it, then a wait), sorted ascending, in milliseconds.
template <typename F>
std::vector<float> SortedEventTimesMs(F&& fn, int warm, int reps) {
  for (int i = 0; i < warm; ++i) fn();
  SM90_BENCH_CUDA(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  SM90_BENCH_CUDA(cudaEventCreate(&a));
  SM90_BENCH_CUDA(cudaEventCreate(&b));
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    SM90_BENCH_CUDA(cudaEventRecord(a));
    fn();
    SM90_BENCH_CUDA(cudaEventRecord(b));
    SM90_BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    SM90_BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms);
  }
  SM90_BENCH_CUDA(cudaEventDestroy(a));
  SM90_BENCH_CUDA(cudaEventDestroy(b));
  std::sort(times.begin(), times.end());
  return times;
}

// The median of SortedEventTimesMs (for an even count the upper of the two middle times).
template <typename F>
float MedianMs(F&& fn, int warm = 3, int reps = 20) {
  const std::vector<float> times = SortedEventTimesMs(fn, warm, reps);
  return times[times.size() / 2];
}

// Like SortedEventTimesMs, but the `reps` calls are issued back to back with an event between
// each and no host wait inside the timed span, the way the engine issues them: a call's time
// may then include waiting for the tail of the one before it.
template <typename F>
std::vector<float> SortedBackToBackTimesMs(F&& fn, int warm, int reps) {
  for (int i = 0; i < warm; ++i) fn();
  SM90_BENCH_CUDA(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(reps + 1);
  for (cudaEvent_t& e : ev) SM90_BENCH_CUDA(cudaEventCreate(&e));
  SM90_BENCH_CUDA(cudaEventRecord(ev[0]));
  for (int i = 0; i < reps; ++i) {
    fn();
    SM90_BENCH_CUDA(cudaEventRecord(ev[i + 1]));
  }
  SM90_BENCH_CUDA(cudaEventSynchronize(ev[reps]));
  std::vector<float> times(reps);
  for (int i = 0; i < reps; ++i) {
    SM90_BENCH_CUDA(cudaEventElapsedTime(&times[i], ev[i], ev[i + 1]));
  }
  for (cudaEvent_t e : ev) SM90_BENCH_CUDA(cudaEventDestroy(e));
  std::sort(times.begin(), times.end());
  return times;
}

// The median of SortedBackToBackTimesMs, picked as MedianMs picks it.
template <typename F>
float MedianBackToBackMs(F&& fn, int warm = 3, int reps = 20) {
  const std::vector<float> times = SortedBackToBackTimesMs(fn, warm, reps);
  return times[times.size() / 2];
}

}  // namespace moe::bench

#endif  // MOE_BENCH_SM90_BENCH_UTIL_H_
