// GPU memory and streams for moe-service-bench's device trainer (see device_tensors.h).
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "bench/service/device_tensors.h"

namespace moe::bench {
namespace {

absl::Status CudaError(const char* what, int device, cudaError_t err) {
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, " on cuda:", device, ": ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}

// Runs `fn` with `device` current; the caller's device is restored after.
template <typename Fn>
cudaError_t OnDevice(int device, Fn fn) {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = fn();
  if (previous >= 0) cudaSetDevice(previous);
  return err;
}

}  // namespace

bool CudaBuilt() { return true; }

absl::StatusOr<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(int device, int64_t bytes) {
  std::unique_ptr<DeviceBuffer> b(new DeviceBuffer());
  b->device_ = device;
  void* p = nullptr;
  if (cudaError_t err = OnDevice(device, [&] { return cudaMalloc(&p, static_cast<size_t>(bytes)); });
      err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaMalloc of ", bytes, " bytes").c_str(), device, err);
  }
  b->data_ = static_cast<char*>(p);
  return b;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) OnDevice(device_, [&] { return cudaFree(data_); });
}

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, int device) {
  if (cudaError_t err =
          OnDevice(device, [&] { return cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice); });
      err != cudaSuccess) {
    return CudaError("cudaMemcpy to the device", device, err);
  }
  return absl::OkStatus();
}

absl::Status CopyFromDevice(void* dst, const void* src, size_t bytes, int device) {
  if (cudaError_t err =
          OnDevice(device, [&] { return cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost); });
      err != cudaSuccess) {
    return CudaError("cudaMemcpy from the device", device, err);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceStream>> DeviceStream::Create(int device) {
  std::unique_ptr<DeviceStream> s(new DeviceStream());
  s->device_ = device;
  cudaStream_t stream = nullptr;
  if (cudaError_t err = OnDevice(
          device, [&] { return cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); });
      err != cudaSuccess) {
    return CudaError("cudaStreamCreateWithFlags", device, err);
  }
  s->stream_ = stream;
  return s;
}

DeviceStream::~DeviceStream() {
  if (stream_ != nullptr) {
    OnDevice(device_, [&] { return cudaStreamDestroy(static_cast<cudaStream_t>(stream_)); });
  }
}

absl::Status DeviceStream::Synchronize() const {
  if (cudaError_t err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
      err != cudaSuccess) {
    return CudaError("cudaStreamSynchronize", device_, err);
  }
  return absl::OkStatus();
}

}  // namespace moe::bench
