// Engine::StartNcclLink (engine/layer.h, engine/nccl.h) for an engine without NCCL: the CPU
// engine, or a CUDA engine built where NCCL was not found. FailedPrecondition naming the engine,
// so a client asking for an NCCL channel learns why and falls back to TCP.
#include <memory>

#include "absl/strings/str_cat.h"
#include "engine/layer.h"
#include "engine/nccl.h"

namespace moe {

absl::StatusOr<std::unique_ptr<NcclLink>> Engine::StartNcclLink() {
  return absl::FailedPreconditionError(absl::StrCat(
      "NCCL channels need a CUDA engine built with NCCL; this server runs on ", name(),
      " without NCCL"));
}

}  // namespace moe
