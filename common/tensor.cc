// Host tensor helpers: dtype sizes, shape checks and the one bf16 conversion every engine uses.
//
// FloatToBFloat16 rounds to nearest, ties to even, and keeps NaN a quiet NaN (a plain
// truncation after adding the rounding bias could turn a NaN payload into infinity). CUDA's
// __float2bfloat16_rn does the same, so host- and device-rounded values agree bit for bit.
#include "common/tensor.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape,
                                           absl::string_view field) {
  auto shape_str = [&] { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); };
  if (shape.size() > kMaxTensorRank) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", shape.size(), " dimensions, at most ", kMaxTensorRank));
  }
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": negative extent ", s, " in shape ", shape_str()));
    }
    // Each extent is bounded on its own too, so that a zero elsewhere cannot hide a huge one
    // from code that multiplies only some of the extents.
    if (s > kMaxTensorBytes || __builtin_mul_overflow(n, s, &n) || n > kMaxTensorBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape ", shape_str(),
                       " has more than 2^40 elements (no tensor is that large)"));
    }
  }
  return n;
}

absl::StatusOr<int64_t> CheckedByteSize(absl::Span<const int64_t> shape, DType dtype,
                                        absl::string_view field) {
  absl::StatusOr<int64_t> n = CheckedNumElements(shape, field);
  if (!n.ok()) return n.status();
  const int64_t size = static_cast<int64_t>(DTypeSize(dtype));
  if (*n > kMaxTensorBytes / size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape [", absl::StrJoin(shape, ", "), "] of ", DTypeName(dtype),
                     " is more than 2^40 bytes (no tensor is that large)"));
  }
  return *n * size;
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  absl::StatusOr<int64_t> n = CheckedNumElements(shape, "");
  return n.ok() ? *n : -1;
}

Tensor Tensor::Zeros(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.assign(static_cast<size_t>(NumElements(t.shape)) * DTypeSize(dtype), std::byte{0});
  return t;
}

Tensor Tensor::Uninitialized(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.resize(static_cast<size_t>(NumElements(t.shape)) * DTypeSize(dtype));
  return t;
}

std::string MemoryLocation::DebugString() const {
  return is_host() ? std::string("host") : absl::StrCat("cuda:", device);
}

absl::Status CheckTensor(const TensorView& view, absl::string_view field, DType dtype,
                         const std::vector<int64_t>& shape) {
  auto shape_str = [](const std::vector<int64_t>& s) {
    return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
  };
  if (view.dtype != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": dtype ", DTypeName(view.dtype), ", expected ", DTypeName(dtype)));
  }
  bool match = view.shape.size() == shape.size();
  for (size_t i = 0; match && i < shape.size(); ++i) {
    if (view.shape[i] < 0 || (shape[i] >= 0 && view.shape[i] != shape[i])) match = false;
  }
  if (!match) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", shape_str(view.shape),
                                                   ", expected ", shape_str(shape), " (-1 = any)"));
  }
  absl::StatusOr<int64_t> bytes = CheckedByteSize(view.shape, dtype, field);
  if (!bytes.ok()) return bytes.status();
  const size_t want = static_cast<size_t>(*bytes);
  if (view.size_bytes != want) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", view.size_bytes,
                                                   " bytes for shape ", shape_str(view.shape),
                                                   " of ", DTypeName(dtype), ", expected ", want));
  }
  if (want > 0 && view.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": no data"));
  }
  return absl::OkStatus();
}

absl::Status CheckTensor(const MutableTensorView& view, absl::string_view field, DType dtype,
                         const std::vector<int64_t>& shape) {
  if (view.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(field, ": no data"));
  return CheckTensor(view.view(), field, dtype, shape);
}

absl::Status CheckDisjoint(const void* a, size_t a_bytes, absl::string_view a_field, const void* b,
                           size_t b_bytes, absl::string_view b_field) {
  if (a == nullptr || b == nullptr || a_bytes == 0 || b_bytes == 0) return absl::OkStatus();
  const auto a0 = reinterpret_cast<uintptr_t>(a), b0 = reinterpret_cast<uintptr_t>(b);
  // Sizes are at most kMaxTensorBytes (CheckTensor), so the ends do not wrap.
  if (a0 < b0 + b_bytes && b0 < a0 + a_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(a_field, ": overlaps ", b_field,
                     " (a destination shares no byte with an input or another destination)"));
  }
  return absl::OkStatus();
}

float BFloat16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint16_t FloatToBFloat16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN, sign kept
  }
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

float LoadFloat(const TensorView& view, int64_t i) {
  if (view.dtype == DType::kBFloat16) return BFloat16ToFloat(view.as<uint16_t>()[i]);
  return view.as<float>()[i];
}

}  // namespace moe
