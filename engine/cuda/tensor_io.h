// A call's tensors as the CUDA layer's kernels see them: where each input is read from and each
// output written to, whether the caller's view is host memory, memory of the layer's device or
// of another device (engine/layer.h, "Where the bytes live").
//
// The kernels read an input on the layer's own device in place and write an output straight into
// a destination there; anything else moves by one copy on the layer's stream: host memory through
// host_staging.h, another device's memory by a peer copy. An input the layer keeps past the call
// (x, for the Backward) is copied into the layer's own memory even from its own device, so that a
// caller may reuse every input once the call is complete. A caller's pointer is used in place
// only when kDirectAlignment-aligned, as the pool's buffers are: cuBLAS may choose other kernels
// for less aligned operands, and results must not depend on where a caller's tensor starts.
#ifndef MOE_ENGINE_CUDA_TENSOR_IO_H_
#define MOE_ENGINE_CUDA_TENSOR_IO_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"
#include "engine/cuda/device.h"
#include "engine/layer.h"
#include "engine/routing.h"

namespace moe::cuda {

inline constexpr uintptr_t kDirectAlignment = 256;

// Every view's location, before any work: a host view must not be device memory (the host-side
// copies would fault on it); a device view must be memory of the device it names (an ordinal of
// this process), all of its bytes inside one allocation. InvalidArgument naming the field.
absl::Status CheckViewLocations(const std::vector<NamedView>& views);

// The layer's stream waits for order.wait_event, when there is one.
absl::Status WaitForCaller(const StreamOrder& order, cudaStream_t stream);

// Device memory of the stream's device holding `view`'s bytes for the kernels: the view itself
// when it is memory of that device, aligned and not to be kept (`keep`: the layer holds it after
// the call); otherwise a copy, enqueued on the stream, in *own (host memory: host_staging.h's
// CopyToDevice, done with the host bytes on return; another device: a peer copy).
absl::StatusOr<const void*> DeviceInput(const TensorView& view, bool keep,
                                        const std::shared_ptr<Stream>& stream, DeviceBuffer* own,
                                        const char* what);

// Where the kernels write an output of `bytes` bytes bound for `dst`: dst itself when it is
// aligned memory of the stream's device; otherwise a new buffer *own (also for an empty dst).
absl::StatusOr<void*> OutputTarget(const MutableTensorView& dst, size_t bytes,
                                   const std::shared_ptr<Stream>& stream, DeviceBuffer* own,
                                   const char* what);

// Once the kernels have written an output at `src` (OutputTarget's pointer), enqueues its copy
// into a device destination `dst` elsewhere; nothing when they wrote it in place. Host
// destinations are the caller's to fill (host_staging.h).
absl::Status DeliverToDevice(const void* src, const MutableTensorView& dst, const Stream& stream);

// The end of a call whose work is enqueued: records order.done_event, then synchronises the
// stream unless the caller may have the call return with work in flight (a done_event, and no
// output bound for host memory still in flight: `host_pending`). `synchronised`: the stream was
// synchronised after the last work was enqueued (a final copy to the host did it).
absl::Status FinishCall(const StreamOrder& order, cudaStream_t stream, bool synchronised,
                        bool host_pending);

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_TENSOR_IO_H_
