// glibc malloc settings for processes that move large host tensors (see host_memory.h).
#include "common/host_memory.h"

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <thread>
#include <vector>

namespace moe {
namespace {

// The installed large-tensor memory, read without a lock on every allocation and release.
std::atomic<const LargeTensorMemory*> large_tensor_memory{nullptr};
// Open LargeTensorMemoryScopes on this thread.
thread_local int large_tensor_scopes = 0;

}  // namespace

LargeTensorMemory SetLargeTensorMemory(const LargeTensorMemory& memory) {
  // Never freed: a buffer may be released through it long after the next install.
  const LargeTensorMemory* previous =
      large_tensor_memory.exchange(new LargeTensorMemory(memory), std::memory_order_acq_rel);
  return previous != nullptr ? *previous : LargeTensorMemory{};
}

LargeTensorMemoryScope::LargeTensorMemoryScope() { ++large_tensor_scopes; }
LargeTensorMemoryScope::~LargeTensorMemoryScope() { --large_tensor_scopes; }

void* AllocateTensorBytes(size_t bytes) {
  if (bytes >= kLargeTensorBytes && large_tensor_scopes > 0) {
    const LargeTensorMemory* m = large_tensor_memory.load(std::memory_order_acquire);
    if (m != nullptr && m->allocate != nullptr) {
      if (void* p = m->allocate(bytes)) return p;
    }
  }
  return ::operator new(bytes);
}

void ReleaseTensorBytes(void* p, size_t bytes) {
  if (p == nullptr) return;
  if (bytes >= kLargeTensorBytes) {
    const LargeTensorMemory* m = large_tensor_memory.load(std::memory_order_acquire);
    if (m != nullptr && m->release != nullptr && m->release(p, bytes)) return;
  }
  ::operator delete(p);
}

bool RetainFreedHeapMemory() {
  // M_MMAP_MAX = 0 rather than a higher M_MMAP_THRESHOLD, which mallopt caps at 32 MiB (the
  // size of a [8192, 1024] fp32 tensor, so such tensors would still be mapped afresh).
  const bool arenas = mallopt(M_ARENA_MAX, 1) == 1;
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  return arenas && no_mmap && no_trim;
}

void ParallelForInterleaved(size_t n, const std::function<void(size_t)>& work) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min<size_t>({8, cores, n});
  auto run = [&](size_t t) {
    for (size_t i = t; i < n; i += threads) work(i);
  };
  std::vector<std::thread> workers;
  for (size_t t = 1; t < threads; ++t) workers.emplace_back(run, t);
  if (threads > 0) run(0);
  for (std::thread& w : workers) w.join();
}

void ParallelMemcpy(void* dst, const void* src, size_t bytes) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = bytes < kParallelCopyMinBytes ? 1 : std::min<size_t>(8, cores);
  if (threads <= 1) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return;
  }
  // Equal pieces rounded up to 4 KiB, one a thread.
  const size_t piece = (bytes / threads + 4095) / 4096 * 4096;
  ParallelForInterleaved((bytes + piece - 1) / piece, [=](size_t i) {
    const size_t off = i * piece;
    std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off,
                std::min(piece, bytes - off));
  });
}

}  // namespace moe
