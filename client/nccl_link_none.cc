// The client's NCCL link (see nccl_link.h) in a client built without CUDA or NCCL: Start says so,
// and the connection stages device tensors (or, without CUDA, refuses them) instead.
#include "client/nccl_link.h"

namespace moe::client::nccl {

bool Built() { return false; }

absl::StatusOr<std::unique_ptr<Link>> Link::Start(int, absl::string_view, absl::string_view) {
  return absl::FailedPreconditionError("this client was built without NCCL");
}

}  // namespace moe::client::nccl
