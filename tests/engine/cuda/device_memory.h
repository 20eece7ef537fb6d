// Caller-side device memory for the device-tensor tests (device_tensor_test.cc, ipc_test.cc): a
// cudaMalloc'd block as a trainer would hold one, views of pieces of it in the engine's terms,
// copies between it and host tensors, and the check of a refused call's status.
#ifndef MOE_TESTS_ENGINE_CUDA_DEVICE_MEMORY_H_
#define MOE_TESTS_ENGINE_CUDA_DEVICE_MEMORY_H_

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/tensor.h"

namespace moe::testing {

// One cudaMalloc'd block on `device`, every byte 0xFF at first (NaN in fp32 and bf16, so a read
// of bytes nobody wrote shows), freed with the object.
class DeviceBlock {
 public:
  explicit DeviceBlock(size_t bytes, int device = 0) : bytes_(bytes), device_(device) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&ptr_, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(ptr_, 0xff, bytes), cudaSuccess);
  }
  ~DeviceBlock() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;

  char* at(size_t offset) const { return static_cast<char*>(ptr_) + offset; }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
  int device_;
};

// A view of `like`'s dtype and shape over device memory at `data` on `device`.
inline TensorView DeviceView(const Tensor& like, const void* data, int device) {
  return {like.dtype, like.shape, data, like.bytes.size(), MemoryLocation::Cuda(device)};
}
inline MutableTensorView DeviceDestination(DType dtype, std::vector<int64_t> shape, void* data,
                                           int device) {
  const size_t bytes = static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype);
  return {dtype, std::move(shape), data, bytes, MemoryLocation::Cuda(device)};
}

// `t`'s bytes into device memory at `dst`, synchronously.
inline void Upload(const Tensor& t, void* dst) {
  ASSERT_EQ(cudaMemcpy(dst, t.bytes.data(), t.bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
}

// A device destination's bytes as a host tensor, synchronously (after all work on the device).
inline Tensor Download(const MutableTensorView& v) {
  Tensor t = Tensor::Zeros(v.dtype, v.shape);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(t.bytes.data(), v.data, t.bytes.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return t;
}

inline bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
}

// InvalidArgument whose message contains `message` (the field it names, and why).
inline void ExpectRefused(const absl::Status& st, const std::string& message) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(message), std::string::npos)
      << "got \"" << st.message() << "\", expected it to contain \"" << message << "\"";
}

}  // namespace moe::testing

#endif  // MOE_TESTS_ENGINE_CUDA_DEVICE_MEMORY_H_
