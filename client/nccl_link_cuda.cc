// The client's NCCL link (see nccl_link.h) over moe::cuda::NcclPair as rank 0. A call's sends and
// receives wait on an event recorded on the caller's stream, so they start after the caller's
// inputs are written and its earlier reads of the destinations are done; the caller's stream
// later waits on both directions' completion events.
#include <cuda_runtime.h>

#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/nccl_link.h"
#include "engine/cuda/ipc_export.h"
#include "engine/cuda/nccl_pair.h"

namespace moe::client::nccl {
namespace {

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  return absl::InternalError(absl::StrCat("cuda: ", what, ": ", cudaGetErrorString(e)));
}

class CudaPosted final : public Posted {
 public:
  CudaPosted(int device, std::unique_ptr<cuda::StreamCompletion> sent,
             std::unique_ptr<cuda::StreamCompletion> received)
      : device_(device), sent_(std::move(sent)), received_(std::move(received)) {}
  absl::Status StreamWait(void* stream) const override {
    cuda::DeviceScope scope(device_);
    if (!scope.ok()) return absl::FailedPreconditionError(scope.error());
    for (const auto* c : {sent_.get(), received_.get()}) {
      // Posted by now in all but a rare race: the server answers once it has the inputs.
      absl::StatusOr<void*> event = c->WaitPosted();
      if (!event.ok()) return event.status();
      if (cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                              static_cast<cudaEvent_t>(*event), 0);
          e != cudaSuccess) {
        return CudaError(e, "cudaStreamWaitEvent");
      }
    }
    return absl::OkStatus();
  }

 private:
  int device_;
  std::unique_ptr<cuda::StreamCompletion> sent_;
  std::unique_ptr<cuda::StreamCompletion> received_;
};

class CudaLink final : public Link {
 public:
  CudaLink(int device, std::unique_ptr<cuda::NcclPair> pair)
      : device_(device), pair_(std::move(pair)) {}
  ~CudaLink() override {
    cuda::DeviceScope scope(device_);
    if (inputs_ready_ != nullptr) cudaEventDestroy(inputs_ready_);
  }

  absl::Status WaitReady(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      // Ready, then warm (NcclPair::PollReady): the server warms its side up as soon as its
      // communicators are ready.
      const absl::Status st = pair_->PollReady();
      if (!absl::IsUnavailable(st)) return st;
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "nccl: the channel's communicators were not ready in ", timeout.count(), " ms"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  absl::StatusOr<std::unique_ptr<Posted>> Post(absl::Span<const NcclBuffer> sends,
                                               absl::Span<const NcclBuffer> receives,
                                               void* stream) override {
    {
      cuda::DeviceScope scope(device_);
      if (!scope.ok()) return absl::FailedPreconditionError(scope.error());
      if (inputs_ready_ == nullptr) {
        if (cudaError_t e = cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming);
            e != cudaSuccess) {
          return CudaError(e, "cudaEventCreateWithFlags");
        }
      }
      // Reused call after call: each post's streams wait on its latest record.
      if (cudaError_t e = cudaEventRecord(inputs_ready_, static_cast<cudaStream_t>(stream));
          e != cudaSuccess) {
        return CudaError(e, "cudaEventRecord");
      }
    }
    absl::StatusOr<std::unique_ptr<cuda::StreamCompletion>> sent =
        pair_->Send(sends, inputs_ready_, /*zero=*/false);
    if (!sent.ok()) return sent.status();
    absl::StatusOr<std::unique_ptr<cuda::StreamCompletion>> received =
        pair_->Receive(receives, inputs_ready_);
    if (!received.ok()) return received.status();
    return std::unique_ptr<Posted>(
        new CudaPosted(device_, *std::move(sent), *std::move(received)));
  }

  void Abort() override { pair_->Abort(); }

 private:
  int device_;
  std::unique_ptr<cuda::NcclPair> pair_;
  cudaEvent_t inputs_ready_ = nullptr;
};

}  // namespace

bool Built() { return true; }

absl::StatusOr<std::unique_ptr<Link>> Link::Start(int device, absl::string_view to_server_id,
                                                  absl::string_view to_client_id) {
  absl::StatusOr<std::unique_ptr<cuda::NcclPair>> pair =
      cuda::NcclPair::Start(device, /*rank=*/0, /*send_id=*/to_server_id,
                            /*recv_id=*/to_client_id);
  if (!pair.ok()) return pair.status();
  return std::unique_ptr<Link>(new CudaLink(device, *std::move(pair)));
}

}  // namespace moe::client::nccl
