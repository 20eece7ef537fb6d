// The pinned-staging copies (engine/cuda/host_staging.h): host -> device -> host round trips
// below the staging threshold,
// at it, across several pieces and past one staging buffer (kMaxStagingBytes), each into a
// poisoned destination with guard bytes after it. The host -> device half is also read back by
// a plain cudaMemcpy, so a bug in one direction cannot hide behind the other. Part of
// moe_engine_cuda_test (ctest label "gpu").
#include "engine/cuda/host_staging.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "engine/cuda/device.h"

namespace moe::cuda {
namespace {

constexpr size_t kGuard = 4096;
constexpr unsigned char kPoisonByte = 0xA5;

std::vector<unsigned char> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t r = rng();
    std::memcpy(v.data() + i, &r, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<unsigned char>(rng());
  return v;
}

// Compares the first n bytes of got with want and checks the kGuard bytes after them.
void ExpectCopied(const std::vector<unsigned char>& got, const std::vector<unsigned char>& want,
                  size_t n, const char* what) {
  ASSERT_GE(got.size(), n + kGuard);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), n), 0) << what << ": " << n << " bytes differ";
  for (size_t i = n; i < n + kGuard; ++i) {
    ASSERT_EQ(got[i], kPoisonByte) << what << ": guard byte " << i - n << " written";
  }
}

TEST(HostStagingTest, RoundTripsThroughTheDevice) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (size_t n : {size_t{0}, size_t{3}, kMinStagedBytes - 16, kMinStagedBytes,
                   (size_t{20} << 20) + 3, kMaxStagingBytes + 4096 + 5}) {
    SCOPED_TRACE(n);
    const std::vector<unsigned char> src = RandomBytes(n, 7 * n + 3);
    void* dev = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, n + kGuard), cudaSuccess);
    ASSERT_EQ(cudaMemset(dev, kPoisonByte, n + kGuard), cudaSuccess);
    ASSERT_TRUE(CopyToDevice(0, dev, src.data(), n, stream).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<unsigned char> plain(n + kGuard);
    ASSERT_EQ(cudaMemcpy(plain.data(), dev, n + kGuard, cudaMemcpyDeviceToHost), cudaSuccess);
    ExpectCopied(plain, src, n, "CopyToDevice");
    std::vector<unsigned char> back(n + kGuard, kPoisonByte);
    ASSERT_TRUE(CopyToHost(0, back.data(), dev, n, stream).ok());
    ExpectCopied(back, src, n, "CopyToHost");
    ASSERT_EQ(cudaFree(dev), cudaSuccess);
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace moe::cuda
