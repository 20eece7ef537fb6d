// The CUDA engine's NCCL links (engine/nccl.h): an NcclPair (nccl_pair.h) on the engine's
// device as rank 1, and the device buffers its transfers land in. Built only with NCCL.
#ifndef MOE_ENGINE_CUDA_NCCL_LINK_H_
#define MOE_ENGINE_CUDA_NCCL_LINK_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/nccl.h"

namespace moe::cuda {

// Makes both unique ids and starts the engine's side of the link on `device`.
absl::StatusOr<std::unique_ptr<NcclLink>> StartNcclLink(int device);

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_NCCL_LINK_H_
