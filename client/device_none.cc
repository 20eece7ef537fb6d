// The client's CUDA calls (see device.h) in a client built without CUDA: there is no device
// memory to export or copy, so every call says so. The library refuses a device tensor before it
// gets here, with InvalidArgument naming the tensor's field.
#include "client/device.h"

namespace moe::client::device {
namespace {

absl::Status NoCuda() {
  return absl::FailedPreconditionError("this client was built without CUDA");
}

}  // namespace

bool Built() { return false; }

absl::StatusOr<ExportedTensor> ExportTensor(const void*, int64_t, absl::string_view) {
  return NoCuda();
}

absl::StatusOr<std::unique_ptr<Event>> Event::Create(int) { return NoCuda(); }

absl::StatusOr<std::unique_ptr<Event>> Event::Open(absl::string_view, int) { return NoCuda(); }

absl::Status CopyToHost(void*, const void*, size_t, int, void*, absl::string_view) {
  return NoCuda();
}

absl::Status CopyToDevice(void*, const void*, size_t, int, void*, absl::string_view) {
  return NoCuda();
}

}  // namespace moe::client::device
