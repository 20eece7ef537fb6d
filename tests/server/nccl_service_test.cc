// NCCL calls through a real moe-server on loopback (CPU engine, plain stub): a server without
// NCCL refuses channels with FAILED_PRECONDITION saying so, and an NCCL micro-batch that names no
// channel of the caller's, or declares its tensors wrongly, gets its code and names its field,
// leaving the layer as it was.
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "tests/server/server_fixture.h"

namespace moe::server_test {
namespace {

using grpc::StatusCode;

v1::Tensor Header(v1::DType dtype, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t e : shape) t.add_shape(e);
  return t;
}

TEST(NcclServiceTest, AServerWithoutNcclRefusesChannels) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  grpc::ClientContext ctx;
  lb.conn->Prepare(&ctx);
  v1::OpenNcclChannelResponse resp;
  const grpc::Status st = lb.conn->stub()->OpenNcclChannel(&ctx, {}, &resp);
  EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "NCCL")) << st.error_message();
}

TEST(NcclServiceTest, AChannelNeedsASession) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  grpc::ClientContext ctx;  // no moe-session-id
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::OpenNcclChannelResponse resp;
  const grpc::Status st = lb.conn->stub()->OpenNcclChannel(&ctx, {}, &resp);
  EXPECT_EQ(st.error_code(), StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "session")) << st.error_message();
}

TEST(NcclServiceTest, BadMicroBatchesNameTheirFieldAndLoseNothing) {
  ReferenceServer ref;
  ASSERT_NO_FATAL_FAILURE(ref.Start(SmallConfig(RoutingMode::kClient)));
  const LayerConfig c = SmallConfig(RoutingMode::kClient);
  auto forward = [&](v1::ForwardRequest r) {
    r.set_layer(ReferenceServer::kReference);
    r.set_last_chunk(true);
    grpc::ClientContext ctx;
    ref.conn().Prepare(&ctx);
    v1::ForwardResponse resp;
    return ref.conn().stub()->NcclForward(&ctx, r, &resp);
  };
  v1::ForwardRequest good;
  *good.mutable_x() = Header(v1::DTYPE_FLOAT32, {4, c.d_model});
  good.mutable_nccl()->set_channel_id(12345);
  good.mutable_nccl()->set_seq(1);
  ExpectStatus(forward(good), StatusCode::NOT_FOUND, "nccl.channel_id");
  ref.ExpectServingAndUnchanged("an unknown channel");

  v1::ForwardRequest with_bytes = good;
  with_bytes.mutable_x()->set_data(std::string(4 * c.d_model * 4, '\0'));
  ExpectStatus(forward(with_bytes), StatusCode::INVALID_ARGUMENT, "x");
  v1::ForwardRequest no_x = good;
  no_x.clear_x();
  ExpectStatus(forward(no_x), StatusCode::INVALID_ARGUMENT, "x");
  v1::ForwardRequest huge = good;
  *huge.mutable_x() = Header(v1::DTYPE_FLOAT32, {int64_t{1} << 40, int64_t{1} << 20});
  ExpectStatus(forward(huge), StatusCode::INVALID_ARGUMENT, "x.shape");
  ref.ExpectServingAndUnchanged("NCCL forwards declaring bad tensors");

  v1::BackwardRequest back;
  back.set_layer(ReferenceServer::kReference);
  back.set_context_id(1);
  *back.mutable_dout() = Header(v1::DTYPE_FLOAT32, {4, c.d_model});
  back.mutable_nccl()->set_channel_id(12345);
  back.mutable_nccl()->set_seq(1);
  back.mutable_nccl()->set_dweights_k(-2);
  grpc::ClientContext ctx;
  ref.conn().Prepare(&ctx);
  v1::BackwardResponse resp;
  ExpectStatus(ref.conn().stub()->NcclBackward(&ctx, back, &resp), StatusCode::INVALID_ARGUMENT,
               "nccl.dweights_k");
  ref.ExpectServingAndUnchanged("an NCCL backward with a negative dweights_k");
}

TEST(NcclServiceTest, PlainForwardAndBackwardRefuseAChannel) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  v1::ForwardRequest f;
  f.set_layer("any");
  f.set_last_chunk(true);
  f.mutable_nccl()->set_channel_id(1);
  ExpectStatus(SendForward(*lb.conn, {f}).status, StatusCode::INVALID_ARGUMENT, "nccl");
  v1::BackwardRequest b;
  b.set_layer("any");
  b.set_last_chunk(true);
  b.mutable_nccl()->set_channel_id(1);
  ExpectStatus(SendBackward(*lb.conn, {b}).status, StatusCode::INVALID_ARGUMENT, "nccl");
}

TEST(NcclServiceTest, ClosingAnUnknownChannelIsNotFound) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  grpc::ClientContext ctx;
  lb.conn->Prepare(&ctx);
  v1::CloseNcclChannelRequest req;
  req.set_channel_id(77);
  v1::CloseNcclChannelResponse resp;
  ExpectStatus(lb.conn->stub()->CloseNcclChannel(&ctx, req, &resp), StatusCode::NOT_FOUND,
               "nccl.channel_id");
}

}  // namespace
}  // namespace moe::server_test
