// The client's CUDA calls (see device.h), for a client built with CUDA: exports and events
// through moe::cuda_ipc_export, copies through the runtime.
//
// Every call leaves the calling thread's current device as it found it (cuda::DeviceScope).
#include <cuda_runtime_api.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/device.h"
#include "engine/cuda/ipc_export.h"

namespace moe::client::device {
namespace {

std::string ErrorText(cudaError_t err) {
  return absl::StrCat(cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(cuda::InterprocessEvent event) : event_(std::move(event)) {}
  const std::string& handle() const override { return event_.handle(); }
  absl::Status Record(void* stream, int device) const override {
    cuda::DeviceScope scope(device);
    if (!scope.ok()) return absl::InternalError(absl::StrCat("cannot use ", scope.error()));
    return event_.Record(stream);
  }
  absl::Status StreamWait(void* stream, int device) const override {
    cuda::DeviceScope scope(device);
    if (!scope.ok()) return absl::InternalError(absl::StrCat("cannot use ", scope.error()));
    return event_.StreamWait(stream);
  }

 private:
  cuda::InterprocessEvent event_;
};

// cudaMemcpyAsync of `kind` on `stream`, then waits for the stream.
absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, int device,
                  void* stream, absl::string_view field) {
  cuda::DeviceScope scope(device);
  if (!scope.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": cannot use ", scope.error()));
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat(
        field, ": copying ", bytes, kind == cudaMemcpyDeviceToHost ? " bytes from" : " bytes to",
        " cuda:", device, " failed: ", ErrorText(err)));
  }
  return absl::OkStatus();
}

}  // namespace

bool Built() { return true; }

absl::StatusOr<ExportedTensor> ExportTensor(const void* ptr, int64_t bytes,
                                            absl::string_view field) {
  absl::StatusOr<cuda::ExportedMemory> e = cuda::ExportDeviceMemory(ptr, bytes);
  if (!e.ok()) {
    return absl::Status(e.status().code(), absl::StrCat(field, ": ", e.status().message()));
  }
  ExportedTensor t;
  t.handle = std::move(e->handle);
  t.device = e->device;
  t.base = static_cast<const char*>(ptr) - e->offset;
  t.offset = e->offset;
  t.allocation_bytes = e->allocation_bytes;
  return t;
}

absl::StatusOr<std::unique_ptr<Event>> Event::Create(int device) {
  absl::StatusOr<cuda::InterprocessEvent> e = cuda::InterprocessEvent::Create(device);
  if (!e.ok()) return e.status();
  return std::unique_ptr<Event>(new CudaEvent(std::move(*e)));
}

absl::StatusOr<std::unique_ptr<Event>> Event::Open(absl::string_view handle, int device) {
  absl::StatusOr<cuda::InterprocessEvent> e = cuda::InterprocessEvent::Open(handle, device);
  if (!e.ok()) return e.status();
  return std::unique_ptr<Event>(new CudaEvent(std::move(*e)));
}

absl::Status CopyToHost(void* dst, const void* src, size_t bytes, int device, void* stream,
                        absl::string_view field) {
  return Copy(dst, src, bytes, cudaMemcpyDeviceToHost, device, stream, field);
}

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, int device, void* stream,
                          absl::string_view field) {
  return Copy(dst, src, bytes, cudaMemcpyHostToDevice, device, stream, field);
}

}  // namespace moe::client::device
