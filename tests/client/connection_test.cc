// moe::client's Connection and RemoteLayer against a loopback server: errors carry the
// server's code and message, tokens are checked at connect, every call has a deadline, health
// checks, create/attach semantics, micro-batches take the connections in turn, and a Backward's
// aux-loss weight reaches the engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <future>
#include <random>
#include <sstream>
#include <string>
#include <vector>

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

// BackwardOptions::aux_loss_grad reaches the engine over every way a Backward travels (TCP
// whole, TCP striped, shared memory): the router-path gradient in dx is affine in it, an absent
// one means 1, and a non-finite one is refused naming the field without consuming the context.
TEST(ClientTest, AuxLossGradScalesTheAuxGradientAcrossTheWire) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  LayerConfig config = Config();
  config.aux_loss_coef = 0.5;
  config.z_loss_coef = 0.2;
  std::mt19937 rng(9);
  const Tensor x = RandomFloat(rng, {48, config.d_model});
  const Tensor dout = RandomFloat(rng, {48, config.d_model});
  struct Way {
    const char* name;
    client::Transport transport;
    int64_t stripe_bytes;
  };
  for (const Way& way :
       {Way{"tcp", client::Transport::kTcp, 0}, Way{"tcp striped", client::Transport::kTcp, 4096},
        Way{"shared memory", client::Transport::kSharedMemory, 0}}) {
    SCOPED_TRACE(way.name);
    client::ClientOptions options;
    options.transport = way.transport;
    options.stripe_bytes = way.stripe_bytes;
    options.log = [](const std::string&) {};
    auto c = client::Connection::Connect(Target(*s), options);
    ASSERT_TRUE(c.ok()) << c.status();
    auto layer = client::RemoteLayer::Create(*c, "aux", config);
    ASSERT_TRUE(layer.ok()) << layer.status();
    // dx of one training Forward + Backward; the weights do not change (no Step).
    auto dx = [&](const client::BackwardOptions* options) -> std::vector<float> {
      auto fwd = (*layer)->Forward(x.view()).get();
      EXPECT_TRUE(fwd.ok()) << fwd.status();
      if (!fwd.ok()) return {};
      auto bwd = options ? (*layer)->Backward(fwd->context_id, dout.view(), *options).get()
                         : (*layer)->Backward(fwd->context_id, dout.view()).get();
      EXPECT_TRUE(bwd.ok()) << bwd.status();
      if (!bwd.ok()) return {};
      return std::vector<float>(bwd->dx.as<float>(), bwd->dx.as<float>() + bwd->dx.num_elements());
    };
    client::BackwardOptions zero{0.0}, one{1.0}, scaled{0.3};
    const std::vector<float> d0 = dx(&zero), d1 = dx(&one), d3 = dx(&scaled), dd = dx(nullptr);
    ASSERT_EQ(d0.size(), x.num_elements());
    ASSERT_EQ(d1.size(), d0.size());
    ASSERT_EQ(d3.size(), d0.size());
    EXPECT_TRUE(dd == d1) << "an absent aux_loss_grad must mean 1";
    double aux = 0, scale = 0;
    for (size_t i = 0; i < d0.size(); ++i) {
      aux = std::max(aux, std::abs(static_cast<double>(d1[i]) - d0[i]));
      scale = std::max(scale, std::abs(static_cast<double>(d1[i])));
    }
    EXPECT_GT(aux, 1e-4 * scale) << "the aux terms add nothing to check";
    for (size_t i = 0; i < d0.size(); ++i) {
      ASSERT_NEAR(d3[i], d0[i] + 0.3 * (static_cast<double>(d1[i]) - d0[i]), 1e-5 * scale) << i;
    }

    auto fwd = (*layer)->Forward(x.view()).get();
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    client::BackwardOptions bad{std::nan("")};
    auto refused = (*layer)->Backward(fwd->context_id, dout.view(), bad).get();
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_NE(refused.status().message().find("aux_loss_grad"), std::string::npos)
        << refused.status();
    auto retried = (*layer)->Backward(fwd->context_id, dout.view(), scaled).get();
    ASSERT_TRUE(retried.ok()) << retried.status();
    EXPECT_TRUE(std::equal(d3.begin(), d3.end(), retried->dx.as<float>()));
    ASSERT_TRUE((*c)->DeleteLayer("aux").ok());
  }
}

}  // namespace
}  // namespace moe
