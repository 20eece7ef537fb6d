// Host-side CUDA plumbing for the engine: error -> absl::Status conversion with file:line,
// stream-ordered pool buffers, and the per-layer stream that outlives its saved contexts.
//
// Every device allocation on the hot path is cudaMallocAsync on the layer's stream from the
// device's default memory pool, whose release threshold the engine raises to "never", so
// after the first calls memory is recycled inside the pool instead of going back to the
// driver (no cudaMalloc/cudaFree per call). Buffers free themselves with cudaFreeAsync on the
// same stream, so a buffer can be dropped as soon as the last kernel using it is enqueued.
#ifndef MOE_ENGINE_CUDA_DEVICE_H_
#define MOE_ENGINE_CUDA_DEVICE_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status_macros.h"

namespace moe::cuda {

// Internal (ResourceExhausted for out-of-memory) naming the call site and the CUDA error.
absl::Status CudaStatus(cudaError_t err, const char* what, const char* file, int line);
absl::Status CublasStatus(cublasStatus_t err, const char* what, const char* file, int line);

#define MOE_CUDA_RETURN(expr)                                              \
  do {                                                                     \
    if (cudaError_t moe_err_ = (expr); moe_err_ != cudaSuccess)            \
      return ::moe::cuda::CudaStatus(moe_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define MOE_CUBLAS_RETURN(expr)                                              \
  do {                                                                       \
    if (cublasStatus_t moe_err_ = (expr); moe_err_ != CUBLAS_STATUS_SUCCESS) \
      return ::moe::cuda::CublasStatus(moe_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// A stream (and the device it belongs to) shared by a layer and the contexts it created, so
// a context dropped after its layer still frees on a live stream.
class Stream {
 public:
  // poison_allocations (tests): every DeviceBuffer allocated on this stream is filled with 0xFF
  // bytes (NaN for fp32 and bf16) first, so that an element a kernel forgot to write shows up.
  static absl::StatusOr<std::shared_ptr<Stream>> Create(int device,
                                                        bool poison_allocations = false);
  ~Stream();
  cudaStream_t get() const { return stream_; }
  int device() const { return device_; }
  bool poison_allocations() const { return poison_allocations_; }

 private:
  Stream(int device, cudaStream_t s, bool poison)
      : device_(device), stream_(s), poison_allocations_(poison) {}
  int device_;
  cudaStream_t stream_;
  bool poison_allocations_;
};

// A pool allocation owned by one stream; freed stream-ordered on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      stream_ = std::exchange(o.stream_, nullptr);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // ResourceExhausted naming `what` when the pool cannot grow.
  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes, std::shared_ptr<Stream> stream,
                                               const char* what);

  void Reset();
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  std::shared_ptr<Stream> stream_;
};

// A CUDA event without timing, for making one stream wait for another's work; destroyed
// with the object.
class Event {
 public:
  static absl::StatusOr<Event> Create(int device);
  Event() = default;
  ~Event();
  Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Everything enqueued on `done` so far happens before anything enqueued on `waiter` after this
// call (records `event` on `done`, `waiter` waits for it).
absl::Status StreamWaitFor(cudaStream_t waiter, cudaStream_t done, const Event& event);

// Page-locked host memory (cudaMallocHost), grown on demand, never shrunk, freed with the
// object: the staging the engine's device-to-host and host-to-device copies go through. Growing
// drops the old contents, so the caller must first make sure no copy still targets it.
class PinnedHostBuffer {
 public:
  PinnedHostBuffer() = default;
  ~PinnedHostBuffer();
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  // At least `bytes` long afterwards.
  absl::Status Reserve(size_t bytes);
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_DEVICE_H_
