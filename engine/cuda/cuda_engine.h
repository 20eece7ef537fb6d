// The CUDA engine: the layer contract of engine/layer.h run on one NVIDIA GPU.
//
// engine/engine.cc's CreateEngine("cuda:N") calls CreateCudaEngine; "auto" asks CudaDeviceCount
// first. The header is plain C++ (no CUDA types), so the engine factory and the server compile
// with g++ and link the CUDA engine as an ordinary library. How a layer is computed on the GPU
// (MoEBlaze dispatch, grouped expert GEMMs, fused elementwise passes, stream-ordered pool
// memory, the one host synchronisation per call) is described in engine/cuda/cuda_layer.h.
#ifndef MOE_ENGINE_CUDA_CUDA_ENGINE_H_
#define MOE_ENGINE_CUDA_CUDA_ENGINE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/layer.h"

namespace moe {

// Number of CUDA devices usable by this process: 0 when there is no GPU, no driver, or the
// driver is older than the runtime. Never fails and never aborts.
int CudaDeviceCount();

// An engine on device `device_ordinal`. InvalidArgument when the ordinal is negative or not
// below CudaDeviceCount(); Unavailable when there is no usable GPU; Internal when the device
// cannot be initialised (the CUDA error string is in the message).
absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(int device_ordinal);

}  // namespace moe

#endif  // MOE_ENGINE_CUDA_CUDA_ENGINE_H_
