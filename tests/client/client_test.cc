// moe::client against a loopback server: errors carry the server's code and message, every
// call has a deadline, health checks, create/attach semantics, and the chunk planner.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <vector>

#include "wire/wire.h"
#include "server/metrics.h"
#include "tests/client/test_util.h"

namespace moe {
namespace {

using testing_util::RandomFloat;
using testing_util::StartServer;
using testing_util::Target;

LayerConfig Config() { return testing_util::ServerRoutedConfig(256, 64); }

TEST(ClientTest, ErrorsCarryTheServersCodeAndMessage) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  auto c = client::Connection::Connect(Target(*s));
  ASSERT_TRUE(c.ok());
  absl::Status st = (*c)->GetLayer("missing-layer").status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(st.message().find("missing-layer"), std::string::npos) << st;
  EXPECT_EQ(client::RemoteLayer::Attach(*c, "missing-layer").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ClientTest, ConnectingToNothingIsUnavailable) {
  client::ClientOptions o;
  o.timeout = std::chrono::milliseconds(300);
  auto c = client::Connection::Connect("127.0.0.1:1", o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
}

// A second server on a port already served fails to start instead of sharing the port (gRPC's
// SO_REUSEPORT default would split a client's connections between the two).
// A token gRPC could not send as metadata is refused before anything is sent; one that the
// server does not hold is the server's UNAUTHENTICATED, from OpenSession.
TEST(ClientTest, TokensAreCheckedAtConnect) {
  client::ClientOptions o;
  o.timeout = std::chrono::milliseconds(300);
  o.token = "abcdefghijklmnop\n";
  auto bad = client::Connection::Connect("127.0.0.1:1", o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("token: "), std::string::npos) << bad.status();

  server::ServerOptions so = testing_util::LoopbackOptions();
  so.tokens_file = so.checkpoint_dir + "/tokens";
  std::ofstream(so.tokens_file) << "alice alice-0123456789abcdef\n";
  auto s = StartServer(so);
  ASSERT_TRUE(s);
  o.timeout = std::chrono::seconds(10);
  o.token = "wrong-0123456789abcdef";
  auto refused = client::Connection::Connect(Target(*s), o);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  EXPECT_NE(refused.status().message().find("OpenSession on "), std::string::npos);
  o.token = "alice-0123456789abcdef";
  auto alice = client::Connection::Connect(Target(*s), o);
  ASSERT_TRUE(alice.ok()) << alice.status();
  EXPECT_TRUE((*alice)->ListLayers().ok());
}

TEST(ClientTest, ASecondServerOnABusyPortDoesNotStart) {
  auto first = StartServer();
  ASSERT_TRUE(first);
  server::ServerOptions o = testing_util::LoopbackOptions();
  o.port = first->port();
  auto second = server::Server::Start(o);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_NE(second.status().message().find("port"), std::string::npos) << second.status();
}

TEST(ClientTest, EveryCallHasADeadline) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  auto setup = client::Connection::Connect(Target(*s));
  ASSERT_TRUE(setup.ok());
  ASSERT_TRUE((*setup)->CreateLayer("l", Config()).ok());
  client::ClientOptions o;
  o.timeout = std::chrono::milliseconds(200);
  auto c = client::Connection::Connect(Target(*s), o);
  ASSERT_TRUE(c.ok()) << c.status();
  // 40k tokens x 256 floats (40 MB) cannot travel and compute in 200 ms on this machine.
  std::mt19937 rng(1);
  Tensor x = RandomFloat(rng, {40000, 256});
  auto r = (*c)->Forward("l", 1, false, x.view(), {}, {}).get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  // The server is fine afterwards.
  Tensor small = RandomFloat(rng, {4, 256});
  EXPECT_TRUE((*setup)->Forward("l", 0, false, small.view(), {}, {}).get().ok());
}

TEST(ClientTest, HealthChecks) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  auto c = client::Connection::Connect(Target(*s));
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE((*c)->Health().ok());
  EXPECT_TRUE((*c)->Health("moe.v1.ExpertService").ok());
  EXPECT_EQ((*c)->Health("no.such.Service").code(), absl::StatusCode::kNotFound);
}

TEST(ClientTest, CreateAttachesOnlyToAnIdenticalLayer) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  auto c = client::Connection::Connect(Target(*s));
  ASSERT_TRUE(c.ok());
  auto a = client::RemoteLayer::Create(*c, "l", Config());
  ASSERT_TRUE(a.ok());
  auto b = client::RemoteLayer::Create(*c, "l", Config());
  EXPECT_TRUE(b.ok()) << b.status();
  LayerConfig other = Config();
  other.d_hidden = 32;
  EXPECT_EQ(client::RemoteLayer::Create(*c, "l", other).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto list = (*c)->ListLayers();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ(list->at(0).config().d_hidden(), 64);
  EXPECT_TRUE((*c)->DeleteLayer("l").ok());
  EXPECT_EQ((*c)->DeleteLayer("l").code(), absl::StatusCode::kNotFound);
}

// Established TCP connections to local port `port`, counted at the client's end: both ends of a
// loopback connection are listed, and the client's has the server's port as its remote. gRPC
// may use IPv6 sockets with v4-mapped addresses, so both tables count.
int ConnectionsTo(int port) {
  int n = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const size_t colon = remote.find(':');
      if (state == "01" && colon != std::string::npos &&
          std::stoi(remote.substr(colon + 1), nullptr, 16) == port) {
        ++n;
      }
    }
  }
  return n;
}

// ClientOptions::connections: Forward and Backward calls take that many TCP connections in turn
// (one gRPC channel's calls would all share one), and every one gives the same bits.
TEST(ClientTest, MicroBatchesTakeTheConnectionsInTurn) {
  for (int connections : {1, 3}) {
    auto s = StartServer();
    ASSERT_TRUE(s);
    client::ClientOptions options;
    options.connections = connections;
    auto c = client::Connection::Connect(Target(*s), options);
    ASSERT_TRUE(c.ok()) << c.status();
    auto layer = client::RemoteLayer::Create(*c, "l", Config());
    ASSERT_TRUE(layer.ok()) << layer.status();
    std::mt19937 rng(7);
    Tensor x = RandomFloat(rng, {33, Config().d_model});
    std::vector<std::future<absl::StatusOr<client::ForwardOutput>>> calls;
    for (int i = 0; i < 2 * connections; ++i) {
      calls.push_back((*layer)->Forward(x.view(), {}, {}, /*training=*/false));
    }
    std::vector<Tensor> outs;
    for (auto& f : calls) {
      auto r = f.get();
      ASSERT_TRUE(r.ok()) << r.status();
      outs.push_back(std::move(r->out));
    }
    for (const Tensor& out : outs) EXPECT_TRUE(out.bytes == outs[0].bytes);
    EXPECT_EQ(ConnectionsTo(s->port()), connections) << "connections = " << connections;
  }
  client::ClientOptions bad;
  bad.connections = 0;
  EXPECT_EQ(client::Connection::Connect("127.0.0.1:1", bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Value of counter `name` with label method=`method` on the server, 0 when absent.
double MethodCounter(server::Server& s, const std::string& name, const std::string& method) {
  for (const auto& family : s.metrics().registry()->Collect()) {
    if (family.name != name) continue;
    for (const auto& m : family.metric) {
      for (const auto& label : m.label) {
        if (label.name == "method" && label.value == method) return m.counter.value;
      }
    }
  }
  return 0;
}

// ClientOptions::stripe_bytes: a micro-batch that large travels as several streams on several
// connections and the server runs it once, so training through striped calls gives the bits of
// whole ones, lent as views or handed over, and errors are the server's, not the cancellations
// of the sibling streams.
TEST(ClientTest, StripedMicroBatchesGiveTheBitsOfWholeOnes) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  client::ClientOptions whole_options, striped_options;
  whole_options.stripe_bytes = 0;
  striped_options.connections = 3;
  striped_options.stripe_bytes = 4096;
  striped_options.chunk_bytes = 3000;  // several messages per stream
  auto whole_conn = client::Connection::Connect(Target(*s), whole_options);
  auto striped_conn = client::Connection::Connect(Target(*s), striped_options);
  ASSERT_TRUE(whole_conn.ok() && striped_conn.ok());
  std::mt19937 rng(17);
  // Client routing sends ids and weights in every stream; server routing returns them per stream.
  for (RoutingMode routing : {RoutingMode::kClient, RoutingMode::kServer}) {
    const bool client_routing = routing == RoutingMode::kClient;
    SCOPED_TRACE(client_routing ? "client routing" : "server routing");
    LayerConfig config = Config();
    config.routing = routing;
    config.seed = 21;
    const std::string tag = client_routing ? "-client" : "-server";
    auto whole = client::RemoteLayer::Create(*whole_conn, "whole" + tag, config);
    auto striped = client::RemoteLayer::Create(*striped_conn, "striped" + tag, config);
    ASSERT_TRUE(whole.ok() && striped.ok());
    for (int step = 0; step < 2; ++step) {
      // 53 rows of 1 KiB: 3 streams of 18, 18 and 17 rows.
      Tensor x = RandomFloat(rng, {53, config.d_model}), ids, w;
      testing_util::RandomRouting(rng, 53, config.top_k, 0,
                                  static_cast<int32_t>(config.num_experts), &ids, &w);
      const TensorView idv = client_routing ? ids.view() : TensorView{};
      const TensorView wv = client_routing ? w.view() : TensorView{};
      Tensor dout = RandomFloat(rng, {53, config.d_model});
      auto wf = (*whole)->Forward(x.view(), idv, wv).get();
      auto sf = (*striped)->Forward(x.view(), idv, wv).get();
      ASSERT_TRUE(wf.ok() && sf.ok()) << wf.status() << " " << sf.status();
      EXPECT_EQ(sf->out.shape, wf->out.shape);
      EXPECT_TRUE(sf->out.bytes == wf->out.bytes) << "step " << step;
      EXPECT_EQ(sf->expert_ids.shape, wf->expert_ids.shape);
      EXPECT_TRUE(sf->expert_ids.bytes == wf->expert_ids.bytes);
      EXPECT_TRUE(sf->weights.bytes == wf->weights.bytes);
      EXPECT_EQ(sf->aux_loss, wf->aux_loss);
      auto wi = (*whole)->Forward(x.view(), idv, wv, /*training=*/false).get();
      auto si = (*striped)->Forward(x.view(), idv, wv, /*training=*/false).get();
      ASSERT_TRUE(wi.ok() && si.ok()) << wi.status() << " " << si.status();
      EXPECT_TRUE(si->out.bytes == wi->out.bytes);
      EXPECT_EQ(si->context_id, 0u);
      // Handing the tensors over instead of lending views gives the same bits, whole and striped.
      Tensor ids_owned = client_routing ? ids : Tensor(), w_owned = client_routing ? w : Tensor();
      auto wo = (*whole)->Forward(Tensor(x), Tensor(ids_owned), Tensor(w_owned), false).get();
      auto so =
          (*striped)->Forward(Tensor(x), std::move(ids_owned), std::move(w_owned), false).get();
      ASSERT_TRUE(wo.ok() && so.ok()) << wo.status() << " " << so.status();
      EXPECT_TRUE(wo->out.bytes == wi->out.bytes);
      EXPECT_TRUE(so->out.bytes == wi->out.bytes);
      auto wb = (*whole)->Backward(wf->context_id, dout.view()).get();
      auto sb = (*striped)->Backward(sf->context_id, Tensor(dout)).get();
      ASSERT_TRUE(wb.ok() && sb.ok()) << wb.status() << " " << sb.status();
      EXPECT_EQ(sb->dx.shape, wb->dx.shape);
      EXPECT_TRUE(sb->dx.bytes == wb->dx.bytes) << "step " << step;
      EXPECT_TRUE(sb->dweights.bytes == wb->dweights.bytes) << "step " << step;
      auto ws = (*whole)->Step(), ss = (*striped)->Step();
      ASSERT_TRUE(ws.ok() && ss.ok());
      EXPECT_EQ(ss->grad_norm, ws->grad_norm);
      EXPECT_EQ(ss->tokens_per_expert, ws->tokens_per_expert);
    }
    auto ww = (*whole)->ExportWeights(true), sw = (*striped)->ExportWeights(true);
    ASSERT_TRUE(ww.ok() && sw.ok());
    for (const auto& [name, t] : *ww) EXPECT_TRUE(sw->at(name).bytes == t.bytes) << name;
  }
  EXPECT_EQ(MethodCounter(*s, "moe_striped_micro_batches_total", "Forward"), 12);
  EXPECT_EQ(MethodCounter(*s, "moe_striped_micro_batches_total", "Backward"), 4);
  // A striped Backward of an unknown context fails on every stream with the server's NotFound.
  Tensor dout = RandomFloat(rng, {53, Config().d_model});
  absl::Status st = (*striped_conn)->Backward("striped-client", 12345, dout.view()).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_NE(st.message().find("context_id"), std::string::npos) << st;
}

TEST(WireTest, PlanChunksCoversEveryByteOnceWithinTheLimit) {
  for (size_t limit : {1u, 7u, 8u, 64u}) {
    const std::vector<size_t> sizes = {10, 0, 25, 3};
    auto plan = wire::PlanChunks(sizes, limit);
    std::vector<size_t> next(sizes.size(), 0);
    for (const auto& message : plan) {
      size_t total = 0;
      for (const auto& p : message) {
        EXPECT_EQ(p.offset, next[p.tensor]) << "limit " << limit;
        next[p.tensor] += p.size;
        total += p.size;
      }
      EXPECT_LE(total, limit);
    }
    EXPECT_EQ(next, sizes) << "limit " << limit;
  }
  EXPECT_EQ(wire::PlanChunks({0, 0}, 16).size(), 1u);  // an empty micro-batch is one message
}

TEST(WireTest, AssemblerNamesTheFieldOnAByteMismatch) {
  wire::TensorAssembler a("dout");
  v1::Tensor chunk;
  wire::SetTensorHeader(DType::kFloat32, {2, 3}, &chunk);
  chunk.set_data(std::string(20, 'x'));
  ASSERT_TRUE(a.Add(chunk).ok());
  absl::Status st = a.Finish().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("dout"), std::string::npos) << st;
  chunk.set_data(std::string(4, 'x'));
  chunk.set_offset(20);
  ASSERT_TRUE(a.Add(chunk).ok());
  EXPECT_TRUE(a.Finish().ok());
  v1::Tensor other;
  wire::SetTensorHeader(DType::kFloat32, {3, 3}, &other);
  EXPECT_EQ(a.Add(other).code(), absl::StatusCode::kInvalidArgument);
}

// kClaimedAtOnce (the client's receivers) and kClaimedOnceAnEighthArrived (the server's) reserve
// the claimed size; the result and every check stay those of the default assembler. A claim past
// the 4 GiB cap is not reserved (the tensor is then short at Finish); an overflowing or negative
// one is refused on its first chunk. Neither throws nor allocates.
TEST(WireTest, ReservingAssemblersAssembleAndCheckLikeTheDefault) {
  using Sizing = wire::TensorAssembler::Sizing;
  for (Sizing sizing :
       {Sizing::kGrow, Sizing::kClaimedAtOnce, Sizing::kClaimedOnceAnEighthArrived}) {
    SCOPED_TRACE(static_cast<int>(sizing));
    // 2048 bytes in chunks of 100 (the last one 48): the eighth arrives mid-stream.
    wire::TensorAssembler a("out", sizing);
    v1::Tensor chunk;
    wire::SetTensorHeader(DType::kFloat32, {16, 32}, &chunk);
    std::string all;
    for (int i = 0; all.size() < 2048; ++i) {
      chunk.set_data(std::string(std::min<size_t>(100, 2048 - all.size()), static_cast<char>(i)));
      chunk.set_offset(static_cast<int64_t>(all.size()));
      all += chunk.data();
      ASSERT_TRUE(a.Add(chunk).ok());
    }
    absl::StatusOr<Tensor> t = a.Finish();
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->bytes.size(), all.size());
    EXPECT_EQ(std::memcmp(t->bytes.data(), all.data(), all.size()), 0);

    for (const std::vector<int64_t>& claim :
         std::vector<std::vector<int64_t>>{{int64_t{1} << 40, int64_t{1} << 30},  // overflows
                                           {int64_t{1} << 30, 8},                 // 32 GiB
                                           {-4, 2}}) {
      wire::TensorAssembler b("dx", sizing);
      v1::Tensor c;
      wire::SetTensorHeader(DType::kFloat32, claim, &c);
      c.set_data(std::string(4, 'x'));
      absl::Status st = b.Add(c);
      if (st.ok()) st = b.Finish().status();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("dx"), std::string::npos) << st;
    }
  }
}

}  // namespace
}  // namespace moe
