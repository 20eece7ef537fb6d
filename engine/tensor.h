// Host tensors as they cross the engine interface: a dtype, a row-major shape and bytes.
//
// The wire format (docs/PROTOCOL.md) is the same: raw little-endian bytes, row-major, no
// strides. `Tensor` owns its bytes; `TensorView` borrows them, so the server can hand the
// engine a protobuf's payload without copying.
#ifndef MOE_ENGINE_TENSOR_H_
#define MOE_ENGINE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace moe {

enum class DType { kFloat32 = 0, kBFloat16 = 1, kInt32 = 2, kInt64 = 3 };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);   // "float32", "bfloat16", "int32", "int64"

int64_t NumElements(const std::vector<int64_t>& shape);

struct TensorView {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t size_bytes = 0;

  bool empty() const { return data == nullptr && shape.empty(); }
  int64_t num_elements() const { return NumElements(shape); }
  template <typename T>
  const T* as() const { return static_cast<const T*>(data); }
};

struct Tensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;

  static Tensor Zeros(DType dtype, std::vector<int64_t> shape);
  bool empty() const { return shape.empty() && bytes.empty(); }
  int64_t num_elements() const { return NumElements(shape); }
  TensorView view() const { return {dtype, shape, bytes.data(), bytes.size()}; }
  template <typename T>
  T* as() { return reinterpret_cast<T*>(bytes.data()); }
  template <typename T>
  const T* as() const { return reinterpret_cast<const T*>(bytes.data()); }
};

// OK when `view` has `dtype`, exactly `shape` (-1 matches any extent) and the matching byte
// count; otherwise InvalidArgument naming `field`.
absl::Status CheckTensor(const TensorView& view, absl::string_view field, DType dtype,
                         const std::vector<int64_t>& shape);

// bf16 <-> fp32 with round-to-nearest-even; the one conversion every engine and test uses.
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);

// Reads element i of a float tensor (fp32 or bf16) as float.
float LoadFloat(const TensorView& view, int64_t i);

}  // namespace moe

#endif  // MOE_ENGINE_TENSOR_H_
