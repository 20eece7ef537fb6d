// Striped micro-batches (moe.proto `Stripe`) against a real server on loopback, driven through the
// plain protobuf stub so each stream's messages are exactly what the test writes: the streams of
// one micro-batch run it once and each gets its rows of the result, equal bit for bit to one
// stream carrying it all; a failure on any stream (bad rows, bad tensors, a cancelled call, a
// deadline) ends every stream with a status naming the field and loses no saved context.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "tests/server/server_fixture.h"
#include "wire/wire.h"

namespace moe::server_test {
namespace {

// Client routing, so each stream carries its rows of expert_ids and weights too.
LayerConfig Config() { return SmallConfig(RoutingMode::kClient); }

// Rows [begin, end) of a [T, ...] tensor, as a proto tensor.
void SetRows(const Tensor& t, int64_t begin, int64_t end, v1::Tensor* proto) {
  const size_t row = t.bytes.size() / static_cast<size_t>(t.shape[0]);
  std::vector<int64_t> shape = t.shape;
  shape[0] = end - begin;
  wire::SetTensorHeader(t.dtype, shape, proto);
  proto->set_data(reinterpret_cast<const char*>(t.bytes.data()) + begin * row, (end - begin) * row);
}

std::string RowBytes(const Tensor& t, int64_t begin, int64_t end) {
  const size_t row = t.bytes.size() / static_cast<size_t>(t.shape[0]);
  return std::string(reinterpret_cast<const char*>(t.bytes.data()) + begin * row,
                     (end - begin) * row);
}

struct Span {
  int64_t begin, end;
};

// A Forward stream's one message: rows `r` of x, ids and weights, striped as `stripe` (count 0:
// the whole micro-batch).
v1::ForwardRequest ForwardPart(const std::string& layer, uint64_t id, bool training,
                               const Tensor& x, const Tensor& ids, const Tensor& w, Span r,
                               const v1::Stripe& stripe) {
  v1::ForwardRequest q;
  q.set_layer(layer);
  q.set_context_id(id);
  q.set_training(training);
  q.set_last_chunk(true);
  SetRows(x, r.begin, r.end, q.mutable_x());
  SetRows(ids, r.begin, r.end, q.mutable_expert_ids());
  SetRows(w, r.begin, r.end, q.mutable_weights());
  if (stripe.count() != 0) *q.mutable_stripe() = stripe;
  return q;
}

v1::BackwardRequest BackwardPart(const std::string& layer, uint64_t id, const Tensor& dout, Span r,
                                 const v1::Stripe& stripe) {
  v1::BackwardRequest q;
  q.set_layer(layer);
  q.set_context_id(id);
  q.set_last_chunk(true);
  SetRows(dout, r.begin, r.end, q.mutable_dout());
  if (stripe.count() != 0) *q.mutable_stripe() = stripe;
  return q;
}

// One stream per request, all written (and half-closed) before any is read, as the streams of a
// striped micro-batch on several connections would be.
template <typename Req, typename Resp, typename Open>
std::vector<Answer<Resp>> RunStreams(client::Connection& c, const std::vector<Req>& requests,
                                     Open open) {
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<Req, Resp>>> streams;
  for (const Req& r : requests) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    c.Prepare(contexts.back().get());
    streams.push_back(open(contexts.back().get()));
    streams.back()->Write(r);
    streams.back()->WritesDone();
  }
  std::vector<Answer<Resp>> answers(requests.size());
  for (size_t i = 0; i < streams.size(); ++i) {
    Resp resp;
    while (streams[i]->Read(&resp)) answers[i].responses.push_back(resp);
    answers[i].status = streams[i]->Finish();
  }
  return answers;
}

std::vector<Answer<v1::ForwardResponse>> RunForward(client::Connection& c,
                                                    const std::vector<v1::ForwardRequest>& reqs) {
  return RunStreams<v1::ForwardRequest, v1::ForwardResponse>(
      c, reqs, [&](grpc::ClientContext* ctx) { return c.stub()->Forward(ctx); });
}

std::vector<Answer<v1::BackwardResponse>> RunBackward(
    client::Connection& c, const std::vector<v1::BackwardRequest>& reqs) {
  return RunStreams<v1::BackwardRequest, v1::BackwardResponse>(
      c, reqs, [&](grpc::ClientContext* ctx) { return c.stub()->Backward(ctx); });
}

// A server with `layers` (Config()) and one micro-batch's tensors.
struct Fixture : Loopback {
  Tensor x, ids, w, dout;
  static constexpr int64_t kTokens = 10;

  explicit Fixture(const std::vector<std::string>& layers) : Loopback(StartLoopback()) {
    if (!conn) return;
    for (const std::string& name : layers) EXPECT_TRUE(conn->CreateLayer(name, Config()).ok());
    std::mt19937 rng(3);
    x = RandomFloat(rng, {kTokens, Config().d_model});
    RandomRouting(rng, kTokens, Config(), &ids, &w);
    dout = RandomFloat(rng, {kTokens, Config().d_model});
  }
};

// Two layers with the same seed: one fed whole micro-batches, the other the same ones striped
// (streams written in an order that is not their rows' order). Every row of every result, the
// step's gradient norm and the weights after it are the same bits.
TEST(StripingTest, StreamsOfOneMicroBatchRunItOnceAndEachGetsItsRows) {
  Fixture f({"whole", "striped"});
  ASSERT_TRUE(f.conn);
  client::Connection& c = *f.conn;
  const int64_t T = Fixture::kTokens;
  auto whole = RunForward(c, {ForwardPart("whole", 5, true, f.x, f.ids, f.w, {0, T}, {})});
  ASSERT_TRUE(whole[0].status.ok()) << whole[0].status.error_message();
  ASSERT_EQ(whole[0].responses.size(), 1u);
  const v1::ForwardResponse& full = whole[0].responses[0];

  // Stream 0 carries rows [4, 10), stream 1 rows [0, 4); stream 0 arrives first.
  const std::vector<Span> rows = {{4, T}, {0, 4}};
  std::vector<v1::ForwardRequest> parts;
  for (uint32_t i = 0; i < 2; ++i) {
    parts.push_back(ForwardPart("striped", 5, true, f.x, f.ids, f.w, rows[i],
                                StripeOf(i, 2, rows[i].begin, T)));
  }
  auto striped = RunForward(c, parts);
  const int64_t out_row = full.out().data().size() / T;
  const int64_t w_row = full.weights().data().size() / T;
  for (uint32_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(striped[i].status.ok()) << striped[i].status.error_message();
    ASSERT_EQ(striped[i].responses.size(), 1u);
    const v1::ForwardResponse& r = striped[i].responses[0];
    EXPECT_EQ(r.context_id(), 5u);
    EXPECT_EQ(r.out().shape(0), rows[i].end - rows[i].begin);
    EXPECT_EQ(r.out().data(), full.out().data().substr(rows[i].begin * out_row,
                                                       (rows[i].end - rows[i].begin) * out_row));
    EXPECT_EQ(
        r.weights().data(),
        full.weights().data().substr(rows[i].begin * w_row, (rows[i].end - rows[i].begin) * w_row));
    EXPECT_EQ(r.aux_loss(), full.aux_loss());
  }
  // One training context for the two streams.
  EXPECT_EQ(c.GetStats()->saved_contexts(), 2);

  // Backward in three streams: rows [0, 3), [3, 7), [7, 10).
  auto whole_b = RunBackward(c, {BackwardPart("whole", 5, f.dout, {0, T}, {})});
  ASSERT_TRUE(whole_b[0].status.ok()) << whole_b[0].status.error_message();
  const v1::BackwardResponse& full_b = whole_b[0].responses[0];
  const std::vector<Span> brows = {{0, 3}, {3, 7}, {7, T}};
  std::vector<v1::BackwardRequest> bparts;
  for (uint32_t i = 0; i < 3; ++i) {
    bparts.push_back(
        BackwardPart("striped", 5, f.dout, brows[i], StripeOf(i, 3, brows[i].begin, T)));
  }
  auto striped_b = RunBackward(c, bparts);
  const int64_t dx_row = full_b.dx().data().size() / T;
  const int64_t dw_row = full_b.dweights().data().size() / T;
  for (uint32_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(striped_b[i].status.ok()) << striped_b[i].status.error_message();
    const v1::BackwardResponse& r = striped_b[i].responses[0];
    const int64_t n = brows[i].end - brows[i].begin;
    EXPECT_EQ(r.dx().data(), full_b.dx().data().substr(brows[i].begin * dx_row, n * dx_row));
    EXPECT_EQ(r.dweights().data(),
              full_b.dweights().data().substr(brows[i].begin * dw_row, n * dw_row));
  }
  EXPECT_EQ(c.GetStats()->saved_contexts(), 0);
  auto sw = c.Step("whole"), ss = c.Step("striped");
  ASSERT_TRUE(sw.ok() && ss.ok());
  EXPECT_EQ(sw->grad_norm, ss->grad_norm);
  EXPECT_EQ(sw->tokens_per_expert, ss->tokens_per_expert);
  auto ww = c.ExportWeights("whole", true), ws = c.ExportWeights("striped", true);
  ASSERT_TRUE(ww.ok() && ws.ok());
  for (const auto& [name, t] : *ww) EXPECT_EQ(ws->at(name).bytes, t.bytes) << name;
}

TEST(StripingTest, AFailureOnOneStreamReachesEveryStreamAndLosesNothing) {
  Fixture f({"l"});
  ASSERT_TRUE(f.conn);
  client::Connection& c = *f.conn;
  const int64_t T = Fixture::kTokens;
  auto two = [&](uint64_t id, Span a, Span b, bool training = true) {
    return std::vector<v1::ForwardRequest>{
        ForwardPart("l", id, training, f.x, f.ids, f.w, a, StripeOf(0, 2, a.begin, T)),
        ForwardPart("l", id, training, f.x, f.ids, f.w, b, StripeOf(1, 2, b.begin, T))};
  };
  auto expect_all = [](const auto& answers, grpc::StatusCode code, const std::string& field) {
    for (const auto& a : answers) ExpectStatus(a.status, code, field);
  };
  {  // a gap between the streams' rows
    expect_all(RunForward(c, two(1, {0, 4}, {5, T})), grpc::StatusCode::INVALID_ARGUMENT,
               "stripe.row_begin");
  }
  {  // the streams disagree on total_rows, on training
    auto reqs = two(2, {0, 4}, {4, T});
    reqs[1].mutable_stripe()->set_total_rows(T + 1);
    expect_all(RunForward(c, reqs), grpc::StatusCode::INVALID_ARGUMENT, "stripe.total_rows");
    reqs = two(2, {0, 4}, {4, T});
    reqs[1].set_training(false);
    expect_all(RunForward(c, reqs), grpc::StatusCode::INVALID_ARGUMENT, "training");
  }
  {  // one stream's x has the wrong width, or no rows dimension
    auto reqs = two(3, {0, 4}, {4, T});
    std::mt19937 rng(1);
    Tensor narrow = RandomFloat(rng, {T, Config().d_model - 1});
    SetRows(narrow, 4, T, reqs[1].mutable_x());
    expect_all(RunForward(c, reqs), grpc::StatusCode::INVALID_ARGUMENT, "x");
  }
  {  // a single stream that says it is one of one, or the third of two, or has no context id
    auto reqs = two(4, {0, 4}, {4, T});
    reqs[0].mutable_stripe()->set_count(1);
    ExpectStatus(RunForward(c, {reqs[0]})[0].status, grpc::StatusCode::INVALID_ARGUMENT,
                 "stripe.count");
    reqs = two(4, {0, 4}, {4, T});
    reqs[0].mutable_stripe()->set_index(2);
    ExpectStatus(RunForward(c, {reqs[0]})[0].status, grpc::StatusCode::INVALID_ARGUMENT,
                 "stripe.index");
    reqs = two(0, {0, 4}, {4, T}, /*training=*/false);
    ExpectStatus(RunForward(c, {reqs[0]})[0].status, grpc::StatusCode::INVALID_ARGUMENT,
                 "context_id");
  }
  // None of those kept a context, and each id works for a correct micro-batch afterwards.
  EXPECT_EQ(c.GetStats()->saved_contexts(), 0);
  for (uint64_t id : {1, 2, 3}) {
    for (const auto& a : RunForward(c, two(id, {0, 4}, {4, T}))) {
      EXPECT_TRUE(a.status.ok()) << "id " << id << ": " << a.status.error_message();
    }
  }
  EXPECT_EQ(c.GetStats()->saved_contexts(), 3);
  {  // a striped Backward with one bad stream keeps the context for a correct retry
    std::mt19937 rng(2);
    Tensor wide = RandomFloat(rng, {T, Config().d_model + 1});
    std::vector<v1::BackwardRequest> reqs = {
        BackwardPart("l", 1, f.dout, {0, 5}, StripeOf(0, 2, 0, T)),
        BackwardPart("l", 1, wide, {5, T}, StripeOf(1, 2, 5, T))};
    for (const auto& a : RunBackward(c, reqs)) {
      ExpectStatus(a.status, grpc::StatusCode::INVALID_ARGUMENT, "dout");
    }
    EXPECT_EQ(c.GetStats()->saved_contexts(), 3);
    reqs[1] = BackwardPart("l", 1, f.dout, {5, T}, StripeOf(1, 2, 5, T));
    for (const auto& a : RunBackward(c, reqs)) {
      EXPECT_TRUE(a.status.ok()) << a.status.error_message();
    }
    EXPECT_EQ(c.GetStats()->saved_contexts(), 2);
  }
}

// A stream waiting for a sibling that never completes ends when its own call does (cancelled by
// the client, or its deadline): the join answers it, keeps no context, and is gone afterwards,
// so the same id then runs normally.
TEST(StripingTest, AStreamLeftWaitingEndsWithItsCallAndFreesTheJoin) {
  Fixture f({"l"});
  ASSERT_TRUE(f.conn);
  client::Connection& c = *f.conn;
  const int64_t T = Fixture::kTokens;
  const v1::ForwardRequest first =
      ForwardPart("l", 9, true, f.x, f.ids, f.w, {0, 4}, StripeOf(0, 2, 0, T));
  const v1::ForwardRequest second =
      ForwardPart("l", 9, true, f.x, f.ids, f.w, {4, T}, StripeOf(1, 2, 4, T));
  {  // the sibling is cancelled halfway through its micro-batch
    grpc::ClientContext a_ctx, b_ctx;
    c.Prepare(&a_ctx);
    c.Prepare(&b_ctx);
    auto a = c.stub()->Forward(&a_ctx);
    ASSERT_TRUE(a->Write(first));
    a->WritesDone();
    auto b = c.stub()->Forward(&b_ctx);
    v1::ForwardRequest partial = second;
    partial.set_last_chunk(false);
    ASSERT_TRUE(b->Write(partial));
    // Cancelled before the server has read its first message, the sibling would never have
    // joined, and the first stream would rightly wait for its deadline.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto t0 = std::chrono::steady_clock::now();
    b_ctx.TryCancel();
    v1::ForwardResponse r;
    EXPECT_FALSE(a->Read(&r));
    ExpectStatus(a->Finish(), grpc::StatusCode::CANCELLED, "stripe 1 of 2");
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    EXPECT_EQ(b->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  {  // the sibling never comes: the waiting stream's deadline ends it
    grpc::ClientContext a_ctx;
    a_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    auto a = c.stub()->Forward(&a_ctx);
    ASSERT_TRUE(a->Write(first));
    a->WritesDone();
    v1::ForwardResponse r;
    EXPECT_FALSE(a->Read(&r));
    EXPECT_EQ(a->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  EXPECT_EQ(c.GetStats()->saved_contexts(), 0);
  // The server forgets a failed join once its streams are gone (it retries briefly: the
  // server-side cancellation of the last call may land just after the client saw it).
  bool ok = false;
  for (int attempt = 0; attempt < 50 && !ok; ++attempt) {
    auto answers = RunForward(c, {first, second});
    ok = answers[0].status.ok() && answers[1].status.ok();
    if (!ok) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(ok);
  EXPECT_EQ(c.GetStats()->saved_contexts(), 1);
}

}  // namespace
}  // namespace moe::server_test
