// The CUDA implementation of moe::Layer (engine/layer.h) on one device.
//
// State: every parameter of the layer lives in one flat fp32 buffer (stacked [W1; W3] per
// expert, then W2, then the router), with the gradients, optimizer moments and, for bf16
// storage, the bf16 copy the GEMMs read in parallel flat buffers. That makes the optimizer,
// the gradient norm and ZeroGrad one launch each over all tensors. Export and import convert
// between this layout and the contract's named tensors.
//
// A call brings its inputs to the device (host inputs copied, inputs on this device read in
// place, others copied peer to peer: tensor_io.h), runs the expert pipeline (expert_pipeline.h)
// and, for server routing, the router (cuBLAS GEMM, fused softmax/top-K, aux and z statistics),
// and delivers the outputs (into the caller's destination, or back to host tensors). Host
// synchronisations: Forward one in the dispatch (per-expert counts, see expert_pipeline.h), one
// more to bring client routing given in device memory to the host for its checks, plus the final
// device-to-host copy of host outputs; Backward only that final copy; with a done_event and every
// output in device memory, neither waits for its last kernels (engine/layer.h StreamOrder);
// Step one (the gradient norm, which the result reports and the clipping needs on the host).
#ifndef MOE_ENGINE_CUDA_CUDA_LAYER_H_
#define MOE_ENGINE_CUDA_CUDA_LAYER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/cuda/device.h"
#include "engine/cuda/pipeline_options.h"
#include "engine/layer.h"

namespace moe::cuda {

// Validates `config` and creates a layer on `device` with the seeded initial weights of
// engine/init.h (bit-identical to the CPU engine's); its expert pipeline runs with `options`.
absl::StatusOr<std::unique_ptr<Layer>> CreateCudaLayer(const LayerConfig& config, int device,
                                                       const PipelineOptions& options = {});

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_CUDA_LAYER_H_
