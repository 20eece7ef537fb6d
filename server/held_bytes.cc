// Request tensors' held bytes (see held_bytes.h).
#include "server/held_bytes.h"

#include <algorithm>
#include <limits>

#include "common/tensor.h"
#include "wire/wire.h"

namespace moe::server {

int64_t ClaimedBytes(const v1::Tensor& t) {
  absl::StatusOr<DType> dtype = wire::DTypeFromProto(t.dtype(), "");
  if (!dtype.ok()) return 0;
  int64_t bytes = static_cast<int64_t>(DTypeSize(*dtype));
  for (int64_t extent : t.shape()) {
    if (extent < 0 || __builtin_mul_overflow(bytes, extent, &bytes)) return 0;
  }
  return bytes;
}

int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? std::numeric_limits<int64_t>::max() : sum;
}

int64_t HeldBytes::Add(const v1::Tensor& chunk, absl::Span<const absl::string_view> payload) {
  const int64_t before = held();
  claimed = std::max(claimed, ClaimedBytes(chunk));
  for (absl::string_view p : payload) received = SaturatingAdd(received, p.size());
  return held() - before;
}

}  // namespace moe::server
