// glibc malloc settings for processes that move large host tensors (see host_memory.h).
#include "engine/host_memory.h"

#include <malloc.h>

#include <climits>

namespace moe {

bool RetainFreedHeapMemory() {
  // M_MMAP_MAX = 0 rather than a higher M_MMAP_THRESHOLD, which mallopt caps at 32 MiB (the
  // size of a [8192, 1024] fp32 tensor, so such tensors would still be mapped afresh).
  const bool arenas = mallopt(M_ARENA_MAX, 1) == 1;
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  return arenas && no_mmap && no_trim;
}

}  // namespace moe
