// Helpers shared by the fused Hopper kernels' tests (sm90_expert_forward_test.cc,
// sm90_expert_backward_test.cc, sm90_weight_grad_test.cc) and, through bench/sm90_bench_util.h,
// their benchmarks: bf16 conversion, poison patterns, a device buffer, random inputs and
// routing, a case's shape, a problem built from its sizes, the sm_90 GPU check, and the
// normalised error the checks are judged by.
//
// Header-only and free of GoogleTest and Abseil, like the tests themselves, so each test stays
// one self-contained binary that runs on a bare GPU machine.
#ifndef MOE_TESTS_KERNELS_CUDA_SM90_TEST_UTIL_H_
#define MOE_TESTS_KERNELS_CUDA_SM90_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/sm90_expert_forward.h"

namespace moe::kernels::testing {

constexpr uint16_t kPoison = 0x7FA5;          // a bf16 NaN no kernel produces
constexpr uint32_t kPoisonF32 = 0x7FA5A5A5u;  // a float NaN no kernel produces (fp32 outputs)

inline float FloatFromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t ToBf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
inline float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// Inside a function returning bool: prints the failing call and returns false.
#define SM90_TEST_CHECK_CUDA(call)                                       \
  do {                                                                   \
    const cudaError_t err_ = (call);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(err_));                            \
      return false;                                                      \
    }                                                                    \
  } while (0)

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    if (cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(count, 1) * sizeof(T)) !=
        cudaSuccess)
      ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

inline std::vector<uint16_t> RandomBf16(size_t n, float scale, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = ToBf16(normal(rng));
  return v;
}

// ||a - b|| / ||b||; any non-finite a makes it infinite.
inline double NormalisedError(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Expert ids [tokens, top_k]: K distinct global experts per token, 30% of picks going to
// `hot` (>= 0) so that its group spans several ragged row blocks, none to `empty` (>= 0).
// With hot < 0 no draw is spent on the 30% coin, so hot = empty = -1 is plain uniform routing,
// draw for draw the same as the benches' (bench/sm90_bench_util.h).
inline std::vector<int32_t> RandomRouting(int64_t tokens, int32_t top_k, int32_t experts,
                                          int32_t empty, int32_t hot, std::mt19937_64& rng) {
  std::vector<int32_t> idx(tokens * top_k);
  std::uniform_int_distribution<int32_t> pick(0, experts - 1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int32_t k = 0; k < top_k; ++k) {
      int32_t e;
      bool again;
      do {
        e = (hot >= 0 && unit(rng) < 0.3f) ? hot : pick(rng);
        again = e == empty;
        for (int32_t j = 0; j < k; ++j) again |= idx[t * top_k + j] == e;
      } while (again);
      idx[t * top_k + k] = e;
    }
  }
  return idx;
}

// One test case: T tokens each routed to K of `experts_global` experts, of which this shard owns
// [expert_first, expert_first + expert_count); sizes d (model) and h (hidden).
struct ShardCase {
  const char* name;
  int64_t tokens;
  int32_t top_k;
  int32_t experts_global;
  int32_t expert_first;
  int32_t expert_count;
  int32_t d;
  int32_t h;
  int32_t empty_global;  // a global expert no token picks (-1: none)
  int32_t hot_global;    // a global expert picked far more often (ragged, multi-block groups)
};

// A problem of the given sizes, every other field left at its default (one expert block per
// W1/W3, no routed-row hint unless given).
inline Sm90ExpertProblem MakeProblem(int64_t tokens, int32_t top_k, int32_t experts,
                                     int32_t d_model, int32_t d_hidden, int64_t routed = -1) {
  Sm90ExpertProblem prob;
  prob.num_tokens = tokens;
  prob.top_k = top_k;
  prob.num_experts = experts;
  prob.d_model = d_model;
  prob.d_hidden = d_hidden;
  prob.num_routed = routed;
  return prob;
}

// True when device 0 can run the sm_90a kernels; otherwise prints the SKIP line to `out` (the
// tests' stdout, which scripts/gpu-check reads; a bench's stderr, keeping its stdout JSON only).
inline bool HaveSm90Gpu(std::FILE* out = stdout) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 || !Sm90DeviceSupported(0)) {
    std::fprintf(out, "SKIP: no sm_90 GPU\n");
    return false;
  }
  return true;
}

}  // namespace moe::kernels::testing

#endif  // MOE_TESTS_KERNELS_CUDA_SM90_TEST_UTIL_H_
