// A moe-server on loopback for hostile-input tests of memory admission: a server with the given
// options, a trained reference layer whose full state (weights and optimizer state) is
// snapshotted, and the checks that after each hostile call the server still serves and the
// reference layer is bitwise unchanged.
#ifndef MOE_TESTS_SERVER_ADMISSION_FIXTURE_H_
#define MOE_TESTS_SERVER_ADMISSION_FIXTURE_H_

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "engine/layer.h"
#include "server/server.h"

namespace moe::testing {

inline std::string AdmissionTempDir(const std::string& name) {
  static int counter = 0;
  std::string dir =
      absl::StrCat(::testing::TempDir(), "/moe_admission_", name, "_", ::getpid(), "_", counter++);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

inline server::ServerOptions AdmissionOptions() {
  server::ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.metrics_port = -1;
  o.device = "cpu";
  o.checkpoint_dir = AdmissionTempDir("ckpt");
  return o;
}

// Server routing: Forward needs only x.
inline LayerConfig ReferenceConfig() {
  LayerConfig c;
  c.num_experts = 6;
  c.top_k = 2;
  c.d_model = 16;
  c.d_hidden = 24;
  c.routing = RoutingMode::kServer;
  c.seed = 5;
  c.optimizer.learning_rate = 1e-2;
  return c;
}

inline Tensor RandomTensor(std::mt19937& rng, std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(DType::kFloat32, std::move(shape));
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.as<float>()[i] = dist(rng);
  return t;
}

class AdmissionServer {
 public:
  static constexpr char kReference[] = "reference";

  // Starts the server and a client (with a session unless `copts` says otherwise), creates the
  // reference layer, trains it one step (so its optimizer state is not zero) and snapshots it.
  void Start(server::ServerOptions options, client::ClientOptions copts = {}) {
    auto s = server::Server::Start(options);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    copts.timeout = std::chrono::seconds(20);
    auto c = client::Connection::Connect(target(), copts);
    ASSERT_TRUE(c.ok()) << c.status();
    conn_ = *c;
    ASSERT_TRUE(conn_->CreateLayer(kReference, ReferenceConfig()).ok());
    std::mt19937 rng(17);
    const int64_t d = ReferenceConfig().d_model;
    Tensor x = RandomTensor(rng, {12, d}), dout = RandomTensor(rng, {12, d});
    const uint64_t id = conn_->NextContextId();
    ASSERT_TRUE(conn_->Forward(kReference, id, true, x.view(), {}, {}).get().ok());
    ASSERT_TRUE(conn_->Backward(kReference, id, dout.view()).get().ok());
    ASSERT_TRUE(conn_->Step(kReference).ok());
    auto state = conn_->ExportWeights(kReference, /*include_optimizer=*/true);
    ASSERT_TRUE(state.ok()) << state.status();
    reference_state_ = std::move(*state);
    ASSERT_GT(reference_state_.count("w1.exp_avg"), 0u);
  }

  std::string target() const { return absl::StrCat("127.0.0.1:", server_->port()); }
  client::Connection& conn() { return *conn_; }
  server::Server& server() { return *server_; }

  // The server answers health checks, lists its layers and runs an inference Forward on the
  // reference layer; the reference layer's weights and optimizer state are bitwise those
  // snapshotted at Start.
  void ExpectServingAndReferenceUnchanged() {
    EXPECT_TRUE(conn_->Health().ok());
    EXPECT_TRUE(conn_->ListLayers().ok());
    std::mt19937 rng(3);
    Tensor x = RandomTensor(rng, {4, ReferenceConfig().d_model});
    auto fwd = conn_->Forward(kReference, 0, false, x.view(), {}, {}).get();
    EXPECT_TRUE(fwd.ok()) << fwd.status();
    auto state = conn_->ExportWeights(kReference, /*include_optimizer=*/true);
    ASSERT_TRUE(state.ok()) << state.status();
    ASSERT_EQ(state->size(), reference_state_.size());
    for (const auto& [name, want] : reference_state_) {
      auto it = state->find(name);
      ASSERT_NE(it, state->end()) << name;
      EXPECT_EQ(it->second.shape, want.shape) << name;
      EXPECT_TRUE(it->second.bytes.size() == want.bytes.size() &&
                  std::equal(want.bytes.begin(), want.bytes.end(), it->second.bytes.begin()))
          << name << " changed";
    }
  }

 private:
  std::unique_ptr<server::Server> server_;
  std::shared_ptr<client::Connection> conn_;
  std::map<std::string, Tensor> reference_state_;
};

}  // namespace moe::testing

#endif  // MOE_TESTS_SERVER_ADMISSION_FIXTURE_H_
