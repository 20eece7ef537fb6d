// What the client does with CUDA (internal to the library; client.h does not include it): find
// and export the device allocation a caller's tensor lies in, make and open interprocess events,
// and copy between a caller's device memory and host memory on the caller's stream.
//
// Two implementations behind one header: device_cuda.cc over moe::cuda_ipc_export
// (engine/cuda/ipc_export.h) when the client is built with CUDA, device_none.cc without, where
// Built() is false and every call is FailedPrecondition (the callers refuse device tensors before
// reaching them, with InvalidArgument naming the field). No CUDA type appears here: pointers are
// void*, a stream is its opaque cudaStream_t value (null: the legacy default stream).
#ifndef MOE_CLIENT_DEVICE_H_
#define MOE_CLIENT_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe::client::device {

// Whether this client was built with CUDA.
bool Built();

// The allocation a device tensor lies in, as another process maps it (CUDA IPC).
struct ExportedTensor {
  std::string handle;          // cudaIpcMemHandle_t bytes of the whole allocation
  int device = -1;             // this process's ordinal of its device
  const void* base = nullptr;  // the allocation's first byte
  int64_t offset = 0;          // of the tensor in the allocation
  int64_t allocation_bytes = 0;
};

// InvalidArgument naming `field` when [ptr, ptr + bytes) is not inside one device allocation of
// this process that CUDA can share (the message says why).
absl::StatusOr<ExportedTensor> ExportTensor(const void* ptr, int64_t bytes,
                                            absl::string_view field);

// An interprocess CUDA event: one made here (its handle goes to the server) or one of the
// server's, opened from its handle. Released when destroyed.
class Event {
 public:
  // A new event on `device`.
  static absl::StatusOr<std::unique_ptr<Event>> Create(int device);
  // Another process's event, opened for the streams of `device`, which alone may wait on it.
  static absl::StatusOr<std::unique_ptr<Event>> Open(absl::string_view handle, int device);
  virtual ~Event() = default;
  virtual const std::string& handle() const = 0;  // cudaIpcEventHandle_t bytes
  // Records the event on `stream`, a stream of `device` (the device is made current meanwhile,
  // so a null stream is that device's legacy default stream).
  virtual absl::Status Record(void* stream, int device) const = 0;
  // Makes `stream` (of `device`) wait for the event's last record.
  virtual absl::Status StreamWait(void* stream, int device) const = 0;
};

// Copies `bytes` from device memory of `device` to host memory (or back), in order on `stream`
// after the work already enqueued on it; returns once the copy is complete. The error names
// `field`.
absl::Status CopyToHost(void* dst, const void* src, size_t bytes, int device, void* stream,
                        absl::string_view field);
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, int device, void* stream,
                          absl::string_view field);

}  // namespace moe::client::device

#endif  // MOE_CLIENT_DEVICE_H_
