// A real moe-server on loopback for hostile-input tests: a reference layer trained one step (so
// its weights and optimizer state are not their initial values) whose exported state is
// remembered, and the checks to run after every hostile request: the server still answers a
// Forward, and the reference layer's weights and optimizer state are bitwise what they were.
// Requests go through the plain protobuf stub, so each message is exactly what a test writes
// (any client generated from moe.proto could send it).
#ifndef MOE_TESTS_SERVER_HOSTILE_FIXTURE_H_
#define MOE_TESTS_SERVER_HOSTILE_FIXTURE_H_

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "server/server.h"
#include "tests/client/test_util.h"

namespace moe::hostile {

// What a whole stream call ended with, and the responses it read.
template <typename Resp>
struct Answer {
  grpc::Status status;
  std::vector<Resp> responses;
};

class HostileServer {
 public:
  static constexpr char kReference[] = "reference";

  // Starts the server, connects with `copts` (a token or certificate, where the server asks for
  // one), creates the reference layer (client routing, 6 experts, top 2, d 16, h 24), runs one
  // Forward, Backward and Step on it and remembers its exported state.
  explicit HostileServer(server::ServerOptions options = testing_util::LoopbackOptions(),
                         client::ClientOptions copts = {}) {
    server_ = testing_util::StartServer(std::move(options));
    if (!server_) return;
    auto c = client::Connection::Connect(testing_util::Target(*server_), copts);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return;
    conn_ = *c;
    EXPECT_TRUE(conn_->CreateLayer(kReference, ReferenceConfig()).ok());
    std::mt19937 rng(7);
    x_ = testing_util::RandomFloat(rng, {9, ReferenceConfig().d_model});
    testing_util::RandomRouting(rng, 9, ReferenceConfig().top_k, 0,
                                static_cast<int32_t>(ReferenceConfig().num_experts), &ids_, &w_);
    auto f = conn_->Forward(kReference, 1, true, x_.view(), ids_.view(), w_.view()).get();
    EXPECT_TRUE(f.ok()) << f.status();
    auto b = conn_->Backward(kReference, 1, f->out.view()).get();
    EXPECT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(conn_->Step(kReference).ok());
    auto state = conn_->ExportWeights(kReference, /*include_optimizer=*/true);
    EXPECT_TRUE(state.ok()) << state.status();
    if (state.ok()) reference_ = std::move(*state);
    EXPECT_TRUE(reference_.count("w1.exp_avg")) << "the reference layer keeps optimizer state";
  }

  static LayerConfig ReferenceConfig() {
    LayerConfig c;
    c.num_experts = 6;
    c.top_k = 2;
    c.d_model = 16;
    c.d_hidden = 24;
    c.routing = RoutingMode::kClient;
    c.seed = 3;
    return c;
  }

  bool ready() const { return conn_ != nullptr && !reference_.empty(); }
  client::Connection& conn() { return *conn_; }
  server::Server& server() { return *server_; }

  // After a hostile request: the server answers an inference Forward on the reference layer,
  // and the layer's exported weights and optimizer state are bitwise those remembered.
  void ExpectServingAndUnchanged(const std::string& after) {
    SCOPED_TRACE("after " + after);
    auto f = conn_->Forward(kReference, 0, false, x_.view(), ids_.view(), w_.view()).get();
    ASSERT_TRUE(f.ok()) << "the server no longer serves: " << f.status();
    auto state = conn_->ExportWeights(kReference, /*include_optimizer=*/true);
    ASSERT_TRUE(state.ok()) << state.status();
    ASSERT_EQ(state->size(), reference_.size());
    for (const auto& [name, t] : reference_) {
      auto it = state->find(name);
      ASSERT_NE(it, state->end()) << name;
      EXPECT_EQ(it->second.shape, t.shape) << name;
      EXPECT_TRUE(it->second.bytes == t.bytes) << name << " changed";
    }
  }

  // One Forward (or Backward) stream: every request written, then half-closed, then every
  // response read. `deadline` bounds the call.
  template <typename Req, typename Resp, typename Open>
  Answer<Resp> Stream(const std::vector<Req>& requests, Open open,
                      std::chrono::milliseconds deadline = std::chrono::seconds(20)) {
    grpc::ClientContext ctx;
    conn_->Prepare(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    auto stream = open(&ctx);
    for (const Req& r : requests) {
      if (!stream->Write(r)) break;
    }
    stream->WritesDone();
    Answer<Resp> a;
    Resp resp;
    while (stream->Read(&resp)) a.responses.push_back(resp);
    a.status = stream->Finish();
    return a;
  }
  Answer<v1::ForwardResponse> Forward(
      const std::vector<v1::ForwardRequest>& requests,
      std::chrono::milliseconds deadline = std::chrono::seconds(20)) {
    return Stream<v1::ForwardRequest, v1::ForwardResponse>(
        requests, [&](grpc::ClientContext* ctx) { return conn_->stub()->Forward(ctx); }, deadline);
  }
  Answer<v1::BackwardResponse> Backward(const std::vector<v1::BackwardRequest>& requests) {
    return Stream<v1::BackwardRequest, v1::BackwardResponse>(
        requests, [&](grpc::ClientContext* ctx) { return conn_->stub()->Backward(ctx); });
  }
  // One ImportWeights stream of `chunks` (none: the client half-closes at once).
  grpc::Status Import(const std::vector<v1::WeightChunk>& chunks) {
    grpc::ClientContext ctx;
    conn_->Prepare(&ctx);
    v1::ImportWeightsResponse resp;
    auto writer = conn_->stub()->ImportWeights(&ctx, &resp);
    for (const v1::WeightChunk& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

 private:
  std::unique_ptr<server::Server> server_;
  std::shared_ptr<client::Connection> conn_;
  std::map<std::string, Tensor> reference_;
  Tensor x_, ids_, w_;
};

}  // namespace moe::hostile

#endif  // MOE_TESTS_SERVER_HOSTILE_FIXTURE_H_
