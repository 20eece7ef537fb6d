// Bad inputs through a real moe-server on loopback: every malformed tensor, layer, id, size,
// deadline and name gets its own status naming the field, a bad dout keeps its context for a
// correct retry, and the server keeps serving. And one stream carries several micro-batches in
// order, answered with the same bytes a plain protobuf client gets.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "engine/layer.h"
#include "tests/server/server_fixture.h"
#include "wire/wire.h"

namespace moe::server_test {
namespace {

using client::Connection;

// One Forward stream carrying exactly `req`: its status.
grpc::Status RawForward(Connection& c, const v1::ForwardRequest& req) {
  return SendForward(c, {req}).status;
}

v1::ForwardRequest GoodRequest(const LayerConfig& c, int64_t tokens, std::mt19937& rng) {
  Tensor x = RandomFloat(rng, {tokens, c.d_model}), ids, w;
  RandomRouting(rng, tokens, c, &ids, &w);
  v1::ForwardRequest r;
  r.set_layer("bad");
  r.set_context_id(1);
  r.set_training(false);
  r.set_last_chunk(true);
  wire::SetTensorHeader(DType::kFloat32, x.shape, r.mutable_x());
  r.mutable_x()->set_data(x.bytes.data(), x.bytes.size());
  wire::SetTensorHeader(DType::kInt32, ids.shape, r.mutable_expert_ids());
  r.mutable_expert_ids()->set_data(ids.bytes.data(), ids.bytes.size());
  wire::SetTensorHeader(DType::kFloat32, w.shape, r.mutable_weights());
  r.mutable_weights()->set_data(w.bytes.data(), w.bytes.size());
  return r;
}

TEST(ServiceTest, EveryBadInputGetsItsStatusAndTheServerKeepsServing) {
  server::ServerOptions options = LoopbackOptions();
  options.max_message_bytes = 64 * 1024;
  Loopback lb = StartLoopback(options);
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kClient);
  ASSERT_TRUE(c.CreateLayer("bad", config).ok());
  std::mt19937 rng(9);
  const v1::ForwardRequest good = GoodRequest(config, 8, rng);
  auto still_serving = [&] {
    grpc::Status st = RawForward(c, good);
    EXPECT_TRUE(st.ok()) << "server stopped serving: " << st.error_message();
  };
  still_serving();

  {  // byte count does not match the shape
    v1::ForwardRequest r = good;
    r.mutable_x()->mutable_data()->resize(r.x().data().size() - 4);
    ExpectStatus(RawForward(c, r), grpc::StatusCode::INVALID_ARGUMENT, "x");
    still_serving();
  }
  {  // unknown dtype
    v1::ForwardRequest r = good;
    r.mutable_x()->set_dtype(static_cast<v1::DType>(99));
    ExpectStatus(RawForward(c, r), grpc::StatusCode::INVALID_ARGUMENT, "dtype");
    still_serving();
  }
  {  // K > E at creation
    LayerConfig bad = config;
    bad.top_k = bad.num_experts + 1;
    absl::Status st = c.CreateLayer("k-too-big", bad).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("top_k"), std::string::npos) << st;
    still_serving();
  }
  {  // expert id out of range
    v1::ForwardRequest r = good;
    int32_t big = static_cast<int32_t>(config.num_experts);
    std::memcpy(r.mutable_expert_ids()->mutable_data()->data(), &big, 4);
    ExpectStatus(RawForward(c, r), grpc::StatusCode::INVALID_ARGUMENT, "expert_ids");
    still_serving();
  }
  {  // unknown layer
    v1::ForwardRequest r = good;
    r.set_layer("nope");
    ExpectStatus(RawForward(c, r), grpc::StatusCode::NOT_FOUND, "nope");
    EXPECT_EQ(c.Step("nope").status().code(), absl::StatusCode::kNotFound);
    still_serving();
  }
  {  // Backward for an unknown context
    Tensor dout = RandomFloat(rng, {8, config.d_model});
    absl::Status st = c.Backward("bad", 424242, dout.view()).get().status();
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
    EXPECT_NE(st.message().find("context_id"), std::string::npos) << st;
    still_serving();
  }
  {  // a message over --max_message_bytes (64 KiB): 2048 tokens x 16 floats = 128 KiB
    v1::ForwardRequest r = GoodRequest(config, 2048, rng);
    r.set_layer("bad");
    grpc::Status st = RawForward(c, r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    still_serving();
    // The same tensor in 32 KiB chunks goes through.
    client::ClientOptions small;
    small.chunk_bytes = 32 * 1024;
    auto chunked = Connection::Connect(lb.target(), small);
    ASSERT_TRUE(chunked.ok());
    Tensor x = RandomFloat(rng, {2048, config.d_model}), ids, w;
    RandomRouting(rng, 2048, config, &ids, &w);
    auto out = (*chunked)->Forward("bad", 0, false, x.view(), ids.view(), w.view()).get();
    EXPECT_TRUE(out.ok()) << out.status();
  }
  {  // an expired deadline
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() - std::chrono::seconds(1));
    v1::StepRequest req;
    req.set_layer("bad");
    v1::StepResponse resp;
    EXPECT_EQ(c.stub()->Step(&ctx, req, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    grpc::ClientContext fctx;
    fctx.set_deadline(std::chrono::system_clock::now() - std::chrono::seconds(1));
    auto stream = c.stub()->Forward(&fctx);
    stream->Write(good);
    stream->WritesDone();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    still_serving();
  }
  {  // dout with the wrong shape keeps the context for a correct retry
    Tensor x = RandomFloat(rng, {8, config.d_model}), ids, w;
    RandomRouting(rng, 8, config, &ids, &w);
    auto f = c.Forward("bad", 77, true, x.view(), ids.view(), w.view()).get();
    ASSERT_TRUE(f.ok()) << f.status();
    Tensor wrong = RandomFloat(rng, {7, config.d_model});
    absl::Status st = c.Backward("bad", 77, wrong.view()).get().status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("dout"), std::string::npos) << st;
    Tensor right = RandomFloat(rng, {8, config.d_model});
    EXPECT_TRUE(c.Backward("bad", 77, right.view()).get().ok());
  }
  {  // duplicate name, bad name, checkpoint path escaping the directory
    EXPECT_EQ(c.CreateLayer("bad", config).status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_EQ(c.CreateLayer("bad name!", config).status().code(),
              absl::StatusCode::kInvalidArgument);
    absl::Status st = c.SaveCheckpoint("bad", "../escape").status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    still_serving();
  }
}

TEST(ServiceTest, OneStreamCarriesSeveralMicroBatchesInOrder) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kClient);
  ASSERT_TRUE(c.CreateLayer("bad", config).ok());
  std::mt19937 rng(13);
  v1::ForwardRequest a = GoodRequest(config, 5, rng), b = GoodRequest(config, 9, rng);
  a.set_context_id(100);
  b.set_context_id(200);
  grpc::ClientContext ctx;
  c.Prepare(&ctx);
  auto stream = c.stub()->Forward(&ctx);
  ASSERT_TRUE(stream->Write(a));
  ASSERT_TRUE(stream->Write(b));
  stream->WritesDone();
  std::vector<v1::ForwardResponse> got;
  v1::ForwardResponse r;
  while (stream->Read(&r)) got.push_back(r);
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].context_id(), 100u);
  EXPECT_EQ(got[0].out().shape(0), 5);
  EXPECT_EQ(got[1].context_id(), 200u);
  EXPECT_EQ(got[1].out().shape(0), 9);
  // A plain protobuf client (this stub) and moe::client (its own encoding, by reference) get the
  // same bytes for the same micro-batch.
  auto view = [](const v1::Tensor& t, DType dtype) {
    return TensorView{dtype, std::vector<int64_t>(t.shape().begin(), t.shape().end()),
                      t.data().data(), t.data().size()};
  };
  auto same = c.Forward("bad", 0, false, view(b.x(), DType::kFloat32),
                        view(b.expert_ids(), DType::kInt32), view(b.weights(), DType::kFloat32))
                  .get();
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(
      std::string(reinterpret_cast<const char*>(same->out.bytes.data()), same->out.bytes.size()),
      got[1].out().data());
  // A stream that ends inside a micro-batch is an error naming last_chunk.
  grpc::ClientContext ctx2;
  c.Prepare(&ctx2);
  auto half = c.stub()->Forward(&ctx2);
  v1::ForwardRequest partial = a;
  partial.set_last_chunk(false);
  ASSERT_TRUE(half->Write(partial));
  half->WritesDone();
  while (half->Read(&r)) {
  }
  ExpectStatus(half->Finish(), grpc::StatusCode::INVALID_ARGUMENT, "last_chunk");
}

}  // namespace
}  // namespace moe::server_test
