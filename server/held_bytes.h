// What a request tensor holds while the server assembles it, for the memory ledger
// (memory_ledger.h): a tensor is charged, from its first chunk on and before each chunk is copied
// in, at the larger of the bytes its shape claims and the bytes received so far. The claim
// covers what the assembler reserves once an eighth of it has arrived; the bytes received cover
// a client that claims too little and keeps sending.
#ifndef MOE_SERVER_HELD_BYTES_H_
#define MOE_SERVER_HELD_BYTES_H_

#include <cstdint>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "moe/v1/moe.pb.h"

namespace moe::server {

// The bytes `t`'s dtype and shape claim; 0 when they do not say (an unknown dtype, a negative
// extent or a product past int64: the assembler's own checks report those).
int64_t ClaimedBytes(const v1::Tensor& t);

// a + b, or INT64_MAX when that overflows.
int64_t SaturatingAdd(int64_t a, int64_t b);

struct HeldBytes {
  int64_t received = 0;
  int64_t claimed = 0;
  int64_t held() const { return received > claimed ? received : claimed; }
  // Accounts a chunk: its claim and its payload (`payload`, the chunk's data in pieces); returns
  // how much held() grew.
  int64_t Add(const v1::Tensor& chunk, absl::Span<const absl::string_view> payload);
};

}  // namespace moe::server

#endif  // MOE_SERVER_HELD_BYTES_H_
