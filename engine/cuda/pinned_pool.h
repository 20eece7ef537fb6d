// Page-locked host memory for large tensors, installed by the CUDA engine as the process's
// large-tensor memory (common/host_memory.h, SetLargeTensorMemory).
//
// Why: the CUDA layer's inputs and outputs are host tensors (a request's x and dout, a result's
// out and dx). From pageable memory each large transfer is copied through a pinned staging
// buffer by 8 threads while the DMAs run (engine/cuda/host_staging.h): about 3.5 ms each way
// for 75 MB on the H100 machine, most of a training Forward's 8-9 ms of host work. When the
// tensor itself is page-locked the transfer is one DMA, and no thread copies anything. In
// moe-server every large tensor (the assembled requests, the results sent back by reference)
// is then page-locked from the start.
//
// How: blocks come from cudaHostAlloc and are kept when released (cudaFreeHost would wait for the
// whole device), in size classes: a request is rounded up to an eighth of its power of two and
// takes the smallest kept block of at least that class and at most half as large again, so the
// same shapes reuse the same blocks and varying ones mostly do too; pinning is slow (about 4 s
// for 640 MB in pinned_pool_test), so a new block is the exception. At most `limit` bytes are
// held, in use and kept together; past it, and wherever cudaHostAlloc fails, the heap serves.
#ifndef MOE_ENGINE_CUDA_PINNED_POOL_H_
#define MOE_ENGINE_CUDA_PINNED_POOL_H_

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace moe::cuda {

class PinnedPool {
 public:
  explicit PinnedPool(size_t limit) : limit_(limit) {}
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A page-locked block of at least `bytes`, or null (over the limit, or cudaHostAlloc failed).
  // The first one of its size pins new memory, which takes about 0.1 s per 0.2 GB.
  void* Allocate(size_t bytes);
  // Keeps `p` for reuse and returns true if it is one of this pool's blocks; false otherwise.
  bool Release(void* p);
  size_t held_bytes() const;

  // The size class of a request.
  static size_t ClassBytes(size_t bytes);

  // Makes a process-wide pool of at most `limit` bytes (EngineOptions::pinned_tensor_bytes; 0:
  // none) the large-tensor memory; the first call does, later calls do nothing. Never freed.
  static void InstallForProcess(size_t limit);
  static PinnedPool* ForProcess();  // null before InstallForProcess or when disabled

 private:
  const size_t limit_;
  mutable std::mutex mu_;
  size_t held_ = 0;
  std::unordered_map<void*, size_t> blocks_;   // every block: its class bytes
  std::map<size_t, std::vector<void*>> free_;  // released blocks by class
};

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_PINNED_POOL_H_
