// The parts of the kernel benchmark moe_bench (moe_bench.cc) that its three modes share: the
// presets, the timing of one series with the GPU's state around it, the JSON lines, and the
// entry points of --max-t (moe_bench_max_t.cc), --ceiling (moe_bench_ceiling.cc) and --layer
// (moe_bench_layer.cc).
#ifndef MOE_BENCH_MOE_BENCH_H_
#define MOE_BENCH_MOE_BENCH_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/gpu_sensor.h"
#include "engine/cuda/device.h"

namespace moe::bench {

struct Preset {
  const char* name;
  int64_t T, d, h, E, K;
};

inline constexpr Preset kPresets[] = {
    {"sonic-7b", 24576, 1536, 256, 128, 8},    {"olmoe", 16384, 2048, 1024, 64, 8},
    {"qwen3-a3b", 16384, 2048, 768, 128, 8},   {"mixtral", 8192, 4096, 14336, 8, 2},
    {"deepseek-v3", 8192, 7168, 2048, 256, 8}, {"scale-8k", 8192, 2048, 1024, 64, 4},
    {"scale-32k", 32768, 2048, 1024, 64, 4},   {"scale-128k", 131072, 2048, 1024, 64, 4},
    {"scale-512k", 524288, 2048, 1024, 64, 4}, {"scale-2m", 2097152, 2048, 1024, 64, 4},
};

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

#define CHECK_OK(expr)                                 \
  do {                                                 \
    if (absl::Status s_ = (expr); !s_.ok()) return s_; \
  } while (0)

// The GPU around each timed series (gpu_sensor.h): with a sensor, TimeMs first waits until the
// GPU is at most cool_to_c (when > 0; at most cool_timeout_s), then reads it after every timed
// run, outside the timed interval; `last` is the latest series' summary.
struct GpuWatch {
  const GpuSensor* sensor = nullptr;
  int cool_to_c = 0;
  double cool_timeout_s = 120;
  GpuSummary last;
};

// Times `fn` (which enqueues on `s`, possibly synchronising inside) with CUDA events.
template <typename Fn>
absl::StatusOr<double> TimeMs(cudaStream_t s, int warmup, int reps, Fn fn,
                              GpuWatch* watch = nullptr) {
  cudaEvent_t a, b;
  MOE_CUDA_RETURN(cudaEventCreate(&a));
  MOE_CUDA_RETURN(cudaEventCreate(&b));
  const GpuSensor* sensor = watch != nullptr ? watch->sensor : nullptr;
  GpuSummary gpu;
  if (sensor != nullptr && watch->cool_to_c > 0) {
    MOE_CUDA_RETURN(cudaStreamSynchronize(s));  // nothing of ours still heating it
    absl::StatusOr<double> waited = WaitUntilAtMost(
        watch->cool_to_c, watch->cool_timeout_s, 0.25,
        [&]() -> absl::StatusOr<int> {
          absl::StatusOr<GpuReading> r = sensor->Read();
          if (!r.ok()) return r.status();
          return r->temp_c;
        },
        [](double seconds) { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); },
        &gpu.cooled);
    if (!waited.ok()) return waited.status();
    gpu.cool_wait_s = *waited;
  }
  std::vector<double> times;
  for (int i = 0; i < warmup + reps; ++i) {
    MOE_CUDA_RETURN(cudaEventRecord(a, s));
    CHECK_OK(fn());
    MOE_CUDA_RETURN(cudaEventRecord(b, s));
    MOE_CUDA_RETURN(cudaEventSynchronize(b));
    float ms = 0;
    MOE_CUDA_RETURN(cudaEventElapsedTime(&ms, a, b));
    if (i >= warmup) {
      times.push_back(ms);
      if (sensor != nullptr) {
        absl::StatusOr<GpuReading> reading = sensor->Read();
        if (!reading.ok()) return reading.status();
        gpu.Add(*reading);
      }
    }
  }
  if (watch != nullptr) watch->last = gpu;
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return Median(times);
}

// Appends `line` (one JSON object) to the file at `path`; nothing when `path` is empty.
void AppendJsonLine(const std::string& path, const std::string& line);

// After a preset: the pool memory it left is given back, since a pool sized for one preset
// would crowd the next one's.
void ReleasePoolMemory();

// --max-t: the search for the largest T of the scale-* shape that fits (moe_bench.cc's file
// comment). Returns the number of failures.
int MaxTokens(bool recompute, double budget_s);

// The dense bf16 GEMM rate of cuBLAS on this GPU (TFLOP/s): M = N = K = 8192, fp32
// accumulation, random inputs, median of 20. The ceiling the "% of cuBLAS" columns compare to.
absl::StatusOr<double> CublasDenseTflops(GpuWatch* watch);

// Device copy bandwidth in GB/s (bytes read + bytes written per second): a 1 GiB
// device-to-device cudaMemcpyAsync, median of 20. The byte floors divide by it.
absl::StatusOr<double> CopyBandwidthGBs();

// The fewest bytes a training step of the layer moves through device memory (moe_bench_ceiling.cc).
double FloorBytes(const Preset& p);

// --layer: a training step through the Layer API on host tensors, on device tensors, and on
// device tensors with a done_event (moe_bench_layer.cc); JSON lines with impl "layer-api";
// returns the exit code.
int LayerApi(const std::vector<const Preset*>& todo, int warmup, int reps, const std::string& json);

// --ceiling's table and JSON lines (impl "cublas-ceiling"); returns the exit code.
int PrintCeiling(const std::vector<const Preset*>& todo, int warmup, int reps, double peak,
                 double copy_gbs, const std::string& json, GpuWatch* watch);

}  // namespace moe::bench

#endif  // MOE_BENCH_MOE_BENCH_H_
