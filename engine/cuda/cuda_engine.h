// The CUDA engine: the layer contract of engine/layer.h run on one NVIDIA GPU.
//
// engine/engine_factory.cc's CreateEngine("cuda:N") calls CreateCudaEngine; "auto" asks
// CudaDeviceCount first. The header is plain C++ (no CUDA types), so the engine factory and the
// server compile with g++ and link the CUDA engine as an ordinary library. How a layer is computed
// on the GPU (MoEBlaze dispatch, grouped expert GEMMs, fused elementwise passes, stream-ordered
// pool memory, the one host synchronisation per call) is described in engine/cuda/cuda_layer.h.
#ifndef MOE_ENGINE_CUDA_CUDA_ENGINE_H_
#define MOE_ENGINE_CUDA_CUDA_ENGINE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/cuda/pipeline_options.h"
#include "engine/engine_options.h"
#include "engine/layer.h"

namespace moe {

// Number of CUDA devices usable by this process: 0 when there is no GPU, no driver, or the
// driver is older than the runtime. Never fails and never aborts.
int CudaDeviceCount();

// An engine on device `device_ordinal`. InvalidArgument when the ordinal is negative or not
// below CudaDeviceCount(); Unavailable when there is no usable GPU; Internal when the device
// cannot be initialised (the CUDA error string is in the message). `options` are the
// operator's settings (fused_kernels, pinned_tensor_bytes); `pipeline` is how every layer's
// expert pipeline runs, what tests and benchmarks force (its fused_kernels is taken from
// `options`).
absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(
    int device_ordinal, const EngineOptions& options = {},
    const cuda::PipelineOptions& pipeline = {});

}  // namespace moe

#endif  // MOE_ENGINE_CUDA_CUDA_ENGINE_H_
