// moe-server and moe::client over TLS and mutual TLS on loopback, with the test PKI of
// tests/testdata/tls (make-certs.sh there): a training round trips exactly as in plaintext,
// and every mismatch a deployment can get wrong (plaintext against TLS either way, an unknown
// CA, the wrong server name, a missing or foreign client certificate) is refused, with
// UNAVAILABLE and a message that says which side to check; renewed certificates are served
// without a restart, and a renewed client certificate is used without a new client.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "tests/client/test_util.h"

namespace moe {
namespace {

using testing_util::LoopbackOptions;
using testing_util::RandomFloat;
using testing_util::StartServer;
using testing_util::Target;

std::string Pem(const std::string& name) { return std::string(MOE_TLS_TESTDATA) + "/" + name; }

server::ServerOptions TlsServer(bool require_client_certificate) {
  server::ServerOptions o = LoopbackOptions();
  o.tls.cert_file = Pem("server.pem");
  o.tls.key_file = Pem("server-key.pem");
  if (require_client_certificate) o.tls.client_ca_file = Pem("ca.pem");
  return o;
}

client::ClientOptions TlsClient(const std::string& ca = "ca.pem", const std::string& cert = "",
                                const std::string& key = "") {
  client::ClientOptions o;
  o.timeout = std::chrono::seconds(10);
  o.connections = 2;
  o.tls.ca_file = Pem(ca);
  if (!cert.empty()) o.tls.cert_file = Pem(cert);
  if (!key.empty()) o.tls.key_file = Pem(key);
  return o;
}

LayerConfig Config() { return testing_util::ServerRoutedConfig(32, 16); }

// Forward, Backward and Step of one micro-batch on a fresh layer; returns the step's gradient
// norm, or the first error.
absl::StatusOr<double> TrainOnce(std::shared_ptr<client::Connection> conn) {
  auto layer = client::RemoteLayer::Create(conn, "l", Config());
  if (!layer.ok()) return layer.status();
  std::mt19937 rng(3);
  Tensor x = RandomFloat(rng, {24, Config().d_model});
  auto fwd = (*layer)->Forward(x.view(), {}, {}, /*training=*/true).get();
  if (!fwd.ok()) return fwd.status();
  Tensor dout = RandomFloat(rng, {24, Config().d_model});
  auto bwd = (*layer)->Backward(fwd->context_id, dout.view()).get();
  if (!bwd.ok()) return bwd.status();
  auto step = (*layer)->Step();
  if (!step.ok()) return step.status();
  return step->grad_norm;
}

// For a connection that must be refused: a refused handshake looks like a server that is not
// there, so each such case waits out the whole timeout.
client::ClientOptions Briefly(client::ClientOptions o) {
  o.timeout = std::chrono::milliseconds(1000);
  return o;
}

// Connecting, then (TLS 1.3 checks the client's certificate after the client's side of the
// handshake is done) the first call: the status of whichever fails first.
absl::Status ConnectAndCall(const std::string& target, const client::ClientOptions& options) {
  auto c = client::Connection::Connect(target, options);
  if (!c.ok()) return c.status();
  return (*c)->Health();
}

// Renews a key pair in place as cert-manager does: the test PKI's FROM-key.pem and FROM.pem
// become TO-key.pem and TO.pem, key first, each written aside and renamed over the old file.
void InstallPair(const std::string& from, const std::string& to) {
  for (const char* suffix : {"-key.pem", ".pem"}) {
    std::ifstream in(Pem(from + suffix), std::ios::binary);
    const std::string path = to + suffix;
    std::ofstream(path + ".tmp", std::ios::binary) << in.rdbuf();
    ASSERT_EQ(std::rename((path + ".tmp").c_str(), path.c_str()), 0);
  }
}

TEST(TlsTest, TrainingOverTlsEqualsPlaintext) {
  auto plain = StartServer();
  auto tls = StartServer(TlsServer(/*require_client_certificate=*/false));
  auto mutual = StartServer(TlsServer(/*require_client_certificate=*/true));
  ASSERT_TRUE(plain && tls && mutual);
  auto p = client::Connection::Connect(Target(*plain));
  auto t = client::Connection::Connect(Target(*tls), TlsClient());
  auto m = client::Connection::Connect(Target(*mutual),
                                       TlsClient("ca.pem", "client.pem", "client-key.pem"));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<double> want = TrainOnce(*p);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_GT(*want, 0);
  absl::StatusOr<double> over_tls = TrainOnce(*t), over_mutual = TrainOnce(*m);
  ASSERT_TRUE(over_tls.ok()) << over_tls.status();
  ASSERT_TRUE(over_mutual.ok()) << over_mutual.status();
  EXPECT_EQ(*over_tls, *want);  // the same deterministic CPU engine, seed and inputs
  EXPECT_EQ(*over_mutual, *want);
}

TEST(TlsTest, MismatchesAreRefusedAndSayWhatToCheck) {
  auto plain = StartServer();
  auto tls = StartServer(TlsServer(/*require_client_certificate=*/false));
  auto mutual = StartServer(TlsServer(/*require_client_certificate=*/true));
  ASSERT_TRUE(plain && tls && mutual);

  client::ClientOptions plaintext = TlsClient();
  plaintext.tls = {};
  absl::Status st = ConnectAndCall(Target(*tls), Briefly(plaintext));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("does the server require TLS?"), std::string::npos) << st;

  st = ConnectAndCall(Target(*plain), Briefly(TlsClient()));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("over TLS"), std::string::npos) << st;

  st = ConnectAndCall(Target(*tls), Briefly(TlsClient("other-ca.pem")));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << "a server signed by an unknown CA";

  client::ClientOptions wrong_name = TlsClient();
  wrong_name.tls.server_name = "not-the-server.example";
  st = ConnectAndCall(Target(*tls), Briefly(wrong_name));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << "a certificate for another name";
  wrong_name.tls.server_name = "localhost";  // in the certificate: accepted
  EXPECT_TRUE(ConnectAndCall(Target(*tls), wrong_name).ok());

  st = ConnectAndCall(Target(*mutual), Briefly(TlsClient()));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << "no client certificate";
  st = ConnectAndCall(Target(*mutual),
                      Briefly(TlsClient("ca.pem", "other-client.pem", "other-client-key.pem")));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << "a client certificate of another CA";
}

// A certificate renewed in place (cert-manager rewrites the Secret's files) is served to new
// connections within reload_seconds, without a restart; with reload_seconds 0 it is not.
TEST(TlsTest, RenewedCertificatesAreServedWithoutARestart) {
  const std::string dir = ::testing::TempDir() + "/moe_tls_reload_" + std::to_string(::getpid());
  ::mkdir(dir.c_str(), 0755);
  auto install = [&](const std::string& from) { InstallPair(from, dir + "/server"); };
  install("server");
  server::ServerOptions reloading = LoopbackOptions(), once = LoopbackOptions();
  for (server::ServerOptions* o : {&reloading, &once}) {
    o->tls.cert_file = dir + "/server.pem";
    o->tls.key_file = dir + "/server-key.pem";
  }
  reloading.tls.reload_seconds = 1;
  once.tls.reload_seconds = 0;
  auto r = StartServer(reloading), s = StartServer(once);
  ASSERT_TRUE(r && s);
  EXPECT_TRUE(ConnectAndCall(Target(*r), TlsClient()).ok());

  install("other-server");  // renewed, by another CA
  absl::Status renewed;
  for (int i = 0; i < 40; ++i) {  // the watcher's period is 1 s; allow 10
    renewed = ConnectAndCall(Target(*r), Briefly(TlsClient("other-ca.pem")));
    if (renewed.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  EXPECT_TRUE(renewed.ok()) << renewed;
  EXPECT_EQ(ConnectAndCall(Target(*r), Briefly(TlsClient())).code(), absl::StatusCode::kUnavailable)
      << "the old certificate is still served";
  EXPECT_TRUE(ConnectAndCall(Target(*s), TlsClient()).ok()) << "reload_seconds 0 reloaded";
}

// A trainer's client certificate renewed in place reaches the connections its client opens
// afterwards within tls.reload_seconds, with no new client; with reload_seconds 0 it does not.
// Here the server's client CA is rotated (the server restarted on its port with the new one)
// after the trainers' certificate files were renewed by the new CA.
TEST(TlsTest, ARenewedClientCertificateIsUsedWithoutANewClient) {
  const std::string dir =
      ::testing::TempDir() + "/moe_tls_client_reload_" + std::to_string(::getpid());
  ::mkdir(dir.c_str(), 0755);
  auto install = [&](const std::string& from) { InstallPair(from, dir + "/client"); };
  install("other-client");
  server::ServerOptions old_ca = TlsServer(/*require_client_certificate=*/true);
  old_ca.tls.client_ca_file = Pem("other-ca.pem");
  auto server = StartServer(old_ca);
  ASSERT_TRUE(server);
  const int port = server->port();
  client::ClientOptions reloading = TlsClient(), once = TlsClient();
  for (client::ClientOptions* o : {&reloading, &once}) {
    o->connections = 1;
    o->tls.cert_file = dir + "/client.pem";
    o->tls.key_file = dir + "/client-key.pem";
  }
  reloading.tls.reload_seconds = 1;
  once.tls.reload_seconds = 0;
  auto r = client::Connection::Connect(Target(*server), reloading);
  auto o = client::Connection::Connect(Target(*server), once);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_TRUE((*r)->Health().ok());
  ASSERT_TRUE((*o)->Health().ok());

  install("client");                                     // renewed, by the new CA
  std::this_thread::sleep_for(std::chrono::seconds(2));  // the watcher's period is 1 s
  server.reset();
  server::ServerOptions new_ca = TlsServer(/*require_client_certificate=*/true);
  new_ca.port = port;
  server = StartServer(new_ca);
  ASSERT_TRUE(server);
  absl::Status renewed;
  for (int i = 0; i < 40; ++i) {  // the channel reconnects on its own backoff; allow 10 s
    renewed = (*r)->Health();
    if (renewed.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  EXPECT_TRUE(renewed.ok()) << renewed;
  // The client that read its files once still presents the old CA's certificate: refused on
  // every try for 2 s.
  for (int i = 0; i < 8; ++i) {
    const absl::Status stale = (*o)->Health();
    EXPECT_EQ(stale.code(), absl::StatusCode::kUnavailable) << "reload_seconds 0 reloaded";
    if (stale.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
}

TEST(TlsTest, BadTlsOptionsNameTheField) {
  server::ServerOptions o = TlsServer(/*require_client_certificate=*/true);
  o.tls.key_file.clear();
  auto s = server::Server::Start(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("tls_key_file"), std::string::npos) << s.status();

  o = TlsServer(/*require_client_certificate=*/false);
  o.tls.cert_file = Pem("missing.pem");
  s = server::Server::Start(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("tls_cert_file"), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("missing.pem"), std::string::npos) << s.status();

  // gRPC refuses a key that is not the certificate's as it refuses a busy port; the server
  // tells the two apart.
  o = TlsServer(/*require_client_certificate=*/false);
  o.tls.key_file = Pem("client-key.pem");
  s = server::Server::Start(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
  EXPECT_NE(s.status().message().find("tls_key_file"), std::string::npos) << s.status();
  auto running = StartServer();
  ASSERT_TRUE(running);
  o = TlsServer(/*require_client_certificate=*/false);
  o.port = running->port();
  s = server::Server::Start(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
  EXPECT_NE(s.status().message().find("port"), std::string::npos) << s.status();

  client::ClientOptions c = TlsClient("ca.pem", "client.pem");  // no key
  auto conn = client::Connection::Connect("127.0.0.1:1", c);
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(conn.status().message().find("tls.key_file"), std::string::npos) << conn.status();
  // A client key that is not its certificate's is refused at Connect, naming the file, where
  // gRPC alone would fail only the handshake.
  c = TlsClient("ca.pem", "client.pem", "server-key.pem");
  conn = client::Connection::Connect("127.0.0.1:1", c);
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kInvalidArgument) << conn.status();
  EXPECT_NE(conn.status().message().find("tls.key_file"), std::string::npos) << conn.status();
  EXPECT_NE(conn.status().message().find("server-key.pem"), std::string::npos) << conn.status();
  c = TlsClient();
  c.tls.reload_seconds = -1;
  conn = client::Connection::Connect("127.0.0.1:1", c);
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(conn.status().message().find("tls.reload_seconds"), std::string::npos) << conn.status();
}

}  // namespace
}  // namespace moe
