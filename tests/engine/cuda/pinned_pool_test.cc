// Page-locked large tensors (engine/cuda/pinned_pool.h): the pool reuses blocks by size class and
// keeps to its limit; once a CUDA engine exists, the process's large tensors are page-locked and
// small ones are not; and the host <-> device copies take them with one DMA, exactly, into
// poisoned buffers with guard bytes after them, whole blocks and views inside one; and only the
// data path (a layer's outputs, not its exported weights) is page-locked. Part of
// moe_engine_cuda_test (ctest label "gpu").
#include "engine/cuda/pinned_pool.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>

#include "common/host_memory.h"
#include "common/tensor.h"
#include "engine/cuda/cuda_engine.h"
#include "engine/cuda/host_staging.h"
#include "engine/layer.h"

namespace moe::cuda {
namespace {

constexpr size_t kGuard = 4096;
constexpr unsigned char kPoison = 0x5A;

bool HasDevice() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
}

bool PageLocked(const void* p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

TEST(PinnedPoolTest, ReusesBlocksByClassAndKeepsToItsLimit) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(PinnedPool::ClassBytes(size_t{20} << 20), size_t{20} << 20);
  EXPECT_EQ(PinnedPool::ClassBytes((size_t{20} << 20) - 100), size_t{20} << 20);
  EXPECT_EQ(PinnedPool::ClassBytes(75'000'000), size_t{80} << 20);  // 5 eighths of 128 MiB
  PinnedPool pool(size_t{64} << 20);
  void* a = pool.Allocate(size_t{20} << 20);
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(PageLocked(a));
  EXPECT_TRUE(pool.Release(a));
  EXPECT_EQ(pool.Allocate((size_t{20} << 20) - 100), a);  // the same class: the same block
  int local = 0;
  EXPECT_FALSE(pool.Release(&local));
  void* b = pool.Allocate(size_t{40} << 20);  // 20 + 40 MiB held: within 64
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(pool.Allocate(size_t{8} << 20), nullptr);  // 68 MiB would pass the limit
  EXPECT_EQ(pool.held_bytes(), size_t{60} << 20);
  EXPECT_TRUE(pool.Release(a));
  EXPECT_TRUE(pool.Release(b));
  // A smaller request takes a kept block up to half as large again, not one twice its size.
  EXPECT_EQ(pool.Allocate(size_t{14} << 20), a);        // 20 MiB for 14: kept
  EXPECT_EQ(pool.Allocate(size_t{20} << 20), nullptr);  // 40 MiB for 20: too large; 80 held
  EXPECT_TRUE(pool.Release(a));
  EXPECT_EQ(pool.held_bytes(), size_t{60} << 20);
}

TEST(PinnedPoolTest, AnEnginesLargeTensorsArePageLockedAndCopyExactly) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(CreateCudaEngine(0).ok());
  ASSERT_NE(PinnedPool::ForProcess(), nullptr);
  LargeTensorMemoryScope data_path;
  Tensor small = Tensor::Uninitialized(DType::kInt32, {int64_t{kLargeTensorBytes / 4} - 1});
  EXPECT_FALSE(PageLocked(small.bytes.data()));
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  std::mt19937_64 rng(11);
  for (size_t n : {kLargeTensorBytes, (size_t{20} << 20) + 3, kMaxStagingBytes + 4101}) {
    SCOPED_TRACE(n);
    TensorBytes src(n + kGuard), back(n + kGuard);
    ASSERT_TRUE(PageLocked(src.data()) && PageLocked(back.data()));
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(rng());
    // Whole buffers, then a view that starts 1000 bytes into them.
    for (size_t offset : {size_t{0}, size_t{1000}}) {
      const size_t len = n - offset;
      void* dev = nullptr;
      ASSERT_EQ(cudaMalloc(&dev, len + kGuard), cudaSuccess);
      ASSERT_EQ(cudaMemset(dev, kPoison, len + kGuard), cudaSuccess);
      ASSERT_TRUE(CopyToDevice(0, dev, src.data() + offset, len, stream).ok());
      std::memset(back.data(), kPoison, back.size());
      ASSERT_TRUE(CopyToHost(0, back.data() + offset, dev, len, stream).ok());
      EXPECT_EQ(std::memcmp(back.data() + offset, src.data() + offset, len), 0);
      for (size_t i = 0; i < offset; ++i) {
        ASSERT_EQ(back[i], std::byte{kPoison}) << "byte " << i << " before the view written";
      }
      for (size_t i = offset + len; i < back.size(); ++i) {
        ASSERT_EQ(back[i], std::byte{kPoison}) << "guard byte " << i - offset - len << " written";
      }
      std::vector<unsigned char> device_guard(kGuard);
      ASSERT_EQ(cudaMemcpy(device_guard.data(), static_cast<char*>(dev) + len, kGuard,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (unsigned char g : device_guard) ASSERT_EQ(g, kPoison) << "device guard written";
      ASSERT_EQ(cudaFree(dev), cudaSuccess);
    }
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Only the data path pins: a layer's Forward output and Backward dx are page-locked, its exported
// weights (a checkpoint's tensors, as large) are not, and nor is a large tensor made outside a
// scope; and the engine reports what the pool holds.
TEST(PinnedPoolTest, OnlyTheDataPathIsPageLocked) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateCudaEngine(0);
  ASSERT_TRUE(engine.ok()) << engine.status();
  LayerConfig config;
  config.num_experts = 8;
  config.top_k = 2;
  config.d_model = 1024;
  config.d_hidden = 1024;  // w1, w2, w3: 8 x 1024 x 1024 bf16 = 16 MiB each
  config.dtype = DType::kBFloat16;
  config.routing = RoutingMode::kServer;
  absl::StatusOr<std::unique_ptr<Layer>> layer = (*engine)->CreateLayer(config);
  ASSERT_TRUE(layer.ok()) << layer.status();
  // 4096 tokens x 1024 bf16 = 8 MiB, made outside a scope as a trainer's own tensor would be.
  Tensor x = Tensor::Zeros(DType::kBFloat16, {4096, 1024});
  EXPECT_FALSE(PageLocked(x.bytes.data()));
  ForwardRequest request;
  request.training = true;
  request.x = x.view();
  absl::StatusOr<ForwardResult> forward = (*layer)->Forward(request);
  ASSERT_TRUE(forward.ok()) << forward.status();
  EXPECT_TRUE(PageLocked(forward->out.bytes.data()));
  absl::StatusOr<BackwardResult> backward =
      (*layer)->Backward(std::move(forward->context), forward->out.view());
  ASSERT_TRUE(backward.ok()) << backward.status();
  EXPECT_TRUE(PageLocked(backward->dx.bytes.data()));
  absl::StatusOr<std::map<std::string, Tensor>> state = (*layer)->ExportState(true);
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_GE(state->at("w1").bytes.size(), kLargeTensorBytes);
  EXPECT_FALSE(PageLocked(state->at("w1").bytes.data()));
  EXPECT_GE((*engine)->pinned_host_bytes(), 2 * static_cast<int64_t>(size_t{8} << 20));
}

}  // namespace
}  // namespace moe::cuda
