// CUDA engine entry points: device discovery that never fails, and engine creation.
//
// Interim version: device discovery is real; layer creation arrives with cuda_layer.cc.
#include "engine/cuda/cuda_engine.h"

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe {

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error so later calls start clean
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(int device_ordinal) {
  const int count = CudaDeviceCount();
  if (count == 0) return absl::UnavailableError("cuda: no usable CUDA device");
  if (device_ordinal < 0 || device_ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat("device: cuda:", device_ordinal,
                                                   " out of range, ", count, " device(s)"));
  }
  return absl::UnimplementedError("cuda: layer support lands with cuda_layer.cc");
}

}  // namespace moe
