// The GPU MoEBlaze dispatch against the CPU reference (kernels/cpu DispatchCpu): counts,
// offsets, entries and slot_of must match bitwise on fresh random routings, with every output
// and the workspace poisoned first so an unwritten element shows. Shapes cover T = 1, K = 1,
// K = E, K over 8, experts that receive nothing, shards, E over the 128- and 256-expert limits
// of the tile-rank path, T not a multiple of any tile, and large T (2M tokens, the scale-2m
// preset). Every shape runs under several tilings: the heuristic's, each sub-tile size of the
// tile-rank path with tiles of many sub-tiles (the running per-expert count across sub-tiles),
// and the legacy global-bitmap path with each of its three ways to the offsets (fused scan,
// shared offsets, global offsets), and the place-pass options (programmatic dependent launch,
// entries staged in shared memory; one tile of the whole problem for the staging fallback
// where the tile is too large to stage). A tiling a shape cannot take must be refused with
// cudaErrorInvalidValue. Needs a GPU (ctest label "gpu"); skips itself without one.
#include "kernels/cuda/dispatch.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
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

struct Tiling {
  const char* name;
  DispatchConfig config;
};

// Whether LaunchDispatch must accept `t` for a shard of `count` experts.
bool Supported(const Tiling& t, int32_t count) {
  if (t.config.legacy || count > 256 || t.config.warps_per_tile == 0) return true;
  return count <= (t.config.warps_per_tile == 32 ? 128 : 256);
}

class DispatchTest : public ::testing::TestWithParam<std::tuple<Case, Tiling>> {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(DispatchTest, MatchesCpuBitwise) {
  const Case c = std::get<0>(GetParam());
  const Tiling tiling = std::get<1>(GetParam());
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  const std::vector<int32_t> ids = RandomIds(c, rng);
  const int64_t n = c.tokens * c.top_k;

  std::vector<int32_t> counts(c.count), offsets(c.count + 1), entries(n, -7), slot_of(n);
  DispatchCpu(ids.data(), c.tokens, c.top_k, c.first, c.count, counts.data(), offsets.data(),
              entries.data(), slot_of.data());

  int32_t *d_ids, *d_counts, *d_offsets, *d_entries, *d_slot;
  void* ws;
  const size_t ws_bytes = DispatchWorkspaceBytes(c.tokens, c.count, tiling.config);
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

  const cudaError_t launched =
      tiling.config.warps_per_tile == 0 && !tiling.config.legacy
          ? LaunchDispatch(d_ids, c.tokens, c.top_k, c.first, c.count, d_counts, d_offsets,
                           d_entries, d_slot, ws, ws_bytes, nullptr)
          : LaunchDispatch(d_ids, c.tokens, c.top_k, c.first, c.count, d_counts, d_offsets,
                           d_entries, d_slot, tiling.config, ws, ws_bytes, nullptr);
  if (!Supported(tiling, c.count)) {
    EXPECT_EQ(launched, cudaErrorInvalidValue) << tiling.name;
  } else {
    ASSERT_EQ(launched, cudaSuccess) << tiling.name << ": " << cudaGetErrorString(launched);
  }
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

  if (!Supported(tiling, c.count)) return;
  const std::string what = Describe(c, seed) + " tiling=" + tiling.name;
  EXPECT_EQ(g_counts, counts) << what;
  EXPECT_EQ(g_offsets, offsets) << what;
  const int32_t routed = offsets[c.count];
  // Only the first `routed` entries are defined; the rest stay poisoned on the GPU.
  EXPECT_TRUE(std::equal(entries.begin(), entries.begin() + routed, g_entries.begin())) << what;
  EXPECT_EQ(g_slot, slot_of) << what;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DispatchTest,
    ::testing::Combine(
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
                          Case{300000, 64, 2, 0, 64, false},    // past the fused-scan size
                          Case{2049, 2100, 3, 0, 2100, true},   // past the fused-scan experts
                          Case{100, 9000, 2, 0, 9000, false},   // offsets beyond shared memory
                          Case{5000, 150, 12, 0, 150, false},   // K over 8, E over 128
                          Case{3000, 40, 5, 0, 33, false},      // shard of 33: 6 id bits
                          Case{2000, 64, 3, 40, 20, false},     // shard in the middle
                          Case{4097, 256, 8, 0, 256, false},    // the rank path's expert limit
                          Case{8192, 256, 8, 0, 256, false},    // deepseek-v3
                          Case{2097152, 64, 4, 0, 64, false}),  // scale-2m
        ::testing::Values(
            Tiling{"heuristic", DispatchConfig{}}, Tiling{"legacy", DispatchConfig{0, 0, true}},
            Tiling{"w4", DispatchConfig{4, 8192, false}},
            Tiling{"w8_two_tiles", DispatchConfig{8, 512, false}},
            Tiling{"w16_one_cell", DispatchConfig{16, 1, false}},
            Tiling{"w32", DispatchConfig{32, 16384, false}},
            Tiling{"w32_few_tiles", DispatchConfig{32, 600, false}},
            Tiling{"w32_pdl_staged", DispatchConfig{32, 16384, false, 2, 2}},
            Tiling{"w4_staged", DispatchConfig{4, 8192, false, 1, 2}},
            Tiling{"w8_two_tiles_pdl", DispatchConfig{8, 512, false, 2, 1}},
            Tiling{"w16_one_cell_staged", DispatchConfig{16, 1, false, 1, 2}},
            Tiling{"w8_many_tiles_pdl_staged", DispatchConfig{8, 1 << 30, false, 2, 2}})),
    [](const ::testing::TestParamInfo<DispatchTest::ParamType>& info) {
      return std::to_string(info.index) + "_" + std::get<1>(info.param).name;
    });

}  // namespace
}  // namespace moe::kernels
