// The Engine's CUDA IPC calls (engine/layer.h, engine/ipc.h) for an engine without CUDA: each
// refuses with FailedPrecondition naming the engine, so a client asking a CPU server to map its
// GPU memory learns why instead of getting a generic "unimplemented".
#include "engine/ipc.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/layer.h"

namespace moe {
namespace {

absl::Status NeedsCuda(const Engine& engine, absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, " needs a CUDA engine; this server runs on ", engine.name()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> Engine::MapCudaIpcMemory(
    absl::string_view /*mem_handle*/, int /*device*/, int64_t /*offset*/, int64_t /*size_bytes*/) {
  return NeedsCuda(*this, "mapping CUDA IPC memory");
}

absl::StatusOr<std::unique_ptr<SharedEvent>> Engine::OpenCudaIpcEvent(
    absl::string_view /*handle*/) {
  return NeedsCuda(*this, "opening a CUDA IPC event");
}

absl::StatusOr<std::pair<std::unique_ptr<SharedEvent>, std::string>> Engine::CreateCudaIpcEvent() {
  return NeedsCuda(*this, "creating a CUDA IPC event");
}

}  // namespace moe
