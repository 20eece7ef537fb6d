// CUDA plumbing for the engine (see device.h).
#include "engine/cuda/device.h"

#include "absl/strings/str_cat.h"

namespace moe::cuda {

absl::Status CudaStatus(cudaError_t err, const char* what, const char* file, int line) {
  const std::string msg = absl::StrCat("cuda: ", what, " failed at ", file, ":", line, ": ",
                                       cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::Status CublasStatus(cublasStatus_t err, const char* what, const char* file, int line) {
  const std::string msg = absl::StrCat("cublas: ", what, " failed at ", file, ":", line,
                                       ": status ", static_cast<int>(err));
  if (err == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::StatusOr<std::shared_ptr<Stream>> Stream::Create(int device, bool poison_allocations) {
  MOE_CUDA_RETURN(cudaSetDevice(device));
  cudaStream_t s = nullptr;
  MOE_CUDA_RETURN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return std::shared_ptr<Stream>(new Stream(device, s, poison_allocations));
}

Stream::~Stream() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes, std::shared_ptr<Stream> stream,
                                                    const char* what) {
  DeviceBuffer b;
  if (bytes == 0) return b;
  void* p = nullptr;
  const cudaError_t err = cudaMallocAsync(&p, bytes, stream->get());
  if (err != cudaSuccess) {
    cudaGetLastError();  // out-of-memory is not sticky; clear it so later calls start clean
    return absl::ResourceExhaustedError(absl::StrCat("cuda: cannot allocate ", bytes,
                                                     " bytes of device memory for ", what, ": ",
                                                     cudaGetErrorString(err)));
  }
  if (stream->poison_allocations() &&
      cudaMemsetAsync(p, 0xff, bytes, stream->get()) != cudaSuccess) {
    cudaFreeAsync(p, stream->get());
    return absl::InternalError("cuda: poisoning a test allocation failed");
  }
  b.ptr_ = p;
  b.bytes_ = bytes;
  b.stream_ = std::move(stream);
  return b;
}

void DeviceBuffer::Reset() {
  if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_->get());
  ptr_ = nullptr;
  bytes_ = 0;
  stream_.reset();
}

absl::StatusOr<Event> Event::Create(int device) {
  MOE_CUDA_RETURN(cudaSetDevice(device));
  Event e;
  MOE_CUDA_RETURN(cudaEventCreateWithFlags(&e.event_, cudaEventDisableTiming));
  return e;
}

Event::~Event() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}

absl::Status StreamWaitFor(cudaStream_t waiter, cudaStream_t done, const Event& event) {
  MOE_CUDA_RETURN(cudaEventRecord(event.get(), done));
  MOE_CUDA_RETURN(cudaStreamWaitEvent(waiter, event.get(), 0));
  return absl::OkStatus();
}

PinnedHostBuffer::~PinnedHostBuffer() {
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
}

absl::Status PinnedHostBuffer::Reserve(size_t bytes) {
  if (bytes <= bytes_) return absl::OkStatus();
  if (ptr_ != nullptr) MOE_CUDA_RETURN(cudaFreeHost(ptr_));
  ptr_ = nullptr;
  bytes_ = 0;
  MOE_CUDA_RETURN(cudaMallocHost(&ptr_, bytes));
  bytes_ = bytes;
  return absl::OkStatus();
}

}  // namespace moe::cuda
