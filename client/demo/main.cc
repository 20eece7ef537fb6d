// moe-demo: a trainer whose MoE layer lives on moe-server. The student layer learns a fixed,
// randomly initialised teacher layer (also on the server, used in inference mode) on fresh
// random inputs. Routing is the trainer's own: a fixed random router on the client picks the
// top-K experts for both, so the student can match the teacher exactly and the loss falls
// steadily. Each step keeps --micro_batches forwards in flight, sends each Backward as soon as
// its forward returns, then steps the optimizer, printing loss and tokens/s. At the end it
// saves a checkpoint, loads it into a fresh layer and shows that the outputs are identical.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/host_memory.h"

ABSL_FLAG(std::string, server, "localhost:50051", "moe-server address");
ABSL_FLAG(int, steps, 100, "optimizer steps");
ABSL_FLAG(int, micro_batches, 4, "micro-batches per step, all in flight at once");
ABSL_FLAG(int64_t, tokens, 256, "tokens per micro-batch");
ABSL_FLAG(int64_t, experts, 8, "experts E");
ABSL_FLAG(int64_t, top_k, 2, "experts per token K");
ABSL_FLAG(int64_t, d_model, 64, "model width d");
ABSL_FLAG(int64_t, d_hidden, 128, "expert hidden width h");
ABSL_FLAG(double, lr, 1e-2, "AdamW learning rate");
ABSL_FLAG(std::string, checkpoint, "demo/student.safetensors",
          "checkpoint path under the server's --checkpoint_dir");
ABSL_FLAG(double, timeout_seconds, 60, "deadline of each call");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token, for a server started with --tokens_file");
ABSL_FLAG(bool, retain_freed_memory, true,
          "Reuse freed heap memory in this trainer process (moe::RetainFreedHeapMemory, "
          "common/host_memory.h): received tensors then land in pages already faulted in");

namespace {

using moe::DType;
using moe::Tensor;

int Die(const std::string& what, const absl::Status& st) {
  std::fprintf(stderr, "moe-demo: %s: %s\n", what.c_str(), st.ToString().c_str());
  return 1;
}

Tensor RandomNormal(std::mt19937& rng, std::vector<int64_t> shape, float scale) {
  Tensor t = Tensor::Zeros(DType::kFloat32, std::move(shape));
  std::normal_distribution<float> dist(0.f, scale);
  float* p = t.as<float>();
  for (int64_t i = 0; i < t.num_elements(); ++i) p[i] = dist(rng);
  return t;
}

// The trainer's router: softmax(x Wr), top-K (ties to the lower id), renormalised.
void Route(const Tensor& x, const Tensor& wr, int64_t k, Tensor* ids, Tensor* weights) {
  const int64_t t_count = x.shape[0], d = x.shape[1], e_count = wr.shape[1];
  *ids = Tensor::Zeros(DType::kInt32, {t_count, k});
  *weights = Tensor::Zeros(DType::kFloat32, {t_count, k});
  std::vector<float> logits(e_count);
  std::vector<int> order(e_count);
  for (int64_t t = 0; t < t_count; ++t) {
    float mx = -1e30f;
    for (int64_t e = 0; e < e_count; ++e) {
      float s = 0;
      for (int64_t j = 0; j < d; ++j)
        s += x.as<float>()[t * d + j] * wr.as<float>()[j * e_count + e];
      logits[e] = s;
      mx = std::max(mx, s);
    }
    for (int64_t e = 0; e < e_count; ++e) order[e] = static_cast<int>(e);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return logits[a] > logits[b]; });
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(logits[order[j]] - mx);
    for (int64_t j = 0; j < k; ++j) {
      ids->as<int32_t>()[t * k + j] = order[j];
      weights->as<float>()[t * k + j] = std::exp(logits[order[j]] - mx) / sum;
    }
  }
}

struct MicroBatch {
  Tensor x, ids, weights;
  std::future<absl::StatusOr<moe::client::ForwardOutput>> student, teacher;
  std::future<absl::StatusOr<moe::client::BackwardOutput>> backward;
  Tensor dout;
};

}  // namespace

int main(int argc, char** argv) {
  // --help lists this file's flags: absl's default lists only those of a file named after the
  // binary (it compares with its name normalized, which drops the leading '/').
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(__FILE__, file);
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "moe-demo --server=HOST:PORT: train a student MoE layer on moe-server");
  absl::ParseCommandLine(argc, argv);
  // A trainer's own choice, made before any thread starts (the client's gRPC threads included).
  if (absl::GetFlag(FLAGS_retain_freed_memory) && !moe::RetainFreedHeapMemory()) {
    std::fprintf(stderr, "moe-demo: warning: malloc settings refused; freed memory is returned\n");
  }
  const int64_t E = absl::GetFlag(FLAGS_experts), K = absl::GetFlag(FLAGS_top_k);
  const int64_t d = absl::GetFlag(FLAGS_d_model), h = absl::GetFlag(FLAGS_d_hidden);
  const int64_t T = absl::GetFlag(FLAGS_tokens);
  const int M = absl::GetFlag(FLAGS_micro_batches), steps = absl::GetFlag(FLAGS_steps);

  moe::client::ClientOptions options;
  options.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_timeout_seconds) * 1000));
  if (const std::string file = absl::GetFlag(FLAGS_token_file); !file.empty()) {
    auto token = moe::client::ReadTokenFile(file, "--token_file");
    if (!token.ok()) return Die("token", token.status());
    options.token = *token;
  }
  auto conn = moe::client::Connection::Connect(absl::GetFlag(FLAGS_server), options);
  if (!conn.ok()) return Die("connect", conn.status());
  if (auto st = (*conn)->Health(); !st.ok()) return Die("health", st);

  moe::LayerConfig config;
  config.num_experts = E;
  config.top_k = K;
  config.d_model = d;
  config.d_hidden = h;
  config.activation = moe::Activation::kSwiGLU;
  config.routing = moe::RoutingMode::kClient;
  config.optimizer.kind = moe::OptimizerKind::kAdamW;
  config.optimizer.learning_rate = absl::GetFlag(FLAGS_lr);
  moe::LayerConfig teacher_config = config;
  teacher_config.seed = 1234;
  config.seed = 1;
  // Fresh layers each run, so the demo starts from step 0 against a long-lived server too.
  for (const char* name : {"demo-teacher", "demo-student", "demo-restored"}) {
    absl::Status st = (*conn)->DeleteLayer(name);
    if (!st.ok() && !absl::IsNotFound(st)) return Die("delete", st);
  }
  auto teacher = moe::client::RemoteLayer::Create(*conn, "demo-teacher", teacher_config);
  if (!teacher.ok()) return Die("create teacher", teacher.status());
  auto student = moe::client::RemoteLayer::Create(*conn, "demo-student", config);
  if (!student.ok()) return Die("create student", student.status());
  auto student_info = (*conn)->GetLayer("demo-student");
  if (!student_info.ok()) return Die("get student", student_info.status());
  std::printf(
      "moe-demo: server %s (%s), student and teacher E=%lld K=%lld d=%lld h=%lld, "
      "%d micro-batches x %lld tokens per step\n",
      (*conn)->target().c_str(), student_info->device().c_str(), static_cast<long long>(E),
      static_cast<long long>(K), static_cast<long long>(d), static_cast<long long>(h), M,
      static_cast<long long>(T));

  std::mt19937 rng(42);
  const Tensor router = RandomNormal(rng, {d, E}, 1.0f / std::sqrt(static_cast<float>(d)));
  double first_loss = 0, last_loss = 0;
  const auto train_start = std::chrono::steady_clock::now();
  for (int step = 1; step <= steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<MicroBatch> mb(M);
    for (auto& b : mb) {  // all forwards in flight at once
      b.x = RandomNormal(rng, {T, d}, 1.0f);
      Route(b.x, router, K, &b.ids, &b.weights);
      b.student = (*student)->Forward(b.x.view(), b.ids.view(), b.weights.view(), true);
      b.teacher = (*teacher)->Forward(b.x.view(), b.ids.view(), b.weights.view(), false);
    }
    double loss = 0;
    const double n = static_cast<double>(M) * T * d;
    for (auto& b : mb) {  // each backward leaves as soon as its forward is back
      auto s = b.student.get();
      if (!s.ok()) return Die("student forward", s.status());
      auto t = b.teacher.get();
      if (!t.ok()) return Die("teacher forward", t.status());
      b.dout = Tensor::Zeros(DType::kFloat32, {T, d});
      for (int64_t i = 0; i < T * d; ++i) {
        const double diff = s->out.as<float>()[i] - t->out.as<float>()[i];
        loss += diff * diff / n;
        b.dout.as<float>()[i] = static_cast<float>(2 * diff / n);
      }
      b.backward = (*student)->Backward(s->context_id, b.dout.view());
    }
    for (auto& b : mb) {
      auto r = b.backward.get();
      if (!r.ok()) return Die("backward", r.status());
    }
    auto st = (*student)->Step();
    if (!st.ok()) return Die("step", st.status());
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (step == 1) first_loss = loss;
    last_loss = loss;
    int64_t busiest = 0;
    for (int64_t c : st->tokens_per_expert) busiest = std::max(busiest, c);
    std::printf("step %4d/%d  loss %.6f  tokens/s %8.0f  grad_norm %.4f  max tokens/expert %lld\n",
                step, steps, loss, M * T / secs, st->grad_norm, static_cast<long long>(busiest));
    std::fflush(stdout);
  }
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - train_start).count();
  std::printf("moe-demo: loss %.6f -> %.6f (%.1fx lower) in %d steps, %.1f s, %.0f tokens/s\n",
              first_loss, last_loss, first_loss / std::max(last_loss, 1e-30), steps, total,
              static_cast<double>(steps) * M * T / total);

  // Checkpoint round trip: save, load into a fresh layer, compare outputs bit for bit.
  const std::string path = absl::GetFlag(FLAGS_checkpoint);
  auto saved = (*student)->SaveCheckpoint(path);
  if (!saved.ok()) return Die("save checkpoint", saved.status());
  std::printf("moe-demo: saved checkpoint %s (step %lld, %lld bytes)\n", saved->path().c_str(),
              static_cast<long long>(saved->step()), static_cast<long long>(saved->bytes()));
  moe::LayerConfig fresh_config = config;
  fresh_config.seed = 999;
  auto fresh = moe::client::RemoteLayer::Create(*conn, "demo-restored", fresh_config);
  if (!fresh.ok()) return Die("create fresh layer", fresh.status());
  Tensor x = RandomNormal(rng, {T, d}, 1.0f), ids, weights;
  Route(x, router, K, &ids, &weights);
  auto before = (*fresh)->Forward(x.view(), ids.view(), weights.view(), false).get();
  if (!before.ok()) return Die("forward fresh", before.status());
  if (auto st = (*fresh)->LoadCheckpoint(path); !st.ok()) return Die("load checkpoint", st);
  auto a = (*student)->Forward(x.view(), ids.view(), weights.view(), false).get();
  auto b = (*fresh)->Forward(x.view(), ids.view(), weights.view(), false).get();
  if (!a.ok()) return Die("forward student", a.status());
  if (!b.ok()) return Die("forward restored", b.status());
  auto max_diff = [&](const Tensor& p, const Tensor& q) {
    double m = 0;
    for (int64_t i = 0; i < p.num_elements(); ++i) {
      m = std::max(m, std::fabs(static_cast<double>(p.as<float>()[i]) - q.as<float>()[i]));
    }
    return m;
  };
  auto info = (*conn)->GetLayer("demo-restored");
  const bool identical = a->out.bytes == b->out.bytes;
  std::printf("moe-demo: fresh layer before load: max |diff| vs student %.6f\n",
              max_diff(a->out, before->out));
  std::printf("moe-demo: loaded into demo-restored (step %lld): max |diff| %.1e, outputs %s\n",
              info.ok() ? static_cast<long long>(info->step()) : -1LL, max_diff(a->out, b->out),
              identical ? "IDENTICAL (bit for bit)" : "DIFFERENT");
  if (!identical) return 1;
  if (!(last_loss < first_loss * 0.5)) {
    std::fprintf(stderr, "moe-demo: the loss did not fall enough\n");
    return 1;
  }
  return 0;
}
