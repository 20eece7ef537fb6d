// EngineOptions: what the process that creates an engine may set about it, passed to
// CreateEngine (engine/layer.h). moe-server fills it from ServerOptions (its flags); tests and
// tools fill it directly. Library code reads no environment variables: every setting an operator
// may change comes through here.
#ifndef MOE_ENGINE_ENGINE_OPTIONS_H_
#define MOE_ENGINE_ENGINE_OPTIONS_H_

#include <cstddef>

namespace moe {

struct EngineOptions {
  // CPU engine: threads of its own pool; 0 shares the process-wide pool of all cores. Results
  // do not depend on the count.
  int cpu_threads = 0;
  // CUDA engine: false runs every expert forward and backward on the unfused (cuBLAS) path,
  // the operator's fallback should the fused sm90 kernels misbehave on some driver. Results
  // stay within the documented tolerances either way.
  bool fused_kernels = true;
  // CUDA engine: page-locked host memory held at most for large request and result tensors
  // (engine/cuda/pinned_pool.h); 0 pins none. The first CUDA engine of a process sets it.
  size_t pinned_tensor_bytes = size_t{8} << 30;
};

}  // namespace moe

#endif  // MOE_ENGINE_ENGINE_OPTIONS_H_
