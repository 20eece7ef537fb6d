// The request checks that need no server state (server/request_validation.h): each bad value is
// InvalidArgument naming its field, and the chunk sizes a client asks for are floored.
#include "server/request_validation.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "tests/server/server_fixture.h"

namespace moe::server {
namespace {

using server_test::StripeOf;

void ExpectInvalidNaming(const absl::Status& st, const std::string& field) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(field), std::string::npos) << "should name " << field << ": " << st;
}

TEST(RequestValidationTest, LayerNames) {
  EXPECT_TRUE(ValidateLayerName("a.b_c-9", "name").ok());
  EXPECT_TRUE(ValidateLayerName(std::string(128, 'x'), "name").ok());
  ExpectInvalidNaming(ValidateLayerName("", "name"), "name");
  ExpectInvalidNaming(ValidateLayerName(std::string(129, 'x'), "layer"), "layer");
  ExpectInvalidNaming(ValidateLayerName("a/b", "layer"), "layer");
  ExpectInvalidNaming(ValidateLayerName(std::string("a\0b", 3), "layer"), "layer");
}

TEST(RequestValidationTest, StripesNameTheFieldThatIsOutOfRange) {
  EXPECT_TRUE(ValidateStripe(StripeOf(1, 2, 4, 10), 7).ok());
  ExpectInvalidNaming(ValidateStripe(StripeOf(0, 1, 0, 10), 7), "stripe.count");
  ExpectInvalidNaming(ValidateStripe(StripeOf(0, 65, 0, 10), 7), "stripe.count");
  ExpectInvalidNaming(ValidateStripe(StripeOf(2, 2, 0, 10), 7), "stripe.index");
  ExpectInvalidNaming(ValidateStripe(StripeOf(0, 2, 0, 0), 7), "stripe.total_rows");
  ExpectInvalidNaming(ValidateStripe(StripeOf(0, 2, 0, -5), 7), "stripe.total_rows");
  ExpectInvalidNaming(ValidateStripe(StripeOf(0, 2, 0, int64_t{1} << 62), 7), "stripe.total_rows");
  ExpectInvalidNaming(ValidateStripe(StripeOf(0, 2, -1, 10), 7), "stripe.row_begin");
  ExpectInvalidNaming(ValidateStripe(StripeOf(0, 2, 11, 10), 7), "stripe.row_begin");
  ExpectInvalidNaming(ValidateStripe(StripeOf(0, 2, std::numeric_limits<int64_t>::min(), 10), 7),
                      "stripe.row_begin");
  ExpectInvalidNaming(ValidateStripe(StripeOf(0, 2, 0, 10), 0), "context_id");
}

TEST(RequestValidationTest, ChunkSizesHaveAFloor) {
  EXPECT_EQ(ResponseChunkBytes(0), kDefaultResponseChunkBytes);
  EXPECT_EQ(ResponseChunkBytes(-3), kDefaultResponseChunkBytes);
  EXPECT_EQ(ResponseChunkBytes(1), kMinResponseChunkBytes);
  EXPECT_EQ(ResponseChunkBytes(1 << 20), 1 << 20);
  EXPECT_EQ(ExportChunkBytes(0, 64 << 20), 32 << 20);
  EXPECT_EQ(ExportChunkBytes(1, 64 << 20), kMinResponseChunkBytes);
  EXPECT_EQ(ExportChunkBytes(0, 0), kMinResponseChunkBytes);
  EXPECT_EQ(ExportChunkBytes(5000, 64 << 20), 5000);
}

TEST(RequestValidationTest, WeightChunksNameTheirLayerFirst) {
  v1::WeightChunk c;
  c.set_name("w1");
  ExpectInvalidNaming(ValidateWeightChunk(c, ""), "layer: required on the first message");
  EXPECT_TRUE(ValidateWeightChunk(c, "l").ok());  // later messages may leave it out
  c.set_layer("l");
  EXPECT_TRUE(ValidateWeightChunk(c, "").ok());
  EXPECT_TRUE(ValidateWeightChunk(c, "l").ok());
  ExpectInvalidNaming(ValidateWeightChunk(c, "other"), "layer");
  c.clear_name();
  ExpectInvalidNaming(ValidateWeightChunk(c, "l"), "name");
  ExpectInvalidNaming(ValidateImportStream(""), "layer: required on the first message");
  EXPECT_TRUE(ValidateImportStream("l").ok());
}

}  // namespace
}  // namespace moe::server
