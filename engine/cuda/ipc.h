// The CUDA engine's side of CUDA IPC (engine/ipc.h): mapping another process's device memory
// and opening or creating interprocess events, for Engine::MapCudaIpcMemory, OpenCudaIpcEvent
// and CreateCudaIpcEvent.
//
// A process may hold a cudaIpcMemHandle_t open only once at a time (a second
// cudaIpcOpenMemHandle of it fails), while a trainer's tensors are usually pieces of one
// allocation and so share a handle. Open handles therefore live in one process-wide table,
// counted: every mapping of an allocation shares its one open handle, and the last mapping
// dropped closes it. The table is keyed by the handle's bytes, which name one allocation for its
// lifetime (a new allocation at the same address gets a new handle).
#ifndef MOE_ENGINE_CUDA_IPC_H_
#define MOE_ENGINE_CUDA_IPC_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/ipc.h"

namespace moe::cuda {

// Engine::MapCudaIpcMemory for an engine on `engine_device`: the handle is opened on `device`,
// the memory's device as the exporter numbers it (the same CUDA_VISIBLE_DEVICES), so memory of
// another GPU is a peer allocation the engine copies from and into (cudaMemcpyPeerAsync) rather
// than memory its kernels read across the link. Pointer attributes of opened memory name the
// device it was opened on, so a wrong `device` cannot be told apart on a first open; it harms
// only its caller (the copies still reach the memory through its peer mapping). A handle already
// open under another device is refused.
absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapIpcMemory(int engine_device,
                                                                  absl::string_view mem_handle,
                                                                  int device, int64_t offset,
                                                                  int64_t size_bytes);

// Engine::OpenCudaIpcEvent for an engine on `device`: opened for that device's streams.
absl::StatusOr<std::unique_ptr<SharedEvent>> OpenIpcEvent(absl::string_view handle, int device);

// Engine::CreateCudaIpcEvent for an engine on `device`.
absl::StatusOr<std::pair<std::unique_ptr<SharedEvent>, std::string>> CreateIpcEvent(int device);

// Allocations this process holds open through CUDA IPC now (for tests and metrics).
int OpenIpcAllocations();

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_IPC_H_
