// common/host_memory.h. moe::RetainFreedHeapMemory: before it, glibc maps a 64 MiB block
// afresh; after it, such blocks come from the heap, and the heap keeps them once freed (its own
// binary: the settings are the whole process's). ParallelMemcpy: every byte, and none past the
// end, on sizes around its thread and page splits. SetLargeTensorMemory: which tensors take the
// installed memory.
#include "common/host_memory.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <vector>

#include "common/tensor.h"

namespace moe {
namespace {

constexpr size_t kBlock = size_t{64} << 20;

// Mapped regions (mallinfo2().hblks) while one kBlock allocation is live, less before it.
size_t MappedBy64MiB() {
  const size_t before = mallinfo2().hblks;
  void* p = std::malloc(kBlock);
  EXPECT_NE(p, nullptr);
  std::memset(p, 1, 4096);
  const size_t during = mallinfo2().hblks;
  std::free(p);
  return during - before;
}

TEST(HostMemoryTest, LargeBlocksComeFromTheHeapAndStayThere) {
  ASSERT_EQ(MappedBy64MiB(), 1u) << "glibc's default: a 64 MiB block is its own mapping";
  ASSERT_TRUE(RetainFreedHeapMemory());
  EXPECT_EQ(MappedBy64MiB(), 0u);
  // The freed block stayed in the heap (not trimmed): at least its size is free there.
  EXPECT_GE(mallinfo2().fordblks, kBlock);
}

TEST(HostMemoryTest, ParallelMemcpyCopiesEveryByteAndNoMore) {
  constexpr size_t kGuard = 4096;
  constexpr unsigned char kPoison = 0xA5;
  for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, kParallelCopyMinBytes - 1,
                   kParallelCopyMinBytes, kParallelCopyMinBytes + 4097, (size_t{37} << 20) + 13}) {
    std::mt19937 rng(static_cast<uint32_t>(n + 1));
    std::vector<unsigned char> src(n);
    for (unsigned char& b : src) b = static_cast<unsigned char>(rng());
    std::vector<unsigned char> dst(n + kGuard, kPoison);
    ParallelMemcpy(dst.data(), src.data(), n);
    EXPECT_EQ(std::memcmp(dst.data(), src.data(), n), 0) << n << " bytes differ";
    for (size_t i = n; i < n + kGuard; ++i) {
      ASSERT_EQ(dst[i], kPoison) << "guard byte " << i - n << " written after " << n << " bytes";
    }
  }
}

TEST(HostMemoryTest, ParallelForInterleavedRunsEveryIndexOnce) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{100}}) {
    std::vector<std::atomic<int>> runs(n);
    ParallelForInterleaved(n, [&](size_t i) { runs[i].fetch_add(1); });
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(runs[i].load(), 1) << "index " << i << " of " << n;
  }
}

// A large-tensor memory that serves from malloc and remembers what it handed out.
std::mutex fake_mu;
std::set<void*> fake_blocks;
int fake_releases = 0;
void* FakeAllocate(size_t bytes) {
  void* p = std::malloc(bytes);
  std::lock_guard<std::mutex> lock(fake_mu);
  fake_blocks.insert(p);
  return p;
}
bool FakeRelease(void* p, size_t) {
  std::lock_guard<std::mutex> lock(fake_mu);
  if (fake_blocks.erase(p) == 0) return false;
  std::free(p);
  ++fake_releases;
  return true;
}
bool FakeOwns(const void* p) {
  std::lock_guard<std::mutex> lock(fake_mu);
  return fake_blocks.count(const_cast<void*>(p)) > 0;
}

// SetLargeTensorMemory: inside a LargeTensorMemoryScope, tensors of kLargeTensorBytes and more
// take the installed memory, smaller ones the heap; outside one, all take the heap; a buffer
// allocated before the install goes back to the heap, and a memory with nothing to give leaves
// the allocation to the heap.
TEST(HostMemoryTest, LargeTensorsOfTheDataPathTakeTheInstalledMemory) {
  const int64_t large = static_cast<int64_t>(kLargeTensorBytes / 4);
  Tensor before = Tensor::Uninitialized(DType::kFloat32, {large});
  const LargeTensorMemory previous = SetLargeTensorMemory({FakeAllocate, FakeRelease});
  {
    Tensor outside = Tensor::Uninitialized(DType::kFloat32, {large});
    EXPECT_FALSE(FakeOwns(outside.bytes.data()));
    LargeTensorMemoryScope data_path;
    Tensor big = Tensor::Uninitialized(DType::kFloat32, {large});
    Tensor small = Tensor::Uninitialized(DType::kFloat32, {large - 1});
    EXPECT_TRUE(FakeOwns(big.bytes.data()));
    EXPECT_FALSE(FakeOwns(small.bytes.data()));
    EXPECT_FALSE(FakeOwns(before.bytes.data()));
    before = Tensor();  // the fake declines it: the heap frees it
    EXPECT_EQ(fake_releases, 0);
  }
  EXPECT_EQ(fake_releases, 1);
  SetLargeTensorMemory({[](size_t) -> void* { return nullptr; }, FakeRelease});
  {
    LargeTensorMemoryScope data_path;
    Tensor big = Tensor::Uninitialized(DType::kFloat32, {large});
    EXPECT_FALSE(FakeOwns(big.bytes.data()));
    big.as<float>()[large - 1] = 1.f;
  }
  SetLargeTensorMemory(previous);
  EXPECT_EQ(fake_releases, 1);
}

}  // namespace
}  // namespace moe
