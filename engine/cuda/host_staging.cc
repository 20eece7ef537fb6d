// Pinned staging for large host <-> device copies (see host_staging.h).
#include "engine/cuda/host_staging.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common/host_memory.h"
#include "engine/cuda/device.h"

namespace moe::cuda {
namespace {

// One device's pinned buffer, grown on demand up to kMaxStagingBytes, its lock, and the events
// that mark each kPipelineBytes piece of a device-to-host copy as landed (made on first use, kept).
struct Staging {
  std::mutex mu;
  PinnedHostBuffer buffer;
  std::vector<Event> landed;
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
// the device's staging reserved and its lock held for the whole transfer.
template <typename Piece>
absl::Status ForEachStagedPiece(int device, size_t bytes, Piece piece) {
  Staging& s = StagingFor(device);
  std::lock_guard<std::mutex> lock(s.mu);
  // Every earlier transfer through it has synchronised on its stream, so nothing targets it.
  MOE_RETURN_IF_ERROR(s.buffer.Reserve(std::min(bytes, kMaxStagingBytes)));
  const size_t step = s.buffer.bytes();
  for (size_t off = 0; off < bytes; off += step) {
    MOE_RETURN_IF_ERROR(piece(s, off, std::min(step, bytes - off)));
  }
  return absl::OkStatus();
}

// A CUDA call's status where it cannot return at once (on a copying thread).
absl::Status Checked(cudaError_t err, const char* what, int line) {
  return err == cudaSuccess ? absl::OkStatus() : CudaStatus(err, what, __FILE__, line);
}
#define MOE_CUDA_STATUS(expr) Checked((expr), #expr, __LINE__)

// The first error any of a transfer's threads met (they all run to the end regardless).
class FirstError {
 public:
  void Record(const absl::Status& status) {
    if (status.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (first_.ok()) first_ = status;
  }
  absl::Status Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return first_;
  }

 private:
  std::mutex mu_;
  absl::Status first_;
};

size_t PieceCount(size_t len) { return (len + kPipelineBytes - 1) / kPipelineBytes; }

// Whether `p` is page-locked host memory (engine/cuda/pinned_pool.h, or any cudaHostAlloc'd or
// registered memory): a DMA can then read or write it directly.
bool PageLocked(const void* p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // older drivers answer pageable pointers with an error: not sticky
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

// One DMA between page-locked host memory and the device, finished before returning (the
// functions below promise their host buffer is done with on return).
absl::Status DirectCopy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                        cudaStream_t stream) {
  if (bytes > 0) MOE_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, kind, stream));
  MOE_CUDA_RETURN(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace

absl::Status CopyToDevice(int device, void* dst, const void* src, size_t bytes,
                          cudaStream_t stream) {
  if (bytes > 0 && PageLocked(src)) {
    return DirectCopy(dst, src, bytes, cudaMemcpyHostToDevice, stream);
  }
  if (bytes < kMinStagedBytes) {
    // From pageable memory the call returns once `src` has been copied out (CUDA's documented
    // behaviour for pageable sources), which is all this function promises the caller.
    if (bytes > 0) {
      MOE_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    }
    return absl::OkStatus();
  }
  // Each thread copies its pieces into the staging and enqueues each one's DMA at once, so the
  // DMA of the first pieces runs while later ones are still being copied.
  return ForEachStagedPiece(device, bytes, [&](Staging& s, size_t off, size_t len) {
    void* staging = s.buffer.get();
    FirstError error;
    ParallelForInterleaved(PieceCount(len), [&](size_t i) {
      const size_t at = i * kPipelineBytes, n = std::min(kPipelineBytes, len - at);
      char* pinned = static_cast<char*>(staging) + at;
      std::memcpy(pinned, static_cast<const char*>(src) + off + at, n);
      // The copying threads other than the caller's need the device made current.
      error.Record(MOE_CUDA_STATUS(cudaSetDevice(device)));
      error.Record(MOE_CUDA_STATUS(cudaMemcpyAsync(static_cast<char*>(dst) + off + at, pinned, n,
                                                   cudaMemcpyHostToDevice, stream)));
    });
    // The staging is rewritten (next piece, another layer) only after the DMAs have read it.
    error.Record(MOE_CUDA_STATUS(cudaStreamSynchronize(stream)));
    return error.Get();
  });
}

absl::Status CopyToHost(int device, void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes > 0 && PageLocked(dst))
    return DirectCopy(dst, src, bytes, cudaMemcpyDeviceToHost, stream);
  if (bytes < kMinStagedBytes) {
    if (bytes > 0) {
      MOE_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
    }
    MOE_CUDA_RETURN(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
  // Every piece's DMA is enqueued first, each followed by its event; the threads then copy each
  // piece out of the staging as soon as its event has fired.
  return ForEachStagedPiece(device, bytes, [&](Staging& s, size_t off, size_t len) {
    void* staging = s.buffer.get();
    const size_t pieces = PieceCount(len);
    while (s.landed.size() < pieces) {
      MOE_ASSIGN_OR_RETURN(Event e, Event::Create(device));
      s.landed.push_back(std::move(e));
    }
    FirstError error;
    for (size_t i = 0; i < pieces; ++i) {
      const size_t at = i * kPipelineBytes, n = std::min(kPipelineBytes, len - at);
      error.Record(MOE_CUDA_STATUS(cudaMemcpyAsync(static_cast<char*>(staging) + at,
                                                   static_cast<const char*>(src) + off + at, n,
                                                   cudaMemcpyDeviceToHost, stream)));
      error.Record(MOE_CUDA_STATUS(cudaEventRecord(s.landed[i].get(), stream)));
    }
    if (!error.Get().ok()) {
      // Nothing may still write into the staging once its lock is released.
      cudaStreamSynchronize(stream);
      return error.Get();
    }
    ParallelForInterleaved(pieces, [&](size_t i) {
      const size_t at = i * kPipelineBytes, n = std::min(kPipelineBytes, len - at);
      const absl::Status landed = MOE_CUDA_STATUS(cudaEventSynchronize(s.landed[i].get()));
      error.Record(landed);
      if (landed.ok()) {
        std::memcpy(static_cast<char*>(dst) + off + at, static_cast<const char*>(staging) + at, n);
      }
    });
    return error.Get();
  });
}

}  // namespace moe::cuda
