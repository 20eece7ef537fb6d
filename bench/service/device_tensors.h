// GPU memory and a stream for moe-service-bench's trainer when its tensors live on a GPU
// (--client_device=cuda:N): the device micro-batches a CUDA trainer would hand the service, and
// the stream it orders them on.
//
// Two implementations behind one header: device_tensors_cuda.cc (a build with CUDA) and
// device_tensors_none.cc, where Built() is false and every call is FailedPrecondition. No CUDA
// type appears here: pointers are void*, the stream its opaque cudaStream_t value.
#ifndef MOE_BENCH_SERVICE_DEVICE_TENSORS_H_
#define MOE_BENCH_SERVICE_DEVICE_TENSORS_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe::bench {

// Whether this bench was built with CUDA.
bool CudaBuilt();

// One cudaMalloc'd block on `device` (so CUDA IPC can share it), freed with the object.
class DeviceBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(int device, int64_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* data() const { return data_; }
  int device() const { return device_; }

 private:
  DeviceBuffer() = default;
  char* data_ = nullptr;
  int device_ = -1;
};

// Synchronous copies between host memory and memory of `device`.
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, int device);
absl::Status CopyFromDevice(void* dst, const void* src, size_t bytes, int device);

// A non-blocking stream on `device`, destroyed with the object.
class DeviceStream {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceStream>> Create(int device);
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;
  void* get() const { return stream_; }
  // Blocks until the work enqueued so far is done.
  absl::Status Synchronize() const;

 private:
  DeviceStream() = default;
  void* stream_ = nullptr;
  int device_ = -1;
};

}  // namespace moe::bench

#endif  // MOE_BENCH_SERVICE_DEVICE_TENSORS_H_
