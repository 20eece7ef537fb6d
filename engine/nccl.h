// NCCL links between the engine's device and a peer process's GPU, as the engine interface
// (engine/layer.h: Engine::StartNcclLink) hands them to the server (docs/PROTOCOL.md, "NCCL
// channels"; docs/decisions/0018-nccl-transport.md).
//
// A link is two two-rank NCCL communicators, one per direction, so each carries its transfers in
// one order on both ranks. The engine makes both unique ids, starts its side as rank 1 without
// blocking (the peer joins later, through the ids the server sends it) and owns the link's
// streams and device buffers: the server only says what to receive and send, in which order.
// No CUDA or NCCL type appears here: a buffer is a pointer and a size, a completion an opaque
// object to poll, so the server compiles without CUDA and a server without NCCL refuses links.
#ifndef MOE_ENGINE_NCCL_H_
#define MOE_ENGINE_NCCL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor.h"

namespace moe {

// Bytes of an ncclUniqueId as the protocol carries it.
inline constexpr size_t kNcclUniqueIdBytes = 128;

// Device memory a link transfers: `bytes` at `data`.
struct NcclBuffer {
  void* data = nullptr;
  int64_t bytes = 0;
};

// Transfers posted together: their completion, polled without blocking.
class NcclCompletion {
 public:
  virtual ~NcclCompletion() = default;
  // OK once every transfer is complete; Unavailable while any is pending; another error when the
  // device reports one.
  virtual absl::Status Query() const = 0;
};

class NcclLink {
 public:
  virtual ~NcclLink() = default;  // aborts the communicators unless closed, frees the buffers
  virtual MemoryLocation location() const = 0;  // the engine's device
  // The ids the peer joins with, as rank 0: it sends on `to_server_id` and receives on
  // `to_client_id`.
  virtual const std::string& to_server_id() const = 0;
  virtual const std::string& to_client_id() const = 0;
  // OK once both communicators are ready; Unavailable while they bootstrap; the communicators'
  // error (ncclCommGetAsyncError) once one failed, and from then on.
  virtual absl::Status Poll() = 0;
  // A device buffer of at least `bytes`, from the link's cache (the smallest free one that fits)
  // or newly allocated; ResourceExhausted when the device has no room. Given back with Release.
  virtual absl::StatusOr<NcclBuffer> Acquire(int64_t bytes) = 0;
  virtual void Release(NcclBuffer buffer) = 0;
  // Posts receives into `into`, in order, on the peer-to-server communicator's stream.
  virtual absl::StatusOr<std::unique_ptr<NcclCompletion>> Receive(
      absl::Span<const NcclBuffer> into) = 0;
  // Posts sends of `from`, in order, on the server-to-peer communicator's stream; `zero` first
  // fills them with zeros (a refused call's results, so no reused buffer shows old bytes).
  // `after`: null, or compute_done_event() once the engine recorded it; the sends wait for it on
  // the device, so the host never waits for the call's device work.
  virtual absl::StatusOr<std::unique_ptr<NcclCompletion>> Send(absl::Span<const NcclBuffer> from,
                                                               bool zero, void* after) = 0;
  // An opaque CUDA event of the link's device for an engine call's StreamOrder::done_event, so
  // the call returns once its work is queued and Send follows it on the device; null where the
  // link has none (the call then waits for its work). One event, re-recorded call after call:
  // one thread at a time may use it (the server's device executor).
  virtual void* compute_done_event() = 0;
  // Aborts both communicators (ncclCommAbort): transfers in flight end, Poll fails from then on.
  // Safe from any thread, at any time, more than once.
  virtual void Abort() = 0;
};

}  // namespace moe

#endif  // MOE_ENGINE_NCCL_H_
