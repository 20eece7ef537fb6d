// CUDA IPC exports (see ipc_export.h).
//
// Every function leaves the calling thread's current device as it found it: the caller is a
// trainer whose framework keeps its own notion of the current device.
#include "engine/cuda/ipc_export.h"

#include <cuda.h>  // CUdeviceptr and CUresult only: the driver is reached through the runtime
#include <cuda_runtime_api.h>

#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/ipc.h"

namespace moe::cuda {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == kCudaIpcHandleBytes);

std::string ErrorText(cudaError_t err) {
  return absl::StrCat(cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

using GetAddressRangeFn = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

// cuMemGetAddressRange (the 64-bit version), or null when the driver does not offer it.
GetAddressRangeFn AddressRangeFn() {
  static const GetAddressRangeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000,
                                                             cudaEnableDefault, &found);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuMemGetAddressRange", &p, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<GetAddressRangeFn>(nullptr);
    }
    return reinterpret_cast<GetAddressRangeFn>(p);
  }();
  return fn;
}

}  // namespace

DeviceScope::DeviceScope(int device) : device_(device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) cudaGetLastError();
  error_ = static_cast<int>(err);
}

DeviceScope::~DeviceScope() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

std::string DeviceScope::error() const {
  return absl::StrCat("cuda:", device_, ": ", ErrorText(static_cast<cudaError_t>(error_)));
}

absl::StatusOr<DeviceAllocation> FindDeviceAllocation(const void* ptr, absl::string_view field) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky; older drivers answer unknown pointers with an error
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": not CUDA device memory (", ErrorText(err), ")"));
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": not CUDA device memory (",
        attr.type == cudaMemoryTypeHost ? "page-locked host memory" : "host memory", ")"));
  }
  GetAddressRangeFn range = AddressRangeFn();
  if (range == nullptr) {
    return absl::UnavailableError(
        absl::StrCat(field, ": the CUDA driver offers no cuMemGetAddressRange"));
  }
  DeviceScope scope(attr.device);
  if (!scope.ok()) {
    return absl::InternalError(absl::StrCat(field, ": cannot make it current: ", scope.error()));
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult r = range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": cuMemGetAddressRange finds no allocation for it (CUresult ", r, ")"));
  }
  DeviceAllocation a;
  a.device = attr.device;
  a.base = reinterpret_cast<const char*>(base);
  a.size_bytes = static_cast<int64_t>(size);
  return a;
}

absl::StatusOr<ExportedMemory> ExportDeviceMemory(const void* ptr, int64_t size_bytes) {
  if (size_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("size_bytes: ", size_bytes, ", must be positive"));
  }
  absl::StatusOr<DeviceAllocation> a = FindDeviceAllocation(ptr, "ptr");
  if (!a.ok()) return a.status();
  const int64_t offset = static_cast<const char*>(ptr) - a->base;
  if (size_bytes > a->size_bytes - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("size_bytes: ", size_bytes, " bytes from offset ", offset,
                     " run past the end of the allocation (", a->size_bytes, " bytes)"));
  }
  DeviceScope scope(a->device);
  cudaIpcMemHandle_t h;
  if (const cudaError_t err = cudaIpcGetMemHandle(&h, const_cast<char*>(a->base));
      err != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "ptr: its allocation cannot be shared by CUDA IPC (cudaIpcGetMemHandle: ", ErrorText(err),
        "); only cudaMalloc'd memory can, not a stream-ordered pool's or the virtual-memory "
        "API's"));
  }
  ExportedMemory e;
  e.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  e.device = a->device;
  e.offset = offset;
  e.allocation_bytes = a->size_bytes;
  return e;
}

absl::StatusOr<InterprocessEvent> InterprocessEvent::Create(int device) {
  DeviceScope scope(device);
  if (!scope.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("device: cannot use ", scope.error()));
  }
  InterprocessEvent e;
  cudaEvent_t ev = nullptr;
  if (const cudaError_t err =
          cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming);
      err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaEventCreateWithFlags: ", ErrorText(err)));
  }
  e.event_ = ev;  // owned from here on
  e.device_ = device;
  cudaIpcEventHandle_t h;
  if (const cudaError_t err = cudaIpcGetEventHandle(&h, ev); err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaIpcGetEventHandle: ", ErrorText(err)));
  }
  e.handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return e;
}

absl::StatusOr<InterprocessEvent> InterprocessEvent::Open(absl::string_view handle, int device) {
  if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("handle: ", handle.size(),
                                                   " bytes, a cudaIpcEventHandle_t has ",
                                                   sizeof(cudaIpcEventHandle_t)));
  }
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    device = -1;
  }
  std::optional<DeviceScope> scope;
  if (device >= 0) {
    scope.emplace(device);
    if (!scope->ok()) {
      return absl::InvalidArgumentError(absl::StrCat("device: cannot use ", scope->error()));
    }
  }
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t ev = nullptr;
  if (const cudaError_t err = cudaIpcOpenEventHandle(&ev, h); err != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrCat("handle: CUDA cannot open it as an event of another process on this host (",
                     ErrorText(err), ")"));
  }
  InterprocessEvent e;
  e.event_ = ev;
  e.handle_ = std::string(handle);
  e.device_ = device;
  return e;
}

namespace {

// Destroys `event` with its device current (an opened event belongs to that device's context).
void DestroyEvent(void* event, int device) {
  if (event == nullptr) return;
  std::optional<DeviceScope> scope;
  if (device >= 0) scope.emplace(device);
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

}  // namespace

InterprocessEvent::~InterprocessEvent() { DestroyEvent(event_, device_); }

InterprocessEvent::InterprocessEvent(InterprocessEvent&& o) noexcept
    : event_(std::exchange(o.event_, nullptr)),
      handle_(std::move(o.handle_)),
      device_(o.device_) {}

InterprocessEvent& InterprocessEvent::operator=(InterprocessEvent&& o) noexcept {
  if (this != &o) {
    DestroyEvent(event_, device_);
    event_ = std::exchange(o.event_, nullptr);
    handle_ = std::move(o.handle_);
    device_ = o.device_;
  }
  return *this;
}

absl::Status InterprocessEvent::Record(void* stream) const {
  if (const cudaError_t err =
          cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream));
      err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaEventRecord: ", ErrorText(err)));
  }
  return absl::OkStatus();
}

absl::Status InterprocessEvent::StreamWait(void* stream) const {
  if (const cudaError_t err = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                                  static_cast<cudaEvent_t>(event_), 0);
      err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaStreamWaitEvent: ", ErrorText(err)));
  }
  return absl::OkStatus();
}

absl::Status InterprocessEvent::Synchronize() const {
  if (const cudaError_t err = cudaEventSynchronize(static_cast<cudaEvent_t>(event_));
      err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaEventSynchronize: ", ErrorText(err)));
  }
  return absl::OkStatus();
}

}  // namespace moe::cuda
