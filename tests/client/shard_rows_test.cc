// ShardedLayer's GPU ops (client/shard_rows.h) against a CPU reference on fresh random inputs:
// each shard's rows (ascending tokens with a pick in its range) and counts bitwise, the first bad
// id and its value, and the float32 scatter-add of partials shard after shard bitwise equal to
// the same sums on the CPU; outputs poisoned first. Label gpu: skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "client/shard_rows.h"
#include "tests/client/cuda_test_util.h"

namespace moe {
namespace {

namespace sr = client::shard_rows;

template <typename T>
T* Upload(const std::vector<T>& v) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(1, v.size() * sizeof(T))) != cudaSuccess) return nullptr;
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return static_cast<T*>(p);
}
template <typename T>
std::vector<T> Download(const T* p, size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

struct Selected {
  std::vector<std::vector<int32_t>> rows;
  std::vector<int32_t> summary;
};

// Runs SelectShardRows on `ids` over shards of `bounds` (shard s: [bounds[s], bounds[s+1])).
Selected Select(const std::vector<int32_t>& ids, int64_t tokens, int32_t k,
                const std::vector<int32_t>& bounds) {
  const int32_t shards = static_cast<int32_t>(bounds.size()) - 1, experts = bounds.back();
  std::vector<int32_t> shard_of(experts);
  for (int32_t s = 0; s < shards; ++s) {
    for (int32_t e = bounds[s]; e < bounds[s + 1]; ++e) shard_of[e] = s;
  }
  size_t temp_bytes = 0;
  EXPECT_EQ(sr::SelectTempBytes(tokens, &temp_bytes), cudaSuccess);
  int32_t* d_ids = Upload(ids);
  int32_t* d_shard_of = Upload(shard_of);
  uint8_t* flags = Upload(std::vector<uint8_t>(shards * tokens, 7));
  int32_t* rows = Upload(std::vector<int32_t>(shards * tokens, -5));
  int32_t* summary = Upload(std::vector<int32_t>(sr::SummaryInts(shards), -5));
  void* temp = Upload(std::vector<char>(temp_bytes));
  EXPECT_EQ(sr::SelectShardRows(d_ids, tokens, k, d_shard_of, experts, shards, flags, rows,
                                summary, temp, temp_bytes, nullptr),
            cudaSuccess);
  Selected out;
  out.summary = Download(summary, sr::SummaryInts(shards));
  const std::vector<int32_t> all = Download(rows, shards * tokens);
  for (int32_t s = 0; s < shards; ++s) {
    const int32_t n = std::max(0, out.summary[s]);
    out.rows.emplace_back(all.begin() + s * tokens, all.begin() + s * tokens + n);
  }
  for (void* p : {static_cast<void*>(d_ids), static_cast<void*>(d_shard_of),
                  static_cast<void*>(flags), static_cast<void*>(rows),
                  static_cast<void*>(summary), temp}) {
    cudaFree(p);
  }
  return out;
}

TEST(ShardRowsTest, SelectMatchesTheCpuReference) {
  if (!cuda_test::HaveGpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(31);
  for (auto [tokens, k, bounds] :
       {std::tuple{int64_t{1000}, 2, std::vector<int32_t>{0, 4, 7}},
        std::tuple{int64_t{4097}, 8, std::vector<int32_t>{0, 43, 86, 128}},
        std::tuple{int64_t{3}, 1, std::vector<int32_t>{0, 1, 2, 3, 4, 5}}}) {
    SCOPED_TRACE(testing::Message() << "tokens " << tokens << " k " << k);
    const int32_t experts = bounds.back(), shards = static_cast<int32_t>(bounds.size()) - 1;
    std::vector<int32_t> ids(tokens * k);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % experts);
    const Selected got = Select(ids, tokens, k, bounds);
    for (int32_t s = 0; s < shards; ++s) {
      std::vector<int32_t> want;
      for (int64_t t = 0; t < tokens; ++t) {
        for (int32_t j = 0; j < k; ++j) {
          const int32_t e = ids[t * k + j];
          if (e >= bounds[s] && e < bounds[s + 1]) {
            want.push_back(static_cast<int32_t>(t));
            break;
          }
        }
      }
      EXPECT_EQ(got.summary[s], static_cast<int32_t>(want.size())) << "shard " << s;
      EXPECT_EQ(got.rows[s], want) << "shard " << s;
    }
    EXPECT_EQ(got.summary[shards], sr::kNoBadId);
  }
}

TEST(ShardRowsTest, TheFirstBadIdIsReported) {
  if (!cuda_test::HaveGpu()) GTEST_SKIP() << "no GPU";
  std::vector<int32_t> ids(50 * 2, 1);
  ids[41 * 2 + 1] = 9;   // later
  ids[17 * 2 + 0] = -3;  // first
  const Selected got = Select(ids, 50, 2, {0, 2, 4});
  EXPECT_EQ(got.summary[2], 17 * 2);
  EXPECT_EQ(got.summary[3], -3);
}

TEST(ShardRowsTest, ScatterAddSumsShardAfterShardAsTheCpuDoes) {
  if (!cuda_test::HaveGpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(8);
  std::normal_distribution<float> n(0.f, 1.f);
  for (int64_t width : {int64_t{256}, int64_t{7}, int64_t{2}}) {
    SCOPED_TRACE(testing::Message() << "width " << width);
    const int64_t tokens = 333;
    std::vector<float> want(tokens * width, 0.f);
    float* dst = Upload(want);
    for (int shard = 0; shard < 3; ++shard) {
      std::vector<int32_t> rows;
      for (int32_t t = 0; t < tokens; ++t) {
        if (rng() % 3 != 0) rows.push_back(t);
      }
      std::vector<float> src(rows.size() * width);
      for (float& v : src) v = n(rng);
      for (size_t i = 0; i < rows.size(); ++i) {
        for (int64_t j = 0; j < width; ++j) want[rows[i] * width + j] += src[i * width + j];
      }
      float* d_src = Upload(src);
      int32_t* d_rows = Upload(rows);
      EXPECT_EQ(sr::ScatterAddRows(d_src, d_rows, static_cast<int64_t>(rows.size()), width, dst,
                                   nullptr),
                cudaSuccess);
      cudaFree(d_src);
      cudaFree(d_rows);
    }
    const std::vector<float> got = Download(dst, want.size());
    cudaFree(dst);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
  }
}

}  // namespace
}  // namespace moe
