// Memory admission through the service, as a hostile or careless client meets it: a layer or a
// checkpoint that does not fit the memory budget, creates and contexts past a principal's quota,
// contexts left behind by clients without a session, and request tensors streamed past the
// budget. Each is answered RESOURCE_EXHAUSTED (naming the bytes or the quota) at once, with
// nothing allocated; afterwards the server still serves and a trained reference layer's weights
// and optimizer state are bitwise unchanged.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/cpu_engine.h"
#include "tests/server/server_fixture.h"
#include "wire/wire.h"

namespace moe::server_test {
namespace {

// The reference layer's: server routing (Forward needs only x), 6 experts, top 2, d 16, h 24.
LayerConfig ReferenceConfig() { return SmallConfig(RoutingMode::kServer); }

using Clock = std::chrono::steady_clock;

constexpr int64_t kMiB = int64_t{1} << 20;

void ExpectExhausted(const absl::Status& st, const std::string& needle) {
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(std::string(st.message()).find(needle), std::string::npos)
      << "message lacks \"" << needle << "\": " << st;
}

void ExpectExhausted(const grpc::Status& st, const std::string& needle) {
  ExpectExhausted(client::FromGrpcStatus(st), needle);
}

// The state bytes the CPU engine keeps for `config` (AdamW, fp32): weight, gradient, two moments.
int64_t CpuStateBytes(const LayerConfig& c) {
  const int64_t params = c.local_experts() * c.d_model * c.d_hidden * (c.gated() ? 3 : 2) +
                         (c.routing == RoutingMode::kServer ? c.d_model * c.num_experts : 0);
  return params * 16;
}

// E = 32, d = h = 2048, fp32, AdamW: 7.5 GiB of state.
LayerConfig HugeConfig() {
  LayerConfig c;
  c.num_experts = 32;
  c.top_k = 2;
  c.d_model = 2048;
  c.d_hidden = 2048;
  return c;
}

int64_t Admitted(client::Connection& conn) {
  auto stats = conn.GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->memory_admitted_bytes() : -1;
}

// What the server admits once a failed call's reactor is gone (which happens just after the
// client sees the status).
int64_t AdmittedSettled(client::Connection& conn, int64_t want) {
  int64_t got = Admitted(conn);
  for (int i = 0; i < 100 && got != want; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    got = Admitted(conn);
  }
  return got;
}

TEST(HostileAdmissionTest, CreateLayerPastTheBudgetIsRefusedAtOnce) {
  server::ServerOptions options = LoopbackOptions();
  options.memory_budget_bytes = int64_t{3} << 30;
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig(), options));
  auto stats = s.conn().GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->memory_budget_bytes(), int64_t{3} << 30);
  const int64_t reference = CpuStateBytes(ReferenceConfig());
  EXPECT_EQ(stats->memory_admitted_bytes(), reference);

  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<v1::LayerInfo> created = s.conn().CreateLayer("huge", HugeConfig());
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ExpectExhausted(created.status(),
                  absl::StrCat("needs ", CpuStateBytes(HugeConfig()), " bytes of state"));
  ExpectExhausted(created.status(), absl::StrCat((int64_t{3} << 30) - reference, " of the ",
                                                 int64_t{3} << 30, "-byte budget"));
  EXPECT_LT(seconds, 2.0) << "refused only after " << seconds << " s";
  EXPECT_EQ(s.conn().GetLayer("huge").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Admitted(s.conn()), reference);
  s.ExpectServingAndUnchanged("a create past the budget");

  // LoadCheckpoint of a new layer is admitted the same way: a checkpoint of a layer larger than
  // the budget, written by a server with room for it, is refused by this one.
  LayerConfig medium = ReferenceConfig();
  medium.num_experts = 8;
  medium.d_model = 64;
  medium.d_hidden = 256;
  server::ServerOptions roomy = LoopbackOptions();
  roomy.checkpoint_dir = options.checkpoint_dir;
  ReferenceServer writer;
  ASSERT_NO_FATAL_FAILURE(writer.Start(ReferenceConfig(), roomy));
  ASSERT_TRUE(writer.conn().CreateLayer("medium", medium).ok());
  ASSERT_TRUE(writer.conn().SaveCheckpoint("medium", "medium.safetensors").ok());

  server::ServerOptions tight = options;
  tight.memory_budget_bytes = CpuStateBytes(medium) - 1 + CpuStateBytes(ReferenceConfig());
  ReferenceServer reader;
  ASSERT_NO_FATAL_FAILURE(reader.Start(ReferenceConfig(), tight));
  absl::StatusOr<v1::LayerInfo> loaded =
      reader.conn().LoadCheckpoint("medium", "medium.safetensors");
  ExpectExhausted(loaded.status(), absl::StrCat("needs ", CpuStateBytes(medium), " bytes"));
  EXPECT_EQ(reader.conn().GetLayer("medium").status().code(), absl::StatusCode::kNotFound);
  reader.ExpectServingAndUnchanged("a load past the budget");
  // One byte more and it fits, and the layer holds what was admitted for it.
  tight.memory_budget_bytes += 1;
  ReferenceServer roomier;
  ASSERT_NO_FATAL_FAILURE(roomier.Start(ReferenceConfig(), tight));
  loaded = roomier.conn().LoadCheckpoint("medium", "medium.safetensors");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->resident_bytes(), CpuStateBytes(medium));
  EXPECT_EQ(Admitted(roomier.conn()), tight.memory_budget_bytes);
}

TEST(HostileAdmissionTest, CreatesPastTheLayerQuotaAreRefusedNamingIt) {
  LayerConfig second = ReferenceConfig();
  second.seed = 9;
  server::ServerOptions options = LoopbackOptions();
  options.principal_layer_bytes_quota = 2 * CpuStateBytes(ReferenceConfig());
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig(), options));
  ASSERT_TRUE(s.conn().CreateLayer("second", second).ok());
  absl::StatusOr<v1::LayerInfo> third = s.conn().CreateLayer("third", second);
  ExpectExhausted(third.status(), "--principal_layer_bytes_quota");
  ExpectExhausted(third.status(), "\"anonymous\"");
  EXPECT_EQ(s.conn().GetLayer("third").status().code(), absl::StatusCode::kNotFound);
  s.ExpectServingAndUnchanged("a create past the layer quota");
  // Deleting a layer gives its bytes back.
  ASSERT_TRUE(s.conn().DeleteLayer("second").ok());
  EXPECT_TRUE(s.conn().CreateLayer("third", second).ok());
  EXPECT_EQ(Admitted(s.conn()), 2 * CpuStateBytes(ReferenceConfig()));
}

TEST(HostileAdmissionTest, ContextsPastTheContextQuotaAreRefusedNamingIt) {
  // One context's size, measured on a server without a quota.
  ReferenceServer probe;
  ASSERT_NO_FATAL_FAILURE(probe.Start(ReferenceConfig(), LoopbackOptions()));
  std::mt19937 rng(8);
  const int64_t d = ReferenceConfig().d_model;
  Tensor x = RandomFloat(rng, {16, d}), dout = RandomFloat(rng, {16, d});
  ASSERT_TRUE(
      probe.conn().Forward(ReferenceServer::kReference, 1, true, x.view(), {}, {}).get().ok());
  const int64_t one = probe.conn().GetStats()->saved_context_bytes();
  ASSERT_GT(one, 0);

  server::ServerOptions options = LoopbackOptions();
  options.principal_context_bytes_quota = 2 * one;
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig(), options));
  client::Connection& c = s.conn();
  const char* ref = ReferenceServer::kReference;
  ASSERT_TRUE(c.Forward(ref, 1, true, x.view(), {}, {}).get().ok());
  ASSERT_TRUE(c.Forward(ref, 2, true, x.view(), {}, {}).get().ok());
  absl::Status st = c.Forward(ref, 3, true, x.view(), {}, {}).get().status();
  ExpectExhausted(st, "--principal_context_bytes_quota");
  ExpectExhausted(st, absl::StrCat("holds ", 2 * one, " bytes of saved contexts"));
  EXPECT_EQ(c.GetStats()->saved_contexts(), 2);
  // Inference keeps no context and still runs; the two contexts are whole.
  EXPECT_TRUE(c.Forward(ref, 0, false, x.view(), {}, {}).get().ok());
  EXPECT_TRUE(c.Backward(ref, 1, dout.view()).get().ok());
  EXPECT_TRUE(c.Backward(ref, 2, dout.view()).get().ok());
  EXPECT_TRUE(c.Forward(ref, 3, true, x.view(), {}, {}).get().ok());  // room again
  EXPECT_TRUE(c.Backward(ref, 3, dout.view()).get().ok());
  s.ExpectServingAndUnchanged("contexts past the context quota");
}

// Training that fills the memory budget with contexts is refused its next context, and never
// locked out of the Backwards that drain it: a Forward's x is charged while its context is
// admitted, so room for a dout of the same size is left beside every context.
TEST(HostileAdmissionTest, ContextsFillingTheBudgetLeaveRoomForTheirBackward) {
  ReferenceServer probe;
  ASSERT_NO_FATAL_FAILURE(probe.Start(ReferenceConfig(), LoopbackOptions()));
  std::mt19937 rng(12);
  const int64_t tokens = 16, d = ReferenceConfig().d_model;
  Tensor x = RandomFloat(rng, {tokens, d}), dout = RandomFloat(rng, {tokens, d});
  const char* ref = ReferenceServer::kReference;
  ASSERT_TRUE(probe.conn().Forward(ref, 1, true, x.view(), {}, {}).get().ok());
  const int64_t context = probe.conn().GetStats()->saved_context_bytes();
  const int64_t x_bytes = tokens * d * 4, dout_bytes = tokens * d * 4;
  // A training Forward is admitted with room for its Backward once its context is kept.
  std::unique_ptr<Engine> cpu = CreateCpuEngine();
  const int64_t forward =
      *cpu->HostWorkingBytes(ReferenceConfig(), tokens, EngineCall::kTrainingForward);
  const int64_t backward = *cpu->HostWorkingBytes(ReferenceConfig(), tokens, EngineCall::kBackward);
  const int64_t reserve = forward + backward + dout_bytes;

  server::ServerOptions options = LoopbackOptions();
  options.memory_budget_bytes = CpuStateBytes(ReferenceConfig()) + context + x_bytes + reserve - 1;
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig(), options));
  client::Connection& c = s.conn();
  ASSERT_TRUE(c.Forward(ref, 1, true, x.view(), {}, {}).get().ok());
  ExpectExhausted(c.Forward(ref, 2, true, x.view(), {}, {}).get().status(),
                  absl::StrCat("memory budget: training forward of 16 tokens (with room for its "
                               "backward): this call's working memory would need ",
                               reserve, " bytes"));
  EXPECT_TRUE(c.Backward(ref, 1, dout.view()).get().ok());
  ASSERT_TRUE(c.Forward(ref, 2, true, x.view(), {}, {}).get().ok());
  EXPECT_TRUE(c.Backward(ref, 2, dout.view()).get().ok());
  s.ExpectServingAndUnchanged("contexts filling the budget");
}

TEST(HostileAdmissionTest, ContextsOutsideASessionAreFreedAfterTheShortTtl) {
  server::ServerOptions options = LoopbackOptions();
  options.sessionless_context_ttl_seconds = 0.3;  // contexts of a session keep the 600 s default
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig(), options));
  client::ClientOptions no_session;
  no_session.open_session = false;
  auto gone = client::Connection::Connect(s.target(), no_session);
  ASSERT_TRUE(gone.ok()) << gone.status();
  std::mt19937 rng(9);
  const int64_t d = ReferenceConfig().d_model;
  Tensor x = RandomFloat(rng, {8, d}), dout = RandomFloat(rng, {8, d});
  const char* ref = ReferenceServer::kReference;
  ASSERT_TRUE((*gone)->Forward(ref, 11, true, x.view(), {}, {}).get().ok());
  ASSERT_TRUE((*gone)->Forward(ref, 12, true, x.view(), {}, {}).get().ok());
  ASSERT_TRUE(s.conn().Forward(ref, 13, true, x.view(), {}, {}).get().ok());
  EXPECT_EQ(s.conn().GetStats()->saved_contexts(), 3);
  const int64_t with_contexts = Admitted(s.conn());
  gone->reset();  // the sessionless client goes away without a Backward

  int64_t left = -1;
  const Clock::time_point t0 = Clock::now();
  while (left != 1 && Clock::now() - t0 < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    left = s.conn().GetStats()->saved_contexts();
  }
  EXPECT_EQ(left, 1);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0);
  EXPECT_LT(Admitted(s.conn()), with_contexts);
  // The session's context is still there; the session-less ones are gone.
  EXPECT_TRUE(s.conn().Backward(ref, 13, dout.view()).get().ok());
  auto other = client::Connection::Connect(s.target(), no_session);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ((*other)->Backward(ref, 11, dout.view()).get().status().code(),
            absl::StatusCode::kNotFound);
  s.ExpectServingAndUnchanged("session-less contexts expiring");
}

// Sends up to `chunks` Forward messages of one micro-batch on the reference layer, each with
// `chunk_bytes` of x's data and x's shape `claimed`, then ends the stream: the status.
grpc::Status StreamX(client::Connection& conn, std::vector<int64_t> claimed, int64_t chunk_bytes,
                     int chunks) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = conn.stub()->Forward(&ctx);
  v1::ForwardRequest req;
  req.set_layer(ReferenceServer::kReference);
  wire::SetTensorHeader(DType::kFloat32, claimed, req.mutable_x());
  req.mutable_x()->set_data(std::string(static_cast<size_t>(chunk_bytes), '\0'));
  for (int i = 0; i < chunks; ++i) {
    req.set_last_chunk(i + 1 == chunks);
    if (!stream->Write(req)) break;  // the server has answered
  }
  stream->WritesDone();
  return stream->Finish();
}

TEST(HostileAdmissionTest, StreamedTensorsPastTheBudgetAreRefused) {
  server::ServerOptions options = LoopbackOptions();
  options.memory_budget_bytes = 16 * kMiB;
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig(), options));
  const int64_t reference = CpuStateBytes(ReferenceConfig());
  const int64_t d = ReferenceConfig().d_model;

  // An x whose shape claims 64 MiB: refused at its first chunk, before anything is reserved.
  grpc::Status st = StreamX(s.conn(), {int64_t{1} << 20, d}, kMiB, 64);
  ExpectExhausted(st, "memory budget: x: this request's tensors would hold 67108864 bytes");
  EXPECT_EQ(AdmittedSettled(s.conn(), reference), reference);
  s.ExpectServingAndUnchanged("an x claiming 64 MiB");

  // An x that claims 1 KiB and keeps sending: refused at the first chunk that passes its shape,
  // before that chunk is charged or kept.
  st = StreamX(s.conn(), {16, d}, kMiB, 64);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("x: 1048576 bytes, more than its shape holds"),
            std::string::npos)
      << st.error_message();
  EXPECT_EQ(AdmittedSettled(s.conn(), reference), reference);
  s.ExpectServingAndUnchanged("an x sent past its shape");

  // The same for ImportWeights: a tensor streamed past the budget.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ImportWeightsResponse resp;
    auto stream = s.conn().stub()->ImportWeights(&ctx, &resp);
    v1::WeightChunk chunk;
    chunk.set_layer(ReferenceServer::kReference);
    chunk.set_name("w1");
    wire::SetTensorHeader(DType::kFloat32, {int64_t{1} << 22, d}, chunk.mutable_tensor());
    chunk.mutable_tensor()->set_data(std::string(static_cast<size_t>(kMiB), '\0'));
    for (int i = 0; i < 64 && stream->Write(chunk); ++i) {
    }
    stream->WritesDone();
    ExpectExhausted(stream->Finish(), "memory budget: tensor w1:");
  }
  EXPECT_EQ(AdmittedSettled(s.conn(), reference), reference);
  s.ExpectServingAndUnchanged("an import past the budget");

  // A micro-batch within the budget still runs.
  std::mt19937 rng(2);
  Tensor x = RandomFloat(rng, {1024, d});
  EXPECT_TRUE(s.conn().Forward(ReferenceServer::kReference, 0, false, x.view(), {}, {}).get().ok());
}

// d = 64, h = 4096, K = 8 of 8 experts: each token's 8 routed rows need [8, 2h] fp32 hidden
// activations, 1024 times x's own bytes, so a modest x asks the engine for far more host
// memory than the server has.
LayerConfig WideConfig() {
  LayerConfig c;
  c.num_experts = 8;
  c.top_k = 8;
  c.d_model = 64;
  c.d_hidden = 4096;
  c.routing = RoutingMode::kServer;
  c.seed = 9;
  return c;
}

// An engine call's working memory is admitted before the engine allocates it: a Forward whose
// activations do not fit is refused (and charges nothing afterwards); a Backward that does not
// fit is refused before its context is consumed, so it runs once memory is free again.
TEST(HostileAdmissionTest, ACallWhoseWorkingMemoryIsPastTheBudgetIsRefused) {
  server::ServerOptions options = LoopbackOptions();
  options.memory_budget_bytes = 256 * kMiB;
  ReferenceServer s;
  ASSERT_NO_FATAL_FAILURE(s.Start(ReferenceConfig(), options));
  ASSERT_TRUE(s.conn().CreateLayer("wide", WideConfig()).ok());
  const int64_t settled = Admitted(s.conn());
  const int64_t d = WideConfig().d_model;
  std::unique_ptr<Engine> cpu = CreateCpuEngine();

  // 1024 tokens (256 KiB of x): over 400 MB of working memory, refused.
  std::mt19937 rng(23);
  Tensor big = RandomFloat(rng, {1024, d});
  auto fwd = s.conn().Forward("wide", 0, false, big.view(), {}, {}).get();
  ExpectExhausted(fwd.status(),
                  "memory budget: forward of 1024 tokens: this call's working memory would need");
  EXPECT_EQ(AdmittedSettled(s.conn(), settled), settled);
  s.ExpectServingAndUnchanged("a forward whose working memory is past the budget");

  // A training Forward of 64 tokens fits; its Backward is made not to fit by a layer that takes
  // all but half of the Backward's working memory.
  Tensor x = RandomFloat(rng, {64, d}), dout = RandomFloat(rng, {64, d});
  const uint64_t id = s.conn().NextContextId();
  fwd = s.conn().Forward("wide", id, true, x.view(), {}, {}).get();
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  auto stats = s.conn().GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  auto backward_bytes = cpu->HostWorkingBytes(WideConfig(), 64, EngineCall::kBackward);
  ASSERT_TRUE(backward_bytes.ok()) << backward_bytes.status();
  const int64_t free = stats->memory_budget_bytes() - stats->memory_admitted_bytes();
  LayerConfig filler;
  filler.num_experts = 1;
  filler.top_k = 1;
  filler.d_model = 64;
  filler.d_hidden = 1;
  const int64_t per_hidden_unit = CpuStateBytes(filler);
  filler.d_hidden = (free - *backward_bytes / 2) / per_hidden_unit;
  ASSERT_GT(filler.d_hidden, 0);
  ASSERT_TRUE(s.conn().CreateLayer("filler", filler).ok());
  auto bwd = s.conn().Backward("wide", id, dout.view()).get();
  ExpectExhausted(bwd.status(), "memory budget: backward of 64 tokens: this call's working memory");
  // The context is still there: with the memory free again, the same Backward runs.
  ASSERT_TRUE(s.conn().DeleteLayer("filler").ok());
  bwd = s.conn().Backward("wide", id, dout.view()).get();
  EXPECT_TRUE(bwd.ok()) << bwd.status();
  s.ExpectServingAndUnchanged("a backward whose working memory is past the budget");
}

}  // namespace
}  // namespace moe::server_test
