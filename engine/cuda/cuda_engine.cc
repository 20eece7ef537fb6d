// CUDA engine entry points: device discovery that never fails, and the Engine for one device.
//
// Creating the engine raises the device's default memory pool release threshold to "keep
// everything", so the stream-ordered allocations of every layer call are served from memory
// the pool already holds (cudaMallocAsync without a trip to the driver after warm-up).
#include "engine/cuda/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_layer.h"
#include "engine/cuda/device.h"
#include "engine/cuda/ipc.h"
#ifdef MOE_HAVE_NCCL
#include "engine/cuda/nccl_link.h"
#endif
#include "engine/cuda/pinned_pool.h"
#include "engine/state.h"

namespace moe {
namespace {

class CudaEngine : public Engine {
 public:
  CudaEngine(int device, const cuda::PipelineOptions& pipeline)
      : device_(device), pipeline_(pipeline) {}
  std::string name() const override { return absl::StrCat("cuda:", device_); }
  absl::StatusOr<std::unique_ptr<Layer>> CreateLayer(const LayerConfig& config) override {
    return cuda::CreateCudaLayer(config, device_, pipeline_);
  }
  // Per parameter: the fp32 master, gradient and first moment (AdamW) or momentum (SGD), the
  // fp32 second moment (AdamW) and the bf16 copy the GEMMs read (bf16 storage): the flat
  // buffers of cuda_layer.cc, whose resident_bytes() sums them.
  absl::StatusOr<int64_t> LayerStateBytes(const LayerConfig& config) const override {
    const int64_t per_param = 12 + (config.optimizer.kind == OptimizerKind::kAdamW ? 4 : 0) +
                              (config.dtype == DType::kBFloat16 ? 2 : 0);
    return LayerStateBytesFor(config, per_param);
  }
  // The host share of a call is its results (out or dx in the layer dtype, the routing used or
  // dweights); its working buffers are device memory, refused by the allocator when short.
  absl::StatusOr<int64_t> HostWorkingBytes(const LayerConfig& config, int64_t tokens,
                                           EngineCall call) const override {
    const double t = static_cast<double>(tokens), k = static_cast<double>(config.top_k),
                 d = static_cast<double>(config.d_model),
                 elem = static_cast<double>(DTypeSize(config.dtype));
    const double routing = call == EngineCall::kBackward ? 4 * t * k : 8 * t * k;
    return EstimatedBytes(t * d * elem + routing, "the call's results");
  }
  absl::StatusOr<DeviceMemoryInfo> DeviceMemory() const override {
    size_t free_b = 0, total_b = 0;
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) err = cudaMemGetInfo(&free_b, &total_b);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::UnavailableError(
          absl::StrCat(name(), ": cudaMemGetInfo failed: ", cudaGetErrorString(err)));
    }
    DeviceMemoryInfo info;
    info.total_bytes = static_cast<int64_t>(total_b);
    info.free_bytes = static_cast<int64_t>(free_b);
    return info;
  }
  int64_t memory_in_use_bytes() const override {
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return static_cast<int64_t>(total_b - free_b);
  }
  int64_t pinned_host_bytes() const override {
    const cuda::PinnedPool* pool = cuda::PinnedPool::ForProcess();
    return pool != nullptr ? static_cast<int64_t>(pool->held_bytes()) : 0;
  }
  absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapCudaIpcMemory(
      absl::string_view mem_handle, int device, int64_t offset, int64_t size_bytes) override {
    return cuda::MapIpcMemory(device_, mem_handle, device, offset, size_bytes);
  }
  absl::StatusOr<std::unique_ptr<SharedEvent>> OpenCudaIpcEvent(absl::string_view handle) override {
    return cuda::OpenIpcEvent(handle, device_);
  }
  absl::StatusOr<std::pair<std::unique_ptr<SharedEvent>, std::string>> CreateCudaIpcEvent()
      override {
    return cuda::CreateIpcEvent(device_);
  }
#ifdef MOE_HAVE_NCCL
  absl::StatusOr<std::unique_ptr<NcclLink>> StartNcclLink() override {
    return cuda::StartNcclLink(device_);
  }
#endif
  int64_t memory_total_bytes() const override {
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return static_cast<int64_t>(total_b);
  }

 private:
  int device_;
  cuda::PipelineOptions pipeline_;
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the "no device" error so later calls start clean
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(int device_ordinal,
                                                         const EngineOptions& options,
                                                         const cuda::PipelineOptions& pipeline) {
  const int count = CudaDeviceCount();
  if (count == 0) return absl::UnavailableError("cuda: no usable CUDA device");
  if (device_ordinal < 0 || device_ordinal >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: cuda:", device_ordinal, " out of range, ", count, " device(s)"));
  }
  MOE_CUDA_RETURN(cudaSetDevice(device_ordinal));
  cudaMemPool_t pool = nullptr;
  MOE_CUDA_RETURN(cudaDeviceGetDefaultMemPool(&pool, device_ordinal));
  uint64_t keep_all = UINT64_MAX;
  MOE_CUDA_RETURN(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
  // From here on the process's large host tensors are page-locked, so the layers' copies of
  // their inputs and outputs are single DMAs (pinned_pool.h).
  cuda::PinnedPool::InstallForProcess(options.pinned_tensor_bytes);
  cuda::PipelineOptions layers = pipeline;
  layers.fused_kernels = options.fused_kernels;
  return std::unique_ptr<Engine>(new CudaEngine(device_ordinal, layers));
}

}  // namespace moe
