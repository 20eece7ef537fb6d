// Forward, Backward and Step through a real moe-server on loopback: a training step through the
// service equals the same engine in process bit for bit (both routings, bf16, tensors cut into
// chunks), many micro-batches in flight at once all train, and a recompute-H layer keeps fewer
// saved-context bytes for the same bits.
#include <gtest/gtest.h>

#include <future>
#include <random>
#include <utility>
#include <vector>

#include "client/client.h"
#include "engine/layer.h"
#include "tests/server/server_fixture.h"
#include "wire/wire.h"

namespace moe::server_test {
namespace {

using client::RemoteLayer;

// --- Bit-exact against the engine in process ------------------------------------------------
void CheckTrainStepMatchesInProcess(RoutingMode routing, int64_t chunk_bytes,
                                    DType dtype = DType::kFloat32) {
  client::ClientOptions copts = LoopbackClientOptions();
  copts.chunk_bytes = chunk_bytes;
  Loopback lb = StartLoopback(LoopbackOptions(), copts);
  ASSERT_TRUE(lb.conn);
  LayerConfig config = SmallConfig(routing);
  config.dtype = dtype;
  auto remote = RemoteLayer::Create(lb.conn, "exact", config);
  ASSERT_TRUE(remote.ok()) << remote.status();
  auto engine = CreateEngine("cpu");
  ASSERT_TRUE(engine.ok());
  auto local = (*engine)->CreateLayer(config);
  ASSERT_TRUE(local.ok());

  std::mt19937 rng(5);
  for (int step = 0; step < 2; ++step) {
    const int64_t tokens = 37;
    Tensor x = RandomFloat(rng, {tokens, config.d_model}), ids, w;
    if (routing == RoutingMode::kClient) RandomRouting(rng, tokens, config, &ids, &w);
    Tensor dout = RandomFloat(rng, {tokens, config.d_model});
    if (dtype == DType::kBFloat16) {
      x = ToBFloat16(x);
      dout = ToBFloat16(dout);
    }

    auto rf = (*remote)->Forward(x.view(), ids.view(), w.view()).get();
    ASSERT_TRUE(rf.ok()) << rf.status();
    ForwardRequest req;
    req.x = x.view();
    if (!ids.empty()) req.expert_ids = ids.view();
    if (!w.empty()) req.weights = w.view();
    auto lf = (*local)->Forward(req);
    ASSERT_TRUE(lf.ok()) << lf.status();
    EXPECT_EQ(rf->out.bytes, lf->out.bytes) << "step " << step;
    EXPECT_EQ(rf->out.shape, lf->out.shape);
    EXPECT_EQ(rf->expert_ids.bytes, lf->expert_ids.bytes);
    EXPECT_EQ(rf->weights.bytes, lf->weights.bytes);
    EXPECT_EQ(rf->aux_loss, lf->aux_loss);

    auto rb = (*remote)->Backward(rf->context_id, dout.view()).get();
    ASSERT_TRUE(rb.ok()) << rb.status();
    auto lb_ = (*local)->Backward(std::move(lf->context), dout.view());
    ASSERT_TRUE(lb_.ok()) << lb_.status();
    EXPECT_EQ(rb->dx.bytes, lb_->dx.bytes) << "step " << step;
    EXPECT_EQ(rb->dweights.bytes, lb_->dweights.bytes) << "step " << step;

    auto rs = (*remote)->Step();
    ASSERT_TRUE(rs.ok()) << rs.status();
    auto ls = (*local)->Step();
    ASSERT_TRUE(ls.ok());
    EXPECT_EQ(rs->step, ls->step);
    EXPECT_EQ(rs->grad_norm, ls->grad_norm);
    EXPECT_EQ(rs->tokens_per_expert, ls->tokens_per_expert);
  }
  auto rw = (*remote)->ExportWeights(/*include_optimizer=*/true);
  ASSERT_TRUE(rw.ok()) << rw.status();
  auto lw = (*local)->ExportState(true);
  ASSERT_TRUE(lw.ok());
  ASSERT_EQ(rw->size(), lw->size());
  for (const auto& [name, t] : *lw) {
    ASSERT_TRUE(rw->count(name)) << name;
    EXPECT_EQ(rw->at(name).bytes, t.bytes) << name;
    EXPECT_EQ(rw->at(name).shape, t.shape) << name;
  }
}

TEST(ServiceTest, TrainStepMatchesInProcessEngineClientRouting) {
  CheckTrainStepMatchesInProcess(RoutingMode::kClient, int64_t{1} << 20);
}

TEST(ServiceTest, TrainStepMatchesInProcessEngineServerRouting) {
  CheckTrainStepMatchesInProcess(RoutingMode::kServer, int64_t{1} << 20);
}

TEST(ServiceTest, TrainStepMatchesInProcessEngineBFloat16) {
  CheckTrainStepMatchesInProcess(RoutingMode::kServer, int64_t{1} << 20, DType::kBFloat16);
  CheckTrainStepMatchesInProcess(RoutingMode::kClient, 500, DType::kBFloat16);
}

TEST(ServiceTest, ChunkedTensorsGiveTheSameBits) {
  // 1000-byte chunks: x (37x16 floats) travels in 3 messages, ids and weights share others.
  CheckTrainStepMatchesInProcess(RoutingMode::kClient, 1000);
}

TEST(ServiceTest, ManyMicroBatchesInFlight) {
  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  const LayerConfig config = SmallConfig(RoutingMode::kServer);
  auto layer = RemoteLayer::Create(lb.conn, "l", config);
  ASSERT_TRUE(layer.ok());
  std::mt19937 rng(8);
  std::vector<Tensor> xs;
  for (int i = 0; i < 16; ++i) xs.push_back(RandomFloat(rng, {20, config.d_model}));
  std::vector<std::future<absl::StatusOr<client::ForwardOutput>>> fs;
  for (const auto& x : xs) fs.push_back((*layer)->Forward(x.view()));
  std::vector<std::future<absl::StatusOr<client::BackwardOutput>>> bs;
  for (auto& f : fs) {
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << r.status();
    bs.push_back((*layer)->Backward(r->context_id, r->out.view()));
  }
  for (auto& b : bs) EXPECT_TRUE(b.get().ok());
  auto st = (*layer)->Step();
  ASSERT_TRUE(st.ok());
  int64_t routed = 0;
  for (int64_t n : st->tokens_per_expert) routed += n;
  EXPECT_EQ(routed, 16 * 20 * config.top_k);
}

// --- Recompute memory mode ------------------------------------------------------------------
// LayerConfig::recompute_h crosses the wire both ways (create, then the layer info), and a layer
// created with it keeps fewer saved-context bytes (exactly the H rows) for bitwise the same
// results as a keep-H layer.
TEST(ServiceTest, RecomputeHRoundTripsAndShrinksSavedContexts) {
  LayerConfig keep = SmallConfig(RoutingMode::kClient);
  LayerConfig recompute = keep;
  recompute.recompute_h = true;
  auto back = wire::LayerConfigFromProto(wire::LayerConfigToProto(recompute));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->recompute_h);
  EXPECT_FALSE(wire::LayerConfigToProto(keep).recompute_h());

  Loopback lb = StartLoopback();
  ASSERT_TRUE(lb.conn);
  auto rk = RemoteLayer::Create(lb.conn, "keep-h", keep);
  auto rr = RemoteLayer::Create(lb.conn, "recompute-h", recompute);
  ASSERT_TRUE(rk.ok()) << rk.status();
  ASSERT_TRUE(rr.ok()) << rr.status();
  auto ik = lb.conn->GetLayer("keep-h");
  auto ir = lb.conn->GetLayer("recompute-h");
  ASSERT_TRUE(ik.ok() && ir.ok());
  EXPECT_FALSE(ik->config().recompute_h());
  EXPECT_TRUE(ir->config().recompute_h());

  std::mt19937 rng(17);
  const int64_t tokens = 29;
  Tensor x = RandomFloat(rng, {tokens, keep.d_model}), ids, w;
  RandomRouting(rng, tokens, keep, &ids, &w);
  Tensor dout = RandomFloat(rng, {tokens, keep.d_model});
  auto fk = (*rk)->Forward(x.view(), ids.view(), w.view()).get();
  auto fr = (*rr)->Forward(x.view(), ids.view(), w.view()).get();
  ASSERT_TRUE(fk.ok()) << fk.status();
  ASSERT_TRUE(fr.ok()) << fr.status();
  EXPECT_EQ(fk->out.bytes, fr->out.bytes);
  ik = lb.conn->GetLayer("keep-h");
  ir = lb.conn->GetLayer("recompute-h");
  ASSERT_TRUE(ik.ok() && ir.ok());
  EXPECT_EQ(ir->saved_contexts(), 1);
  // Every (t,k) lands on a local expert (no shard): H is T*K rows of [W1 x, W3 x], fp32.
  EXPECT_EQ(ik->saved_context_bytes() - ir->saved_context_bytes(),
            tokens * keep.top_k * 2 * keep.d_hidden * 4);
  auto bk = (*rk)->Backward(fk->context_id, dout.view()).get();
  auto br = (*rr)->Backward(fr->context_id, dout.view()).get();
  ASSERT_TRUE(bk.ok()) << bk.status();
  ASSERT_TRUE(br.ok()) << br.status();
  EXPECT_EQ(bk->dx.bytes, br->dx.bytes);
  EXPECT_EQ(bk->dweights.bytes, br->dweights.bytes);
}

}  // namespace
}  // namespace moe::server_test
