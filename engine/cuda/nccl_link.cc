// StartNcclLink (see nccl_link.h). Buffers are cudaMalloc'd (the engine checks device views
// against their allocation, which cudaMalloc memory always has) and kept for reuse until the link
// goes: a steady training loop allocates nothing after its first micro-batches, and freeing
// (which synchronises the device) happens only when the link is destroyed.
#include "engine/cuda/nccl_link.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cuda/ipc_export.h"
#include "engine/cuda/nccl_pair.h"

namespace moe::cuda {
namespace {

class CudaNcclLink final : public NcclLink {
 public:
  CudaNcclLink(int device, std::string to_server, std::string to_client,
               std::unique_ptr<NcclPair> pair)
      : device_(device),
        to_server_(std::move(to_server)),
        to_client_(std::move(to_client)),
        pair_(std::move(pair)) {}

  ~CudaNcclLink() override {
    pair_->Abort();  // no transfer may still use a buffer freed below
    DeviceScope scope(device_);
    for (const NcclBuffer& b : all_) cudaFree(b.data);
    if (done_ != nullptr) cudaEventDestroy(done_);
  }

  MemoryLocation location() const override { return MemoryLocation::Cuda(device_); }
  const std::string& to_server_id() const override { return to_server_; }
  const std::string& to_client_id() const override { return to_client_; }
  // Ready once both communicators are, and warm (NcclPair::PollReady).
  absl::Status Poll() override { return pair_->PollReady(); }

  absl::StatusOr<NcclBuffer> Acquire(int64_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->bytes >= bytes && (best == free_.end() || it->bytes < best->bytes)) best = it;
      }
      if (best != free_.end()) {
        NcclBuffer b = *best;
        free_.erase(best);
        return b;
      }
    }
    DeviceScope scope(device_);
    if (!scope.ok()) return absl::FailedPreconditionError(scope.error());
    void* p = nullptr;
    // At least 256 bytes, so that an empty tensor still has an address of its own.
    const int64_t size = std::max<int64_t>(bytes, 256);
    if (cudaError_t e = cudaMalloc(&p, static_cast<size_t>(size)); e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("nccl: a receive buffer of ", size,
                                                       " bytes on cuda:", device_, ": ",
                                                       cudaGetErrorString(e)));
    }
    std::lock_guard<std::mutex> lock(mu_);
    all_.push_back({p, size});
    return NcclBuffer{p, size};
  }

  void Release(NcclBuffer buffer) override {
    if (buffer.data == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(buffer);
  }

  absl::StatusOr<std::unique_ptr<NcclCompletion>> Receive(
      absl::Span<const NcclBuffer> into) override {
    absl::StatusOr<std::unique_ptr<StreamCompletion>> c = pair_->Receive(into, nullptr);
    if (!c.ok()) return c.status();
    return std::unique_ptr<NcclCompletion>(std::move(*c));
  }

  absl::StatusOr<std::unique_ptr<NcclCompletion>> Send(absl::Span<const NcclBuffer> from,
                                                       bool zero, void* after) override {
    absl::StatusOr<std::unique_ptr<StreamCompletion>> c = pair_->Send(from, after, zero);
    if (!c.ok()) return c.status();
    // A send that could not be posted is the call's error (the channel is then out of step):
    // so the caller answers only once the results' transfers are queued on the device.
    if (absl::StatusOr<void*> posted = (*c)->WaitPosted(); !posted.ok()) return posted.status();
    return std::unique_ptr<NcclCompletion>(std::move(*c));
  }

  void* compute_done_event() override {
    if (done_ == nullptr) {
      DeviceScope scope(device_);
      cudaEvent_t e = nullptr;
      // Without one the engine call waits for its work, which is slower but as correct.
      if (!scope.ok() || cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
      }
      done_ = e;
    }
    return done_;
  }

  void Abort() override { pair_->Abort(); }

 private:
  const int device_;
  const std::string to_server_;
  const std::string to_client_;
  std::unique_ptr<NcclPair> pair_;
  std::mutex mu_;
  std::vector<NcclBuffer> all_;   // every buffer allocated, freed with the link
  std::vector<NcclBuffer> free_;  // those not in use
  cudaEvent_t done_ = nullptr;    // compute_done_event(), made at its first use
};

}  // namespace

absl::StatusOr<std::unique_ptr<NcclLink>> StartNcclLink(int device) {
  absl::StatusOr<std::string> to_server = NewNcclUniqueId();
  if (!to_server.ok()) return to_server.status();
  absl::StatusOr<std::string> to_client = NewNcclUniqueId();
  if (!to_client.ok()) return to_client.status();
  // The server is rank 1: it receives on to_server and sends on to_client.
  absl::StatusOr<std::unique_ptr<NcclPair>> pair =
      NcclPair::Start(device, /*rank=*/1, /*send_id=*/*to_client, /*recv_id=*/*to_server);
  if (!pair.ok()) return pair.status();
  return std::unique_ptr<NcclLink>(
      new CudaNcclLink(device, *std::move(to_server), *std::move(to_client), *std::move(pair)));
}

}  // namespace moe::cuda
