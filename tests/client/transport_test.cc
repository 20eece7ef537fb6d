// ClientOptions::transport against loopback servers: shared memory regions give the bits of TCP
// (client and server routing, micro-batches in flight, returned results and host destinations);
// kAuto takes TCP, and says why, where the server refuses regions or is not on this host;
// kSharedMemory fails to connect there; destinations are checked; device tensors are refused by
// a client built without CUDA, and by a sharded layer.
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/data_plane.h"
#include "client/device.h"
#include "moe/v1/moe.grpc.pb.h"
#include "tests/client/test_util.h"

namespace moe {
namespace {

using testing_util::RandomFloat;
using testing_util::StartServer;
using testing_util::Target;

// An ExpertService that opens sessions and answers every other call UNIMPLEMENTED, as a server
// that predates registered regions does.
class SessionOnlyService final : public v1::ExpertService::Service {
 public:
  grpc::Status OpenSession(grpc::ServerContext* ctx, const v1::OpenSessionRequest*,
                           grpc::ServerWriter<v1::SessionEvent>* writer) override {
    v1::SessionEvent event;
    event.set_session_id("s1");
    writer->Write(event);
    while (!ctx->IsCancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return grpc::Status::OK;
  }
};

struct SessionOnlyServer {
  SessionOnlyService service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

std::unique_ptr<SessionOnlyServer> StartSessionOnlyServer() {
  auto s = std::make_unique<SessionOnlyServer>();
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &s->port);
  builder.RegisterService(&s->service);
  s->server = builder.BuildAndStart();
  return s->server ? std::move(s) : nullptr;
}

client::ClientOptions WithTransport(client::Transport t, std::vector<std::string>* log) {
  client::ClientOptions o;
  o.transport = t;
  o.chunk_bytes = 3000;  // several messages per micro-batch over TCP
  o.log = [log](const std::string& line) { log->push_back(line); };
  return o;
}

// A small layer with client routing: d 64, h 32, 4 experts, top 2.
LayerConfig ClientRouted() {
  LayerConfig c = testing_util::ServerRoutedConfig(64, 32);
  c.routing = RoutingMode::kClient;
  return c;
}

std::string Joined(const std::vector<std::string>& lines) {
  std::string all;
  for (const std::string& l : lines) all += l + "\n";
  return all;
}

// Two layers of one config and seed, one through each connection, trained the same way: every
// result must be bitwise equal. Three Forwards in flight per step, their Backwards one at a
// time; the shared memory side also writes results into host destinations.
void ExpectSameTraining(std::shared_ptr<client::Connection> tcp_conn,
                        std::shared_ptr<client::Connection> shm_conn, RoutingMode routing,
                        const std::string& tag) {
  const bool client_routing = routing == RoutingMode::kClient;
  LayerConfig config = testing_util::ServerRoutedConfig(96, 32);
  config.routing = routing;
  config.seed = 5;
  auto tcp_layer = client::RemoteLayer::Create(tcp_conn, "tcp" + tag, config);
  auto shm_layer = client::RemoteLayer::Create(shm_conn, "shm" + tag, config);
  ASSERT_TRUE(tcp_layer.ok() && shm_layer.ok()) << tcp_layer.status() << shm_layer.status();
  std::mt19937 rng(29);
  constexpr int kInFlight = 3;
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(testing::Message() << tag << " step " << step);
    std::vector<Tensor> x(kInFlight), ids(kInFlight), w(kInFlight), dout(kInFlight);
    std::vector<std::future<absl::StatusOr<client::ForwardOutput>>> tf, sf;
    std::vector<Tensor> out(kInFlight);
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t rows = 37 + 11 * i;  // a different size each: the slots grow
      x[i] = RandomFloat(rng, {rows, config.d_model});
      dout[i] = RandomFloat(rng, {rows, config.d_model});
      if (client_routing) {
        testing_util::RandomRouting(rng, rows, config.top_k, 0,
                                    static_cast<int32_t>(config.num_experts), &ids[i], &w[i]);
      }
      tf.push_back((*tcp_layer)->Forward(x[i].view(), ids[i].view(), w[i].view()));
      if (i == 0) {
        // Into a host destination, poisoned first so an unwritten byte shows.
        out[i] = Tensor::Zeros(DType::kFloat32, {rows, config.d_model});
        std::fill(out[i].bytes.begin(), out[i].bytes.end(), std::byte{0x7f});
        sf.push_back((*shm_layer)->ForwardInto(x[i].view(), ids[i].view(), w[i].view(),
                                               out[i].mutable_view()));
      } else {
        sf.push_back((*shm_layer)->Forward(x[i].view(), ids[i].view(), w[i].view()));
      }
    }
    std::vector<uint64_t> tcp_ctx, shm_ctx;
    for (int i = 0; i < kInFlight; ++i) {
      auto t = tf[i].get();
      auto s = sf[i].get();
      ASSERT_TRUE(t.ok() && s.ok()) << t.status() << " " << s.status();
      const Tensor& s_out = i == 0 ? out[i] : s->out;
      if (i == 0) EXPECT_TRUE(s->out.empty()) << "a result written to its destination";
      EXPECT_EQ(s_out.shape, t->out.shape);
      EXPECT_TRUE(s_out.bytes == t->out.bytes) << "micro-batch " << i;
      EXPECT_TRUE(s->expert_ids.bytes == t->expert_ids.bytes);
      EXPECT_TRUE(s->weights.bytes == t->weights.bytes);
      EXPECT_EQ(s->aux_loss, t->aux_loss);
      tcp_ctx.push_back(t->context_id);
      shm_ctx.push_back(s->context_id);
    }
    // Inference, the tensors handed over.
    auto ti = (*tcp_layer)->Forward(Tensor(x[1]), Tensor(ids[1]), Tensor(w[1]), false).get();
    auto si = (*shm_layer)->Forward(Tensor(x[1]), Tensor(ids[1]), Tensor(w[1]), false).get();
    ASSERT_TRUE(ti.ok() && si.ok()) << ti.status() << " " << si.status();
    EXPECT_TRUE(si->out.bytes == ti->out.bytes);
    // Backwards one at a time: the weight gradients sum over them in the order they run.
    Tensor dx0 = Tensor::Zeros(DType::kFloat32, dout[0].shape), dw0;
    std::fill(dx0.bytes.begin(), dx0.bytes.end(), std::byte{0x7f});
    if (client_routing) dw0 = Tensor::Zeros(DType::kFloat32, {dout[0].shape[0], config.top_k});
    for (int i = 0; i < kInFlight; ++i) {
      auto tb = (*tcp_layer)->Backward(tcp_ctx[i], dout[i].view());
      auto sb = i == 0 ? (*shm_layer)->BackwardInto(shm_ctx[i], dout[i].view(),
                                                    dx0.mutable_view(),
                                                    client_routing ? dw0.mutable_view()
                                                                   : MutableTensorView())
                       : (*shm_layer)->Backward(shm_ctx[i], dout[i].view());
      auto t = tb.get();
      auto s = sb.get();
      ASSERT_TRUE(t.ok() && s.ok()) << t.status() << " " << s.status();
      EXPECT_TRUE((i == 0 ? dx0 : s->dx).bytes == t->dx.bytes) << "micro-batch " << i;
      if (client_routing) {
        EXPECT_TRUE((i == 0 ? dw0 : s->dweights).bytes == t->dweights.bytes);
      }
    }
    auto ts = (*tcp_layer)->Step(), ss = (*shm_layer)->Step();
    ASSERT_TRUE(ts.ok() && ss.ok());
    EXPECT_EQ(ss->grad_norm, ts->grad_norm);
  }
  auto tw = (*tcp_layer)->ExportWeights(true), sw = (*shm_layer)->ExportWeights(true);
  ASSERT_TRUE(tw.ok() && sw.ok());
  for (const auto& [name, t] : *tw) EXPECT_TRUE(sw->at(name).bytes == t.bytes) << name;
}

TEST(TransportTest, SharedMemoryGivesTheBitsOfTcp) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  std::vector<std::string> log;
  auto tcp = client::Connection::Connect(Target(*s), WithTransport(client::Transport::kTcp, &log));
  auto shm = client::Connection::Connect(Target(*s),
                                         WithTransport(client::Transport::kSharedMemory, &log));
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  ASSERT_TRUE(shm.ok()) << shm.status();
  EXPECT_EQ((*tcp)->transport(), client::Transport::kTcp);
  EXPECT_EQ((*shm)->transport(), client::Transport::kSharedMemory);
  ExpectSameTraining(*tcp, *shm, RoutingMode::kClient, "-client");
  ExpectSameTraining(*tcp, *shm, RoutingMode::kServer, "-server");
}

// kAuto on loopback takes shared memory when the server registers a region, and says so.
TEST(TransportTest, AutoTakesSharedMemoryOnThisHost) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  std::vector<std::string> log;
  auto conn = client::Connection::Connect(Target(*s),
                                          WithTransport(client::Transport::kAuto, &log));
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_EQ((*conn)->transport(), client::Transport::kSharedMemory) << Joined(log);
  ASSERT_EQ(log.size(), 1u) << Joined(log);
  EXPECT_NE(log[0].find("shared memory"), std::string::npos) << log[0];
}

// A server that answers the region calls UNIMPLEMENTED: kAuto falls back to TCP, logging one line
// with the server's answer; kSharedMemory does not connect.
TEST(TransportTest, AutoFallsBackToTcpWhenTheServerRefusesRegions) {
  auto fake = StartSessionOnlyServer();
  ASSERT_TRUE(fake);
  const std::string target = absl::StrCat("127.0.0.1:", fake->port);
  std::vector<std::string> log;
  auto conn = client::Connection::Connect(target, WithTransport(client::Transport::kAuto, &log));
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_EQ((*conn)->transport(), client::Transport::kTcp);
  EXPECT_NE((*conn)->transport_reason().find("UNIMPLEMENTED"), std::string::npos)
      << (*conn)->transport_reason();
  ASSERT_EQ(log.size(), 1u) << Joined(log);
  EXPECT_NE(log[0].find("tcp"), std::string::npos) << log[0];
  EXPECT_NE(log[0].find("UNIMPLEMENTED"), std::string::npos) << log[0];

  log.clear();
  auto shm =
      client::Connection::Connect(target, WithTransport(client::Transport::kSharedMemory, &log));
  EXPECT_EQ(shm.status().code(), absl::StatusCode::kUnimplemented) << shm.status();
  EXPECT_NE(shm.status().message().find("transport: "), std::string::npos) << shm.status();
}

// Without a session the server cannot own a region: kAuto takes TCP (and Forward works),
// kSharedMemory fails at Connect naming the option.
TEST(TransportTest, RegionsNeedASession) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  std::vector<std::string> log;
  client::ClientOptions o = WithTransport(client::Transport::kAuto, &log);
  o.open_session = false;
  auto conn = client::Connection::Connect(Target(*s), o);
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_EQ((*conn)->transport(), client::Transport::kTcp);
  EXPECT_NE((*conn)->transport_reason().find("open_session"), std::string::npos)
      << (*conn)->transport_reason();
  auto layer = client::RemoteLayer::Create(*conn, "sessionless", testing_util::ServerRoutedConfig(
                                                                      32, 16));
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::mt19937 rng(3);
  Tensor x = RandomFloat(rng, {5, 32});
  auto f = (*layer)->Forward(x.view(), {}, {}, /*training=*/false).get();
  EXPECT_TRUE(f.ok()) << f.status();

  o.transport = client::Transport::kSharedMemory;
  auto shm = client::Connection::Connect(Target(*s), o);
  EXPECT_EQ(shm.status().code(), absl::StatusCode::kFailedPrecondition) << shm.status();
  EXPECT_NE(shm.status().message().find("open_session"), std::string::npos) << shm.status();
}

TEST(TransportTest, OnlyLoopbackAndUnixTargetsAreThisHost) {
  for (const char* local : {"localhost:50051", "127.0.0.1:50051", "127.3.4.5:1", "[::1]:50051",
                            "ipv4:127.0.0.1:50051", "ipv6:[::1]:50051", "dns:///localhost:50051",
                            "unix:/tmp/moe.sock", "unix-abstract:moe", "LOCALHOST:1", "::1"}) {
    EXPECT_TRUE(client::IsLocalTarget(local)) << local;
  }
  for (const char* remote : {"10.0.0.5:50051", "gpu-box:50051", "dns:///gpu-box:50051",
                             "[2001:db8::1]:50051", "128.0.0.1:1", "localhost.example.com:1",
                             "ipv4:10.1.2.3:50051", ""}) {
    EXPECT_FALSE(client::IsLocalTarget(remote)) << remote;
  }
}

// Over TCP a call with destinations writes them and returns no tensor for them; a destination
// of the wrong dtype or shape is refused before anything is sent.
TEST(TransportTest, DestinationsOverTcp) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  auto conn = client::Connection::Connect(Target(*s));
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto layer = client::RemoteLayer::Create(*conn, "dest", ClientRouted());
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::mt19937 rng(8);
  Tensor x = RandomFloat(rng, {19, 64}), ids, w;
  testing_util::RandomRouting(rng, 19, 2, 0, 4, &ids, &w);
  auto plain = (*layer)->Forward(x.view(), ids.view(), w.view(), false).get();
  ASSERT_TRUE(plain.ok()) << plain.status();
  Tensor out = Tensor::Zeros(DType::kFloat32, {19, 64});
  auto into =
      (*layer)->ForwardInto(x.view(), ids.view(), w.view(), out.mutable_view(), nullptr, false)
          .get();
  ASSERT_TRUE(into.ok()) << into.status();
  EXPECT_TRUE(into->out.empty());
  EXPECT_TRUE(out.bytes == plain->out.bytes);
  EXPECT_TRUE(into->expert_ids.bytes == plain->expert_ids.bytes);

  Tensor wrong = Tensor::Zeros(DType::kFloat32, {18, 64});
  absl::Status st =
      (*layer)->ForwardInto(x.view(), ids.view(), w.view(), wrong.mutable_view()).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message().rfind("out: ", 0), 0u) << st;
  Tensor dout = RandomFloat(rng, {19, 64});
  // dweights of the wrong dtype, or of another K than the layer's.
  for (Tensor bad_dw : {Tensor::Zeros(DType::kInt32, {19, 2}), Tensor::Zeros(DType::kFloat32,
                                                                             {19, 3})}) {
    st = (*layer)->BackwardInto(1, dout.view(), {}, bad_dw.mutable_view()).get().status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_EQ(st.message().rfind("dweights: ", 0), 0u) << st;
  }
}

// A client built without CUDA refuses device tensors and destinations, naming the field, before
// anything is sent; a sharded layer refuses them in any build.
TEST(TransportTest, DeviceTensorsAreRefusedWithoutCuda) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  auto conn = client::Connection::Connect(Target(*s));
  ASSERT_TRUE(conn.ok()) << conn.status();
  const LayerConfig config = ClientRouted();
  std::mt19937 rng(9);
  Tensor x = RandomFloat(rng, {7, 64}), ids, w;
  testing_util::RandomRouting(rng, 7, 2, 0, 4, &ids, &w);
  TensorView on_gpu = x.view();
  on_gpu.location = MemoryLocation::Cuda(0);

  auto sharded = client::ShardedLayer::Create({*conn}, "sharded", config);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  absl::Status st = (*sharded)->Forward(on_gpu, ids.view(), w.view()).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message().rfind("x: ", 0), 0u) << st;

  if (client::device::Built()) GTEST_SKIP() << "this client is built with CUDA";
  EXPECT_EQ((*conn)->device_transport(), client::DeviceTransport::kUnavailable);
  auto layer = client::RemoteLayer::Create(*conn, "host-only", config);
  ASSERT_TRUE(layer.ok()) << layer.status();
  st = (*layer)->Forward(on_gpu, ids.view(), w.view()).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message().rfind("x: ", 0), 0u) << st;
  EXPECT_NE(st.message().find("without CUDA"), std::string::npos) << st;
  Tensor out = Tensor::Zeros(DType::kFloat32, {7, 64});
  MutableTensorView out_on_gpu = out.mutable_view();
  out_on_gpu.location = MemoryLocation::Cuda(0);
  st = (*layer)->ForwardInto(x.view(), ids.view(), w.view(), out_on_gpu).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message().rfind("out: ", 0), 0u) << st;
  TensorView dout_on_gpu = on_gpu;
  st = (*layer)->Backward(1, dout_on_gpu).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message().rfind("dout: ", 0), 0u) << st;
}

}  // namespace
}  // namespace moe
