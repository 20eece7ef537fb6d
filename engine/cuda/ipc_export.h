// The exporting side of CUDA IPC: what a trainer process (moe::client, built with CUDA) hands a
// server on the same host so the server can use its device memory and events in place
// (engine/ipc.h is the server's side).
//
// A framework's tensor is usually a piece of a larger allocation (PyTorch's caching allocator
// carves tensors out of cudaMalloc'd blocks), and CUDA IPC shares whole allocations: so an export
// names the allocation (its cudaIpcMemHandle_t) and the tensor's offset inside it, found with
// cuMemGetAddressRange. Only memory from cudaMalloc (or cuMemAlloc) can be exported this way;
// memory from a stream-ordered pool (cudaMallocAsync) or the virtual-memory API (PyTorch's
// expandable segments) is refused with the reason.
//
// The driver entry point is looked up through the runtime (cudaGetDriverEntryPoint) rather than
// linked: a binary built with CUDA then still starts on a machine without the driver, as the rest
// of the engine does. This header has no CUDA type in it: device pointers are void*, an event is
// its opaque cudaEvent_t value.
#ifndef MOE_ENGINE_CUDA_IPC_EXPORT_H_
#define MOE_ENGINE_CUDA_IPC_EXPORT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe::cuda {

// Makes `device` current for its scope and restores the caller's device after: a trainer's
// framework keeps its own notion of the current device, and a null stream means the legacy
// default stream of whichever device is current.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  bool ok() const { return error_ == 0; }
  // Why it could not be made current: "cuda:N: <CUDA's error name and text>".
  std::string error() const;

 private:
  int device_ = -1;
  int previous_ = -1;
  int error_ = 0;  // the cudaError_t of making it current
};

// The device allocation a pointer lies in.
struct DeviceAllocation {
  int device = -1;             // this process's ordinal
  const char* base = nullptr;  // its first byte
  int64_t size_bytes = 0;
};

// InvalidArgument (naming `field`) when `ptr` is not device memory of this process (host or
// unknown memory); an error status, never a crash, for any pointer.
absl::StatusOr<DeviceAllocation> FindDeviceAllocation(const void* ptr, absl::string_view field);

// What another process needs to map [ptr, ptr + size_bytes) (engine/layer.h
// Engine::MapCudaIpcMemory).
struct ExportedMemory {
  std::string handle;            // cudaIpcMemHandle_t bytes of the whole allocation
  int device = -1;               // the exporter's ordinal of the memory's device
  int64_t offset = 0;            // ptr - the allocation's base
  int64_t allocation_bytes = 0;  // the whole allocation
};

// InvalidArgument when the bytes are not all inside one device allocation, or CUDA cannot export
// that allocation (the message says why).
absl::StatusOr<ExportedMemory> ExportDeviceMemory(const void* ptr, int64_t size_bytes);

// An interprocess CUDA event (cudaEventInterprocess | cudaEventDisableTiming), destroyed with the
// object: made here and shared through handle(), or opened from another process's handle.
class InterprocessEvent {
 public:
  // A new event on `device`; the current device is left as it was.
  static absl::StatusOr<InterprocessEvent> Create(int device);
  // Another process's event (cudaIpcEventHandle_t bytes), opened for the streams of `device`
  // (this process's ordinal; -1: the current device), and destroyed, with that device current,
  // whichever device made it: only streams of the device it was opened under may wait on it or
  // record it (another device's stream faults in the driver).
  // InvalidArgument for a handle of the wrong length, a device that cannot be used, or a handle
  // CUDA cannot open.
  static absl::StatusOr<InterprocessEvent> Open(absl::string_view handle, int device);

  InterprocessEvent() = default;
  ~InterprocessEvent();
  InterprocessEvent(InterprocessEvent&& o) noexcept;
  InterprocessEvent& operator=(InterprocessEvent&& o) noexcept;
  InterprocessEvent(const InterprocessEvent&) = delete;
  InterprocessEvent& operator=(const InterprocessEvent&) = delete;

  void* native() const { return event_; }                // the cudaEvent_t
  const std::string& handle() const { return handle_; }  // cudaIpcEventHandle_t bytes
  int device() const { return device_; }  // the device it belongs to; -1: unknown
  // Records the event on `stream` (a cudaStream_t; null: the legacy default stream).
  absl::Status Record(void* stream) const;
  // Makes `stream` wait for the event's last record.
  absl::Status StreamWait(void* stream) const;
  // Blocks the calling thread until the event's last record has completed.
  absl::Status Synchronize() const;

 private:
  void* event_ = nullptr;
  std::string handle_;
  int device_ = -1;
};

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_IPC_EXPORT_H_
