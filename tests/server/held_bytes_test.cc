// HeldBytes: a request tensor is charged at the larger of its claim and the bytes received; a
// claim that does not say (unknown dtype, negative extent, past int64) counts as nothing.
#include "server/held_bytes.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "wire/wire.h"

namespace moe::server {
namespace {

v1::Tensor Claim(DType dtype, std::vector<int64_t> shape) {
  v1::Tensor t;
  wire::SetTensorHeader(dtype, shape, &t);
  return t;
}

TEST(HeldBytesTest, ClaimsAreTheShapesBytesOrNothing) {
  EXPECT_EQ(ClaimedBytes(Claim(DType::kFloat32, {1024, 16})), 65536);
  EXPECT_EQ(ClaimedBytes(Claim(DType::kBFloat16, {3, 5})), 30);
  EXPECT_EQ(ClaimedBytes(Claim(DType::kFloat32, {})), 4);
  EXPECT_EQ(ClaimedBytes(Claim(DType::kFloat32, {int64_t{1} << 62, 4})), 0);  // past int64
  EXPECT_EQ(ClaimedBytes(Claim(DType::kFloat32, {-2, 4})), 0);
  v1::Tensor unknown = Claim(DType::kFloat32, {8});
  unknown.set_dtype(static_cast<v1::DType>(999));
  EXPECT_EQ(ClaimedBytes(unknown), 0);
}

TEST(HeldBytesTest, HoldsTheLargerOfClaimAndReceived) {
  HeldBytes h;
  const v1::Tensor big = Claim(DType::kFloat32, {256, 16});  // 16 KiB
  const std::string piece(1000, 'a');
  const absl::string_view pieces[] = {piece, piece};
  EXPECT_EQ(h.Add(big, pieces), 16384);  // the claim, from the first chunk
  EXPECT_EQ(h.received, 2000);
  EXPECT_EQ(h.Add(big, pieces), 0);
  HeldBytes liar;  // claims 64 bytes, sends more
  const v1::Tensor small = Claim(DType::kFloat32, {16});
  EXPECT_EQ(liar.Add(small, pieces), 2000);
  EXPECT_EQ(liar.Add(small, pieces), 2000);
  EXPECT_EQ(liar.held(), 4000);
  EXPECT_EQ(SaturatingAdd(std::numeric_limits<int64_t>::max(), 1),
            std::numeric_limits<int64_t>::max());
}

}  // namespace
}  // namespace moe::server
