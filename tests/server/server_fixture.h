// The one way tests/server starts a real moe-server on loopback (127.0.0.1, an ephemeral port,
// the CPU engine) and talks to it: options, a server with a client connection (Loopback), a
// server whose trained reference layer must survive hostile requests bitwise unchanged
// (ReferenceServer), and the plain-stub stream calls that send exactly the messages a test wrote
// (any client generated from moe.proto could send them). The server itself is started by
// tests/client/test_util.h's StartServer, which the client tests share.
#ifndef MOE_TESTS_SERVER_SERVER_FIXTURE_H_
#define MOE_TESTS_SERVER_SERVER_FIXTURE_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "engine/layer.h"
#include "moe/v1/moe.grpc.pb.h"
#include "server/server.h"
#include "tests/client/test_util.h"

namespace moe::server_test {

// A server on 127.0.0.1, port 0, without the metrics endpoint, on the CPU engine, keeping
// checkpoints in a fresh directory.
using testing_util::LoopbackOptions;
using testing_util::RandomFloat;
using State = std::map<std::string, Tensor>;

// <test temp dir>/moe_<name>_<pid>_<n>, a new name on every call: TempDir makes the directory,
// TempPath only names it.
std::string TempPath(const std::string& name);
std::string TempDir(const std::string& name);

// What every fixture's client starts from: a 20 s deadline on each call.
client::ClientOptions LoopbackClientOptions();

// A small layer: 6 experts, top 2, d 16, h 24, seed 11, learning rate 1e-2.
LayerConfig SmallConfig(RoutingMode routing);
// Distinct random expert ids per token in [0, num_experts) and positive weights.
void RandomRouting(std::mt19937& rng, int64_t tokens, const LayerConfig& c, Tensor* ids,
                   Tensor* weights);

// moe.proto's Stripe: stream `index` of `count`, rows from `row_begin` of `total_rows`.
v1::Stripe StripeOf(uint32_t index, uint32_t count, int64_t row_begin, int64_t total_rows);

// `t` (float32) in bf16, rounded to nearest even: what a bf16 layer takes for x and dout.
Tensor ToBFloat16(const Tensor& t);
// The value of the series `name{labels}` (labels in alphabetical order, as the exposition
// format lists them) in a metrics page; -1 when absent.
double MetricValue(const std::string& page, const std::string& series);

// `st` has `code` and its message names `field`.
void ExpectStatus(const grpc::Status& st, grpc::StatusCode code, const std::string& field);
// Every tensor of `before` is in `after` with the same dtype, shape and bytes, and nothing else
// is; `what` names the step for the failure message.
void ExpectSameState(const State& before, const State& after, const std::string& what);

// A server and a connection to it. After a failure (reported through EXPECT) `conn` is null:
// tests ASSERT_TRUE(lb.conn) first.
struct Loopback {
  std::unique_ptr<server::Server> server;
  std::shared_ptr<client::Connection> conn;

  std::string target() const;
  // One more connection, as another client would open it.
  absl::StatusOr<std::shared_ptr<client::Connection>> Connect(
      client::ClientOptions copts = LoopbackClientOptions()) const;
};
Loopback StartLoopback(server::ServerOptions options = LoopbackOptions(),
                       client::ClientOptions copts = LoopbackClientOptions());

// What a whole stream call ended with, and the responses it read.
template <typename Resp>
struct Answer {
  grpc::Status status;
  std::vector<Resp> responses;
};
// One Forward (or Backward) stream through the plain stub: every request written, then
// half-closed, then every response read. `deadline` bounds the call.
Answer<v1::ForwardResponse> SendForward(
    client::Connection& conn, const std::vector<v1::ForwardRequest>& requests,
    std::chrono::milliseconds deadline = std::chrono::seconds(20));
Answer<v1::BackwardResponse> SendBackward(client::Connection& conn,
                                          const std::vector<v1::BackwardRequest>& requests);
// One ImportWeights stream of `chunks` (none: the client half-closes at once).
grpc::Status SendImport(client::Connection& conn, const std::vector<v1::WeightChunk>& chunks);

// A Loopback with a reference layer that hostile requests must leave alone: trained one step (so
// its weights and optimizer state are not their initial values), its exported state remembered,
// and the check to run after every hostile request.
class ReferenceServer {
 public:
  static constexpr char kReference[] = "reference";

  // Starts the server, connects with `copts` (a token or certificate, where the server asks for
  // one), creates the reference layer with `config`, runs one Forward, Backward and Step on it
  // and remembers its exported state. ASSERTs: call it under ASSERT_NO_FATAL_FAILURE.
  void Start(const LayerConfig& config, server::ServerOptions options = LoopbackOptions(),
             client::ClientOptions copts = LoopbackClientOptions());

  client::Connection& conn() { return *loopback_.conn; }
  server::Server& server() { return *loopback_.server; }
  std::string target() const { return loopback_.target(); }

  // After a hostile request: the server answers health checks, lists its layers and runs an
  // inference Forward on the reference layer, whose exported weights and optimizer state are
  // bitwise those remembered.
  void ExpectServingAndUnchanged(const std::string& after);

 private:
  Loopback loopback_;
  State reference_;
  Tensor x_, ids_, w_;  // the trained micro-batch, fed again by the check
};

}  // namespace moe::server_test

#endif  // MOE_TESTS_SERVER_SERVER_FIXTURE_H_
