// Process-wide glibc malloc settings for a process that moves large host tensors: moe-server
// (its --retain_freed_memory flag) and, by their own choice, trainer processes using moe::client.
//
// By default glibc serves every block of 32 MiB or more (and, in the per-thread arenas gRPC's
// threads use, anything their 64 MiB heaps cannot hold) with a fresh mmap and unmaps it on
// free, so each micro-batch's tensors are page-faulted in anew, which costs several times the
// copy itself. Retaining freed memory (no mmap for large blocks, no trimming, one arena) makes
// each micro-batch reuse the last one's pages, at the price of keeping the process's peak heap
// (docs/decisions/0005-retained-heap-memory.md). The same settings without code:
// GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:
// glibc.malloc.arena_max=1 (one string, no spaces).
//
// Also here: the threads that copy large host tensors on the hot path (the client's copy of a
// caller's tensors by ParallelMemcpy, the CUDA engine's pinned staging piece by piece by
// ParallelForInterleaved). One thread cannot saturate host memory bandwidth; 8 copy the same
// bytes about 3x faster (docs/decisions/0004-host-staging.md).
#ifndef MOE_COMMON_HOST_MEMORY_H_
#define MOE_COMMON_HOST_MEMORY_H_

#include <cstddef>
#include <functional>

namespace moe {

// Copies of at least this many bytes are split over threads.
inline constexpr size_t kParallelCopyMinBytes = size_t{4} << 20;

// memcpy split over up to 8 threads (at most the machine's cores) from kParallelCopyMinBytes
// on; one thread below it. Returns when every byte is copied.
void ParallelMemcpy(void* dst, const void* src, size_t bytes);

// Runs work(i) for every i in [0, n) on up to 8 threads (at most the machine's cores and n),
// the caller's thread among them: thread t takes i = t, t + threads, ..., so the calls finish
// roughly in the order of i (a consumer of piece i, such as a DMA, can start on the first pieces
// while later ones are still being produced). Returns when every call has.
void ParallelForInterleaved(size_t n, const std::function<void(size_t)>& work);

// Where large tensor bytes live. A Tensor's bytes of at least kLargeTensorBytes allocated while
// a LargeTensorMemoryScope is open on the thread (a request's x or dout as moe-server assembles
// it, a result's out or dx as the CUDA layer makes it) come from the process's large-tensor
// memory: the C++ heap, unless an engine installed its own. The CUDA engine installs page-locked
// memory (engine/cuda/pinned_pool.h), so that its host <-> device copies of those tensors are
// DMAs straight from and into them instead of copies through a staging buffer. Outside a scope
// (weight exports, checkpoints, a trainer's own tensors) the heap serves: those tensors would
// only fill the page-locked memory the data path reuses.
inline constexpr size_t kLargeTensorBytes = size_t{4} << 20;
struct LargeTensorMemory {
  // Null when it has no memory to give: the heap serves that allocation.
  void* (*allocate)(size_t bytes) = nullptr;
  // Takes `p` back and returns true when it handed `p` out; false leaves `p` to the heap (a
  // buffer allocated before it was installed, or one it declined).
  bool (*release)(void* p, size_t bytes) = nullptr;
};
// Installs `memory` for the rest of the process, or until the next call; returns the one before
// (for tests). Buffers allocated under the previous memory stay valid.
LargeTensorMemory SetLargeTensorMemory(const LargeTensorMemory& memory);
// Opens the data path's scope on this thread for its lifetime (nests).
class LargeTensorMemoryScope {
 public:
  LargeTensorMemoryScope();
  ~LargeTensorMemoryScope();
  LargeTensorMemoryScope(const LargeTensorMemoryScope&) = delete;
  LargeTensorMemoryScope& operator=(const LargeTensorMemoryScope&) = delete;
};
// TensorBytes' allocation and release (common/tensor.h); bad_alloc as operator new.
void* AllocateTensorBytes(size_t bytes);
void ReleaseTensorBytes(void* p, size_t bytes);

// Applies the settings above. Call it before the process starts any thread (the arena limit
// applies to arenas created afterwards). False when the C library refused one of them (not
// glibc, or a glibc without the parameter); the process then keeps its defaults for that one.
bool RetainFreedHeapMemory();

}  // namespace moe

#endif  // MOE_COMMON_HOST_MEMORY_H_
