// The client's side of an NCCL channel's communicators (internal to the library; client.h does
// not include it), in the manner of device.h: nccl_link_cuda.cc over moe::cuda::NcclPair
// (engine/cuda/nccl_pair.h) when the client is built with CUDA and NCCL, nccl_link_none.cc
// otherwise, where Built() is false and Start is FailedPrecondition saying so. No CUDA or NCCL
// type here: a stream is its opaque cudaStream_t value (null: the legacy default stream).
#ifndef MOE_CLIENT_NCCL_LINK_H_
#define MOE_CLIENT_NCCL_LINK_H_

#include <chrono>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/nccl.h"

namespace moe::client::nccl {

// Whether this client was built with NCCL.
bool Built();

// One call's transfers, posted: the caller's stream waits for them with StreamWait.
class Posted {
 public:
  virtual ~Posted() = default;
  // Makes `stream` (of the link's device) wait until the sends and receives are complete; on the
  // host it first waits, briefly, for them to be posted (they are queued, NcclPair).
  virtual absl::Status StreamWait(void* stream) const = 0;
};

class Link {
 public:
  // Joins the server's channel as rank 0 on `device`: sends on `to_server_id`'s communicator,
  // receives on `to_client_id`'s.
  static absl::StatusOr<std::unique_ptr<Link>> Start(int device, absl::string_view to_server_id,
                                                     absl::string_view to_client_id);
  virtual ~Link() = default;  // aborts the communicators
  // Polls until both communicators are ready; DeadlineExceeded after `timeout`.
  virtual absl::Status WaitReady(std::chrono::milliseconds timeout) = 0;
  // Posts sends of `sends` and receives into `receives`, each in order, after the work enqueued
  // on `stream` so far. Not thread-safe: the caller posts one call at a time, in its sequence.
  virtual absl::StatusOr<std::unique_ptr<Posted>> Post(absl::Span<const NcclBuffer> sends,
                                                       absl::Span<const NcclBuffer> receives,
                                                       void* stream) = 0;
  virtual void Abort() = 0;
};

}  // namespace moe::client::nccl

#endif  // MOE_CLIENT_NCCL_LINK_H_
