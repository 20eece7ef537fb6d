// moe-service-bench built without CUDA (see device_tensors.h): there is no GPU memory to give
// the trainer, so every call says so; main.cc refuses --client_device=cuda:N before reaching it.
#include "bench/service/device_tensors.h"

namespace moe::bench {
namespace {

absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "client_device: this moe-service-bench was built without CUDA");
}

}  // namespace

bool CudaBuilt() { return false; }

absl::StatusOr<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(int, int64_t) {
  return NoCuda();
}
DeviceBuffer::~DeviceBuffer() = default;

absl::Status CopyToDevice(void*, const void*, size_t, int) { return NoCuda(); }
absl::Status CopyFromDevice(void*, const void*, size_t, int) { return NoCuda(); }

absl::StatusOr<std::unique_ptr<DeviceStream>> DeviceStream::Create(int) { return NoCuda(); }
DeviceStream::~DeviceStream() = default;
absl::Status DeviceStream::Synchronize() const { return NoCuda(); }

}  // namespace moe::bench
