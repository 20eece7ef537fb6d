// CUDA IPC for the engine (see ipc.h).
#include "engine/cuda/ipc.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/cuda/ipc_export.h"

namespace moe::cuda {
namespace {

struct OpenAllocation {
  char* base = nullptr;
  int64_t size_bytes = 0;
  int device = -1;   // the allocation's device
  int used_on = -1;  // the engine's device, whose streams read and write it
  int mappings = 0;
};

// The process's open IPC memory handles, by handle bytes. Never destroyed: mappings may outlive
// static destruction order at exit.
class HandleTable {
 public:
  static HandleTable& Get() {
    static auto* table = new HandleTable();
    return *table;
  }

  // The allocation `handle` names, opened on `device` (the memory's, as the exporter numbers it)
  // unless it is open already; counts one more mapping of it, used by the engine on
  // `engine_device`.
  absl::StatusOr<OpenAllocation> Acquire(const std::string& handle, int device, int engine_device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(handle);
    if (it != open_.end()) {
      ++it->second.mappings;
      return it->second;
    }
    // Opened with the memory's device current, which the calling thread gets back afterwards
    // (a gRPC thread: whatever it runs next must not inherit this device).
    DeviceScope scope(device);
    if (!scope.ok()) return absl::InternalError(absl::StrCat("cannot use ", scope.error()));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    if (const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        err != cudaSuccess) {
      cudaGetLastError();  // a handle that names nothing is not a sticky error
      return absl::InvalidArgumentError(absl::StrCat(
          "mem_handle: CUDA cannot open it as memory of another process on this host (",
          cudaGetErrorName(err), ": ", cudaGetErrorString(err), ")"));
    }
    absl::StatusOr<DeviceAllocation> a = FindDeviceAllocation(p, "mem_handle");
    if (!a.ok()) {
      cudaIpcCloseMemHandle(p);
      return a.status();
    }
    OpenAllocation o;
    o.base = static_cast<char*>(p);
    o.size_bytes = a->size_bytes;
    o.device = a->device;
    o.used_on = engine_device;
    o.mappings = 1;
    open_[handle] = o;
    return o;
  }

  void Release(const std::string& handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(handle);
    if (it == open_.end() || --it->second.mappings > 0) return;
    // A call ordered by a done_event returns while its copies may still read or write the
    // mapping: closing it under them would fault the device. Rare (unregistration, session end).
    {
      DeviceScope engine(it->second.used_on);
      if (engine.ok()) cudaDeviceSynchronize();
    }
    // Closed with the device it was opened on current (the memory's, not the engine's): the
    // mapping belongs to that device's context.
    {
      DeviceScope opened(it->second.device);
      if (opened.ok()) cudaIpcCloseMemHandle(it->second.base);
    }
    cudaGetLastError();  // the exporter may be gone; closing then is all that is left to do
    open_.erase(it);
  }

  int size() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(open_.size());
  }

 private:
  std::mutex mu_;
  std::map<std::string, OpenAllocation> open_;
};

class IpcMapping : public SharedMemoryMapping {
 public:
  IpcMapping(std::string handle, void* data, int64_t size_bytes, int device)
      : handle_(std::move(handle)), data_(data), size_bytes_(size_bytes), device_(device) {}
  ~IpcMapping() override { HandleTable::Get().Release(handle_); }
  void* data() const override { return data_; }
  int64_t size_bytes() const override { return size_bytes_; }
  MemoryLocation location() const override { return MemoryLocation::Cuda(device_); }

 private:
  std::string handle_;
  void* data_;
  int64_t size_bytes_;
  int device_;
};

class IpcEvent : public SharedEvent {
 public:
  explicit IpcEvent(InterprocessEvent event) : event_(std::move(event)) {}
  void* native() const override { return event_.native(); }
  int device() const override { return event_.device(); }

 private:
  InterprocessEvent event_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapIpcMemory(int engine_device,
                                                                  absl::string_view mem_handle,
                                                                  int device, int64_t offset,
                                                                  int64_t size_bytes) {
  if (mem_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("mem_handle: ", mem_handle.size(),
                                                   " bytes, a cudaIpcMemHandle_t has ",
                                                   kCudaIpcHandleBytes));
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: cuda:", device, " out of range, ", count, " device(s)"));
  }
  if (offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat("offset: ", offset, ", must be >= 0"));
  }
  if (size_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("size_bytes: ", size_bytes, ", must be positive"));
  }
  const std::string handle(mem_handle);
  MOE_ASSIGN_OR_RETURN(const OpenAllocation a,
                       HandleTable::Get().Acquire(handle, device, engine_device));
  absl::Status refused;
  if (a.device != device) {
    refused = absl::InvalidArgumentError(
        absl::StrCat("device: the handle's memory is on cuda:", a.device, ", not cuda:", device));
  } else if (offset >= a.size_bytes) {
    refused = absl::InvalidArgumentError(absl::StrCat(
        "offset: ", offset, " is past the end of the allocation (", a.size_bytes, " bytes)"));
  } else if (size_bytes > a.size_bytes - offset) {
    refused = absl::InvalidArgumentError(
        absl::StrCat("size_bytes: ", size_bytes, " bytes from offset ", offset,
                     " run past the end of the allocation (", a.size_bytes, " bytes)"));
  }
  if (!refused.ok()) {
    HandleTable::Get().Release(handle);
    return refused;
  }
  return std::unique_ptr<SharedMemoryMapping>(
      new IpcMapping(handle, a.base + offset, size_bytes, a.device));
}

absl::StatusOr<std::unique_ptr<SharedEvent>> OpenIpcEvent(absl::string_view handle, int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  if (device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: cuda:", device, " out of range, ", count, " device(s)"));
  }
  MOE_ASSIGN_OR_RETURN(InterprocessEvent e, InterprocessEvent::Open(handle, device));
  return std::unique_ptr<SharedEvent>(new IpcEvent(std::move(e)));
}

absl::StatusOr<std::pair<std::unique_ptr<SharedEvent>, std::string>> CreateIpcEvent(int device) {
  MOE_ASSIGN_OR_RETURN(InterprocessEvent e, InterprocessEvent::Create(device));
  std::string handle = e.handle();
  return std::make_pair(std::unique_ptr<SharedEvent>(new IpcEvent(std::move(e))),
                        std::move(handle));
}

int OpenIpcAllocations() { return HandleTable::Get().size(); }

}  // namespace moe::cuda
