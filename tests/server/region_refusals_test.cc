// Registered regions refused through a real moe-server on loopback (CPU engine, plain stub):
// every bad reference in a Forward or Backward gets its code and names its field, and loses
// nothing (the layer's weights and optimizer state, its saved contexts and the gradients it
// accumulates are as if the call had never been made); registering needs a live session of the
// caller; the region quota; CUDA regions and event pairs on a server without CUDA.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "client/client.h"
#include "client/shared_memory_region.h"
#include "engine/layer.h"
#include "server/region_registry.h"
#include "tests/server/region_fixture.h"
#include "tests/server/server_fixture.h"
#include "wire/wire.h"

namespace moe::server_test {
namespace {

using grpc::StatusCode;

constexpr int64_t kTokens = 8;
constexpr int64_t kArenaBytes = 16 << 10;

// A bad request and what it must get.
template <typename Req>
struct Refusal {
  std::string what;
  std::vector<Req> messages;
  StatusCode code;
  std::string field;
};

// Layer "m" (client routing) and its twin "twin" run the same good Forward (context 1); only "m"
// then gets the bad requests, each checked to leave its weights, optimizer state and saved
// contexts alone. Last, both run the same good Backward and a Step, and must agree bitwise: so
// no refused Backward consumed the context or accumulated a gradient.
class RegionRefusalsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    lb_ = StartLoopback();
    ASSERT_TRUE(lb_.conn);
    config_ = SmallConfig(RoutingMode::kClient);
    ASSERT_TRUE(conn().CreateLayer("m", config_).ok());
    ASSERT_TRUE(conn().CreateLayer("twin", config_).ok());
    ASSERT_NO_FATAL_FAILURE(arena_.Create(conn(), kArenaBytes));
    auto other = lb_.Connect();
    ASSERT_TRUE(other.ok()) << other.status();
    other_ = *other;
    ASSERT_NO_FATAL_FAILURE(foreign_.Create(*other_, kArenaBytes));

    std::mt19937 rng(31);
    x_ = RandomFloat(rng, {kTokens, config_.d_model});
    RandomRouting(rng, kTokens, config_, &ids_, &w_);
    dout_ = RandomFloat(rng, {kTokens, config_.d_model});
    x_at_ = arena_.Put(x_);
    ids_at_ = arena_.Put(ids_);
    w_at_ = arena_.Put(w_);
    out_at_ = arena_.Room(OutBytes());
    dout_at_ = arena_.Put(dout_);
    dx_at_ = arena_.Room(OutBytes());
    dweights_at_ = arena_.Room(kTokens * config_.top_k * 4);

    for (const char* layer : {"m", "twin"}) {
      v1::ForwardRequest f = GoodForward(1);
      f.set_layer(layer);
      auto a = SendForward(conn(), {f});
      ASSERT_TRUE(a.status.ok()) << a.status.error_message();
    }
    auto state = conn().ExportWeights("m", /*include_optimizer=*/true);
    ASSERT_TRUE(state.ok()) << state.status();
    state_ = std::move(*state);
  }

  client::Connection& conn() { return *lb_.conn; }
  int64_t OutBytes() const { return kTokens * config_.d_model * 4; }

  // A training Forward of "m", everything by reference.
  v1::ForwardRequest GoodForward(uint64_t context_id) const {
    v1::ForwardRequest r = ForwardOf("m", context_id);
    *r.mutable_x() = ByRef(x_, arena_.id(), x_at_);
    *r.mutable_expert_ids() = ByRef(ids_, arena_.id(), ids_at_);
    *r.mutable_weights() = ByRef(w_, arena_.id(), w_at_);
    *r.mutable_out_ref() = RefTo(arena_.id(), out_at_);
    return r;
  }
  // The Backward of context 1 of "m", everything by reference.
  v1::BackwardRequest GoodBackward() const {
    v1::BackwardRequest r = BackwardOf("m", 1);
    *r.mutable_dout() = ByRef(dout_, arena_.id(), dout_at_);
    *r.mutable_dx_ref() = RefTo(arena_.id(), dx_at_);
    *r.mutable_dweights_ref() = RefTo(arena_.id(), dweights_at_);
    return r;
  }

  // "m" holds what it held after SetUp: the same state and one saved context.
  void ExpectNothingLost(const std::string& after) {
    auto state = conn().ExportWeights("m", /*include_optimizer=*/true);
    ASSERT_TRUE(state.ok()) << state.status();
    ExpectSameState(state_, *state, after);
    auto info = conn().GetLayer("m");
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->saved_contexts(), 1) << "after " << after;
  }

  Loopback lb_;
  LayerConfig config_;
  RegionArena arena_, foreign_;  // foreign_: another session's
  std::shared_ptr<client::Connection> other_;
  Tensor x_, ids_, w_, dout_;
  int64_t x_at_ = 0, ids_at_ = 0, w_at_ = 0, out_at_ = 0, dout_at_ = 0, dx_at_ = 0,
          dweights_at_ = 0;
  State state_;
};

TEST_F(RegionRefusalsTest, BadForwardReferencesLoseNothing) {
  std::vector<Refusal<v1::ForwardRequest>> refusals;
  auto add = [&](std::string what, v1::ForwardRequest r, StatusCode code, std::string field) {
    refusals.push_back({std::move(what), {std::move(r)}, code, std::move(field)});
  };
  uint64_t id = 100;
  v1::ForwardRequest r = GoodForward(++id);
  r.mutable_x()->mutable_ref()->set_region_id(arena_.id() + 1);
  add("unknown region", r, StatusCode::NOT_FOUND, "x.ref.region_id");
  r = GoodForward(++id);
  r.mutable_x()->mutable_ref()->set_region_id(foreign_.id());
  add("another session's region", r, StatusCode::NOT_FOUND, "x.ref.region_id");
  r = GoodForward(++id);
  *r.mutable_out_ref() = RefTo(foreign_.id(), 0);
  add("a destination in another session's region", r, StatusCode::NOT_FOUND,
      "out_ref.region_id");
  r = GoodForward(++id);
  r.mutable_x()->mutable_ref()->set_region_id(0);
  add("region 0", r, StatusCode::INVALID_ARGUMENT, "x.ref.region_id");
  r = GoodForward(++id);
  r.mutable_x()->mutable_ref()->set_offset(kArenaBytes - 64);
  add("out of bounds", r, StatusCode::INVALID_ARGUMENT, "x.ref.offset");
  r = GoodForward(++id);
  r.mutable_x()->mutable_ref()->set_offset(x_at_ + 2);
  add("misaligned", r, StatusCode::INVALID_ARGUMENT, "x.ref.offset");
  r = GoodForward(++id);
  r.mutable_expert_ids()->mutable_ref()->set_offset(-4);
  add("negative offset", r, StatusCode::INVALID_ARGUMENT, "expert_ids.ref.offset");
  r = GoodForward(++id);
  *r.mutable_out_ref() = RefTo(arena_.id(), kArenaBytes - 4);
  add("destination out of bounds", r, StatusCode::INVALID_ARGUMENT, "out_ref.offset");
  r = GoodForward(++id);
  *r.mutable_out_ref() = RefTo(arena_.id(), x_at_);
  add("out over x", r, StatusCode::INVALID_ARGUMENT, "out_ref");
  r = GoodForward(++id);
  *r.mutable_out_ref() = RefTo(arena_.id(), w_at_ - 4);
  add("out over the tail of expert_ids and weights", r, StatusCode::INVALID_ARGUMENT, "out_ref");
  r = GoodForward(++id);
  r.mutable_x()->set_dtype(v1::DTYPE_BFLOAT16);
  add("x of the wrong dtype", r, StatusCode::INVALID_ARGUMENT, "x");
  r = GoodForward(++id);
  r.mutable_x()->set_shape(1, config_.d_model / 2);
  add("x of the wrong shape", r, StatusCode::INVALID_ARGUMENT, "x");
  r = GoodForward(++id);
  r.mutable_x()->set_shape(1, config_.d_model / 2);
  r.clear_out_ref();
  add("x of the wrong shape, out in the response", r, StatusCode::INVALID_ARGUMENT, "x");
  r = GoodForward(++id);
  r.mutable_expert_ids()->set_dtype(v1::DTYPE_FLOAT32);
  add("expert_ids of the wrong dtype", r, StatusCode::INVALID_ARGUMENT, "expert_ids");
  r = GoodForward(++id);
  r.mutable_weights()->set_shape(0, kTokens - 1);
  add("weights of the wrong shape", r, StatusCode::INVALID_ARGUMENT, "weights");
  r = GoodForward(++id);
  r.mutable_x()->set_data("abcd");
  add("bytes as well as a reference", r, StatusCode::INVALID_ARGUMENT, "x.data");
  r = GoodForward(++id);
  r.set_last_chunk(false);
  add("not one message", r, StatusCode::INVALID_ARGUMENT, "last_chunk");
  r = GoodForward(++id);
  *r.mutable_stripe() = StripeOf(0, 2, 0, kTokens);
  add("striped", r, StatusCode::INVALID_ARGUMENT, "stripe");
  r = GoodForward(++id);
  r.set_event_id(7);
  add("an event pair never registered", r, StatusCode::NOT_FOUND, "event_id");
  v1::ForwardRequest plain = ForwardOf("m", ++id);
  *plain.mutable_x() = Inline(x_);
  *plain.mutable_expert_ids() = Inline(ids_);
  *plain.mutable_weights() = Inline(w_);
  plain.set_event_id(7);
  add("an event pair without references", plain, StatusCode::INVALID_ARGUMENT, "event_id");
  // A micro-batch that began inline and references in its second message.
  v1::ForwardRequest head = ForwardOf("m", ++id);
  v1::Tensor half = Inline(x_);
  half.set_data(half.data().substr(0, half.data().size() / 2));
  *head.mutable_x() = half;
  head.set_last_chunk(false);
  v1::ForwardRequest tail = GoodForward(id);
  tail.clear_x();
  refusals.push_back({"references after the first message",
                      {head, tail},
                      StatusCode::INVALID_ARGUMENT,
                      "expert_ids.ref"});

  // SetUp's Forwards wrote out: poisoned again, to show that no refused call writes it.
  std::memset(static_cast<char*>(arena_.shm().data()) + out_at_, 0xA5,
              static_cast<size_t>(OutBytes()));
  for (const auto& refusal : refusals) {
    SCOPED_TRACE(refusal.what);
    ExpectStatus(SendForward(conn(), refusal.messages).status, refusal.code, refusal.field);
    ExpectNothingLost(refusal.what);
  }
  const Tensor out = arena_.Read(DType::kFloat32, {kTokens, config_.d_model}, out_at_);
  EXPECT_TRUE(std::all_of(out.bytes.begin(), out.bytes.end(),
                          [](auto b) { return static_cast<uint8_t>(b) == 0xA5; }));
}

TEST_F(RegionRefusalsTest, BadBackwardReferencesKeepTheContext) {
  std::vector<Refusal<v1::BackwardRequest>> refusals;
  auto add = [&](std::string what, v1::BackwardRequest r, StatusCode code, std::string field) {
    refusals.push_back({std::move(what), {std::move(r)}, code, std::move(field)});
  };
  v1::BackwardRequest r = GoodBackward();
  r.mutable_dout()->mutable_ref()->set_region_id(arena_.id() ^ 1);
  add("unknown region", r, StatusCode::NOT_FOUND, "dout.ref.region_id");
  r = GoodBackward();
  r.mutable_dout()->mutable_ref()->set_region_id(foreign_.id());
  add("another session's region", r, StatusCode::NOT_FOUND, "dout.ref.region_id");
  r = GoodBackward();
  *r.mutable_dx_ref() = RefTo(foreign_.id(), 0);
  add("dx in another session's region", r, StatusCode::NOT_FOUND, "dx_ref.region_id");
  r = GoodBackward();
  r.mutable_dout()->mutable_ref()->set_offset(kArenaBytes - 4);
  add("out of bounds", r, StatusCode::INVALID_ARGUMENT, "dout.ref.offset");
  r = GoodBackward();
  r.mutable_dout()->mutable_ref()->set_offset(dout_at_ + 1);
  add("misaligned", r, StatusCode::INVALID_ARGUMENT, "dout.ref.offset");
  r = GoodBackward();
  r.mutable_dout()->set_shape(0, kTokens - 1);
  add("dout of the wrong shape", r, StatusCode::INVALID_ARGUMENT, "dout");
  r = GoodBackward();
  r.mutable_dout()->set_dtype(v1::DTYPE_BFLOAT16);
  add("dout of the wrong dtype", r, StatusCode::INVALID_ARGUMENT, "dout");
  r = GoodBackward();
  *r.mutable_dx_ref() = RefTo(arena_.id(), dout_at_);
  add("dx over dout", r, StatusCode::INVALID_ARGUMENT, "dx_ref");
  r = GoodBackward();
  *r.mutable_dweights_ref() = RefTo(arena_.id(), dx_at_ + 8);
  add("dweights over dx", r, StatusCode::INVALID_ARGUMENT, "dweights_ref");
  r = GoodBackward();
  *r.mutable_dweights_ref() = RefTo(arena_.id(), dweights_at_ + 2);
  add("dweights misaligned", r, StatusCode::INVALID_ARGUMENT, "dweights_ref.offset");
  r = GoodBackward();
  r.set_last_chunk(false);
  add("not one message", r, StatusCode::INVALID_ARGUMENT, "last_chunk");
  r = GoodBackward();
  *r.mutable_stripe() = StripeOf(1, 2, kTokens / 2, kTokens);
  add("striped", r, StatusCode::INVALID_ARGUMENT, "stripe");
  r = GoodBackward();
  r.set_event_id(9);
  add("an event pair never registered", r, StatusCode::NOT_FOUND, "event_id");

  for (const auto& refusal : refusals) {
    SCOPED_TRACE(refusal.what);
    ExpectStatus(SendBackward(conn(), refusal.messages).status, refusal.code, refusal.field);
    ExpectNothingLost(refusal.what);
  }
  // The context is still there, and no refused call accumulated a gradient: "m" and its twin,
  // after the same good Backward and Step, agree bitwise.
  auto by_ref = SendBackward(conn(), {GoodBackward()});
  ASSERT_TRUE(by_ref.status.ok()) << by_ref.status.error_message();
  v1::BackwardRequest by_bytes = BackwardOf("twin", 1);
  *by_bytes.mutable_dout() = Inline(dout_);
  auto twin = SendBackward(conn(), {by_bytes});
  ASSERT_TRUE(twin.status.ok()) << twin.status.error_message();
  EXPECT_TRUE(arena_.Read(DType::kFloat32, {kTokens, config_.d_model}, dx_at_).bytes ==
              FromProto(twin.responses.at(0).dx()).bytes);
  ASSERT_TRUE(conn().Step("m").ok());
  ASSERT_TRUE(conn().Step("twin").ok());
  auto m = conn().ExportWeights("m", true);
  auto t = conn().ExportWeights("twin", true);
  ASSERT_TRUE(m.ok() && t.ok());
  ExpectSameState(*t, *m, "the refused Backwards");
}

TEST_F(RegionRefusalsTest, ServerRoutingHasNoDweightsToWrite) {
  ASSERT_TRUE(conn().CreateLayer("srv", SmallConfig(RoutingMode::kServer)).ok());
  v1::ForwardRequest f = ForwardOf("srv", 5);
  *f.mutable_x() = ByRef(x_, arena_.id(), x_at_);
  ASSERT_TRUE(SendForward(conn(), {f}).status.ok());
  v1::BackwardRequest b = BackwardOf("srv", 5);
  *b.mutable_dout() = ByRef(dout_, arena_.id(), dout_at_);
  *b.mutable_dweights_ref() = RefTo(arena_.id(), dweights_at_);
  ExpectStatus(SendBackward(conn(), {b}).status, StatusCode::INVALID_ARGUMENT, "dweights_ref");
  b.clear_dweights_ref();
  *b.mutable_dx_ref() = RefTo(arena_.id(), dx_at_);
  auto ok = SendBackward(conn(), {b});
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_FALSE(ok.responses.at(0).has_dweights());
}

TEST_F(RegionRefusalsTest, UnregisteredRegionIsNotFound) {
  ExpectStatus(UnregisterRegion(conn(), foreign_.id()), StatusCode::NOT_FOUND, "region_id");
  ASSERT_TRUE(UnregisterRegion(conn(), arena_.id()).ok());
  ExpectStatus(UnregisterRegion(conn(), arena_.id()), StatusCode::NOT_FOUND, "region_id");
  ExpectStatus(SendForward(conn(), {GoodForward(200)}).status, StatusCode::NOT_FOUND,
               "x.ref.region_id");
  ExpectNothingLost("a reference to an unregistered region");
}

TEST(RegionRegistrationTest, NeedsALiveSessionOfTheCaller) {
  const std::string alice = "alice-0123456789abcdef0123456789";
  const std::string bob = "bob-0123456789abcdef0123456789abc";
  server::ServerOptions options = LoopbackOptions();
  options.tokens_file = TempPath("tokens");
  std::ofstream(options.tokens_file) << "alice " << alice << "\nbob " << bob << "\n";
  client::ClientOptions copts = LoopbackClientOptions();
  copts.token = alice;
  Loopback lb = StartLoopback(options, copts);
  ASSERT_TRUE(lb.conn);
  auto shm = client::SharedMemoryRegion::Create(4096);
  ASSERT_TRUE(shm.ok()) << shm.status();
  const v1::RegisterRegionRequest req = (*shm)->RegisterRequest();
  auto call = [&](const std::string& token, const std::string& session) {
    grpc::ClientContext ctx;
    PrepareAs(&ctx, token, session);
    v1::RegisterRegionResponse resp;
    return lb.conn->stub()->RegisterRegion(&ctx, req, &resp);
  };
  const std::string session = lb.conn->session_id();
  ExpectStatus(call(alice, ""), StatusCode::FAILED_PRECONDITION, "moe-session-id");
  ExpectStatus(call(alice, "0123456789abcdef0123456789abcdef"), StatusCode::FAILED_PRECONDITION,
               "moe-session-id");
  ExpectStatus(call(bob, session), StatusCode::PERMISSION_DENIED, "moe-session-id");
  ExpectStatus(call("", session), StatusCode::UNAUTHENTICATED, "authorization");
  EXPECT_EQ(MetricValue(MetricsText(*lb.server), "moe_regions"), 0);
  EXPECT_TRUE(call(alice, session).ok());
  EXPECT_EQ(MetricValue(MetricsText(*lb.server), "moe_regions"), 1);
}

TEST(RegionRegistrationTest, QuotaAndWrongProofsMapNothing) {
  server::ServerOptions options = LoopbackOptions();
  options.principal_region_bytes_quota = 32 << 10;
  Loopback lb = StartLoopback(options);
  ASSERT_TRUE(lb.conn);
  RegionArena first;
  ASSERT_NO_FATAL_FAILURE(first.Create(*lb.conn, 16 << 10));
  auto second = client::SharedMemoryRegion::Create(24 << 10);
  ASSERT_TRUE(second.ok()) << second.status();
  v1::RegisterRegionResponse resp;
  ExpectStatus(RegisterRegion(*lb.conn, (*second)->RegisterRequest(), &resp),
               StatusCode::RESOURCE_EXHAUSTED, "shared_memory.size_bytes");
  auto small = client::SharedMemoryRegion::Create(4 << 10);
  ASSERT_TRUE(small.ok()) << small.status();
  v1::RegisterRegionRequest forged = (*small)->RegisterRequest();
  forged.mutable_shared_memory()->mutable_access_proof()->back() ^= 1;
  ExpectStatus(RegisterRegion(*lb.conn, forged, &resp), StatusCode::PERMISSION_DENIED,
               "shared_memory");
  const std::string page = MetricsText(*lb.server);
  EXPECT_EQ(MetricValue(page, "moe_regions"), 1);
  EXPECT_EQ(MetricValue(page, "moe_region_bytes"), 16 << 10);
  // Within the quota again once the first is gone.
  ASSERT_TRUE(UnregisterRegion(*lb.conn, first.id()).ok());
  EXPECT_TRUE(RegisterRegion(*lb.conn, (*second)->RegisterRequest(), &resp).ok());
}

// Tensors by reference are the client's memory: their shapes are not charged to the memory
// budget as request bytes, only checked against their region.
TEST(RegionAdmissionTest, ReferencedTensorsAreNotRequestBytes) {
  server::ServerOptions options = LoopbackOptions();
  options.memory_budget_bytes = 16 << 20;
  Loopback lb = StartLoopback(options);
  ASSERT_TRUE(lb.conn);
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(lb.conn->CreateLayer("m", config).ok());
  RegionArena arena;
  ASSERT_NO_FATAL_FAILURE(arena.Create(*lb.conn, kArenaBytes));
  // x claims 64 MiB, four times the budget.
  const Tensor claim = Tensor::Zeros(DType::kFloat32, {int64_t{1} << 20, config.d_model});
  v1::ForwardRequest inline_req = ForwardOf("m", 0);
  inline_req.set_training(false);
  wire::SetTensorHeader(DType::kFloat32, claim.shape, inline_req.mutable_x());
  inline_req.mutable_x()->set_data(std::string(1024, '\0'));
  inline_req.set_last_chunk(false);
  ExpectStatus(SendForward(*lb.conn, {inline_req}).status, StatusCode::RESOURCE_EXHAUSTED, "x");
  v1::ForwardRequest ref_req = ForwardOf("m", 0);
  ref_req.set_training(false);
  *ref_req.mutable_x() = ByRef(claim, arena.id(), 0);
  ExpectStatus(SendForward(*lb.conn, {ref_req}).status, StatusCode::INVALID_ARGUMENT,
               "x.ref.offset");
}

TEST(RegionRegistrationTest, CudaRegionsAndEventPairsNeedACudaEngine) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  v1::RegisterRegionRequest cuda;
  cuda.mutable_cuda_ipc()->set_mem_handle(std::string(kCudaIpcHandleBytes, 'm'));
  cuda.mutable_cuda_ipc()->set_size_bytes(4096);
  v1::RegisterRegionResponse resp;
  ExpectStatus(RegisterRegion(*lb.conn, cuda, &resp), StatusCode::FAILED_PRECONDITION,
               "cuda_ipc");
  grpc::ClientContext ctx;
  lb.conn->Prepare(&ctx);
  v1::RegisterEventsRequest events;
  events.set_wait_event_handle(std::string(kCudaIpcHandleBytes, 'e'));
  v1::RegisterEventsResponse events_resp;
  ExpectStatus(lb.conn->stub()->RegisterEvents(&ctx, events, &events_resp),
               StatusCode::FAILED_PRECONDITION, "wait_event_handle");
  grpc::ClientContext unregister_ctx;
  lb.conn->Prepare(&unregister_ctx);
  v1::UnregisterEventsRequest unregister;
  unregister.set_event_id(3);
  v1::UnregisterEventsResponse unregister_resp;
  ExpectStatus(lb.conn->stub()->UnregisterEvents(&unregister_ctx, unregister, &unregister_resp),
               StatusCode::NOT_FOUND, "event_id");
  const std::string page = MetricsText(*lb.server);
  EXPECT_EQ(MetricValue(page, "moe_regions"), 0);
  EXPECT_EQ(MetricValue(page, "moe_event_pairs"), 0);
}

}  // namespace
}  // namespace moe::server_test
