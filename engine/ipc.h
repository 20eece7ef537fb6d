// Memory and events another process shares with this one through CUDA IPC, as the engine
// interface (engine/layer.h: Engine::MapCudaIpcMemory, OpenCudaIpcEvent, CreateCudaIpcEvent)
// hands them to the server.
//
// A trainer on the same host exports a tensor's device memory (engine/cuda/ipc_export.h) and
// the server maps it once, when the trainer registers it as a region, then passes views of it
// to Forward/Backward, so a call moves no bytes through host memory or a socket. The stream
// ordering between the two processes goes through interprocess events: the trainer's "inputs
// ready" event is a request's StreamOrder::wait_event, an event the server created is its
// done_event. This header has no CUDA type in it: an event is an opaque cudaEvent_t value, so
// the server compiles without CUDA and a server on the CPU engine refuses these calls.
#ifndef MOE_ENGINE_IPC_H_
#define MOE_ENGINE_IPC_H_

#include <cstdint>

#include "common/tensor.h"

namespace moe {

// Bytes of the opaque CUDA IPC handles (cudaIpcMemHandle_t, cudaIpcEventHandle_t), as a client
// sends them; any other length is refused before CUDA sees it.
inline constexpr size_t kCudaIpcHandleBytes = 64;

// [data, data + size_bytes) of another process's device memory, mapped into this process.
// Unmapped on destruction: the last mapping of an allocation closes the IPC handle (a process may
// hold one open handle per allocation; mappings of one allocation share it). The owner keeps
// the mapping as long as any call that was given a view into it may still touch it.
class SharedMemoryMapping {
 public:
  virtual ~SharedMemoryMapping() = default;
  virtual void* data() const = 0;
  virtual int64_t size_bytes() const = 0;
  virtual MemoryLocation location() const = 0;  // the device the memory is on
};

// An interprocess CUDA event, destroyed with the object. native() is the cudaEvent_t a
// StreamOrder takes. An event of this engine's device can be recorded (a done_event); any can be
// waited on (a wait_event).
class SharedEvent {
 public:
  virtual ~SharedEvent() = default;
  virtual void* native() const = 0;
  virtual int device() const = 0;  // the device whose streams may use it (this process's ordinal)
};

}  // namespace moe

#endif  // MOE_ENGINE_IPC_H_
