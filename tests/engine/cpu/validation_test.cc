// Bad configs and requests get InvalidArgument whose message names the field, before any work;
// and the Tensor helpers (bf16 rounding, the checked shape arithmetic, CheckTensor, Zeros and
// Uninitialized).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "engine/routing.h"
#include "tests/engine/cpu/test_util.h"

namespace moe::testing {
namespace {

void ExpectInvalid(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(field), std::string::npos)
      << "message '" << s.message() << "' does not name " << field;
}

TEST(ValidateLayerConfigTest, NamesTheBadField) {
  const LayerConfig good = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  ASSERT_TRUE(ValidateLayerConfig(good).ok());
  struct Case {
    std::string field;
    std::function<void(LayerConfig&)> edit;
  };
  const std::vector<Case> cases = {
      {"num_experts", [](LayerConfig& c) { c.num_experts = 0; }},
      {"top_k", [](LayerConfig& c) { c.top_k = 5; }},
      {"top_k", [](LayerConfig& c) { c.top_k = 0; }},
      {"d_model", [](LayerConfig& c) { c.d_model = 0; }},
      {"d_hidden", [](LayerConfig& c) { c.d_hidden = -3; }},
      {"activation", [](LayerConfig& c) { c.activation = static_cast<Activation>(9); }},
      {"dtype", [](LayerConfig& c) { c.dtype = DType::kInt32; }},
      {"routing", [](LayerConfig& c) { c.routing = static_cast<RoutingMode>(2); }},
      {"expert_count", [](LayerConfig& c) { c.expert_count = 0; }},
      {"expert_first", [](LayerConfig& c) { c.expert_first = 3, c.expert_count = 2; }},
      // expert_first + expert_count past int64 (found by the request_validation fuzzer).
      {"expert_first",
       [](LayerConfig& c) {
         c.expert_first = std::numeric_limits<int64_t>::max(), c.expert_count = 72;
       }},
      {"expert_first", [](LayerConfig& c) { c.expert_first = 1; }},
      {"init_scale", [](LayerConfig& c) { c.init_scale = NAN; }},
      {"aux_loss_coef", [](LayerConfig& c) { c.aux_loss_coef = -1; }},
      {"z_loss_coef", [](LayerConfig& c) { c.routing = RoutingMode::kClient, c.z_loss_coef = 1; }},
      {"optimizer.learning_rate", [](LayerConfig& c) { c.optimizer.learning_rate = -1; }},
      {"optimizer.beta1", [](LayerConfig& c) { c.optimizer.beta1 = 1.0; }},
      {"optimizer.beta2", [](LayerConfig& c) { c.optimizer.beta2 = -0.1; }},
      {"optimizer.epsilon", [](LayerConfig& c) { c.optimizer.epsilon = 0; }},
      {"optimizer.weight_decay", [](LayerConfig& c) { c.optimizer.weight_decay = INFINITY; }},
      {"optimizer.momentum", [](LayerConfig& c) { c.optimizer.momentum = 1.5; }},
      {"optimizer.max_grad_norm", [](LayerConfig& c) { c.optimizer.max_grad_norm = -1; }},
      // Weights or a router that could not exist, whatever their products wrap to.
      {"d_hidden", [](LayerConfig& c) { c.d_model = c.d_hidden = int64_t{1} << 30; }},
      {"num_experts",
       [](LayerConfig& c) {
         c.num_experts = c.d_model = (int64_t{1} << 31) - 1;
         c.expert_first = 0, c.expert_count = 1, c.d_hidden = 1;
       }},
  };
  for (const Case& cs : cases) {
    LayerConfig c = good;
    cs.edit(c);
    ExpectInvalid(ValidateLayerConfig(c), cs.field);
    auto layer = CreateCpuEngine()->CreateLayer(c);
    ExpectInvalid(layer.status(), cs.field);
  }
}

class ForwardValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
    layer_ = MakeLayer(cfg_);
    x_ = MakeTensor(RandomVec(3 * 8, 1), DType::kFloat32, {3, 8});
    ids_ = IdTensor({0, 1, 2, 3, 1, 0}, 3, 2);
    w_ = MakeTensor({0.5, 0.5, 0.3, 0.7, 1, 0}, DType::kFloat32, {3, 2});
  }
  ForwardRequest Req() const {
    ForwardRequest r;
    r.x = x_.view();
    r.expert_ids = ids_.view();
    r.weights = w_.view();
    return r;
  }
  absl::Status Fwd(const ForwardRequest& r) { return layer_->Forward(r).status(); }

  LayerConfig cfg_;
  std::unique_ptr<Layer> layer_;
  Tensor x_, ids_, w_;
};

TEST_F(ForwardValidationTest, GoodRequestPasses) { EXPECT_TRUE(Fwd(Req()).ok()); }

TEST_F(ForwardValidationTest, BadXShape) {
  Tensor x = MakeTensor(RandomVec(3 * 9, 1), DType::kFloat32, {3, 9});
  ForwardRequest r = Req();
  r.x = x.view();
  ExpectInvalid(Fwd(r), "x");
  Tensor flat = MakeTensor(RandomVec(24, 1), DType::kFloat32, {24});
  r.x = flat.view();
  ExpectInvalid(Fwd(r), "x");
  TensorView short_bytes = x_.view();
  short_bytes.size_bytes -= 4;
  r.x = short_bytes;
  ExpectInvalid(Fwd(r), "x");
}

TEST_F(ForwardValidationTest, WrongXDtype) {
  Tensor x = MakeTensor(RandomVec(3 * 8, 1), DType::kBFloat16, {3, 8});
  ForwardRequest r = Req();
  r.x = x.view();
  ExpectInvalid(Fwd(r), "x");
}

TEST_F(ForwardValidationTest, OutOfRangeExpertIds) {
  for (int32_t bad : {4, -1, 1 << 30}) {
    Tensor ids = IdTensor({0, 1, 2, bad, 1, 0}, 3, 2);
    ForwardRequest r = Req();
    r.expert_ids = ids.view();
    ExpectInvalid(Fwd(r), "expert_ids[1, 1]");
  }
}

TEST_F(ForwardValidationTest, DuplicateExpertIdsWithinAToken) {
  Tensor ids = IdTensor({0, 1, 2, 2, 1, 0}, 3, 2);
  ForwardRequest r = Req();
  r.expert_ids = ids.view();
  const absl::Status s = Fwd(r);
  ExpectInvalid(s, "expert_ids[1, 1]");
  EXPECT_NE(s.message().find("duplicates"), std::string::npos) << s;
}

TEST_F(ForwardValidationTest, BadExpertIdsShapeOrDtype) {
  Tensor ids = IdTensor({0, 1, 2}, 3, 1);
  ForwardRequest r = Req();
  r.expert_ids = ids.view();
  ExpectInvalid(Fwd(r), "expert_ids");
  Tensor f = MakeTensor({0, 1, 2, 3, 1, 0}, DType::kFloat32, {3, 2});
  r.expert_ids = f.view();
  ExpectInvalid(Fwd(r), "expert_ids");
  r.expert_ids = TensorView{};
  ExpectInvalid(Fwd(r), "expert_ids");
}

TEST_F(ForwardValidationTest, BadWeights) {
  Tensor w = MakeTensor({0.5, 0.5, 0.3}, DType::kFloat32, {3, 1});
  ForwardRequest r = Req();
  r.weights = w.view();
  ExpectInvalid(Fwd(r), "weights");
  Tensor nan = MakeTensor({0.5, 0.5, NAN, 0.7, 1, 0}, DType::kFloat32, {3, 2});
  r.weights = nan.view();
  ExpectInvalid(Fwd(r), "weights[1, 0]");
  Tensor i32 = IdTensor({0, 1, 2, 3, 1, 0}, 3, 2);
  r.weights = i32.view();
  ExpectInvalid(Fwd(r), "weights");
}

TEST_F(ForwardValidationTest, WeightsMayBeFloat32OrTheLayerDtype) {
  // fp32 layer: bf16 weights are neither float32 nor the layer dtype.
  Tensor w16 = MakeTensor({0.5, 0.5, 0.3, 0.7, 1, 0}, DType::kBFloat16, {3, 2});
  ForwardRequest r = Req();
  r.weights = w16.view();
  ExpectInvalid(Fwd(r), "weights");
  // bf16 layer: both bf16 and fp32 weights are accepted.
  LayerConfig c = cfg_;
  c.dtype = DType::kBFloat16;
  auto layer = MakeLayer(c);
  Tensor x16 = MakeTensor(RandomVec(3 * 8, 1), DType::kBFloat16, {3, 8});
  r.x = x16.view();
  EXPECT_TRUE(layer->Forward(r).ok());
  r.weights = w_.view();
  EXPECT_TRUE(layer->Forward(r).ok());
}

TEST_F(ForwardValidationTest, ServerRoutingRejectsClientRouting) {
  auto layer = MakeLayer(SmallConfig(Activation::kSwiGLU, RoutingMode::kServer));
  ExpectInvalid(layer->Forward(Req()).status(), "expert_ids");
  ForwardRequest r = Req();
  r.expert_ids = TensorView{};
  r.weights = TensorView{};
  EXPECT_TRUE(layer->Forward(r).ok());
}

TEST_F(ForwardValidationTest, BadDoutAndForeignContext) {
  auto fwd = layer_->Forward(Req());
  ASSERT_TRUE(fwd.ok());
  Tensor dout = MakeTensor(RandomVec(4 * 8, 2), DType::kFloat32, {4, 8});
  auto other = MakeLayer(cfg_);
  auto fwd2 = other->Forward(Req());
  ASSERT_TRUE(fwd2.ok());
  ExpectInvalid(layer_->Backward(std::move(fwd2->context), x_.view()).status(), "context");
  ExpectInvalid(layer_->Backward(nullptr, x_.view()).status(), "context");
  ExpectInvalid(layer_->Backward(std::move(fwd->context), dout.view()).status(), "dout");
}

// TensorBytes leaves bytes unset on resize, so Zeros must zero them itself: memory a freed
// tensor filled with 0xFF and malloc hands out again must come back as zeros (the first round's
// block may be a fresh mapping, zero anyway; later ones reuse the heap).
TEST(TensorTest, ZerosZeroesReusedMemoryAndUninitializedHasTheSize) {
  for (int round = 0; round < 4; ++round) {
    {
      Tensor junk = Tensor::Uninitialized(DType::kFloat32, {1024, 1024});
      ASSERT_EQ(junk.bytes.size(), size_t{4} << 20);
      std::memset(junk.bytes.data(), 0xFF, junk.bytes.size());
    }
    const Tensor z = Tensor::Zeros(DType::kFloat32, {1024, 1024});
    ASSERT_EQ(z.bytes.size(), size_t{4} << 20);
    for (float v : std::vector<float>(z.as<float>(), z.as<float>() + 1024 * 1024)) {
      ASSERT_EQ(v, 0.0f) << "round " << round;
    }
  }
}

TEST(TensorTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  auto from_bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  EXPECT_EQ(FloatToBFloat16(from_bits(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(FloatToBFloat16(from_bits(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(FloatToBFloat16(from_bits(0x3f808001u)), 0x3f81);  // above half
  EXPECT_EQ(FloatToBFloat16(from_bits(0x7f7fffffu)), 0x7f80);  // max float -> inf
  EXPECT_EQ(FloatToBFloat16(INFINITY), 0x7f80);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(NAN))));
  EXPECT_EQ(BFloat16ToFloat(0xc040), -3.0f);
}

TEST(TensorTest, CheckTensorNamesFieldAndChecksBytes) {
  Tensor t = Tensor::Zeros(DType::kFloat32, {2, 3});
  EXPECT_TRUE(CheckTensor(t.view(), "a", DType::kFloat32, {-1, 3}).ok());
  ExpectInvalid(CheckTensor(t.view(), "alpha", DType::kFloat32, {3, 2}), "alpha");
  ExpectInvalid(CheckTensor(t.view(), "beta", DType::kBFloat16, {2, 3}), "beta");
  TensorView v = t.view();
  v.size_bytes = 20;
  ExpectInvalid(CheckTensor(v, "gamma", DType::kFloat32, {2, 3}), "gamma");
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
  EXPECT_STREQ(DTypeName(DType::kBFloat16), "bfloat16");
}

// The one checked product of extents: exact below the bounds; a negative extent, too many
// dimensions, an overflowing product (whatever it wraps to) or one past kMaxTensorBytes is
// InvalidArgument naming the field; NumElements of such a shape is -1, never a wrapped value.
TEST(TensorTest, CheckedNumElementsRefusesWhatCannotExist) {
  EXPECT_EQ(*CheckedNumElements({}, "s"), 1);
  EXPECT_EQ(*CheckedNumElements({0, 5}, "s"), 0);
  EXPECT_EQ(*CheckedNumElements({3, 5, 7}, "s"), 105);
  EXPECT_EQ(*CheckedNumElements({kMaxTensorBytes}, "s"), kMaxTensorBytes);
  EXPECT_EQ(*CheckedByteSize({kMaxTensorBytes / 4}, DType::kFloat32, "s"), kMaxTensorBytes);
  EXPECT_EQ(*CheckedByteSize({2, 3}, DType::kBFloat16, "s"), 12);
  constexpr int64_t k62 = int64_t{1} << 62;
  const std::vector<std::vector<int64_t>> bad = {
      {-1},
      {4, -2},
      {k62, 4},                              // 2^64: wraps to 0
      {int64_t{1} << 61, 8},                 // wraps to 0 too
      {k62, k62, 0},                         // a zero after the overflow
      {0, int64_t{1} << 41},                 // an extent past the bound, hidden by a zero
      {int64_t{1} << 20, int64_t{1} << 21},  // 2^41 elements: no overflow, past the bound
      {kMaxTensorBytes + 1},
      std::vector<int64_t>(kMaxTensorRank + 1, 1),
  };
  for (const auto& shape : bad) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    ExpectInvalid(CheckedNumElements(shape, "x").status(), "x: ");
    ExpectInvalid(CheckedByteSize(shape, DType::kInt64, "dout").status(), "dout: ");
    EXPECT_EQ(NumElements(shape), -1);
  }
  // Within the element bound but past the byte bound once the dtype's size counts.
  ExpectInvalid(CheckedByteSize({kMaxTensorBytes / 2}, DType::kFloat32, "w").status(), "w: ");
  EXPECT_EQ(NumElements({3, 5}), 15);
}

// CheckTensor goes through the checked size: a shape whose byte count wraps to the view's
// (here 0 bytes, no data) is refused, not taken as an empty tensor.
TEST(TensorTest, CheckTensorRefusesAWrappingShape) {
  TensorView v;
  v.dtype = DType::kFloat32;
  v.shape = {int64_t{1} << 62, 4};
  ExpectInvalid(CheckTensor(v, "x", DType::kFloat32, {-1, 4}), "x: shape");
  v.shape = {-1, 4};
  ExpectInvalid(CheckTensor(v, "x", DType::kFloat32, {-1, 4}), "x");
}

// T * top_k is checked: tokens whose product with K passes 2^31 - 1 are refused, also when the
// product overflows int64 and wraps to 0 (2^38 tokens of d = 1 times K = 2^26). Only the view's
// shape and size are read before the refusal, so no memory stands behind it.
TEST(ValidateForwardRequestTest, TokensTimesTopKIsChecked) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  c.d_model = 1;
  c.d_hidden = 1;
  c.num_experts = int64_t{1} << 26;
  ASSERT_TRUE(ValidateLayerConfig(c).ok());
  static const char byte = 0;
  for (auto [tokens, top_k] :
       {std::pair<int64_t, int64_t>{int64_t{1} << 30, 4}, {int64_t{1} << 38, int64_t{1} << 26}}) {
    c.top_k = top_k;
    ForwardRequest r;
    r.x.dtype = DType::kFloat32;
    r.x.shape = {tokens, 1};
    r.x.size_bytes = static_cast<size_t>(tokens) * 4;
    r.x.data = &byte;
    ExpectInvalid(ValidateForwardRequest(c, r).status(), "x: ");
  }
  // 2^20 tokens of d = 1 (4 MiB of x) whose hidden activations [T * K, 2h] would be 8 TiB, and
  // ones whose router logits [T, E] would be: refused before an engine sizes anything from them.
  c.num_experts = 2;
  c.top_k = 1;
  c.d_hidden = int64_t{1} << 20;
  ASSERT_TRUE(ValidateLayerConfig(c).ok());
  ForwardRequest r;
  r.x.dtype = DType::kFloat32;
  r.x.shape = {int64_t{1} << 20, 1};
  r.x.size_bytes = size_t{4} << 20;
  r.x.data = &byte;
  ExpectInvalid(ValidateForwardRequest(c, r).status(), "x: 1048576 tokens");
  c.d_hidden = 1;
  c.num_experts = int64_t{1} << 26;
  r.x.shape = {int64_t{1} << 16, 1};
  r.x.size_bytes = size_t{4} << 16;
  ExpectInvalid(ValidateForwardRequest(c, r).status(), "x: 65536 tokens");
}

TEST(EngineFactoryTest, DeviceStrings) {
  auto cpu = CreateEngine("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->name(), "cpu");
  EXPECT_GT((*cpu)->memory_total_bytes(), 0);
  auto layer = (*cpu)->CreateLayer(SmallConfig(Activation::kSwiGLU, RoutingMode::kClient));
  ASSERT_TRUE(layer.ok());
  EXPECT_EQ((*cpu)->memory_in_use_bytes(), (*layer)->resident_bytes());
  layer->reset();
  EXPECT_EQ((*cpu)->memory_in_use_bytes(), 0);
  auto any = CreateEngine("auto");
  ASSERT_TRUE(any.ok()) << any.status();
  ExpectInvalid(CreateEngine("tpu").status(), "device");
  ExpectInvalid(CreateEngine("cuda:x").status(), "device");
  EXPECT_EQ(CreateEngine("cuda:4096").status().code(), absl::StatusCode::kUnavailable);
}

// EngineOptions reach the engine made: a CPU engine with its own pool of 3 threads gives the
// bits of one on the shared pool, and a negative thread count is refused naming the field.
TEST(EngineFactoryTest, Options) {
  EngineOptions three;
  three.cpu_threads = 3;
  auto own = CreateEngine("cpu", three);
  auto shared = CreateEngine("cpu");
  ASSERT_TRUE(own.ok() && shared.ok());
  LayerConfig config = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  config.d_model = 96;
  config.d_hidden = 80;
  auto a = (*own)->CreateLayer(config);
  auto b = (*shared)->CreateLayer(config);
  ASSERT_TRUE(a.ok() && b.ok());
  const int64_t tokens = 300;
  const Tensor x = MakeTensor(RandomVec(tokens * config.d_model, 7), config.dtype,
                              {tokens, config.d_model});
  ForwardRequest request;
  request.x = x.view();
  request.training = false;
  auto fa = (*a)->Forward(request);
  auto fb = (*b)->Forward(request);
  ASSERT_TRUE(fa.ok() && fb.ok());
  EXPECT_EQ(fa->out.bytes, fb->out.bytes);
  EngineOptions negative;
  negative.cpu_threads = -1;
  ExpectInvalid(CreateEngine("cpu", negative).status(), "cpu_threads");
  ExpectInvalid(CreateEngine("auto", negative).status(), "cpu_threads");
}

}  // namespace
}  // namespace moe::testing
