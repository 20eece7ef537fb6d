// The loopback server fixture of tests/server (server_fixture.h).
#include "tests/server/server_fixture.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe::server_test {

std::string TempPath(const std::string& name) {
  static int counter = 0;
  return absl::StrCat(::testing::TempDir(), "/moe_", name, "_", ::getpid(), "_", counter++);
}

std::string TempDir(const std::string& name) {
  std::string dir = TempPath(name);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

client::ClientOptions LoopbackClientOptions() {
  client::ClientOptions o;
  o.timeout = std::chrono::seconds(20);
  return o;
}

LayerConfig SmallConfig(RoutingMode routing) {
  LayerConfig c;
  c.num_experts = 6;
  c.top_k = 2;
  c.d_model = 16;
  c.d_hidden = 24;
  c.routing = routing;
  c.seed = 11;
  c.optimizer.learning_rate = 1e-2;
  return c;
}

void RandomRouting(std::mt19937& rng, int64_t tokens, const LayerConfig& c, Tensor* ids,
                   Tensor* weights) {
  testing_util::RandomRouting(rng, tokens, c.top_k, 0, static_cast<int32_t>(c.num_experts), ids,
                              weights);
}

v1::Stripe StripeOf(uint32_t index, uint32_t count, int64_t row_begin, int64_t total_rows) {
  v1::Stripe s;
  s.set_index(index);
  s.set_count(count);
  s.set_row_begin(row_begin);
  s.set_total_rows(total_rows);
  return s;
}

Tensor ToBFloat16(const Tensor& t) {
  Tensor out = Tensor::Zeros(DType::kBFloat16, t.shape);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    out.as<uint16_t>()[i] = FloatToBFloat16(t.as<float>()[i]);
  }
  return out;
}

double MetricValue(const std::string& page, const std::string& series) {
  const size_t at = page.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::strtod(page.c_str() + at + series.size() + 2, nullptr);
}

void ExpectStatus(const grpc::Status& st, grpc::StatusCode code, const std::string& field) {
  EXPECT_EQ(st.error_code(), code) << st.error_message();
  EXPECT_NE(st.error_message().find(field), std::string::npos)
      << "message should name " << field << ": " << st.error_message();
}

void ExpectSameState(const State& before, const State& after, const std::string& what) {
  ASSERT_EQ(before.size(), after.size()) << "after " << what;
  for (const auto& [name, t] : before) {
    auto it = after.find(name);
    ASSERT_NE(it, after.end()) << name << " missing after " << what;
    EXPECT_EQ(it->second.dtype, t.dtype) << name << " after " << what;
    EXPECT_EQ(it->second.shape, t.shape) << name << " after " << what;
    ASSERT_EQ(it->second.bytes.size(), t.bytes.size()) << name << " after " << what;
    EXPECT_EQ(std::memcmp(it->second.bytes.data(), t.bytes.data(), t.bytes.size()), 0)
        << name << " changed after " << what;
  }
}

std::string Loopback::target() const { return testing_util::Target(*server); }

absl::StatusOr<std::shared_ptr<client::Connection>> Loopback::Connect(
    client::ClientOptions copts) const {
  return client::Connection::Connect(target(), copts);
}

Loopback StartLoopback(server::ServerOptions options, client::ClientOptions copts) {
  Loopback lb;
  lb.server = testing_util::StartServer(std::move(options));
  if (!lb.server) return lb;
  auto c = lb.Connect(copts);
  EXPECT_TRUE(c.ok()) << c.status();
  if (c.ok()) lb.conn = *c;
  return lb;
}

namespace {

template <typename Req, typename Resp, typename Open>
Answer<Resp> SendStream(client::Connection& conn, const std::vector<Req>& requests, Open open,
                        std::chrono::milliseconds deadline) {
  grpc::ClientContext ctx;
  conn.Prepare(&ctx);
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

}  // namespace

Answer<v1::ForwardResponse> SendForward(client::Connection& conn,
                                        const std::vector<v1::ForwardRequest>& requests,
                                        std::chrono::milliseconds deadline) {
  return SendStream<v1::ForwardRequest, v1::ForwardResponse>(
      conn, requests, [&](grpc::ClientContext* ctx) { return conn.stub()->Forward(ctx); },
      deadline);
}

Answer<v1::BackwardResponse> SendBackward(client::Connection& conn,
                                          const std::vector<v1::BackwardRequest>& requests) {
  return SendStream<v1::BackwardRequest, v1::BackwardResponse>(
      conn, requests, [&](grpc::ClientContext* ctx) { return conn.stub()->Backward(ctx); },
      std::chrono::seconds(20));
}

grpc::Status SendImport(client::Connection& conn, const std::vector<v1::WeightChunk>& chunks) {
  grpc::ClientContext ctx;
  conn.Prepare(&ctx);
  v1::ImportWeightsResponse resp;
  auto writer = conn.stub()->ImportWeights(&ctx, &resp);
  for (const v1::WeightChunk& c : chunks) {
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

void ReferenceServer::Start(const LayerConfig& config, server::ServerOptions options,
                            client::ClientOptions copts) {
  loopback_ = StartLoopback(std::move(options), std::move(copts));
  ASSERT_TRUE(loopback_.conn);
  client::Connection& c = *loopback_.conn;
  ASSERT_TRUE(c.CreateLayer(kReference, config).ok());
  std::mt19937 rng(7);
  x_ = RandomFloat(rng, {9, config.d_model});
  if (config.routing == RoutingMode::kClient) RandomRouting(rng, 9, config, &ids_, &w_);
  const uint64_t id = c.NextContextId();
  auto f = c.Forward(kReference, id, true, x_.view(), ids_.view(), w_.view()).get();
  ASSERT_TRUE(f.ok()) << f.status();
  Tensor dout = RandomFloat(rng, {9, config.d_model});
  auto b = c.Backward(kReference, id, dout.view()).get();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(c.Step(kReference).ok());
  auto state = c.ExportWeights(kReference, /*include_optimizer=*/true);
  ASSERT_TRUE(state.ok()) << state.status();
  reference_ = std::move(*state);
  ASSERT_GT(reference_.count("w1.exp_avg"), 0u) << "the reference layer keeps optimizer state";
}

void ReferenceServer::ExpectServingAndUnchanged(const std::string& after) {
  SCOPED_TRACE("after " + after);
  client::Connection& c = *loopback_.conn;
  EXPECT_TRUE(c.Health().ok());
  EXPECT_TRUE(c.ListLayers().ok());
  auto f = c.Forward(kReference, 0, false, x_.view(), ids_.view(), w_.view()).get();
  ASSERT_TRUE(f.ok()) << "the server no longer serves: " << f.status();
  auto state = c.ExportWeights(kReference, /*include_optimizer=*/true);
  ASSERT_TRUE(state.ok()) << state.status();
  ExpectSameState(reference_, *state, after);
}

}  // namespace moe::server_test
