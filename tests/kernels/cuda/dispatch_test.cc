// The GPU MoEBlaze dispatch against the CPU reference (kernels/cpu DispatchCpu): counts,
// offsets, entries and slot_of must match bitwise on fresh random routings, with every output
// poisoned first so an unwritten element shows. Shapes cover T = 1, K = 1, K = E, experts that
// receive nothing, shards, E over the 256-expert shared-memory chunk, T not a multiple of the
// 1024-token tile, and a large T; together they take each of the write kernel's three ways
// to its offsets (fused scan, shared offsets, global offsets). Needs a GPU (ctest label "gpu");
// skips itself without one.
#include "kernels/cuda/dispatch.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/dispatch.h"

namespace moe::kernels {
namespace {

#define ASSERT_CUDA(expr) \
  ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

struct Case {
  int64_t tokens;
  int32_t experts, top_k, first, count;
  bool skewed;  // draw ids from a few hot experts so many experts stay empty
};

std::string Describe(const Case& c, uint64_t seed) {
  return "T=" + std::to_string(c.tokens) + " E=" + std::to_string(c.experts) +
         " K=" + std::to_string(c.top_k) + " shard=[" + std::to_string(c.first) + ", +" +
         std::to_string(c.count) + ") skewed=" + std::to_string(c.skewed) +
         " seed=" + std::to_string(seed);
}

// K distinct ids per token.
std::vector<int32_t> RandomIds(const Case& c, std::mt19937_64& rng) {
  std::vector<int32_t> ids(c.tokens * c.top_k);
  std::vector<int32_t> pool(c.experts);
  std::iota(pool.begin(), pool.end(), 0);
  const int32_t hot = c.skewed ? std::max(c.top_k, std::min(c.experts, c.top_k + 2)) : c.experts;
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int32_t k = 0; k < c.top_k; ++k) {
      std::uniform_int_distribution<int32_t> pick(k, std::max(k, hot - 1));
      std::swap(pool[k], pool[pick(rng)]);
      ids[t * c.top_k + k] = pool[k];
    }
  }
  return ids;
}

class DispatchTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(DispatchTest, MatchesCpuBitwise) {
  const Case c = GetParam();
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  const std::vector<int32_t> ids = RandomIds(c, rng);
  const int64_t n = c.tokens * c.top_k;

  std::vector<int32_t> counts(c.count), offsets(c.count + 1), entries(n, -7), slot_of(n);
  DispatchCpu(ids.data(), c.tokens, c.top_k, c.first, c.count, counts.data(), offsets.data(),
              entries.data(), slot_of.data());

  int32_t *d_ids, *d_counts, *d_offsets, *d_entries, *d_slot;
  void* ws;
  const size_t ws_bytes = DispatchWorkspaceBytes(c.tokens, c.count);
  ASSERT_CUDA(cudaMalloc(&d_ids, n * 4));
  ASSERT_CUDA(cudaMalloc(&d_counts, c.count * 4));
  ASSERT_CUDA(cudaMalloc(&d_offsets, (c.count + 1) * 4));
  ASSERT_CUDA(cudaMalloc(&d_entries, n * 4));
  ASSERT_CUDA(cudaMalloc(&d_slot, n * 4));
  ASSERT_CUDA(cudaMalloc(&ws, ws_bytes));
  ASSERT_CUDA(cudaMemcpy(d_ids, ids.data(), n * 4, cudaMemcpyHostToDevice));
  // Poison: 0x7f7f7f7f is no valid count, offset, entry or slot.
  ASSERT_CUDA(cudaMemset(d_counts, 0x7f, c.count * 4));
  ASSERT_CUDA(cudaMemset(d_offsets, 0x7f, (c.count + 1) * 4));
  ASSERT_CUDA(cudaMemset(d_entries, 0x7f, n * 4));
  ASSERT_CUDA(cudaMemset(d_slot, 0x7f, n * 4));
  ASSERT_CUDA(cudaMemset(ws, 0x5a, ws_bytes));

  ASSERT_CUDA(LaunchDispatch(d_ids, c.tokens, c.top_k, c.first, c.count, d_counts, d_offsets,
                             d_entries, d_slot, ws, ws_bytes, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> g_counts(c.count), g_offsets(c.count + 1), g_entries(n), g_slot(n);
  ASSERT_CUDA(cudaMemcpy(g_counts.data(), d_counts, c.count * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(g_offsets.data(), d_offsets, (c.count + 1) * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(g_entries.data(), d_entries, n * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(g_slot.data(), d_slot, n * 4, cudaMemcpyDeviceToHost));
  for (void* p :
       {static_cast<void*>(d_ids), static_cast<void*>(d_counts), static_cast<void*>(d_offsets),
        static_cast<void*>(d_entries), static_cast<void*>(d_slot), ws}) {
    cudaFree(p);
  }

  const std::string what = Describe(c, seed);
  EXPECT_EQ(g_counts, counts) << what;
  EXPECT_EQ(g_offsets, offsets) << what;
  const int32_t routed = offsets[c.count];
  // Only the first `routed` entries are defined; the rest stay poisoned on the GPU.
  EXPECT_TRUE(std::equal(entries.begin(), entries.begin() + routed, g_entries.begin())) << what;
  EXPECT_EQ(g_slot, slot_of) << what;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DispatchTest,
    ::testing::Values(Case{1, 1, 1, 0, 1, false},         // T = 1, K = 1, E = 1
                      Case{1, 7, 7, 0, 7, false},         // K = E
                      Case{37, 5, 2, 0, 5, false},        // E not a power of two
                      Case{100, 64, 1, 0, 64, true},      // K = 1, most experts empty
                      Case{1500, 12, 3, 3, 6, false},     // shard, T across tiles
                      Case{1024, 8, 2, 0, 8, false},      // exactly one tile
                      Case{3000, 300, 4, 0, 300, false},  // E over the 256-expert chunk
                      Case{2049, 257, 8, 200, 57, true},  // shard at the end, skewed
                      Case{131072, 64, 4, 0, 64, false},  // the bench shape
                      Case{65537, 128, 8, 16, 64, false},
                      Case{300000, 64, 2, 0, 64, false},     // past the fused-scan size
                      Case{2049, 2100, 3, 0, 2100, true},    // past the fused-scan experts
                      Case{100, 9000, 2, 0, 9000, false}));  // offsets beyond shared memory

}  // namespace
}  // namespace moe::kernels
