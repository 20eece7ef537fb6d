// Pinned staging for large host <-> device copies (see host_staging.h).
#include "engine/cuda/host_staging.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "engine/cuda/device.h"
#include "engine/host_memory.h"

namespace moe::cuda {
namespace {

// One device's pinned buffer, grown on demand up to kMaxStagingBytes, and its lock.
struct Staging {
  std::mutex mu;
  PinnedHostBuffer buffer;
};

Staging& StagingFor(int device) {
  static std::mutex map_mu;
  static auto* stagings = new std::map<int, std::unique_ptr<Staging>>();  // never destroyed
  std::lock_guard<std::mutex> lock(map_mu);
  std::unique_ptr<Staging>& s = (*stagings)[device];
  if (!s) s = std::make_unique<Staging>();
  return *s;
}

// Runs piece(staging, offset, length) over `bytes` in pieces of at most one staging buffer, with
// the device's staging reserved and held for the whole transfer.
template <typename Piece>
absl::Status ForEachStagedPiece(int device, size_t bytes, Piece piece) {
  Staging& s = StagingFor(device);
  std::lock_guard<std::mutex> lock(s.mu);
  // Every earlier transfer through it has synchronised on its stream, so nothing targets it.
  MOE_RETURN_IF_ERROR(s.buffer.Reserve(std::min(bytes, kMaxStagingBytes)));
  const size_t step = s.buffer.bytes();
  for (size_t off = 0; off < bytes; off += step) {
    MOE_RETURN_IF_ERROR(piece(s.buffer.get(), off, std::min(step, bytes - off)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CopyToDevice(int device, void* dst, const void* src, size_t bytes,
                          cudaStream_t stream) {
  if (bytes < kMinStagedBytes) {
    // From pageable memory the call returns once `src` has been copied out (CUDA's documented
    // behaviour for pageable sources), which is all this function promises the caller.
    if (bytes > 0) {
      MOE_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    }
    return absl::OkStatus();
  }
  return ForEachStagedPiece(device, bytes, [&](void* staging, size_t off, size_t len) {
    ParallelMemcpy(staging, static_cast<const char*>(src) + off, len);
    MOE_CUDA_RETURN(cudaMemcpyAsync(static_cast<char*>(dst) + off, staging, len,
                                    cudaMemcpyHostToDevice, stream));
    // The staging is rewritten (next piece, another layer) only after the DMA has read it.
    MOE_CUDA_RETURN(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  });
}

absl::Status CopyToHost(int device, void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes < kMinStagedBytes) {
    if (bytes > 0) {
      MOE_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
    }
    MOE_CUDA_RETURN(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
  return ForEachStagedPiece(device, bytes, [&](void* staging, size_t off, size_t len) {
    MOE_CUDA_RETURN(cudaMemcpyAsync(staging, static_cast<const char*>(src) + off, len,
                                    cudaMemcpyDeviceToHost, stream));
    MOE_CUDA_RETURN(cudaStreamSynchronize(stream));
    ParallelMemcpy(static_cast<char*>(dst) + off, staging, len);
    return absl::OkStatus();
  });
}

}  // namespace moe::cuda
