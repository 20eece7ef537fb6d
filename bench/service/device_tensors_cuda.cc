// GPU memory and streams for moe-service-bench's device trainer (see device_tensors.h). Every
// call makes its device current for its duration (cuda::DeviceScope) and restores the caller's.
#include <cuda_runtime_api.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "bench/service/device_tensors.h"
#include "engine/cuda/ipc_export.h"

namespace moe::bench {
namespace {

// OK, or why `what` failed on `device`: making it current, or `err`.
absl::Status Check(const cuda::DeviceScope& scope, cudaError_t err, const std::string& what,
                   int device) {
  if (!scope.ok()) return absl::InternalError(absl::StrCat(what, ": cannot use ", scope.error()));
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, " on cuda:", device, ": ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}

absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, int device) {
  cuda::DeviceScope scope(device);
  const cudaError_t err = scope.ok() ? cudaMemcpy(dst, src, bytes, kind) : cudaSuccess;
  return Check(scope, err, "cudaMemcpy", device);
}

}  // namespace

bool CudaBuilt() { return true; }

absl::StatusOr<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(int device, int64_t bytes) {
  std::unique_ptr<DeviceBuffer> b(new DeviceBuffer());
  b->device_ = device;
  cuda::DeviceScope scope(device);
  void* p = nullptr;
  const cudaError_t err = scope.ok() ? cudaMalloc(&p, static_cast<size_t>(bytes)) : cudaSuccess;
  if (absl::Status st = Check(scope, err, absl::StrCat("cudaMalloc of ", bytes, " bytes"), device);
      !st.ok()) {
    return st;
  }
  b->data_ = static_cast<char*>(p);
  return b;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ == nullptr) return;
  cuda::DeviceScope scope(device_);
  cudaFree(data_);
}

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, int device) {
  return Copy(dst, src, bytes, cudaMemcpyHostToDevice, device);
}

absl::Status CopyFromDevice(void* dst, const void* src, size_t bytes, int device) {
  return Copy(dst, src, bytes, cudaMemcpyDeviceToHost, device);
}

absl::StatusOr<std::unique_ptr<DeviceStream>> DeviceStream::Create(int device) {
  std::unique_ptr<DeviceStream> s(new DeviceStream());
  s->device_ = device;
  cuda::DeviceScope scope(device);
  cudaStream_t stream = nullptr;
  const cudaError_t err =
      scope.ok() ? cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) : cudaSuccess;
  if (absl::Status st = Check(scope, err, "cudaStreamCreateWithFlags", device); !st.ok()) {
    return st;
  }
  s->stream_ = stream;
  return s;
}

DeviceStream::~DeviceStream() {
  if (stream_ == nullptr) return;
  cuda::DeviceScope scope(device_);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status DeviceStream::Synchronize() const {
  cuda::DeviceScope scope(device_);
  const cudaError_t err =
      scope.ok() ? cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)) : cudaSuccess;
  return Check(scope, err, "cudaStreamSynchronize", device_);
}

}  // namespace moe::bench
