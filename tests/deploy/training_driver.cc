// training_driver: a short, real training run against a moe-server, for the deploy tests that
// watch the server through Prometheus. It creates a server-routed SwiGLU layer, runs STEPS
// rounds of Forward -> Backward -> Step on fresh random micro-batches (pausing between rounds so
// the run spans several 1 s scrapes), saves a checkpoint, makes one call that must fail
// (Forward on a layer that does not exist: NOT_FOUND), and ends with a training Forward whose
// Backward never comes, so that closing the connection makes the server drop that context
// (reason session_closed). Afterwards every series the dashboard and the alert rules read
// exists, error codes and dropped contexts included. With TOKEN_FILE (a server with
// authentication on, as the manifests run it) every call carries that bearer token, and a
// connection without one must first be refused UNAUTHENTICATED. Exits non-zero when any call
// that should succeed fails, or a bad call does not fail as it should.
//
// Usage: training_driver HOST:PORT STEPS PAUSE_MS [TOKEN_FILE]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>

#include "client/client.h"
#include "common/tensor.h"
#include "engine/layer.h"

namespace {

constexpr int64_t kTokens = 128;
constexpr char kLayer[] = "deploy-test";

moe::Tensor RandomTensor(std::mt19937& rng, int64_t rows, int64_t cols) {
  moe::Tensor t = moe::Tensor::Zeros(moe::DType::kFloat32, {rows, cols});
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float* p = t.as<float>();
  for (int64_t i = 0; i < rows * cols; ++i) p[i] = normal(rng);
  return t;
}

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "training_driver: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: %s HOST:PORT STEPS PAUSE_MS [TOKEN_FILE]\n", argv[0]);
    return 2;
  }
  const std::string target = argv[1];
  const int steps = std::atoi(argv[2]);
  const int pause_ms = std::atoi(argv[3]);

  moe::client::ClientOptions options;
  if (argc == 5) {
    auto refused = moe::client::Connection::Connect(target);
    if (refused.status().code() != absl::StatusCode::kUnauthenticated) {
      return Fail("a connection without a token should be UNAUTHENTICATED", refused.status());
    }
    auto token = moe::client::ReadTokenFile(argv[4], "TOKEN_FILE");
    if (!token.ok()) return Fail("token", token.status());
    options.token = *token;
  }
  auto conn = moe::client::Connection::Connect(target, options);
  if (!conn.ok()) return Fail("connect", conn.status());

  moe::LayerConfig config;
  config.num_experts = 8;
  config.top_k = 2;
  config.d_model = 64;
  config.d_hidden = 128;
  config.activation = moe::Activation::kSwiGLU;
  config.routing = moe::RoutingMode::kServer;
  config.seed = 7;
  config.aux_loss_coef = 0.01;
  config.optimizer.learning_rate = 1e-3;
  auto layer = moe::client::RemoteLayer::Create(*conn, kLayer, config);
  if (!layer.ok()) return Fail("create layer", layer.status());

  std::mt19937 rng(1234);
  int64_t tokens = 0;
  for (int s = 0; s < steps; ++s) {
    moe::Tensor x = RandomTensor(rng, kTokens, config.d_model);
    auto fwd = (*layer)->Forward(x.view()).get();
    if (!fwd.ok()) return Fail("forward", fwd.status());
    moe::Tensor dout = RandomTensor(rng, kTokens, config.d_model);
    auto bwd = (*layer)->Backward(fwd->context_id, dout.view()).get();
    if (!bwd.ok()) return Fail("backward", bwd.status());
    auto step = (*layer)->Step();
    if (!step.ok()) return Fail("step", step.status());
    tokens += kTokens;
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
  }
  auto saved = (*layer)->SaveCheckpoint("deploy-test.safetensors");
  if (!saved.ok()) return Fail("save checkpoint", saved.status());

  moe::Tensor x = RandomTensor(rng, kTokens, config.d_model);
  auto missing = (*conn)->Forward("no-such-layer", (*conn)->NextContextId(), false, x.view(), {},
                                  {}).get();
  if (missing.status().code() != absl::StatusCode::kNotFound) {
    return Fail("forward on a missing layer should be NOT_FOUND", missing.status());
  }
  // Abandoned: the session's end (the connection going away below) frees it.
  auto abandoned = (*layer)->Forward(x.view()).get();
  if (!abandoned.ok()) return Fail("forward to abandon", abandoned.status());
  std::printf("training_driver: %d steps, %lld tokens, checkpoint saved, one context abandoned\n",
              steps, static_cast<long long>(tokens + kTokens));
  return 0;
}
