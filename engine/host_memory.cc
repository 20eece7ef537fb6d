// glibc malloc settings for processes that move large host tensors (see host_memory.h).
#include "engine/host_memory.h"

#include <malloc.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>
#include <vector>

namespace moe {

bool RetainFreedHeapMemory() {
  // M_MMAP_MAX = 0 rather than a higher M_MMAP_THRESHOLD, which mallopt caps at 32 MiB (the
  // size of a [8192, 1024] fp32 tensor, so such tensors would still be mapped afresh).
  const bool arenas = mallopt(M_ARENA_MAX, 1) == 1;
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  return arenas && no_mmap && no_trim;
}

void ParallelMemcpy(void* dst, const void* src, size_t bytes) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = bytes < kParallelCopyMinBytes ? 1 : std::min<size_t>(8, cores);
  if (threads <= 1) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return;
  }
  // Equal pieces rounded up to 4 KiB; the caller's thread copies the first.
  const size_t piece = (bytes / threads + 4095) / 4096 * 4096;
  std::vector<std::thread> workers;
  for (size_t off = piece; off < bytes; off += piece) {
    const size_t len = std::min(piece, bytes - off);
    workers.emplace_back([=] {
      std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, len);
    });
  }
  std::memcpy(dst, src, std::min(piece, bytes));
  for (std::thread& w : workers) w.join();
}

}  // namespace moe
