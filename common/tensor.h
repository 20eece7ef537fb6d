// Tensors as they cross the engine interface: a dtype, a row-major shape and bytes.
//
// The wire format (docs/PROTOCOL.md) is the same: raw little-endian bytes, row-major, no
// strides. `Tensor` owns its bytes, always in host memory; `TensorView` borrows them, so the
// server can hand the engine a protobuf's payload without copying; `MutableTensorView` is a
// caller's destination an engine writes an output into. A view says where its bytes live
// (`MemoryLocation`): host memory, or a CUDA device's memory (a trainer's tensor mapped into
// the server, engine/ipc.h). Only engines dereference device memory; this header names a device
// by its ordinal and includes no CUDA header.
#ifndef MOE_COMMON_TENSOR_H_
#define MOE_COMMON_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/host_memory.h"

namespace moe {

enum class DType { kFloat32 = 0, kBFloat16 = 1, kInt32 = 2, kInt64 = 3 };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);  // "float32", "bfloat16", "int32", "int64"

// Bounds on any shape a peer or a file describes. No host holds a tensor of 1 TiB, and none of
// this project's tensors has more than 3 dimensions: a shape past either bound is a peer's bug or
// an attack, refused before anything is sized from it.
inline constexpr size_t kMaxTensorRank = 8;
inline constexpr int64_t kMaxTensorBytes = int64_t{1} << 40;

// The one checked product of a shape's extents. Every product of extents a client or a file
// supplied goes through it (or CheckedByteSize) before anything is allocated or indexed from
// it: at most kMaxTensorRank extents, each >= 0, and a product that neither overflows int64 nor
// exceeds kMaxTensorBytes (no element is smaller than a byte). InvalidArgument naming `field`.
absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape,
                                           absl::string_view field);
// The same, times the dtype's size: the bytes a tensor of that shape holds, at most
// kMaxTensorBytes.
absl::StatusOr<int64_t> CheckedByteSize(absl::Span<const int64_t> shape, DType dtype,
                                        absl::string_view field);

// The product of a shape the caller already knows to be valid (the engine's own tensors, or a
// peer's after CheckedNumElements). -1 for a shape CheckedNumElements refuses, never a wrapped
// product.
int64_t NumElements(const std::vector<int64_t>& shape);

// Where a view's bytes live: this process's host memory, or the memory of CUDA device `device`
// (this process's ordinal; the pointer is a device pointer in the unified address space).
struct MemoryLocation {
  enum class Kind { kHost, kCuda };
  Kind kind = Kind::kHost;
  int device = -1;  // kCuda only

  static MemoryLocation Host() { return {}; }
  static MemoryLocation Cuda(int device) { return {Kind::kCuda, device}; }
  bool is_host() const { return kind == Kind::kHost; }
  bool is_cuda() const { return kind == Kind::kCuda; }
  std::string DebugString() const;  // "host", "cuda:N"
  bool operator==(const MemoryLocation& o) const { return kind == o.kind && device == o.device; }
  bool operator!=(const MemoryLocation& o) const { return !(*this == o); }
};

struct TensorView {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t size_bytes = 0;
  MemoryLocation location;  // host unless a caller says otherwise

  bool empty() const { return data == nullptr && shape.empty(); }
  int64_t num_elements() const { return NumElements(shape); }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data);
  }
};

// A caller-owned destination of `size_bytes` bytes an engine writes one output into, in host or
// device memory; empty() (no data) means "no destination: return the output as a Tensor".
struct MutableTensorView {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  void* data = nullptr;
  size_t size_bytes = 0;
  MemoryLocation location;

  bool empty() const { return data == nullptr; }
  int64_t num_elements() const { return NumElements(shape); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  // The same bytes, read-only (for the checks TensorView has).
  TensorView view() const { return {dtype, shape, data, size_bytes, location}; }
};

// std::allocator, except that a value-less construct (resize, the count constructor) leaves
// the bytes unset instead of zeroing them: an output that is overwritten at once
// (Tensor::Uninitialized) need not pay for zero-filling it first
// (docs/decisions/0012-uninitialized-outputs.md).
// Its memory comes from AllocateTensorBytes (common/host_memory.h): large tensors of the data
// path from the memory an engine installed there (page-locked, with the CUDA engine), the rest
// from the heap.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(AllocateTensorBytes(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { ReleaseTensorBytes(p, n * sizeof(T)); }
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// A tensor's bytes. resize() does not zero them: Tensor::Zeros does, explicitly.
using TensorBytes = std::vector<std::byte, DefaultInitAllocator<std::byte>>;

struct Tensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  TensorBytes bytes;

  static Tensor Zeros(DType dtype, std::vector<int64_t> shape);
  // Bytes left unset, for an output the caller overwrites entirely before anyone reads it.
  static Tensor Uninitialized(DType dtype, std::vector<int64_t> shape);
  bool empty() const { return shape.empty() && bytes.empty(); }
  int64_t num_elements() const { return NumElements(shape); }
  TensorView view() const { return {dtype, shape, bytes.data(), bytes.size(), {}}; }
  // The bytes as a host destination (an engine writing an output into this tensor).
  MutableTensorView mutable_view() { return {dtype, shape, bytes.data(), bytes.size(), {}}; }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(bytes.data());
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(bytes.data());
  }
};

// OK when `view` has `dtype`, exactly `shape` (-1 matches any extent), a size within
// CheckedByteSize's bounds and the matching byte count; otherwise InvalidArgument naming `field`.
absl::Status CheckTensor(const TensorView& view, absl::string_view field, DType dtype,
                         const std::vector<int64_t>& shape);
// The same for a destination; also refuses an empty one ("out: no data").
absl::Status CheckTensor(const MutableTensorView& view, absl::string_view field, DType dtype,
                         const std::vector<int64_t>& shape);

// InvalidArgument naming both fields when [a, a + a_bytes) and [b, b + b_bytes) share a byte
// (host and device pointers share one address space, so the location need not be compared).
absl::Status CheckDisjoint(const void* a, size_t a_bytes, absl::string_view a_field, const void* b,
                           size_t b_bytes, absl::string_view b_field);

// bf16 <-> fp32 with round-to-nearest-even; the one conversion every engine and test uses.
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);

// Reads element i of a float tensor (fp32 or bf16) as float.
float LoadFloat(const TensorView& view, int64_t i);

}  // namespace moe

#endif  // MOE_COMMON_TENSOR_H_
