// Hostile requests on the wire against a real moe-server on loopback: shapes whose products
// overflow or cannot exist, chunks out of order, repeated or past their shape, stripes whose rows
// leave their micro-batch, imports that name no layer. Each gets the status and a message naming
// the field, and afterwards the server still serves and the reference layer's weights and
// optimizer state are bitwise unchanged (server_fixture.h, ReferenceServer).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "server/request_validation.h"
#include "tests/server/server_fixture.h"
#include "wire/wire.h"

namespace moe::server_test {
namespace {

// The reference layer's: client routing, 6 experts, top 2, d 16, h 24.
LayerConfig ReferenceConfig() { return SmallConfig(RoutingMode::kClient); }

constexpr int64_t kHuge = int64_t{1} << 62;

v1::Tensor TensorProto(DType dtype, std::vector<int64_t> shape, std::string data = "",
                       int64_t offset = 0) {
  v1::Tensor t;
  wire::SetTensorHeader(dtype, shape, &t);
  t.set_data(std::move(data));
  t.set_offset(offset);
  return t;
}

std::string Bytes(size_t n, char fill = 1) { return std::string(n, fill); }

v1::ForwardRequest ForwardOf(const std::string& layer, v1::Tensor x, bool training = false,
                             uint64_t context_id = 0) {
  v1::ForwardRequest r;
  r.set_layer(layer);
  r.set_training(training);
  r.set_context_id(context_id);
  *r.mutable_x() = std::move(x);
  r.set_last_chunk(true);
  return r;
}

// A client-routed Forward of `tokens` valid rows for the reference layer's shapes (d 16, K 2):
// ids 0 and 1, weights 0.5.
v1::ForwardRequest ClientRouted(const std::string& layer, int64_t tokens) {
  v1::ForwardRequest r = ForwardOf(layer, TensorProto(DType::kFloat32, {tokens, 16},
                                                      Bytes(static_cast<size_t>(tokens) * 64, 0)));
  std::string ids, w;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int32_t e : {0, 1}) ids.append(reinterpret_cast<const char*>(&e), 4);
    const float half = 0.5f;
    for (int k = 0; k < 2; ++k) w.append(reinterpret_cast<const char*>(&half), 4);
  }
  *r.mutable_expert_ids() = TensorProto(DType::kInt32, {tokens, 2}, ids);
  *r.mutable_weights() = TensorProto(DType::kFloat32, {tokens, 2}, w);
  return r;
}

v1::WeightChunk WeightOf(const std::string& layer, const std::string& name, v1::Tensor t,
                         bool last = true) {
  v1::WeightChunk c;
  c.set_layer(layer);
  c.set_name(name);
  *c.mutable_tensor() = std::move(t);
  c.set_last_chunk(last);
  return c;
}

struct Case {
  std::string name;
  std::function<grpc::Status(client::Connection&)> send;
  grpc::StatusCode code;
  std::string message;  // a substring naming the field
};

// Layers besides the reference one: server routing with K = 4 in fp32 and bf16, and a
// client-routed twin of the reference layer for Backward.
void CreateLayers(client::Connection& c) {
  LayerConfig server = ReferenceConfig();
  server.num_experts = 8;
  server.top_k = 4;
  server.d_model = 4;
  server.d_hidden = 8;
  server.routing = RoutingMode::kServer;
  ASSERT_TRUE(c.CreateLayer("srv4", server).ok());
  server.dtype = DType::kBFloat16;
  ASSERT_TRUE(c.CreateLayer("srv4-bf16", server).ok());
  ASSERT_TRUE(c.CreateLayer("twin", ReferenceConfig()).ok());
}

std::vector<Case> Cases() {
  const std::string ref = ReferenceServer::kReference;
  using Code = grpc::StatusCode;
  auto forward = [](std::vector<v1::ForwardRequest> reqs) {
    return [reqs](client::Connection& c) { return SendForward(c, reqs).status; };
  };
  auto import = [](std::vector<v1::WeightChunk> chunks) {
    return [chunks](client::Connection& c) { return SendImport(c, chunks); };
  };
  std::vector<Case> cases;

  // --- Shapes whose products overflow int64 or cannot exist --------------------------------
  cases.push_back({"x [2^62, 4] without data, server routing K=4",
                   forward({ForwardOf("srv4", TensorProto(DType::kFloat32, {kHuge, 4}))}),
                   Code::INVALID_ARGUMENT, "x: shape"});
  cases.push_back({"the same, training",
                   forward({ForwardOf("srv4", TensorProto(DType::kFloat32, {kHuge, 4}), true, 5)}),
                   Code::INVALID_ARGUMENT, "x: shape"});
  cases.push_back({"the same, bf16",
                   forward({ForwardOf("srv4-bf16", TensorProto(DType::kBFloat16, {kHuge, 4}))}),
                   Code::INVALID_ARGUMENT, "x: shape"});
  {
    v1::ForwardRequest r = ForwardOf(ref, TensorProto(DType::kFloat32, {kHuge, 16}));
    *r.mutable_expert_ids() = TensorProto(DType::kInt32, {kHuge, 2});
    *r.mutable_weights() = TensorProto(DType::kFloat32, {kHuge, 2});
    cases.push_back({"client routing, x [2^62, 16], expert_ids and weights [2^62, 2]", forward({r}),
                     Code::INVALID_ARGUMENT, "x: shape"});
    v1::ForwardRequest ids_only = ClientRouted(ref, 4);
    *ids_only.mutable_expert_ids() = TensorProto(DType::kInt32, {kHuge, 2});
    cases.push_back({"client routing, expert_ids [2^62, 2] beside a valid x", forward({ids_only}),
                     Code::INVALID_ARGUMENT, "expert_ids: shape"});
    v1::ForwardRequest wrapped = ClientRouted(ref, 4);
    // 2^61 * 2^3 wraps to 0 elements in int64: an empty tensor to an unchecked product.
    *wrapped.mutable_weights() = TensorProto(DType::kFloat32, {int64_t{1} << 61, 8});
    cases.push_back({"weights whose element count wraps to 0", forward({wrapped}),
                     Code::INVALID_ARGUMENT, "weights: shape"});
  }
  cases.push_back({"a negative extent",
                   forward({ForwardOf(ref, TensorProto(DType::kFloat32, {-1, 16}))}),
                   Code::INVALID_ARGUMENT, "x: negative extent"});
  cases.push_back(
      {"nine dimensions",
       forward({ForwardOf(ref, TensorProto(DType::kFloat32, {1, 1, 1, 1, 1, 1, 1, 1, 16}))}),
       Code::INVALID_ARGUMENT, "x: 9 dimensions"});
  cases.push_back({"Backward, dout [2^62, 16] for a live context",
                   [](client::Connection& c) {
                     v1::ForwardRequest f = ClientRouted("twin", 4);
                     f.set_training(true);
                     f.set_context_id(77);
                     grpc::Status st = SendForward(c, {f}).status;
                     if (!st.ok()) return st;
                     v1::BackwardRequest b;
                     b.set_layer("twin");
                     b.set_context_id(77);
                     *b.mutable_dout() = TensorProto(DType::kFloat32, {kHuge, 16});
                     b.set_last_chunk(true);
                     return SendBackward(c, {b}).status;
                   },
                   Code::INVALID_ARGUMENT, "dout: shape"});
  cases.push_back({"ImportWeights, w1 [2^62, 2^62, 2]",
                   import({WeightOf(ref, "w1", TensorProto(DType::kFloat32, {kHuge, kHuge, 2}))}),
                   Code::INVALID_ARGUMENT, "tensor w1: shape"});

  // --- Chunk offsets -----------------------------------------------------------------------
  {
    // x [4, 16] in two 128-byte chunks.
    v1::ForwardRequest first = ClientRouted(ref, 4), second = ClientRouted(ref, 4);
    first.set_last_chunk(false);
    first.mutable_x()->set_data(Bytes(128));
    second.clear_expert_ids();
    second.clear_weights();
    second.mutable_x()->set_data(Bytes(128, 2));
    second.mutable_x()->set_offset(128);
    v1::ForwardRequest second_first = second;
    second_first.set_last_chunk(false);
    v1::ForwardRequest first_last = first;
    first_last.set_last_chunk(true);
    cases.push_back({"x's chunks out of order", forward({second_first, first_last}),
                     Code::INVALID_ARGUMENT, "x: chunk at byte offset 128"});
    cases.push_back({"x's first chunk twice", forward({first, first, second}),
                     Code::INVALID_ARGUMENT, "x: chunk at byte offset 0"});
    v1::ForwardRequest lost = second;
    lost.mutable_x()->set_offset(192);
    cases.push_back({"a chunk of x lost", forward({first, lost}), Code::INVALID_ARGUMENT,
                     "x: chunk at byte offset 192"});
    v1::ForwardRequest past = ClientRouted(ref, 4);
    past.mutable_x()->set_data(Bytes(300));
    cases.push_back({"more bytes than x's shape holds", forward({past}), Code::INVALID_ARGUMENT,
                     "x: 300 bytes, more than its shape holds"});
  }
  {
    const std::string w1(6 * 24 * 16 * 4, 0);
    v1::WeightChunk a =
        WeightOf(ref, "w1", TensorProto(DType::kFloat32, {6, 24, 16}, w1.substr(0, 4096)), false);
    v1::WeightChunk b =
        WeightOf("", "w1", TensorProto(DType::kFloat32, {6, 24, 16}, w1.substr(4096), 4096));
    v1::WeightChunk b_first = b;
    b_first.set_layer(ref);
    cases.push_back({"ImportWeights, w1's chunks out of order", import({b_first, a}),
                     Code::INVALID_ARGUMENT, "tensor w1: chunk at byte offset 4096"});
    cases.push_back({"ImportWeights, w1's first chunk twice", import({a, a, b}),
                     Code::INVALID_ARGUMENT, "tensor w1: chunk at byte offset 0"});
  }

  // --- Stripes -------------------------------------------------------------------------------
  // Each case under its own context id: its own join.
  uint64_t next_id = 90;
  auto striped = [&](v1::Stripe stripe, int64_t rows) {
    v1::ForwardRequest r = ClientRouted(ref, rows);
    r.set_context_id(++next_id);
    *r.mutable_stripe() = stripe;
    return r;
  };
  cases.push_back({"stripe rows past total_rows", forward({striped(StripeOf(1, 2, 2, 4), 4)}),
                   Code::INVALID_ARGUMENT, "stripe.row_begin"});
  cases.push_back({"a negative stripe.row_begin", forward({striped(StripeOf(0, 2, -1, 4), 2)}),
                   Code::INVALID_ARGUMENT, "stripe.row_begin"});
  cases.push_back(
      {"stripe.row_begin near 2^63",
       forward({striped(StripeOf(1, 2, std::numeric_limits<int64_t>::max() - 1, 4), 2)}),
       Code::INVALID_ARGUMENT, "stripe.row_begin"});
  cases.push_back({"stripe.count 65", forward({striped(StripeOf(0, 65, 0, 4), 2)}),
                   Code::INVALID_ARGUMENT, "stripe.count"});
  cases.push_back({"stripe.index 2 of 2", forward({striped(StripeOf(2, 2, 0, 4), 2)}),
                   Code::INVALID_ARGUMENT, "stripe.index"});
  cases.push_back({"stripe.total_rows 2^62", forward({striped(StripeOf(0, 2, 0, kHuge), 2)}),
                   Code::INVALID_ARGUMENT, "stripe.total_rows"});
  {
    v1::ForwardRequest r = striped(StripeOf(0, 2, 0, 4), 2);
    r.mutable_x()->set_offset(64);
    cases.push_back({"a stripe's first chunk at offset 64", forward({r}), Code::INVALID_ARGUMENT,
                     "x: stream 0's first chunk at byte offset 64"});
  }

  // --- Imports that name no layer ------------------------------------------------------------
  cases.push_back({"ImportWeights, an empty stream", import({}), Code::INVALID_ARGUMENT,
                   "layer: required on the first message"});
  cases.push_back({"ImportWeights, no layer on the first message",
                   import({WeightOf("", "w1", TensorProto(DType::kFloat32, {6, 24, 16}))}),
                   Code::INVALID_ARGUMENT, "layer: required on the first message"});
  return cases;
}

TEST(HostileWireTest, EveryRequestGetsItsStatusAndLosesNothing) {
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig()));
  CreateLayers(s.conn());
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    const auto t0 = std::chrono::steady_clock::now();
    const grpc::Status st = c.send(s.conn());
    EXPECT_EQ(st.error_code(), c.code) << st.error_message();
    EXPECT_NE(st.error_message().find(c.message), std::string::npos)
        << "message should contain \"" << c.message << "\": " << st.error_message();
    // At once: none of these waits for a deadline.
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    s.ExpectServingAndUnchanged(c.name);
  }
}

// A stream that failed (its rows leave the micro-batch) before its sibling's first message
// reached the server: the sibling is answered with that failure at once, not at its deadline;
// and a retry of the whole micro-batch under the same id then runs.
TEST(HostileWireTest, ASiblingOfAFailedStripeIsAnsweredAtOnce) {
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig()));
  CreateLayers(s.conn());
  auto part = [](uint32_t index, int64_t row_begin, int64_t rows) {
    v1::ForwardRequest r = ClientRouted("twin", rows);
    r.set_context_id(123);
    r.set_training(true);
    *r.mutable_stripe() = StripeOf(index, 2, row_begin, 6);
    return r;
  };
  auto bad = SendForward(s.conn(), {part(1, 4, 4)});  // rows [4, 8) of 6
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const auto t0 = std::chrono::steady_clock::now();
  auto sibling = SendForward(s.conn(), {part(0, 0, 4)}, std::chrono::seconds(8));
  EXPECT_EQ(sibling.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << sibling.status.error_message();
  EXPECT_NE(sibling.status.error_message().find("stripe.row_begin"), std::string::npos)
      << sibling.status.error_message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(s.conn().GetStats()->saved_contexts(), 0);

  // The retry: both streams again, under the same id.
  grpc::Status first, second;
  std::thread t([&] { first = SendForward(s.conn(), {part(0, 0, 4)}).status; });
  second = SendForward(s.conn(), {part(1, 4, 2)}).status;
  t.join();
  EXPECT_TRUE(first.ok()) << first.error_message();
  EXPECT_TRUE(second.ok()) << second.error_message();
  EXPECT_EQ(s.conn().GetStats()->saved_contexts(), 1);
  s.ExpectServingAndUnchanged("a striped retry");
}

// A client asking for 1-byte response or export chunks gets chunks of at least
// kMinResponseChunkBytes: a handful of messages, each tensor's offsets in order.
TEST(HostileWireTest, TinyChunkRequestsAreRaisedToTheFloor) {
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig()));
  v1::ForwardRequest r = ClientRouted(ReferenceServer::kReference, 64);  // out: 4 KiB
  r.set_max_response_chunk_bytes(1);
  auto a = SendForward(s.conn(), {r});
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  int64_t offset = 0, payload = 0;
  for (const v1::ForwardResponse& m : a.responses) {
    EXPECT_EQ(m.out().offset(), offset);
    offset += static_cast<int64_t>(m.out().data().size());
    payload += static_cast<int64_t>(m.out().data().size() + m.expert_ids().data().size() +
                                    m.weights().data().size());
  }
  EXPECT_EQ(offset, 64 * 16 * 4);
  const int64_t floor = server::kMinResponseChunkBytes;
  EXPECT_EQ(static_cast<int64_t>(a.responses.size()), (payload + floor - 1) / floor);

  grpc::ClientContext ctx;
  s.conn().Prepare(&ctx);
  v1::ExportWeightsRequest e;
  e.set_layer(ReferenceServer::kReference);
  e.set_include_optimizer(true);
  e.set_max_chunk_bytes(1);
  auto reader = s.conn().stub()->ExportWeights(&ctx, e);
  v1::WeightChunk chunk;
  size_t chunks = 0, bytes = 0;
  std::map<std::string, int64_t> next;
  while (reader->Read(&chunk)) {
    ++chunks;
    bytes += chunk.tensor().data().size();
    EXPECT_EQ(chunk.tensor().offset(), next[chunk.name()]) << chunk.name();
    next[chunk.name()] += static_cast<int64_t>(chunk.tensor().data().size());
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_LE(chunks, bytes / server::kMinResponseChunkBytes + next.size());
  s.ExpectServingAndUnchanged("tiny chunks");
}

}  // namespace
}  // namespace moe::server_test
