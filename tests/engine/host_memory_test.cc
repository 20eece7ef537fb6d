// moe::RetainFreedHeapMemory (engine/host_memory.h): before it, glibc maps a 64 MiB block
// afresh; after it, such blocks come from the heap, and the heap keeps them once freed. Its own
// binary: the settings are the whole process's.
#include "engine/host_memory.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>
#include <cstring>

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

}  // namespace
}  // namespace moe
