// The ExpertService against a real moe-server on loopback (127.0.0.1, ephemeral ports): a
// training step through the service equals the same engine in process bit for bit; every bad
// input gets its own status and the server keeps serving; context budget, TTL and session end;
// chunked tensors; metrics scraped over HTTP; checkpoints exact and readable by Python.
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "engine/layer.h"
#include "wire/wire.h"
#include "server/server.h"

namespace moe {
namespace {

using client::Connection;
using client::RemoteLayer;

std::string TempDir(const std::string& name) {
  static int counter = 0;
  std::string dir =
      absl::StrCat(::testing::TempDir(), "/moe_service_", name, "_", ::getpid(), "_", counter++);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

server::ServerOptions LoopbackOptions() {
  server::ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.metrics_port = -1;  // only the metrics test needs the HTTP endpoint
  o.device = "cpu";
  o.checkpoint_dir = TempDir("ckpt");
  return o;
}

struct Loopback {
  std::unique_ptr<server::Server> server;
  std::shared_ptr<Connection> conn;
  std::string target() const { return absl::StrCat("127.0.0.1:", server->port()); }
};

Loopback Start(server::ServerOptions options = LoopbackOptions(),
               client::ClientOptions copts = {}) {
  Loopback lb;
  auto s = server::Server::Start(options);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return lb;
  lb.server = std::move(*s);
  copts.timeout = std::chrono::seconds(20);
  auto c = Connection::Connect(lb.target(), copts);
  EXPECT_TRUE(c.ok()) << c.status();
  if (c.ok()) lb.conn = *c;
  return lb;
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

Tensor RandomFloat(std::mt19937& rng, std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(DType::kFloat32, std::move(shape));
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.as<float>()[i] = dist(rng);
  return t;
}

// Distinct random expert ids per token and positive weights.
void RandomRouting(std::mt19937& rng, int64_t tokens, const LayerConfig& c, Tensor* ids,
                   Tensor* weights) {
  *ids = Tensor::Zeros(DType::kInt32, {tokens, c.top_k});
  *weights = Tensor::Zeros(DType::kFloat32, {tokens, c.top_k});
  std::uniform_real_distribution<float> u(0.1f, 1.f);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> all(c.num_experts);
    for (int i = 0; i < c.num_experts; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t k = 0; k < c.top_k; ++k) {
      ids->as<int32_t>()[t * c.top_k + k] = all[k];
      weights->as<float>()[t * c.top_k + k] = u(rng);
    }
  }
}

// --- Bit-exact against the engine in process ------------------------------------------------
// float32 -> bf16 (round to nearest even), the dtype a bf16 layer expects for x and dout.
Tensor ToBFloat16(const Tensor& t) {
  Tensor out = Tensor::Zeros(DType::kBFloat16, t.shape);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    out.as<uint16_t>()[i] = FloatToBFloat16(t.as<float>()[i]);
  }
  return out;
}

void CheckTrainStepMatchesInProcess(RoutingMode routing, int64_t chunk_bytes,
                                    DType dtype = DType::kFloat32) {
  client::ClientOptions copts;
  copts.chunk_bytes = chunk_bytes;
  Loopback lb = Start(LoopbackOptions(), copts);
  ASSERT_TRUE(lb.conn);
  LayerConfig config = SmallConfig(routing);
  config.dtype = dtype;
  auto remote = RemoteLayer::Create(lb.conn, "exact", config);
  ASSERT_TRUE(remote.ok()) << remote.status();
  auto engine = CreateEngine("cpu");
  ASSERT_TRUE(engine.ok());
  auto local = (*engine)->CreateLayer(config);
  ASSERT_TRUE(local.ok());

  std::mt19937 rng(5);
  for (int step = 0; step < 2; ++step) {
    const int64_t tokens = 37;
    Tensor x = RandomFloat(rng, {tokens, config.d_model}), ids, w;
    if (routing == RoutingMode::kClient) RandomRouting(rng, tokens, config, &ids, &w);
    Tensor dout = RandomFloat(rng, {tokens, config.d_model});
    if (dtype == DType::kBFloat16) {
      x = ToBFloat16(x);
      dout = ToBFloat16(dout);
    }

    auto rf = (*remote)->Forward(x.view(), ids.view(), w.view()).get();
    ASSERT_TRUE(rf.ok()) << rf.status();
    ForwardRequest req;
    req.x = x.view();
    if (!ids.empty()) req.expert_ids = ids.view();
    if (!w.empty()) req.weights = w.view();
    auto lf = (*local)->Forward(req);
    ASSERT_TRUE(lf.ok()) << lf.status();
    EXPECT_EQ(rf->out.bytes, lf->out.bytes) << "step " << step;
    EXPECT_EQ(rf->out.shape, lf->out.shape);
    EXPECT_EQ(rf->expert_ids.bytes, lf->expert_ids.bytes);
    EXPECT_EQ(rf->weights.bytes, lf->weights.bytes);
    EXPECT_EQ(rf->aux_loss, lf->aux_loss);

    auto rb = (*remote)->Backward(rf->context_id, dout.view()).get();
    ASSERT_TRUE(rb.ok()) << rb.status();
    auto lb_ = (*local)->Backward(std::move(lf->context), dout.view());
    ASSERT_TRUE(lb_.ok()) << lb_.status();
    EXPECT_EQ(rb->dx.bytes, lb_->dx.bytes) << "step " << step;
    EXPECT_EQ(rb->dweights.bytes, lb_->dweights.bytes) << "step " << step;

    auto rs = (*remote)->Step();
    ASSERT_TRUE(rs.ok()) << rs.status();
    auto ls = (*local)->Step();
    ASSERT_TRUE(ls.ok());
    EXPECT_EQ(rs->step, ls->step);
    EXPECT_EQ(rs->grad_norm, ls->grad_norm);
    EXPECT_EQ(rs->tokens_per_expert, ls->tokens_per_expert);
  }
  auto rw = (*remote)->ExportWeights(/*include_optimizer=*/true);
  ASSERT_TRUE(rw.ok()) << rw.status();
  auto lw = (*local)->ExportState(true);
  ASSERT_TRUE(lw.ok());
  ASSERT_EQ(rw->size(), lw->size());
  for (const auto& [name, t] : *lw) {
    ASSERT_TRUE(rw->count(name)) << name;
    EXPECT_EQ(rw->at(name).bytes, t.bytes) << name;
    EXPECT_EQ(rw->at(name).shape, t.shape) << name;
  }
}

TEST(ServiceTest, TrainStepMatchesInProcessEngineClientRouting) {
  CheckTrainStepMatchesInProcess(RoutingMode::kClient, int64_t{1} << 20);
}

TEST(ServiceTest, TrainStepMatchesInProcessEngineServerRouting) {
  CheckTrainStepMatchesInProcess(RoutingMode::kServer, int64_t{1} << 20);
}

TEST(ServiceTest, TrainStepMatchesInProcessEngineBFloat16) {
  CheckTrainStepMatchesInProcess(RoutingMode::kServer, int64_t{1} << 20, DType::kBFloat16);
  CheckTrainStepMatchesInProcess(RoutingMode::kClient, 500, DType::kBFloat16);
}

TEST(ServiceTest, ChunkedTensorsGiveTheSameBits) {
  // 1000-byte chunks: x (37x16 floats) travels in 3 messages, ids and weights share others.
  CheckTrainStepMatchesInProcess(RoutingMode::kClient, 1000);
}

// --- Bad inputs --------------------------------------------------------------------------
grpc::Status RawForward(Connection& c, const v1::ForwardRequest& req) {
  grpc::ClientContext ctx;
  c.Prepare(&ctx);
  auto stream = c.stub()->Forward(&ctx);
  stream->Write(req);
  stream->WritesDone();
  v1::ForwardResponse resp;
  while (stream->Read(&resp)) {
  }
  return stream->Finish();
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

void ExpectStatus(const grpc::Status& st, grpc::StatusCode code, const std::string& field) {
  EXPECT_EQ(st.error_code(), code) << st.error_message();
  EXPECT_NE(st.error_message().find(field), std::string::npos)
      << "message should name " << field << ": " << st.error_message();
}

TEST(ServiceTest, EveryBadInputGetsItsStatusAndTheServerKeepsServing) {
  server::ServerOptions options = LoopbackOptions();
  options.max_message_bytes = 64 * 1024;
  Loopback lb = Start(options);
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
  Loopback lb = Start();
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

// --- Saved contexts -----------------------------------------------------------------------
TEST(ServiceTest, ContextBudgetRefusesTheNewForwardAndLosesNothingElse) {
  Loopback probe = Start();
  ASSERT_TRUE(probe.conn);
  const LayerConfig config = SmallConfig(RoutingMode::kClient);
  std::mt19937 rng(3);
  Tensor x = RandomFloat(rng, {16, config.d_model}), ids, w;
  RandomRouting(rng, 16, config, &ids, &w);
  // Measure one context's size, then allow exactly two.
  ASSERT_TRUE(probe.conn->CreateLayer("l", config).ok());
  ASSERT_TRUE(probe.conn->Forward("l", 1, true, x.view(), ids.view(), w.view()).get().ok());
  const int64_t one = probe.conn->GetStats()->saved_context_bytes();
  ASSERT_GT(one, 0);

  server::ServerOptions options = LoopbackOptions();
  options.context_budget_bytes = 2 * one;
  Loopback lb = Start(options);
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  ASSERT_TRUE(c.CreateLayer("l", config).ok());
  ASSERT_TRUE(c.Forward("l", 1, true, x.view(), ids.view(), w.view()).get().ok());
  ASSERT_TRUE(c.Forward("l", 2, true, x.view(), ids.view(), w.view()).get().ok());
  absl::Status st = c.Forward("l", 3, true, x.view(), ids.view(), w.view()).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(c.GetStats()->saved_contexts(), 2);
  // Inference needs no context and still runs; both saved contexts are still there.
  EXPECT_TRUE(c.Forward("l", 0, false, x.view(), ids.view(), w.view()).get().ok());
  Tensor dout = RandomFloat(rng, {16, config.d_model});
  EXPECT_TRUE(c.Backward("l", 1, dout.view()).get().ok());
  EXPECT_TRUE(c.Backward("l", 2, dout.view()).get().ok());
  EXPECT_TRUE(c.Forward("l", 3, true, x.view(), ids.view(), w.view()).get().ok());
  EXPECT_EQ(c.GetStats()->saved_context_bytes(), one);
}

TEST(ServiceTest, ExpiredContextIsNotFound) {
  server::ServerOptions options = LoopbackOptions();
  options.context_ttl_seconds = 0.2;
  Loopback lb = Start(options);
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(c.CreateLayer("l", config).ok());
  std::mt19937 rng(4);
  Tensor x = RandomFloat(rng, {8, config.d_model});
  ASSERT_TRUE(c.Forward("l", 5, true, x.view(), {}, {}).get().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(c.GetStats()->saved_contexts(), 0);  // the sweeper freed it
  Tensor dout = RandomFloat(rng, {8, config.d_model});
  EXPECT_EQ(c.Backward("l", 5, dout.view()).get().status().code(), absl::StatusCode::kNotFound);
}

TEST(ServiceTest, ClientThatGoesAwayFreesItsContexts) {
  Loopback lb = Start();
  ASSERT_TRUE(lb.conn);
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(lb.conn->CreateLayer("l", config).ok());
  std::mt19937 rng(6);
  Tensor x = RandomFloat(rng, {8, config.d_model});
  ASSERT_TRUE(lb.conn->Forward("l", 1, true, x.view(), {}, {}).get().ok());  // stays
  {
    auto other = Connection::Connect(lb.target());
    ASSERT_TRUE(other.ok());
    ASSERT_TRUE((*other)->Forward("l", 2, true, x.view(), {}, {}).get().ok());
    ASSERT_TRUE((*other)->Forward("l", 3, true, x.view(), {}, {}).get().ok());
    EXPECT_EQ(lb.conn->GetStats()->saved_contexts(), 3);
    EXPECT_EQ(lb.conn->GetStats()->sessions(), 2);
  }  // the other client's connection ends here
  int64_t left = -1;
  for (int i = 0; i < 100 && left != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    left = lb.conn->GetStats()->saved_contexts();
  }
  EXPECT_EQ(left, 1);
  Tensor dout = RandomFloat(rng, {8, config.d_model});
  EXPECT_EQ(lb.conn->Backward("l", 2, dout.view()).get().status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(lb.conn->Backward("l", 1, dout.view()).get().ok());
}

TEST(ServiceTest, ManyMicroBatchesInFlight) {
  Loopback lb = Start();
  ASSERT_TRUE(lb.conn);
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  auto layer = RemoteLayer::Create(lb.conn, "l", config);
  ASSERT_TRUE(layer.ok());
  std::mt19937 rng(8);
  std::vector<Tensor> xs;
  for (int i = 0; i < 16; ++i) xs.push_back(RandomFloat(rng, {20, config.d_model}));
  std::vector<std::future<absl::StatusOr<client::ForwardOutput>>> fs;
  for (const auto& x : xs) fs.push_back((*layer)->Forward(x.view()));
  std::vector<std::future<absl::StatusOr<client::BackwardOutput>>> bs;
  for (auto& f : fs) {
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << r.status();
    bs.push_back((*layer)->Backward(r->context_id, r->out.view()));
  }
  for (auto& b : bs) EXPECT_TRUE(b.get().ok());
  auto st = (*layer)->Step();
  ASSERT_TRUE(st.ok());
  int64_t routed = 0;
  for (int64_t n : st->tokens_per_expert) routed += n;
  EXPECT_EQ(routed, 16 * 20 * config.top_k);
}

// --- Metrics over HTTP ----------------------------------------------------------------------
std::string HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  ::send(fd, req.data(), req.size(), 0);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, n);
  ::close(fd);
  return out;
}

// Value of the series `name{labels}` (labels in exposition order), -1 when absent.
double Metric(const std::string& page, const std::string& series) {
  size_t at = page.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::strtod(page.c_str() + at + series.size() + 2, nullptr);
}

TEST(ServiceTest, MetricsEndpointShowsCountersMoving) {
  server::ServerOptions options = LoopbackOptions();
  options.metrics_port = 0;
  Loopback lb = Start(options);
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(c.CreateLayer("m", config).ok());
  std::mt19937 rng(2);
  Tensor x = RandomFloat(rng, {10, config.d_model});
  ASSERT_TRUE(c.Forward("m", 1, true, x.view(), {}, {}).get().ok());
  const std::string before = HttpGet(lb.server->metrics_port(), "/metrics");
  ASSERT_NE(before.find("200 OK"), std::string::npos) << before.substr(0, 200);
  const std::string fwd_ok = "moe_requests_total{code=\"OK\",method=\"Forward\"}";
  const std::string tokens = "moe_tokens_total{direction=\"forward\",layer=\"m\"}";
  EXPECT_EQ(Metric(before, fwd_ok), 1) << before;
  EXPECT_EQ(Metric(before, tokens), 10);
  EXPECT_GT(Metric(before, "moe_saved_context_bytes"), 0);

  ASSERT_TRUE(c.Backward("m", 1, x.view()).get().ok());
  ASSERT_TRUE(c.Forward("m", 2, false, x.view(), {}, {}).get().ok());
  ASSERT_TRUE(c.Step("m").ok());
  EXPECT_EQ(c.Step("zzz").status().code(), absl::StatusCode::kNotFound);
  const std::string after = HttpGet(lb.server->metrics_port(), "/metrics");
  EXPECT_EQ(Metric(after, fwd_ok), 2);
  EXPECT_EQ(Metric(after, tokens), 20);
  EXPECT_EQ(Metric(after, "moe_tokens_total{direction=\"backward\",layer=\"m\"}"), 10);
  EXPECT_EQ(Metric(after, "moe_requests_total{code=\"NOT_FOUND\",method=\"Step\"}"), 1);
  EXPECT_EQ(Metric(after, "moe_optimizer_steps_total{layer=\"m\"}"), 1);
  EXPECT_EQ(Metric(after, "moe_saved_context_bytes"), 0);
  double expert_sum = 0;
  for (int e = 0; e < config.num_experts; ++e) {
    expert_sum += std::max(0.0, Metric(after, absl::StrCat("moe_expert_tokens_total{expert=\"", e,
                                                           "\",layer=\"m\"}")));
  }
  EXPECT_EQ(expert_sum, 20 * config.top_k);
  EXPECT_GT(Metric(after, "moe_stage_duration_seconds_count{method=\"Forward\",stage=\"compute\"}"),
            1);
  EXPECT_GT(Metric(after, "moe_received_bytes_total{method=\"Forward\"}"),
            Metric(before, "moe_received_bytes_total{method=\"Forward\"}"));
  EXPECT_GT(Metric(after, "moe_device_memory_used_bytes{device=\"cpu\"}"), 0);
  EXPECT_EQ(Metric(after, "moe_pinned_host_bytes"), 0);  // the CPU engine pins nothing
  EXPECT_EQ(Metric(after, "moe_layers"), 1);
  EXPECT_NE(HttpGet(lb.server->metrics_port(), "/other").find("404"), std::string::npos);
  // Deleting the layer removes its series.
  ASSERT_TRUE(c.DeleteLayer("m").ok());
  const std::string gone = HttpGet(lb.server->metrics_port(), "/metrics");
  EXPECT_EQ(Metric(gone, tokens), -1);
  EXPECT_EQ(Metric(gone, "moe_layers"), 0);
}

// --- Checkpoints --------------------------------------------------------------------------
TEST(ServiceTest, CheckpointRoundTripIsExactAndPythonReadsIt) {
  Loopback lb = Start();
  ASSERT_TRUE(lb.conn);
  Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  auto layer = RemoteLayer::Create(lb.conn, "ck", config);
  ASSERT_TRUE(layer.ok());
  std::mt19937 rng(12);
  for (int s = 0; s < 2; ++s) {  // optimizer state and step are non-trivial
    Tensor x = RandomFloat(rng, {12, config.d_model});
    auto f = (*layer)->Forward(x.view()).get();
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*layer)->Backward(f->context_id, x.view()).get().ok());
    ASSERT_TRUE((*layer)->Step().ok());
  }
  auto saved = (*layer)->SaveCheckpoint("run/ck.safetensors");
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step(), 2);
  auto original = (*layer)->ExportWeights(true);
  ASSERT_TRUE(original.ok());

  // Into a new layer created from the checkpoint, and into an existing differently-seeded one.
  auto loaded = c.LoadCheckpoint("ck2", "run/ck.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step(), 2);
  LayerConfig other = config;
  other.seed = 99;
  ASSERT_TRUE(c.CreateLayer("ck3", other).ok());
  ASSERT_TRUE(c.LoadCheckpoint("ck3", "run/ck.safetensors").ok());
  for (const char* name : {"ck2", "ck3"}) {
    auto state = c.ExportWeights(name, true);
    ASSERT_TRUE(state.ok());
    ASSERT_EQ(state->size(), original->size()) << name;
    for (const auto& [n, t] : *original) {
      EXPECT_EQ(state->at(n).bytes, t.bytes) << name << " " << n;
    }
  }
  Tensor x = RandomFloat(rng, {9, config.d_model});
  auto a = c.Forward("ck", 0, false, x.view(), {}, {}).get();
  auto b = c.Forward("ck3", 0, false, x.view(), {}, {}).get();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->out.bytes, b->out.bytes);
  EXPECT_EQ(c.LoadCheckpoint("ck4", "run/missing.safetensors").status().code(),
            absl::StatusCode::kNotFound);

  // The real Python safetensors package reads the same values.
  const std::string expected = TempDir("expected");
  std::ofstream manifest(expected + "/manifest.json");
  manifest << "{";
  bool first = true;
  for (const auto& [n, t] : *original) {
    std::ofstream(expected + "/" + n + ".bin", std::ios::binary)
        .write(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    manifest << (first ? "" : ",") << "\"" << n << "\": [\"" << DTypeName(t.dtype) << "\", [";
    for (size_t i = 0; i < t.shape.size(); ++i) manifest << (i ? "," : "") << t.shape[i];
    manifest << "]]";
    first = false;
  }
  manifest << "}";
  manifest.close();
  const std::string cmd =
      absl::StrCat("python3 ", MOE_READ_SAFETENSORS_PY, " ", saved->path(), " ", expected, " 2>&1");
  auto run = [&](std::string* out) {
    FILE* p = ::popen(cmd.c_str(), "r");
    char buf[512];
    while (p && std::fgets(buf, sizeof(buf), p)) *out += buf;
    int rc = p ? ::pclose(p) : -1;
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  };
  std::string out;
  int rc = run(&out);
  if (rc == 77) {  // not installed: try PyPI once, as scripts/install-deps would
    std::system(
        "python3 -m pip install -q safetensors numpy >/dev/null 2>&1 || "
        "python3 -m pip install -q --break-system-packages safetensors numpy >/dev/null 2>&1");
    out.clear();
    rc = run(&out);
  }
  if (rc == 77) GTEST_SKIP() << "Python safetensors could not be installed: " << out;
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok:"), std::string::npos) << out;
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// --- Reflection ---------------------------------------------------------------------------
// grpc++ ships no reflection client, so this speaks grpc.reflection.v1alpha by hand through the
// generic stub: a ServerReflectionRequest with list_services = "" (field 7) and a check that the
// answer names moe.v1.ExpertService and the health service.
class RawBidi : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RawBidi(const std::string& request) {
    grpc::Slice slice(request);
    request_ = grpc::ByteBuffer(&slice, 1);
  }
  void Start() {
    StartWrite(&request_);
    StartRead(&response_);
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (ok) StartWritesDone();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    std::vector<grpc::Slice> slices;
    response_.Dump(&slices);
    for (const auto& s : slices) text_.append(reinterpret_cast<const char*>(s.begin()), s.size());
    StartRead(&response_);
  }
  void OnDone(const grpc::Status& status) override { done_.set_value(status); }
  std::future<grpc::Status> done() { return done_.get_future(); }
  const std::string& text() const { return text_; }
  grpc::ClientContext ctx;

 private:
  grpc::ByteBuffer request_, response_;
  std::string text_;
  std::promise<grpc::Status> done_;
};

TEST(ServiceTest, ServesReflectionAndHealth) {
  Loopback lb = Start();
  ASSERT_TRUE(lb.conn);
  EXPECT_TRUE(lb.conn->Health().ok());
  auto channel = grpc::CreateChannel(lb.target(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  RawBidi call(std::string("\x3a\x00", 2));
  call.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto done = call.done();
  stub.PrepareBidiStreamingCall(
      &call.ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", {}, &call);
  call.Start();
  grpc::Status st = done.get();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_NE(call.text().find("moe.v1.ExpertService"), std::string::npos) << call.text();
  EXPECT_NE(call.text().find("grpc.health.v1.Health"), std::string::npos) << call.text();
}

// Forward and Backward are raw methods on the server (wire/raw_message.h): bytes that are not a
// message get InvalidArgument naming the message type, and the server keeps serving.
TEST(ServiceTest, MalformedMicroBatchBytesAreInvalidArgument) {
  Loopback lb = Start();
  ASSERT_TRUE(lb.conn);
  auto channel = grpc::CreateChannel(lb.target(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  struct Case {
    const char* method;
    std::string bytes;
    const char* type;
  };
  const Case cases[] = {
      // x: 5 bytes of tensor announcing 16 bytes of data.
      {"/moe.v1.ExpertService/Forward", std::string("\x22\x05\x1a\x10\x61\x62\x63", 7),
       "moe.v1.ForwardRequest"},
      // a stray end of group.
      {"/moe.v1.ExpertService/Backward", std::string("\x0c", 1), "moe.v1.BackwardRequest"}};
  for (const Case& c : cases) {
    RawBidi call(c.bytes);
    call.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto done = call.done();
    stub.PrepareBidiStreamingCall(&call.ctx, c.method, {}, &call);
    call.Start();
    ExpectStatus(done.get(), grpc::StatusCode::INVALID_ARGUMENT, c.type);
  }
  EXPECT_TRUE(lb.conn->Health().ok());
}

// --- Recompute memory mode ------------------------------------------------------------------
// LayerConfig::recompute_h crosses the wire both ways (create, then the layer info), and a layer
// created with it keeps fewer saved-context bytes (exactly the H rows) for bitwise the same
// results as a keep-H layer.
TEST(ServiceTest, RecomputeHRoundTripsAndShrinksSavedContexts) {
  LayerConfig keep = SmallConfig(RoutingMode::kClient);
  LayerConfig recompute = keep;
  recompute.recompute_h = true;
  auto back = wire::LayerConfigFromProto(wire::LayerConfigToProto(recompute));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->recompute_h);
  EXPECT_FALSE(wire::LayerConfigToProto(keep).recompute_h());

  Loopback lb = Start();
  ASSERT_TRUE(lb.conn);
  auto rk = RemoteLayer::Create(lb.conn, "keep-h", keep);
  auto rr = RemoteLayer::Create(lb.conn, "recompute-h", recompute);
  ASSERT_TRUE(rk.ok()) << rk.status();
  ASSERT_TRUE(rr.ok()) << rr.status();
  auto ik = lb.conn->GetLayer("keep-h");
  auto ir = lb.conn->GetLayer("recompute-h");
  ASSERT_TRUE(ik.ok() && ir.ok());
  EXPECT_FALSE(ik->config().recompute_h());
  EXPECT_TRUE(ir->config().recompute_h());

  std::mt19937 rng(17);
  const int64_t tokens = 29;
  Tensor x = RandomFloat(rng, {tokens, keep.d_model}), ids, w;
  RandomRouting(rng, tokens, keep, &ids, &w);
  Tensor dout = RandomFloat(rng, {tokens, keep.d_model});
  auto fk = (*rk)->Forward(x.view(), ids.view(), w.view()).get();
  auto fr = (*rr)->Forward(x.view(), ids.view(), w.view()).get();
  ASSERT_TRUE(fk.ok()) << fk.status();
  ASSERT_TRUE(fr.ok()) << fr.status();
  EXPECT_EQ(fk->out.bytes, fr->out.bytes);
  ik = lb.conn->GetLayer("keep-h");
  ir = lb.conn->GetLayer("recompute-h");
  ASSERT_TRUE(ik.ok() && ir.ok());
  EXPECT_EQ(ir->saved_contexts(), 1);
  // Every (t,k) lands on a local expert (no shard): H is T*K rows of [W1 x, W3 x], fp32.
  EXPECT_EQ(ik->saved_context_bytes() - ir->saved_context_bytes(),
            tokens * keep.top_k * 2 * keep.d_hidden * 4);
  auto bk = (*rk)->Backward(fk->context_id, dout.view()).get();
  auto br = (*rr)->Backward(fr->context_id, dout.view()).get();
  ASSERT_TRUE(bk.ok()) << bk.status();
  ASSERT_TRUE(br.ok()) << br.status();
  EXPECT_EQ(bk->dx.bytes, br->dx.bytes);
  EXPECT_EQ(bk->dweights.bytes, br->dweights.bytes);
}

}  // namespace
}  // namespace moe
