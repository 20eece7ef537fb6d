// An expert-sharded layer over two servers equals one unsharded layer: same weights (imported
// from the unsharded layer), same forward output, dx, dweights, token counts and, after a step,
// the same weights. Sums over shards reorder float additions, so outputs are compared by the
// normalised error with bound 1e-6; token counts exactly. ForwardInto and BackwardInto with host
// tensors give the bits of Forward and Backward in the caller's destinations; device tensors in a
// client built without CUDA, or tensors in two places, are refused naming the field.
#include <gtest/gtest.h>

#include <cstring>

#include "tests/client/test_util.h"

namespace moe {
namespace {

using testing_util::RandomFloat;
using testing_util::RandomRouting;
using testing_util::RelError;
using testing_util::StartServer;
using testing_util::Target;

// A client-routed float32 layer of this size.
LayerConfig SmallConfig(int64_t experts, int64_t top_k, int64_t d_model, int64_t d_hidden) {
  LayerConfig config;
  config.num_experts = experts;
  config.top_k = top_k;
  config.d_model = d_model;
  config.d_hidden = d_hidden;
  return config;
}

// Two servers on loopback, a connection to each.
class ShardedLayerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (auto* s : {&s0_, &s1_}) {
      *s = StartServer();
      ASSERT_TRUE(*s);
    }
    auto c0 = client::Connection::Connect(Target(*s0_));
    auto c1 = client::Connection::Connect(Target(*s1_));
    ASSERT_TRUE(c0.ok() && c1.ok()) << c0.status() << c1.status();
    c0_ = *c0;
    c1_ = *c1;
  }
  std::unique_ptr<server::Server> s0_, s1_;
  std::shared_ptr<client::Connection> c0_, c1_;
};

// Rows [first, first + count) of a [E, ...] tensor.
Tensor SliceExperts(const Tensor& t, int64_t first, int64_t count) {
  Tensor out = t;
  const size_t per = t.bytes.size() / t.shape[0];
  out.shape[0] = count;
  out.bytes.assign(t.bytes.begin() + first * per, t.bytes.begin() + (first + count) * per);
  return out;
}

TEST_F(ShardedLayerTest, TwoServersEqualOneUnshardedLayer) {

  LayerConfig config;
  config.num_experts = 7;  // uneven split: [0, 4) and [4, 7)
  config.top_k = 2;
  config.d_model = 16;
  config.d_hidden = 24;
  config.seed = 3;
  config.optimizer.learning_rate = 1e-2;
  auto full = client::RemoteLayer::Create(c0_, "full", config);
  ASSERT_TRUE(full.ok()) << full.status();
  auto sharded = client::ShardedLayer::Create({c0_, c1_}, "sharded", config);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  ASSERT_EQ((*sharded)->num_shards(), 2u);
  EXPECT_EQ((*sharded)->shard(0).config().expert_first, 0);
  EXPECT_EQ((*sharded)->shard(0).config().local_experts(), 4);
  EXPECT_EQ((*sharded)->shard(1).config().expert_first, 4);
  EXPECT_EQ((*sharded)->shard(1).config().local_experts(), 3);

  auto weights = (*full)->ExportWeights();
  ASSERT_TRUE(weights.ok()) << weights.status();
  for (size_t s = 0; s < 2; ++s) {
    const LayerConfig& c = (*sharded)->shard(s).config();
    std::map<std::string, Tensor> part;
    for (const auto& [name, t] : *weights) {
      part[name] = SliceExperts(t, c.expert_first, c.local_experts());
    }
    ASSERT_TRUE((*sharded)->shard(s).ImportWeights(part).ok());
  }

  std::mt19937 rng(21);
  for (int round = 0; round < 3; ++round) {
    const int64_t tokens = 29;
    Tensor x = RandomFloat(rng, {tokens, config.d_model}), ids, w;
    // Round 2 routes everything to shard 0, so shard 1 must be skipped and contribute nothing.
    RandomRouting(rng, tokens, config.top_k, 0, round == 2 ? 4 : 7, &ids, &w);
    auto a = (*full)->Forward(x.view(), ids.view(), w.view()).get();
    auto b = (*sharded)->Forward(x.view(), ids.view(), w.view()).get();
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_LT(RelError(b->out, a->out), 1e-6) << "round " << round;
    Tensor dout = RandomFloat(rng, {tokens, config.d_model});
    auto da = (*full)->Backward(a->context_id, dout.view()).get();
    auto db = (*sharded)->Backward(b->context_id, dout.view()).get();
    ASSERT_TRUE(da.ok()) << da.status();
    ASSERT_TRUE(db.ok()) << db.status();
    EXPECT_LT(RelError(db->dx, da->dx), 1e-6) << "round " << round;
    EXPECT_LT(RelError(db->dweights, da->dweights), 1e-6) << "round " << round;
    auto sa = (*full)->Step();
    auto sb = (*sharded)->Step();
    ASSERT_TRUE(sa.ok() && sb.ok());
    EXPECT_EQ(sb->tokens_per_expert, sa->tokens_per_expert) << "round " << round;
    EXPECT_NEAR(sb->grad_norm, sa->grad_norm, 1e-6 * sa->grad_norm);
  }
  auto after = (*full)->ExportWeights();
  ASSERT_TRUE(after.ok());
  for (size_t s = 0; s < 2; ++s) {
    const LayerConfig& c = (*sharded)->shard(s).config();
    auto part = (*sharded)->shard(s).ExportWeights();
    ASSERT_TRUE(part.ok());
    for (const auto& [name, t] : *after) {
      EXPECT_LT(RelError(part->at(name), SliceExperts(t, c.expert_first, c.local_experts())), 1e-5)
          << "shard " << s << " " << name;
    }
  }
}

TEST_F(ShardedLayerTest, RejectsWhatItCannotShard) {
  LayerConfig config = SmallConfig(4, 1, 8, 8);
  config.routing = RoutingMode::kServer;
  EXPECT_EQ(client::ShardedLayer::Create({c0_}, "x", config).status().code(),
            absl::StatusCode::kInvalidArgument);
  config.routing = RoutingMode::kClient;
  auto layer = client::ShardedLayer::Create({c0_}, "x", config);
  ASSERT_TRUE(layer.ok());
  std::mt19937 rng(1);
  Tensor x = RandomFloat(rng, {3, 8}), ids, w;
  RandomRouting(rng, 3, 1, 0, 4, &ids, &w);
  absl::Status no_weights = (*layer)->Forward(x.view(), ids.view(), {}).get().status();
  EXPECT_EQ(no_weights.code(), absl::StatusCode::kInvalidArgument) << no_weights;
  EXPECT_NE(no_weights.message().find("weights"), std::string::npos) << no_weights;
  ids.as<int32_t>()[1] = 9;
  absl::Status st = (*layer)->Forward(x.view(), ids.view(), w.view()).get().status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("expert_ids"), std::string::npos) << st;
  Tensor dout = RandomFloat(rng, {3, 8});
  EXPECT_EQ((*layer)->Backward(12345, dout.view()).get().status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ShardedLayerTest, IntoHostDestinationsGivesTheBitsOfForwardAndBackward) {
  LayerConfig config = SmallConfig(6, 2, 8, 12);
  config.seed = 5;
  auto a = client::ShardedLayer::Create({c0_, c1_}, "plain", config);
  auto b = client::ShardedLayer::Create({c0_, c1_}, "into", config);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  std::mt19937 rng(4);
  const int64_t tokens = 13;
  Tensor x = RandomFloat(rng, {tokens, 8}), ids, w;
  RandomRouting(rng, tokens, 2, 0, 6, &ids, &w);
  Tensor out = Tensor::Zeros(DType::kFloat32, {tokens, 8});
  std::memset(out.bytes.data(), 0xff, out.bytes.size());  // poisoned: every byte must be written
  auto fa = (*a)->Forward(x.view(), ids.view(), w.view()).get();
  auto fb = (*b)->ForwardInto(x.view(), ids.view(), w.view(), out.mutable_view()).get();
  ASSERT_TRUE(fa.ok() && fb.ok()) << fa.status() << fb.status();
  EXPECT_TRUE(fb->out.empty());
  EXPECT_EQ(out.bytes, fa->out.bytes);
  Tensor dout = RandomFloat(rng, {tokens, 8});
  Tensor dx = Tensor::Zeros(DType::kFloat32, {tokens, 8});
  std::memset(dx.bytes.data(), 0xff, dx.bytes.size());
  auto ba = (*a)->Backward(fa->context_id, dout.view()).get();
  // dweights without a destination comes back, as RemoteLayer's.
  auto bb = (*b)->BackwardInto(fb->context_id, dout.view(), dx.mutable_view(), {}).get();
  ASSERT_TRUE(ba.ok() && bb.ok()) << ba.status() << bb.status();
  EXPECT_TRUE(bb->dx.empty());
  EXPECT_EQ(dx.bytes, ba->dx.bytes);
  EXPECT_EQ(bb->dweights.bytes, ba->dweights.bytes);
}

TEST_F(ShardedLayerTest, IntoRefusesDeviceTensorsWithoutCudaAndMixedPlacesNamingTheField) {
  auto layer = client::ShardedLayer::Create({c0_}, "placed", SmallConfig(4, 1, 8, 8));
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::mt19937 rng(2);
  Tensor x = RandomFloat(rng, {3, 8}), ids, w;
  RandomRouting(rng, 3, 1, 0, 4, &ids, &w);
  Tensor out = Tensor::Zeros(DType::kFloat32, {3, 8});
  // A host pointer said to be on cuda:0: refused before anything reads it.
  auto on_gpu = [](TensorView v) {
    v.location = MemoryLocation::Cuda(0);
    return v;
  };
  MutableTensorView out_on_gpu = out.mutable_view();
  out_on_gpu.location = MemoryLocation::Cuda(0);
  auto expect_refused = [](absl::Status st, const std::string& field, const std::string& why) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_EQ(st.message().rfind(field + ": ", 0), 0u) << st;
    EXPECT_NE(st.message().find(why), std::string::npos) << st;
  };
  // Without CUDA the reason is that; with it, the pointer is found not to be device memory.
  const bool cuda = c0_->device_transport() != client::DeviceTransport::kUnavailable;
  const std::string no_cuda = cuda ? "" : "built without CUDA";
  expect_refused((*layer)
                     ->ForwardInto(on_gpu(x.view()), on_gpu(ids.view()), on_gpu(w.view()),
                                   out_on_gpu)
                     .get()
                     .status(),
                 "x", no_cuda);
  // Tensors in two places: the first that differs from x is named (without CUDA, as on a device).
  expect_refused((*layer)->ForwardInto(x.view(), ids.view(), w.view(), out_on_gpu).get().status(),
                 "out", cuda ? "one place" : no_cuda);
  auto f = (*layer)->ForwardInto(x.view(), ids.view(), w.view(), out.mutable_view()).get();
  ASSERT_TRUE(f.ok()) << f.status();
  Tensor dout = RandomFloat(rng, {3, 8});
  expect_refused(
      (*layer)->BackwardInto(f->context_id, on_gpu(dout.view()), {}, {}).get().status(), "dout",
      no_cuda);
  // A destination of the wrong shape is refused before the context is taken: it still works.
  Tensor small = Tensor::Zeros(DType::kFloat32, {2, 8});
  expect_refused(
      (*layer)->BackwardInto(f->context_id, dout.view(), small.mutable_view(), {}).get().status(),
      "dx", "");
  EXPECT_TRUE((*layer)->BackwardInto(f->context_id, dout.view(), {}, {}).get().ok());
  EXPECT_EQ((*layer)->BackwardInto(f->context_id, dout.view(), {}, {}).get().status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe
