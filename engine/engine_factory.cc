// CreateEngine: maps a device string to an engine ("auto", "cpu", "cuda", "cuda:N").
//
// The CUDA engine is linked only when it was built (MOE_HAVE_CUDA_ENGINE, set by CMake when
// the moe_engine_cuda target exists); without it every CUDA device string is Unavailable, so
// a CPU-only build still serves "auto" and "cpu".
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/cpu_engine.h"
#include "engine/layer.h"
#ifdef MOE_HAVE_CUDA_ENGINE
#include "engine/cuda/cuda_engine.h"
#endif

namespace moe {

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const std::string& device,
                                                     const EngineOptions& options) {
  if (options.cpu_threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cpu_threads: ", options.cpu_threads,
                                                   " (expected 0 for every core, or more)"));
  }
  if (device == "cpu") return CreateCpuEngine(options.cpu_threads);
  int ordinal = -1;
  if (device == "auto") {
#ifdef MOE_HAVE_CUDA_ENGINE
    if (CudaDeviceCount() > 0) return CreateCudaEngine(0, options);
#endif
    return CreateCpuEngine(options.cpu_threads);
  }
  if (device == "cuda") {
    ordinal = 0;
  } else if (absl::StartsWith(device, "cuda:")) {
    if (!absl::SimpleAtoi(absl::string_view(device).substr(5), &ordinal) || ordinal < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("device: '", device, "' has no valid ordinal (expected cuda:N, N >= 0)"));
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("device: unknown '", device, "' (expected auto, cpu, cuda or cuda:N)"));
  }
#ifdef MOE_HAVE_CUDA_ENGINE
  const int count = CudaDeviceCount();
  if (ordinal >= count) {
    return absl::UnavailableError(absl::StrCat("device: '", device, "' is not available (", count,
                                               " CUDA device(s) visible)"));
  }
  return CreateCudaEngine(ordinal, options);
#else
  return absl::UnavailableError(
      absl::StrCat("device: '", device, "' needs the CUDA engine, which this build lacks"));
#endif
}

}  // namespace moe
