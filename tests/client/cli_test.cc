// moe-cli end to end against a loopback server: every command, exit codes and error output, its
// --tls_ flags against a TLS server, and its bearer token (--token_file, --token, MOE_TOKEN)
// against a server with authentication on.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>

#include "tests/client/test_util.h"

namespace moe {
namespace {

using testing_util::StartServer;
using testing_util::Target;

// `env`: VAR=value assignments for the command, or "".
int RunCli(const std::string& args, std::string* out, const std::string& env = "") {
  out->clear();
  FILE* p = ::popen((env + " " + std::string(MOE_CLI_PATH) + " " + args + " 2>&1").c_str(), "r");
  char buf[512];
  while (p && std::fgets(buf, sizeof(buf), p)) *out += buf;
  int rc = p ? ::pclose(p) : -1;
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(CliTest, EveryCommand) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  const std::string srv = "--server=" + Target(*s) + " ";
  std::string out;
  EXPECT_EQ(RunCli(srv + "health", &out), 0) << out;
  EXPECT_NE(out.find("SERVING"), std::string::npos) << out;
  // One service: what a readiness probe asks (deploy/kubernetes/tls runs this command).
  EXPECT_EQ(RunCli(srv + "health moe.v1.ExpertService", &out), 0) << out;
  EXPECT_NE(out.find("moe.v1.ExpertService: SERVING"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "health no.such.Service", &out), 1) << out;
  EXPECT_NE(out.find("NOT_FOUND"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "health a b", &out), 2) << out;
  EXPECT_EQ(RunCli(srv + "list", &out), 0) << out;
  EXPECT_NE(out.find("no layers"), std::string::npos) << out;
  EXPECT_EQ(
      RunCli(srv + "create l1 --experts=4 --top_k=2 --d_model=8 --d_hidden=16 --routing=server",
             &out),
      0)
      << out;
  EXPECT_NE(out.find("created l1"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "create l2 --experts=2 --top_k=3", &out), 1) << out;
  EXPECT_NE(out.find("INVALID_ARGUMENT"), std::string::npos) << out;
  EXPECT_NE(out.find("top_k"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "list", &out), 0) << out;
  EXPECT_NE(out.find("l1  E=4 K=2 d=8 h=16"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "save l1 ck/l1.safetensors", &out), 0) << out;
  EXPECT_NE(out.find("saved l1 step 0"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "load l3 ck/l1.safetensors", &out), 0) << out;
  EXPECT_NE(out.find("loaded l3"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "stats", &out), 0) << out;
  EXPECT_NE(out.find("device cpu"), std::string::npos) << out;
  EXPECT_NE(out.find("l3"), std::string::npos) << out;
  // l1 and l3: 4 experts of [16, 8] w1, w3 and [8, 16] w2 and an [8, 4] router, fp32 AdamW (16
  // bytes a parameter): 2 * 1568 * 16.
  EXPECT_NE(out.find("memory admitted 50176 of "), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "delete l1", &out), 0) << out;
  EXPECT_EQ(RunCli(srv + "delete l1", &out), 1) << out;
  EXPECT_NE(out.find("NOT_FOUND"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "frobnicate", &out), 2) << out;
  EXPECT_EQ(RunCli("--server=127.0.0.1:1 --timeout_seconds=0.3 health", &out), 1) << out;
  EXPECT_NE(out.find("UNAVAILABLE"), std::string::npos) << out;
}

// The --tls_ flags: health over TLS; a missing CA file is named before anything is sent.
TEST(CliTest, TalksToATlsServer) {
  server::ServerOptions o = testing_util::LoopbackOptions();
  const std::string pki = std::string(MOE_TLS_TESTDATA) + "/";
  o.tls.cert_file = pki + "server.pem";
  o.tls.key_file = pki + "server-key.pem";
  auto s = StartServer(o);
  ASSERT_TRUE(s);
  const std::string srv = "--server=" + Target(*s) + " ";
  std::string out;
  EXPECT_EQ(RunCli(srv + "--tls_ca_file=" + pki + "ca.pem health", &out), 0) << out;
  EXPECT_NE(out.find("SERVING"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "--timeout_seconds=1 health", &out), 1) << out;  // refused: waits it out
  EXPECT_NE(out.find("UNAVAILABLE"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "--tls_ca_file=" + pki + "absent.pem health", &out), 1) << out;
  EXPECT_NE(out.find("INVALID_ARGUMENT: tls.ca_file"), std::string::npos) << out;
}

// A server with --tokens_file: moe-cli without a token is refused (health is not), and each way
// of giving the token works; the principal owns what it creates and shares it as told.
TEST(CliTest, SendsItsToken) {
  const std::string alice = "alice-0123456789abcdef0123", bob = "bob-0123456789abcdef012345";
  server::ServerOptions o = testing_util::LoopbackOptions();
  o.tokens_file = o.checkpoint_dir + "/../cli_tokens_" + std::to_string(::getpid());
  std::ofstream(o.tokens_file) << "alice " << alice << "\nbob " << bob << "\n";
  const std::string token_file = o.tokens_file + ".alice";
  std::ofstream(token_file) << "  " << alice << "\n";  // whitespace around it is dropped
  auto s = StartServer(o);
  ASSERT_TRUE(s);
  const std::string srv = "--server=" + Target(*s) + " ";
  std::string out;
  EXPECT_EQ(RunCli(srv + "health", &out), 0) << out;
  EXPECT_EQ(RunCli(srv + "list", &out), 1) << out;
  EXPECT_NE(out.find("UNAUTHENTICATED: authorization: missing"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "--token=not-a-valid-token-000 list", &out), 1) << out;
  EXPECT_NE(out.find("UNAUTHENTICATED"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "--token_file=" + token_file + " create l1 --shared_with=bob", &out), 0)
      << out;
  EXPECT_NE(out.find("owner=alice shared_with=bob"), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "--token=" + alice + " list", &out), 0) << out;
  EXPECT_NE(out.find("l1 "), std::string::npos) << out;
  EXPECT_EQ(RunCli(srv + "list", &out, "MOE_TOKEN=" + bob), 0) << out;
  EXPECT_NE(out.find("l1 "), std::string::npos) << out;  // shared with bob
  EXPECT_EQ(RunCli(srv + "delete l1", &out, "MOE_TOKEN=" + bob), 1) << out;
  EXPECT_NE(out.find("PERMISSION_DENIED"), std::string::npos) << out;
  // --token_file wins over MOE_TOKEN.
  EXPECT_EQ(RunCli(srv + "--token_file=" + token_file + " delete l1", &out, "MOE_TOKEN=" + bob), 0)
      << out;
  EXPECT_EQ(RunCli(srv + "--token_file=" + o.tokens_file + ".absent list", &out), 2) << out;
  EXPECT_NE(out.find("--token_file: cannot read"), std::string::npos) << out;
}

}  // namespace
}  // namespace moe
