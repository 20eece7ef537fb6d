// A call's tensors on the layer's device (see tensor_io.h).
#include "engine/cuda/tensor_io.h"

#include "absl/strings/str_cat.h"
#include "engine/cuda/host_staging.h"
#include "engine/cuda/ipc_export.h"

namespace moe::cuda {
namespace {

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kDirectAlignment == 0; }

bool OnStreamDevice(const MemoryLocation& location, const Stream& stream) {
  return location.is_cuda() && location.device == stream.device();
}

// Enqueues a copy of `bytes` from `src` on device `src_device` to `dst` on device `dst_device`.
absl::Status CopyBetweenDevices(void* dst, int dst_device, const void* src, int src_device,
                                size_t bytes, cudaStream_t stream) {
  if (dst_device == src_device) {
    MOE_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  } else {
    MOE_CUDA_RETURN(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, stream));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckViewLocations(const std::vector<NamedView>& views) {
  for (const NamedView& v : views) {
    if (v.location.is_host()) {
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, v.data) != cudaSuccess) {
        cudaGetLastError();  // older drivers answer pageable pointers with an error
        continue;
      }
      if (attr.type == cudaMemoryTypeDevice) {
        return absl::InvalidArgumentError(
            absl::StrCat(v.field, ": said to be host memory, but is memory of cuda:", attr.device));
      }
      continue;
    }
    MOE_ASSIGN_OR_RETURN(const DeviceAllocation a, FindDeviceAllocation(v.data, v.field));
    if (a.device != v.location.device) {
      return absl::InvalidArgumentError(absl::StrCat(v.field, ": said to be on ",
                                                     v.location.DebugString(),
                                                     ", but is memory of cuda:", a.device));
    }
    const int64_t offset = static_cast<const char*>(v.data) - a.base;
    if (static_cast<int64_t>(v.size_bytes) > a.size_bytes - offset) {
      return absl::InvalidArgumentError(
          absl::StrCat(v.field, ": ", v.size_bytes, " bytes from offset ", offset,
                       " run past the end of its allocation (", a.size_bytes, " bytes)"));
    }
  }
  return absl::OkStatus();
}

absl::Status WaitForCaller(const StreamOrder& order, cudaStream_t stream) {
  if (order.wait_event == nullptr) return absl::OkStatus();
  MOE_CUDA_RETURN(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(order.wait_event), 0));
  return absl::OkStatus();
}

absl::StatusOr<const void*> DeviceInput(const TensorView& view, bool keep,
                                        const std::shared_ptr<Stream>& stream, DeviceBuffer* own,
                                        const char* what) {
  if (OnStreamDevice(view.location, *stream) && !keep && Aligned(view.data)) return view.data;
  MOE_ASSIGN_OR_RETURN(*own, DeviceBuffer::Allocate(view.size_bytes, stream, what));
  if (view.location.is_host()) {
    MOE_RETURN_IF_ERROR(
        CopyToDevice(stream->device(), own->get(), view.data, view.size_bytes, stream->get()));
  } else {
    MOE_RETURN_IF_ERROR(CopyBetweenDevices(own->get(), stream->device(), view.data,
                                           view.location.device, view.size_bytes, stream->get()));
  }
  return static_cast<const void*>(own->get());
}

absl::StatusOr<void*> OutputTarget(const MutableTensorView& dst, size_t bytes,
                                   const std::shared_ptr<Stream>& stream, DeviceBuffer* own,
                                   const char* what) {
  if (!dst.empty() && OnStreamDevice(dst.location, *stream) && Aligned(dst.data)) {
    return dst.data;
  }
  MOE_ASSIGN_OR_RETURN(*own, DeviceBuffer::Allocate(bytes, stream, what));
  return own->get();
}

absl::Status DeliverToDevice(const void* src, const MutableTensorView& dst, const Stream& stream) {
  if (dst.empty() || dst.location.is_host() || src == dst.data) return absl::OkStatus();
  return CopyBetweenDevices(dst.data, dst.location.device, src, stream.device(), dst.size_bytes,
                            stream.get());
}

absl::Status FinishCall(const StreamOrder& order, cudaStream_t stream, bool synchronised,
                        bool host_pending) {
  if (order.done_event != nullptr) {
    MOE_CUDA_RETURN(cudaEventRecord(static_cast<cudaEvent_t>(order.done_event), stream));
  }
  if (!synchronised && (order.done_event == nullptr || host_pending)) {
    MOE_CUDA_RETURN(cudaStreamSynchronize(stream));
  }
  return absl::OkStatus();
}

}  // namespace moe::cuda
