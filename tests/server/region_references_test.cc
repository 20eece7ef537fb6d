// Forward and Backward by reference through a real moe-server on loopback (CPU engine, plain
// stub): a micro-batch whose tensors and destinations lie in a registered shared memory region
// gives bitwise what the same micro-batch sent as bytes gives (both routings, fp32 and bf16), and
// after Steps the two layers hold the same weights and optimizer state; requests that mix
// references with inline tensors work, outputs without a destination come back as bytes; the
// transport metrics count both paths; a region goes with its session; and a region its owner
// truncates fails the calls that use it, not the server.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/shared_memory_region.h"
#include "engine/layer.h"
#include "tests/server/region_fixture.h"
#include "tests/server/server_fixture.h"
#include "wire/raw_message.h"
#include "wire/wire.h"

namespace moe::server_test {
namespace {

// One micro-batch's inputs.
struct Batch {
  Tensor x, ids, w, dout;
};

Batch RandomBatch(std::mt19937& rng, const LayerConfig& c, int64_t tokens) {
  Batch b;
  b.x = RandomFloat(rng, {tokens, c.d_model});
  b.dout = RandomFloat(rng, {tokens, c.d_model});
  if (c.routing == RoutingMode::kClient) RandomRouting(rng, tokens, c, &b.ids, &b.w);
  if (c.dtype == DType::kBFloat16) {
    b.x = ToBFloat16(b.x);
    b.dout = ToBFloat16(b.dout);
  }
  return b;
}

// `a` and `b` have the same dtype, shape and bytes.
void ExpectSameTensor(const Tensor& a, const Tensor& b, const std::string& what) {
  EXPECT_EQ(a.dtype, b.dtype) << what;
  EXPECT_EQ(a.shape, b.shape) << what;
  EXPECT_TRUE(a.bytes == b.bytes) << what << " differs";
}

// The response tensor `t` is `shape` of `dtype` written in place at `ref`: no bytes.
void ExpectWrittenInPlace(const v1::Tensor& t, DType dtype, const std::vector<int64_t>& shape,
                          const v1::TensorRef& ref, const std::string& what) {
  EXPECT_TRUE(t.has_ref()) << what;
  EXPECT_EQ(t.ref().region_id(), ref.region_id()) << what;
  EXPECT_EQ(t.ref().offset(), ref.offset()) << what;
  EXPECT_EQ(t.dtype(), wire::DTypeToProto(dtype)) << what;
  EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), shape) << what;
  EXPECT_TRUE(t.data().empty()) << what;
}

// Which of a micro-batch's tensors travel by reference.
struct Placement {
  bool x = true, routing = true, out = true, dout = true, dx = true, dweights = true;
};

// Trains layer "bytes" with micro-batches sent as bytes and layer "refs" (same config, so the
// same initial weights) with the same micro-batches placed by `placement`, two steps, and
// checks every result and the final state bitwise.
void CheckReferencesMatchBytes(const LayerConfig& config, const Placement& placement) {
  SCOPED_TRACE(::testing::Message()
               << "routing " << (config.routing == RoutingMode::kClient ? "client" : "server")
               << ", dtype " << DTypeName(config.dtype) << ", x " << placement.x << " routing "
               << placement.routing << " out " << placement.out << " dout " << placement.dout
               << " dx " << placement.dx << " dweights " << placement.dweights);
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  client::Connection& c = *lb.conn;
  ASSERT_TRUE(c.CreateLayer("bytes", config).ok());
  ASSERT_TRUE(c.CreateLayer("refs", config).ok());
  const bool client_routing = config.routing == RoutingMode::kClient;
  const int64_t tokens = 13, d = config.d_model, k = config.top_k;
  const int64_t elem = static_cast<int64_t>(DTypeSize(config.dtype));
  std::mt19937 rng(23);
  for (uint64_t step = 1; step <= 2; ++step) {
    const Batch b = RandomBatch(rng, config, tokens);
    RegionArena arena;
    ASSERT_NO_FATAL_FAILURE(arena.Create(c, 64 << 10));

    v1::ForwardRequest by_bytes = ForwardOf("bytes", step);
    *by_bytes.mutable_x() = Inline(b.x);
    v1::ForwardRequest by_ref = ForwardOf("refs", step);
    *by_ref.mutable_x() = placement.x ? ByRef(b.x, arena.id(), arena.Put(b.x)) : Inline(b.x);
    if (client_routing) {
      *by_bytes.mutable_expert_ids() = Inline(b.ids);
      *by_bytes.mutable_weights() = Inline(b.w);
      *by_ref.mutable_expert_ids() =
          placement.routing ? ByRef(b.ids, arena.id(), arena.Put(b.ids)) : Inline(b.ids);
      *by_ref.mutable_weights() =
          placement.routing ? ByRef(b.w, arena.id(), arena.Put(b.w)) : Inline(b.w);
    }
    if (placement.out) *by_ref.mutable_out_ref() = RefTo(arena.id(), arena.Room(tokens * d * elem));
    auto fb = SendForward(c, {by_bytes});
    auto fr = SendForward(c, {by_ref});
    ASSERT_TRUE(fb.status.ok()) << fb.status.error_message();
    ASSERT_TRUE(fr.status.ok()) << fr.status.error_message();
    ASSERT_EQ(fb.responses.size(), 1u);
    ASSERT_EQ(fr.responses.size(), 1u);
    const v1::ForwardResponse& rb = fb.responses[0];
    const v1::ForwardResponse& rr = fr.responses[0];
    const Tensor out = FromProto(rb.out());
    if (placement.out) {
      ExpectWrittenInPlace(rr.out(), config.dtype, {tokens, d}, by_ref.out_ref(), "out");
      ExpectSameTensor(arena.Read(config.dtype, {tokens, d}, by_ref.out_ref().offset()), out,
                       "out");
    } else {
      EXPECT_FALSE(rr.out().has_ref());
      ExpectSameTensor(FromProto(rr.out()), out, "out");
    }
    // Server routing's routing comes back as bytes; the caller's own is not echoed.
    EXPECT_EQ(rr.has_expert_ids(), !client_routing);
    EXPECT_EQ(rb.has_weights(), !client_routing);
    if (!client_routing) {
      ExpectSameTensor(FromProto(rr.expert_ids()), FromProto(rb.expert_ids()), "expert_ids");
      ExpectSameTensor(FromProto(rr.weights()), FromProto(rb.weights()), "weights");
    }
    EXPECT_EQ(rr.aux_loss(), rb.aux_loss());
    EXPECT_EQ(rr.z_loss(), rb.z_loss());
    EXPECT_EQ(rr.context_id(), step);

    v1::BackwardRequest bb = BackwardOf("bytes", step);
    *bb.mutable_dout() = Inline(b.dout);
    v1::BackwardRequest br = BackwardOf("refs", step);
    *br.mutable_dout() =
        placement.dout ? ByRef(b.dout, arena.id(), arena.Put(b.dout)) : Inline(b.dout);
    if (placement.dx) *br.mutable_dx_ref() = RefTo(arena.id(), arena.Room(tokens * d * elem));
    const bool dweights_in_place = client_routing && placement.dweights;
    if (dweights_in_place)
      *br.mutable_dweights_ref() = RefTo(arena.id(), arena.Room(tokens * k * 4));
    auto gb = SendBackward(c, {bb});
    auto gr = SendBackward(c, {br});
    ASSERT_TRUE(gb.status.ok()) << gb.status.error_message();
    ASSERT_TRUE(gr.status.ok()) << gr.status.error_message();
    ASSERT_EQ(gb.responses.size(), 1u);
    ASSERT_EQ(gr.responses.size(), 1u);
    const v1::BackwardResponse& sb = gb.responses[0];
    const v1::BackwardResponse& sr = gr.responses[0];
    const Tensor dx = FromProto(sb.dx());
    if (placement.dx) {
      ExpectWrittenInPlace(sr.dx(), config.dtype, {tokens, d}, br.dx_ref(), "dx");
      ExpectSameTensor(arena.Read(config.dtype, {tokens, d}, br.dx_ref().offset()), dx, "dx");
    } else {
      ExpectSameTensor(FromProto(sr.dx()), dx, "dx");
    }
    if (dweights_in_place) {
      ExpectWrittenInPlace(sr.dweights(), DType::kFloat32, {tokens, k}, br.dweights_ref(),
                           "dweights");
      ExpectSameTensor(arena.Read(DType::kFloat32, {tokens, k}, br.dweights_ref().offset()),
                       FromProto(sb.dweights()), "dweights");
    } else {
      EXPECT_EQ(sr.has_dweights(), sb.has_dweights());
      if (sb.has_dweights()) {
        ExpectSameTensor(FromProto(sr.dweights()), FromProto(sb.dweights()), "dweights");
      }
    }
    auto step_bytes = c.Step("bytes");
    auto step_refs = c.Step("refs");
    ASSERT_TRUE(step_bytes.ok()) << step_bytes.status();
    ASSERT_TRUE(step_refs.ok()) << step_refs.status();
    EXPECT_EQ(step_bytes->grad_norm, step_refs->grad_norm);
    EXPECT_EQ(step_bytes->tokens_per_expert, step_refs->tokens_per_expert);
  }
  auto state_bytes = c.ExportWeights("bytes", /*include_optimizer=*/true);
  auto state_refs = c.ExportWeights("refs", /*include_optimizer=*/true);
  ASSERT_TRUE(state_bytes.ok()) << state_bytes.status();
  ASSERT_TRUE(state_refs.ok()) << state_refs.status();
  ExpectSameState(*state_bytes, *state_refs, "steps by reference");
}

LayerConfig ConfigOf(RoutingMode routing, DType dtype) {
  LayerConfig c = SmallConfig(routing);
  c.dtype = dtype;
  return c;
}

TEST(RegionReferencesTest, EverythingByReferenceMatchesBytes) {
  for (RoutingMode routing : {RoutingMode::kClient, RoutingMode::kServer}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      CheckReferencesMatchBytes(ConfigOf(routing, dtype), Placement{});
    }
  }
}

TEST(RegionReferencesTest, MixedReferencesAndBytesMatchBytes) {
  // Inputs by reference, results in the response.
  Placement inputs_only;
  inputs_only.out = inputs_only.dx = inputs_only.dweights = false;
  CheckReferencesMatchBytes(ConfigOf(RoutingMode::kClient, DType::kFloat32), inputs_only);
  // Inputs inline, results written in place.
  Placement outputs_only;
  outputs_only.x = outputs_only.routing = outputs_only.dout = false;
  CheckReferencesMatchBytes(ConfigOf(RoutingMode::kClient, DType::kBFloat16), outputs_only);
  // Each kind of tensor its own way.
  Placement mixed;
  mixed.routing = false;
  mixed.dx = false;
  CheckReferencesMatchBytes(ConfigOf(RoutingMode::kClient, DType::kFloat32), mixed);
  Placement x_only;
  x_only.out = x_only.dout = x_only.dx = false;
  CheckReferencesMatchBytes(ConfigOf(RoutingMode::kServer, DType::kFloat32), x_only);
}

TEST(RegionReferencesTest, TransportMetricsCountBothPaths) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  client::Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(c.CreateLayer("m", config).ok());
  std::mt19937 rng(3);
  const Batch b = RandomBatch(rng, config, 8);
  RegionArena arena;
  ASSERT_NO_FATAL_FAILURE(arena.Create(c, 16 << 10));
  std::string page = MetricsText(*lb.server);
  EXPECT_EQ(MetricValue(page, "moe_regions"), 1) << page;
  EXPECT_EQ(MetricValue(page, "moe_region_bytes"), 16 << 10);
  EXPECT_EQ(MetricValue(page, "moe_event_pairs"), 0);

  v1::ForwardRequest inline_req = ForwardOf("m", 0);
  inline_req.set_training(false);
  *inline_req.mutable_x() = Inline(b.x);
  ASSERT_TRUE(SendForward(c, {inline_req}).status.ok());
  v1::ForwardRequest ref_req = inline_req;
  *ref_req.mutable_x() = ByRef(b.x, arena.id(), arena.Put(b.x));
  *ref_req.mutable_out_ref() = RefTo(arena.id(), arena.Room(8 * config.d_model * 4));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(SendForward(c, {ref_req}).status.ok());

  page = MetricsText(*lb.server);
  const double x_bytes = static_cast<double>(b.x.bytes.size());
  EXPECT_EQ(MetricValue(page, "moe_transport_calls_total{method=\"Forward\",transport=\"tcp\"}"), 1)
      << page;
  EXPECT_EQ(MetricValue(
                page, "moe_transport_calls_total{method=\"Forward\",transport=\"shared_memory\"}"),
            2);
  EXPECT_EQ(
      MetricValue(page, "moe_transport_bytes_total{direction=\"in\",transport=\"shared_memory\"}"),
      2 * x_bytes);
  EXPECT_EQ(
      MetricValue(page, "moe_transport_bytes_total{direction=\"out\",transport=\"shared_memory\"}"),
      2 * x_bytes);  // out is x's shape
  // Every message crossed TCP: at least the inline x went in, and every response came out.
  EXPECT_GT(MetricValue(page, "moe_transport_bytes_total{direction=\"in\",transport=\"tcp\"}"),
            x_bytes);
  EXPECT_GT(MetricValue(page, "moe_transport_bytes_total{direction=\"out\",transport=\"tcp\"}"), 0);

  ASSERT_TRUE(UnregisterRegion(c, arena.id()).ok());
  page = MetricsText(*lb.server);
  EXPECT_EQ(MetricValue(page, "moe_regions"), 0);
  EXPECT_EQ(MetricValue(page, "moe_region_bytes"), 0);
}

TEST(RegionReferencesTest, RegionsGoWithTheirSession) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(lb.conn->CreateLayer("m", config).ok());
  auto other = lb.Connect();
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string session = (*other)->session_id();
  ASSERT_FALSE(session.empty());
  RegionArena arena;
  ASSERT_NO_FATAL_FAILURE(arena.Create(**other, 16 << 10));
  std::mt19937 rng(4);
  const Tensor x = RandomFloat(rng, {4, config.d_model});
  v1::ForwardRequest req = ForwardOf("m", 0);
  req.set_training(false);
  *req.mutable_x() = ByRef(x, arena.id(), arena.Put(x));
  // In its session the region serves; in another it does not exist.
  EXPECT_TRUE(ForwardAs(*lb.conn, session, {req}).status.ok());
  ExpectStatus(SendForward(*lb.conn, {req}).status, grpc::StatusCode::NOT_FOUND, "x.ref.region_id");
  EXPECT_EQ(MetricValue(MetricsText(*lb.server), "moe_regions"), 1);

  other->reset();  // the client goes away: its session ends
  for (int i = 0; i < 200 && MetricValue(MetricsText(*lb.server), "moe_regions") != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(MetricValue(MetricsText(*lb.server), "moe_regions"), 0);
  EXPECT_EQ(MetricValue(MetricsText(*lb.server), "moe_region_bytes"), 0);
  ExpectStatus(ForwardAs(*lb.conn, session, {req}).status, grpc::StatusCode::NOT_FOUND,
               "x.ref.region_id");
}

// The client shrinks its shared memory object under the server's mapping: the call that touches
// the lost pages fails (its results are not returned, its context not kept), so does every later
// reference to the region, and the server carries on.
TEST(RegionReferencesTest, ATruncatedRegionFailsItsCallsNotTheServer) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  client::Connection& c = *lb.conn;
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  ASSERT_TRUE(c.CreateLayer("m", config).ok());
  RegionArena arena;
  ASSERT_NO_FATAL_FAILURE(arena.Create(c, 64 << 10));
  std::mt19937 rng(6);
  const Tensor x = RandomFloat(rng, {16, config.d_model});
  v1::ForwardRequest req = ForwardOf("m", 1);
  *req.mutable_x() = ByRef(x, arena.id(), arena.Put(x));
  *req.mutable_out_ref() = RefTo(arena.id(), arena.Room(static_cast<int64_t>(x.bytes.size())));

  const int fd = ::shm_open(arena.shm().name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::ftruncate(fd, 0), 0) << std::strerror(errno);
  ::close(fd);
  ExpectStatus(SendForward(c, {req}).status, grpc::StatusCode::FAILED_PRECONDITION,
               "x.ref.region_id");
  ExpectStatus(SendForward(c, {req}).status, grpc::StatusCode::FAILED_PRECONDITION,
               "x.ref.region_id");
  auto info = c.GetLayer("m");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->saved_contexts(), 0);
  v1::ForwardRequest inline_req = ForwardOf("m", 2);
  *inline_req.mutable_x() = Inline(x);
  EXPECT_TRUE(SendForward(c, {inline_req}).status.ok());
  EXPECT_TRUE(UnregisterRegion(c, arena.id()).ok());
}

}  // namespace
}  // namespace moe::server_test
