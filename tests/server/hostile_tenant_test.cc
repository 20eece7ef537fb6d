// Principals against each other's layers, through a real moe-server on loopback with
// authentication on: every call a foreign principal makes on another's layer is
// PERMISSION_DENIED with a message naming the layer, a call without a token or with a wrong one
// is UNAUTHENTICATED, the owner, a principal the layer is shared with and an admin get what
// they may; and after every refused call the server still serves and the victim layer's
// weights and optimizer state (exported by its owner) are bitwise what they were.
// Also: a client certificate's identity as a principal, the per-principal checkpoint
// directories, CallerPrincipal, and the loopback default of both listening addresses.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "engine/layer.h"
#include "moe/v1/moe.grpc.pb.h"
#include "server/auth.h"
#include "server/options.h"
#include "server/server.h"
#include "tests/server/server_fixture.h"

namespace moe::server_test {
namespace {

using client::Connection;

constexpr char kVictim[] = "victim";
const std::map<std::string, std::string> kTokens = {
    {"alice", "alice-0123456789abcdef0123456789"},  // owns the victim layer
    {"bob", "bob-0123456789abcdef0123456789abc"},   // a stranger to it
    {"carol", "carol-0123456789abcdef0123456789"},  // the victim is shared with her
    {"root", "root-0123456789abcdef0123456789ab"},  // an admin
};

std::string TlsFile(const std::string& name) { return absl::StrCat(MOE_TLS_TESTDATA, "/", name); }

LayerConfig VictimConfig() {
  LayerConfig c;
  c.num_experts = 4;
  c.top_k = 2;
  c.d_model = 8;
  c.d_hidden = 12;
  c.routing = RoutingMode::kServer;
  c.seed = 5;
  c.optimizer.learning_rate = 1e-2;
  return c;
}

// A server with bearer tokens for alice, bob, carol and root (the admin), and a connection
// (with its session) for each. alice owns "victim", shared with carol, trained one step so that
// its optimizer state is not zero.
class HostileTenantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_file_ = TempPath("tokens");
    std::ofstream out(tokens_file_);
    out << "# principal token\n";
    for (const auto& [principal, token] : kTokens) out << principal << " " << token << "\n";
    out.close();
    options_ = LoopbackOptions();
    options_.tokens_file = tokens_file_;
    options_.admin_principals = {"root"};
    server_ = testing_util::StartServer(options_);
    ASSERT_TRUE(server_);
    for (const auto& [principal, token] : kTokens) {
      auto c = ConnectAs(token);
      ASSERT_TRUE(c.ok()) << principal << ": " << c.status();
      conns_[principal] = *c;
    }
    auto info = alice().CreateLayer(kVictim, VictimConfig(), false, {"carol"});
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->owner(), "alice");
    ASSERT_EQ(info->shared_with_size(), 1);
    EXPECT_EQ(info->shared_with(0), "carol");
    ASSERT_TRUE(TrainStep(alice(), kVictim).ok());
    victim_ = Snapshot();
    ASSERT_FALSE(victim_.empty());
  }

  absl::StatusOr<std::shared_ptr<Connection>> ConnectAs(const std::string& token,
                                                        bool open_session = true) {
    client::ClientOptions o = LoopbackClientOptions();
    o.connections = 1;
    o.token = token;
    o.open_session = open_session;
    return Connection::Connect(Target(), o);
  }
  std::string Target() const { return testing_util::Target(*server_); }
  Connection& alice() { return *conns_["alice"]; }
  Connection& bob() { return *conns_["bob"]; }
  Connection& carol() { return *conns_["carol"]; }
  Connection& root() { return *conns_["root"]; }

  absl::Status TrainStep(Connection& c, const std::string& layer) {
    const uint64_t id = c.NextContextId();
    Tensor x = RandomFloat(rng_, {6, VictimConfig().d_model});
    auto fwd = c.Forward(layer, id, true, x.view(), {}, {}).get();
    if (!fwd.ok()) return fwd.status();
    Tensor dout = RandomFloat(rng_, {6, VictimConfig().d_model});
    auto bwd = c.Backward(layer, id, dout.view()).get();
    if (!bwd.ok()) return bwd.status();
    return c.Step(layer).status();
  }

  // The victim's weights and optimizer state, exported by its owner.
  State Snapshot() {
    auto state = alice().ExportWeights(kVictim, /*include_optimizer=*/true);
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? *state : State{};
  }

  // The server still serves its owner, and the victim is bitwise as it was.
  void ExpectVictimIntact(const std::string& after) {
    ASSERT_TRUE(alice().Health().ok()) << "after " << after;
    auto info = alice().GetLayer(kVictim);
    ASSERT_TRUE(info.ok()) << "after " << after << ": " << info.status();
    ExpectSameState(victim_, Snapshot(), after);
  }

  struct Row {
    std::string call;
    std::function<absl::Status()> run;
  };

  // Every call on the victim, made through `c`.
  std::vector<Row> CallsOnVictim(Connection& c, uint64_t owners_context) {
    std::vector<Row> rows = {
        {"GetLayer", [&c] { return c.GetLayer(kVictim).status(); }},
        {"Forward (training)",
         [this, &c] {
           Tensor x = RandomFloat(rng_, {4, VictimConfig().d_model});
           return c.Forward(kVictim, c.NextContextId(), true, x.view(), {}, {}).get().status();
         }},
        {"Forward (inference)",
         [this, &c] {
           Tensor x = RandomFloat(rng_, {4, VictimConfig().d_model});
           return c.Forward(kVictim, 0, false, x.view(), {}, {}).get().status();
         }},
        {"Backward on the owner's context",
         [this, &c, owners_context] {
           Tensor dout = RandomFloat(rng_, {6, VictimConfig().d_model});
           return c.Backward(kVictim, owners_context, dout.view()).get().status();
         }},
        {"Step", [&c] { return c.Step(kVictim).status(); }},
        {"ZeroGrad", [&c] { return c.ZeroGrad(kVictim); }},
        {"ExportWeights", [&c] { return c.ExportWeights(kVictim, false).status(); }},
        {"ExportWeights (optimizer)", [&c] { return c.ExportWeights(kVictim, true).status(); }},
        {"SaveCheckpoint",
         [&c] { return c.SaveCheckpoint(kVictim, "taken.safetensors").status(); }},
        {"CreateLayer attach_if_exists",
         [&c] { return c.CreateLayer(kVictim, VictimConfig(), true).status(); }},
        {"RemoteLayer::Create (attach)",
         [this, &c] {
           return client::RemoteLayer::Create(conns_for(c), kVictim, VictimConfig()).status();
         }},
    };
    for (Row& r : ManageCallsOnVictim(c)) rows.push_back(std::move(r));
    return rows;
  }

  // The calls only the owner and admins may make.
  std::vector<Row> ManageCallsOnVictim(Connection& c) {
    return {
        {"ImportWeights",
         [this, &c] {
           State forged = victim_;
           for (auto& [name, t] : forged) {
             if (name == "w1") t.as<float>()[0] += 1.0f;
           }
           return c.ImportWeights(kVictim, forged);
         }},
        {"LoadCheckpoint over it",
         [this, &c] {
           // The caller's own checkpoint of a layer shaped like the victim.
           const std::string own = absl::StrCat("own-", c.NextContextId());
           absl::Status st = c.CreateLayer(own, VictimConfig()).status();
           if (st.ok()) st = c.SaveCheckpoint(own, "own.safetensors").status();
           if (!st.ok()) return absl::InternalError(absl::StrCat("setup: ", st.ToString()));
           return c.LoadCheckpoint(kVictim, "own.safetensors").status();
         }},
        {"DeleteLayer", [&c] { return c.DeleteLayer(kVictim); }},
    };
  }

  std::shared_ptr<Connection> conns_for(Connection& c) {
    for (auto& [p, conn] : conns_) {
      if (conn.get() == &c) return conn;
    }
    return nullptr;
  }

  // A training context of the owner's, for the Backward rows.
  uint64_t OwnersContext() {
    const uint64_t id = alice().NextContextId();
    Tensor x = RandomFloat(rng_, {6, VictimConfig().d_model});
    auto fwd = alice().Forward(kVictim, id, true, x.view(), {}, {}).get();
    EXPECT_TRUE(fwd.ok()) << fwd.status();
    return id;
  }

  std::string tokens_file_;
  server::ServerOptions options_;
  std::unique_ptr<server::Server> server_;
  std::map<std::string, std::shared_ptr<Connection>> conns_;
  State victim_;
  std::mt19937 rng_{99};
};

TEST_F(HostileTenantTest, ForeignPrincipalIsDeniedEveryCallAndChangesNothing) {
  const uint64_t context = OwnersContext();
  for (const Row& row : CallsOnVictim(bob(), context)) {
    SCOPED_TRACE(row.call);
    absl::Status st = row.run();
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
    EXPECT_NE(st.message().find("\"victim\""), std::string::npos) << st;
    EXPECT_NE(st.message().find("\"bob\""), std::string::npos) << st;
    ExpectVictimIntact(row.call);
  }
  // The owner's context survived the stranger's Backward: it is still there to consume.
  Tensor dout = RandomFloat(rng_, {6, VictimConfig().d_model});
  EXPECT_TRUE(alice().Backward(kVictim, context, dout.view()).get().ok());
}

TEST_F(HostileTenantTest, SharedPrincipalMayReadAndTrainButNotManage) {
  for (const Row& row : ManageCallsOnVictim(carol())) {
    SCOPED_TRACE(row.call);
    absl::Status st = row.run();
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
    EXPECT_NE(st.message().find("\"victim\""), std::string::npos) << st;
    EXPECT_NE(st.message().find("only its owner and admins"), std::string::npos) << st;
    ExpectVictimIntact(row.call);
  }
  // Everything else succeeds for her: her own context, a step, reads, a checkpoint, attach.
  for (const Row& row : CallsOnVictim(carol(), 0)) {
    if (row.call == "Backward on the owner's context" || row.call == "ImportWeights" ||
        row.call == "LoadCheckpoint over it" || row.call == "DeleteLayer") {
      continue;
    }
    SCOPED_TRACE(row.call);
    EXPECT_TRUE(row.run().ok());
  }
  EXPECT_TRUE(TrainStep(carol(), kVictim).ok());
  auto state = carol().ExportWeights(kVictim, true);
  ASSERT_TRUE(state.ok());
  auto owners = alice().ExportWeights(kVictim, true);
  ASSERT_TRUE(owners.ok());
  ExpectSameState(*owners, *state, "the grantee's export");
}

TEST_F(HostileTenantTest, OwnerAndAdminMayDoEverything) {
  for (Connection* c : {&alice(), &root()}) {
    const uint64_t context = OwnersContext();
    for (const Row& row : CallsOnVictim(*c, context)) {
      if (row.call == "DeleteLayer") continue;  // last, below
      // A saved context is its own principal's, admins' included (server/context_store.h).
      if (c == &root() && row.call == "Backward on the owner's context") continue;
      SCOPED_TRACE(absl::StrCat(c == &root() ? "root: " : "alice: ", row.call));
      EXPECT_TRUE(row.run().ok());
    }
  }
  ASSERT_TRUE(root().DeleteLayer(kVictim).ok());
  EXPECT_EQ(alice().GetLayer(kVictim).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(HostileTenantTest, ListsAndStatsShowOnlyWhatTheCallerMaySee) {
  ASSERT_TRUE(bob().CreateLayer("bobs", VictimConfig()).ok());
  auto names = [](const std::vector<v1::LayerInfo>& layers) {
    std::vector<std::string> out;
    for (const auto& l : layers) out.push_back(l.name());
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(names(*alice().ListLayers()), V({"victim"}));
  EXPECT_EQ(names(*bob().ListLayers()), V({"bobs"}));
  EXPECT_EQ(names(*carol().ListLayers()), V({"victim"}));
  EXPECT_EQ(names(*root().ListLayers()), V({"bobs", "victim"}));
  for (auto& [principal, want] : std::map<std::string, V>{{"alice", {"victim"}},
                                                          {"bob", {"bobs"}},
                                                          {"carol", {"victim"}},
                                                          {"root", {"bobs", "victim"}}}) {
    auto stats = conns_[principal]->GetStats();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(names({stats->layers().begin(), stats->layers().end()}), want) << principal;
  }
}

TEST_F(HostileTenantTest, MissingOrWrongTokenIsUnauthenticated) {
  // Without a session: opening one is itself a call that must authenticate (below).
  for (const std::string& token :
       {std::string(), std::string("not-a-token-0123456789"), kTokens.at("alice") + "x"}) {
    SCOPED_TRACE(token.empty() ? "no token" : token);
    auto conn = ConnectAs(token, /*open_session=*/false);
    ASSERT_TRUE(conn.ok()) << conn.status();
    Connection& c = **conn;
    // Health checks stay open: a Kubernetes probe carries no token.
    EXPECT_TRUE(c.Health().ok());
    EXPECT_TRUE(c.Health("moe.v1.ExpertService").ok());
    std::vector<Row> rows = CallsOnVictim(c, OwnersContext());
    rows.push_back({"CreateLayer", [&c] { return c.CreateLayer("new", VictimConfig()).status(); }});
    rows.push_back({"ListLayers", [&c] { return c.ListLayers().status(); }});
    rows.push_back({"GetStats", [&c] { return c.GetStats().status(); }});
    rows.push_back({"LoadCheckpoint (new layer)",
                    [&c] { return c.LoadCheckpoint("new", "x.safetensors").status(); }});
    for (const Row& row : rows) {
      if (row.call == "RemoteLayer::Create (attach)") continue;  // needs a shared_ptr; = attach
      SCOPED_TRACE(row.call);
      absl::Status st = row.run();
      if (row.call == "LoadCheckpoint over it") {
        // Its setup (CreateLayer) is refused first.
        EXPECT_NE(st.message().find("UNAUTHENTICATED"), std::string::npos) << st;
      } else {
        EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
        EXPECT_NE(st.message().find("authorization: "), std::string::npos) << st;
      }
      ExpectVictimIntact(row.call);
    }
    auto with_session = ConnectAs(token, /*open_session=*/true);
    ASSERT_FALSE(with_session.ok());
    EXPECT_EQ(with_session.status().code(), absl::StatusCode::kUnauthenticated)
        << with_session.status();
  }
  auto listed = root().ListLayers();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 1u);  // nothing was created
}

TEST_F(HostileTenantTest, ReloadedTokensTakeEffect) {
  std::ofstream(tokens_file_) << "alice " << kTokens.at("alice") << "\n"
                              << "dave dave-0123456789abcdef0123456789\n";
  ASSERT_TRUE(server_->ReloadTokens().ok());
  auto dave = ConnectAs("dave-0123456789abcdef0123456789");
  ASSERT_TRUE(dave.ok()) << dave.status();
  EXPECT_EQ((*dave)->GetLayer(kVictim).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(bob().GetLayer(kVictim).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(alice().GetLayer(kVictim).ok());
  std::ofstream(tokens_file_) << "broken\n";
  EXPECT_FALSE(server_->ReloadTokens().ok());
  EXPECT_TRUE(alice().GetLayer(kVictim).ok());  // the tokens in use stay
}

TEST_F(HostileTenantTest, CheckpointsLiveInTheirPrincipalsDirectory) {
  auto saved = alice().SaveCheckpoint(kVictim, "mine.safetensors");
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->path(), absl::StrCat(options_.checkpoint_dir, "/alice/mine.safetensors"));
  // Another principal's path of the same name is its own directory's: nothing there.
  auto stolen = bob().LoadCheckpoint("stolen", "mine.safetensors");
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound) << stolen.status();
  EXPECT_EQ(bob().LoadCheckpoint("stolen", "../alice/mine.safetensors").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Saving under the same name writes bob's own file, never alice's.
  ASSERT_TRUE(bob().CreateLayer("bobs", VictimConfig()).ok());
  auto bobs = bob().SaveCheckpoint("bobs", "mine.safetensors");
  ASSERT_TRUE(bobs.ok());
  EXPECT_EQ(bobs->path(), absl::StrCat(options_.checkpoint_dir, "/bob/mine.safetensors"));
  // The owner reloads her own file into a new layer, which she then owns; an admin reaches
  // every principal's directory from the top.
  auto reloaded = alice().LoadCheckpoint("restored", "mine.safetensors", {"carol"});
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(reloaded->owner(), "alice");
  EXPECT_EQ(reloaded->shared_with_size(), 1);
  auto by_admin = root().LoadCheckpoint("by-admin", "alice/mine.safetensors");
  ASSERT_TRUE(by_admin.ok()) << by_admin.status();
  EXPECT_EQ(by_admin->owner(), "root");
  EXPECT_EQ(bob().GetLayer("by-admin").status().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(HostileTenantTest, SharedWithIsChecked) {
  std::vector<std::string> too_many(65, "p");
  auto many = alice().CreateLayer("x", VictimConfig(), false, too_many);
  EXPECT_EQ(many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(many.status().message().find("shared_with: at most 64"), std::string::npos);
  auto bad = alice().CreateLayer("x", VictimConfig(), false, {"ok", "has space"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("shared_with[1]"), std::string::npos) << bad.status();
  EXPECT_EQ(alice().GetLayer("x").status().code(), absl::StatusCode::kNotFound);
}

// --- A client certificate's identity --------------------------------------------------------
TEST(ClientCertificateTest, CertificateIdentityIsAPrincipal) {
  server::ServerOptions o = LoopbackOptions();
  o.tls.cert_file = TlsFile("server.pem");
  o.tls.key_file = TlsFile("server-key.pem");
  o.tls.client_ca_file = TlsFile("ca.pem");
  o.tokens_file = TempPath("tokens");
  std::ofstream(o.tokens_file) << "alice " << kTokens.at("alice") << "\n";
  for (int reload : {0, 300}) {  // read once, and through gRPC's file watcher
    SCOPED_TRACE(absl::StrCat("tls.reload_seconds ", reload));
    o.tls.reload_seconds = reload;
    auto s = server::Server::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    client::ClientOptions c = LoopbackClientOptions();
    c.connections = 1;
    c.tls.ca_file = TlsFile("ca.pem");
    c.tls.cert_file = TlsFile("client.pem");  // CN trainer-0
    c.tls.key_file = TlsFile("client-key.pem");
    const std::string target = absl::StrCat("localhost:", (*s)->port());
    auto trainer = Connection::Connect(target, c);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    auto info = (*trainer)->CreateLayer("certs", VictimConfig());
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->owner(), "trainer-0");
    // The same certificate with alice's token is alice, who may not use trainer-0's layer.
    c.token = kTokens.at("alice");
    auto alice = Connection::Connect(target, c);
    ASSERT_TRUE(alice.ok()) << alice.status();
    absl::Status denied = (*alice)->Step("certs").status();
    EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied) << denied;
    EXPECT_NE(denied.message().find("\"alice\""), std::string::npos) << denied;
    c.token = kTokens.at("bob");  // not in this server's file
    auto wrong = Connection::Connect(target, c);
    EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated) << wrong.status();
    EXPECT_TRUE((*trainer)->DeleteLayer("certs").ok());
  }
}

// --- CallerPrincipal ------------------------------------------------------------------------
// A callback service that answers GetStats with CallerPrincipal in `device`, on a server whose
// contexts come from an AuthContextAllocator, as moe-server's do.
class WhoAmI final : public v1::ExpertService::CallbackService {
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const v1::GetStatsRequest*,
                                     v1::StatsResponse* resp) override {
    resp->set_device(server::CallerPrincipal(ctx));
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

std::string WhoAmIOn(v1::ExpertService::Stub& stub, const std::string& authorization) {
  grpc::ClientContext ctx;
  if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
  v1::StatsResponse resp;
  grpc::Status st = stub.GetStats(&ctx, v1::GetStatsRequest(), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return resp.device();
}

TEST(CallerPrincipalTest, NamesTheAuthenticatedPrincipal) {
  for (bool on : {true, false}) {
    server::AuthOptions o;
    if (on) {
      o.tokens_file = TempPath("tokens");
      std::ofstream(o.tokens_file) << "alice " << kTokens.at("alice") << "\n";
    }
    auto auth = server::Authenticator::Create(o);
    ASSERT_TRUE(auth.ok());
    WhoAmI service;
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    builder.SetContextAllocator(std::make_unique<server::AuthContextAllocator>(*auth));
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    ASSERT_NE(server, nullptr);
    auto stub = v1::ExpertService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    const std::string alice = absl::StrCat("Bearer ", kTokens.at("alice"));
    EXPECT_EQ(WhoAmIOn(*stub, alice), on ? "alice" : "anonymous");
    EXPECT_EQ(WhoAmIOn(*stub, ""), on ? "" : "anonymous");
    EXPECT_EQ(WhoAmIOn(*stub, "Bearer wrong-token-0123456789"), on ? "" : "anonymous");
    server->Shutdown();
  }
}

// --- Listening addresses --------------------------------------------------------------------
// An IPv4 address of this host other than loopback, or "" when it has none.
std::string NonLoopbackAddress() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if ((ntohl(in->sin_addr.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN];
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text))) found = text;
  }
  ::freeifaddrs(list);
  return found;
}

bool CanConnect(const std::string& address, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, address.c_str(), &sa.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
  ::close(fd);
  return ok;
}

TEST(ListeningAddressTest, DefaultsAreLoopback) {
  const server::ServerOptions defaults;
  EXPECT_EQ(defaults.host, "127.0.0.1");
  EXPECT_EQ(defaults.metrics_host, "127.0.0.1");
  EXPECT_TRUE(defaults.tokens_file.empty());

  // A server started with the default addresses answers on loopback only.
  server::ServerOptions o;
  o.port = 0;
  o.metrics_port = 0;
  o.device = "cpu";
  auto s = server::Server::Start(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(CanConnect("127.0.0.1", (*s)->port()));
  EXPECT_TRUE(CanConnect("127.0.0.1", (*s)->metrics_port()));
  const std::string other = NonLoopbackAddress();
  if (other.empty()) GTEST_SKIP() << "this host has no non-loopback IPv4 address to try";
  EXPECT_FALSE(CanConnect(other, (*s)->port())) << other;
  EXPECT_FALSE(CanConnect(other, (*s)->metrics_port())) << other;

  // Asked for every interface, both answer there too (the check above can fail).
  o.host = "0.0.0.0";
  o.metrics_host = "0.0.0.0";
  s->reset();
  auto wide = server::Server::Start(o);
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_TRUE(CanConnect(other, (*wide)->port())) << other;
  EXPECT_TRUE(CanConnect(other, (*wide)->metrics_port())) << other;
}

}  // namespace
}  // namespace moe::server_test
