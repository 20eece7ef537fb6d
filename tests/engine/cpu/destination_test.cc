// The CPU engine's side of the device-tensor contract (engine/layer.h): outputs written into a
// caller's host destinations are the bytes the host-tensor results hold, device views and
// stream events are refused naming the field, and a refused call leaves the layer as it was.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "engine/layer.h"
#include "tests/engine/cpu/test_util.h"

namespace moe::testing {
namespace {

constexpr int64_t kTokens = 13;

// An uninitialised-looking destination: every byte 0xFF (NaN in fp32 and bf16), so an element
// the engine does not write shows.
Tensor Poisoned(DType dtype, std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(dtype, std::move(shape));
  std::memset(t.bytes.data(), 0xff, t.bytes.size());
  return t;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
}

// Exported state (weights, moments, step) of two layers, bitwise.
void ExpectSameState(const Layer& a, const Layer& b, const std::string& what) {
  auto sa = a.ExportState(true), sb = b.ExportState(true);
  ASSERT_TRUE(sa.ok() && sb.ok()) << what;
  ASSERT_EQ(sa->size(), sb->size()) << what;
  for (const auto& [name, t] : *sa) {
    EXPECT_TRUE(SameBytes(t, sb->at(name))) << what << ": state " << name;
  }
}

class DestinationTest : public ::testing::TestWithParam<std::tuple<RoutingMode, DType>> {
 protected:
  LayerConfig Config() const {
    LayerConfig c = SmallConfig(Activation::kSwiGLU, std::get<0>(GetParam()));
    c.dtype = std::get<1>(GetParam());
    if (c.routing == RoutingMode::kServer) {
      c.aux_loss_coef = 0.01;
      c.z_loss_coef = 0.001;
    }
    return c;
  }
  std::string Name() const {
    return std::string(std::get<0>(GetParam()) == RoutingMode::kClient ? "client" : "server") +
           " " + DTypeName(std::get<1>(GetParam()));
  }
};

TEST_P(DestinationTest, OutputsInDestinationsEqualTheTensorResults) {
  const LayerConfig c = Config();
  const bool client = c.routing == RoutingMode::kClient;
  std::unique_ptr<Layer> tensors = MakeLayer(c), dests = MakeLayer(c);
  ASSERT_TRUE(tensors && dests);
  for (uint32_t round = 0; round < 2; ++round) {
    const std::string what = Name() + " round " + std::to_string(round);
    const Inputs in = MakeInputs(c, kTokens, 100 + 10 * round);
    auto ft = tensors->Forward(RequestOf(c, in));
    ASSERT_TRUE(ft.ok()) << ft.status() << " " << what;

    Tensor out = Poisoned(c.dtype, {kTokens, c.d_model});
    ForwardRequest req = RequestOf(c, in);
    req.out = out.mutable_view();
    auto fd = dests->Forward(req);
    ASSERT_TRUE(fd.ok()) << fd.status() << " " << what;
    EXPECT_TRUE(fd->out.empty()) << what;
    EXPECT_TRUE(SameBytes(out, ft->out)) << what << ": out";
    EXPECT_TRUE(SameBytes(fd->expert_ids, ft->expert_ids)) << what;
    EXPECT_TRUE(SameBytes(fd->weights, ft->weights)) << what;
    EXPECT_EQ(fd->aux_loss, ft->aux_loss) << what;

    auto bt = tensors->Backward(std::move(ft->context), in.dout.view());
    ASSERT_TRUE(bt.ok()) << bt.status() << " " << what;
    Tensor dx = Poisoned(c.dtype, {kTokens, c.d_model});
    Tensor dp = Poisoned(DType::kFloat32, {kTokens, c.top_k});
    BackwardRequest breq;
    breq.dout = in.dout.view();
    breq.dx = dx.mutable_view();
    if (client) breq.dweights = dp.mutable_view();
    auto bd = dests->Backward(std::move(fd->context), breq);
    ASSERT_TRUE(bd.ok()) << bd.status() << " " << what;
    EXPECT_TRUE(bd->dx.empty() && bd->dweights.empty()) << what;
    EXPECT_TRUE(SameBytes(dx, bt->dx)) << what << ": dx";
    if (client) EXPECT_TRUE(SameBytes(dp, bt->dweights)) << what << ": dweights";
  }
  ASSERT_TRUE(tensors->Step().ok());
  ASSERT_TRUE(dests->Step().ok());
  ExpectSameState(*tensors, *dests, Name());
}

TEST(DestinationMixTest, OneDestinationWithTheOtherOutputAsATensor) {
  const LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
  std::unique_ptr<Layer> tensors = MakeLayer(c), dests = MakeLayer(c);
  ASSERT_TRUE(tensors && dests);
  const Inputs in = MakeInputs(c, kTokens, 300);
  auto ft = tensors->Forward(RequestOf(c, in));
  auto fd = dests->Forward(RequestOf(c, in));
  ASSERT_TRUE(ft.ok() && fd.ok());
  auto bt = tensors->Backward(std::move(ft->context), in.dout.view());
  ASSERT_TRUE(bt.ok()) << bt.status();
  Tensor dp = Poisoned(DType::kFloat32, {kTokens, c.top_k});
  BackwardRequest breq;
  breq.dout = in.dout.view();
  breq.dweights = dp.mutable_view();
  auto bd = dests->Backward(std::move(fd->context), breq);
  ASSERT_TRUE(bd.ok()) << bd.status();
  EXPECT_TRUE(SameBytes(bd->dx, bt->dx));
  EXPECT_TRUE(bd->dweights.empty());
  EXPECT_TRUE(SameBytes(dp, bt->dweights));
}

INSTANTIATE_TEST_SUITE_P(
    RoutingAndDtype, DestinationTest,
    ::testing::Combine(::testing::Values(RoutingMode::kClient, RoutingMode::kServer),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16)),
    [](const ::testing::TestParamInfo<DestinationTest::ParamType>& info) {
      return std::string(std::get<0>(info.param) == RoutingMode::kClient ? "Client" : "Server") +
             (std::get<1>(info.param) == DType::kFloat32 ? "Float32" : "BFloat16");
    });

void ExpectRefused(const absl::Status& st, absl::StatusCode code, const std::string& message) {
  EXPECT_EQ(st.code(), code) << st;
  EXPECT_NE(st.message().find(message), std::string::npos)
      << "got \"" << st.message() << "\", expected it to contain \"" << message << "\"";
}

// After every refused call the layer gives what a layer that never saw them gives.
class RefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = SmallConfig(Activation::kSwiGLU, RoutingMode::kClient);
    layer_ = MakeLayer(c_);
    ASSERT_NE(layer_, nullptr);
    in_ = MakeInputs(c_, kTokens, 500);
  }
  void ExpectUnchanged() {
    std::unique_ptr<Layer> fresh = MakeLayer(c_);
    for (Layer* l : {layer_.get(), fresh.get()}) {
      auto f = l->Forward(RequestOf(c_, in_));
      ASSERT_TRUE(f.ok()) << f.status();
      ASSERT_TRUE(l->Backward(std::move(f->context), in_.dout.view()).ok());
      auto s = l->Step();
      ASSERT_TRUE(s.ok()) << s.status();
    }
    ExpectSameState(*layer_, *fresh, "after the refusals");
  }
  // A Backward of a fresh training Forward with `request`'s views; the status.
  absl::Status BackwardWith(const BackwardRequest& request) {
    auto f = layer_->Forward(RequestOf(c_, in_));
    if (!f.ok()) return f.status();
    return layer_->Backward(std::move(f->context), request).status();
  }

  LayerConfig c_;
  std::unique_ptr<Layer> layer_;
  Inputs in_;
};

TEST_F(RefusalTest, DeviceViewsAreRefusedNamingTheField) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  Tensor out = Poisoned(c_.dtype, {kTokens, c_.d_model});
  for (const char* field : {"x", "expert_ids", "weights", "out"}) {
    ForwardRequest r = RequestOf(c_, in_);
    r.out = out.mutable_view();
    if (std::string(field) == "x") r.x.location = MemoryLocation::Cuda(0);
    if (std::string(field) == "expert_ids") r.expert_ids.location = MemoryLocation::Cuda(1);
    if (std::string(field) == "weights") r.weights.location = MemoryLocation::Cuda(0);
    if (std::string(field) == "out") r.out.location = MemoryLocation::Cuda(0);
    const bool dest = std::string(field) == "out";
    const std::string device = std::string(field) == "expert_ids" ? "cuda:1" : "cuda:0";
    ExpectRefused(layer_->Forward(r).status(), kInvalid,
                  std::string(field) + ": on " + device + "; the cpu engine " +
                      (dest ? "writes" : "reads") + " host memory");
  }
  Tensor dx = Poisoned(c_.dtype, {kTokens, c_.d_model});
  Tensor dp = Poisoned(DType::kFloat32, {kTokens, c_.top_k});
  for (const char* field : {"dout", "dx", "dweights"}) {
    BackwardRequest b;
    b.dout = in_.dout.view();
    b.dx = dx.mutable_view();
    b.dweights = dp.mutable_view();
    if (std::string(field) == "dout") b.dout.location = MemoryLocation::Cuda(0);
    if (std::string(field) == "dx") b.dx.location = MemoryLocation::Cuda(0);
    if (std::string(field) == "dweights") b.dweights.location = MemoryLocation::Cuda(0);
    const bool dest = std::string(field) != "dout";
    ExpectRefused(BackwardWith(b), kInvalid,
                  std::string(field) + ": on cuda:0; the cpu engine " +
                      (dest ? "writes" : "reads") + " host memory");
  }
  // The destinations were never written.
  for (const Tensor* t : {&out, &dx, &dp}) {
    EXPECT_TRUE(SameBytes(*t, Poisoned(t->dtype, t->shape)));
  }
  ExpectUnchanged();
}

TEST_F(RefusalTest, StreamEventsAreRefused) {
  int token = 0;  // any non-null value: the engine must refuse it without touching it
  for (const char* field : {"order.wait_event", "order.done_event"}) {
    ForwardRequest r = RequestOf(c_, in_);
    BackwardRequest b;
    b.dout = in_.dout.view();
    void** event =
        std::string(field) == "order.wait_event" ? &r.order.wait_event : &r.order.done_event;
    *event = &token;
    ExpectRefused(layer_->Forward(r).status(), absl::StatusCode::kFailedPrecondition,
                  std::string(field) + ": the cpu engine runs no CUDA stream");
    (std::string(field) == "order.wait_event" ? b.order.wait_event : b.order.done_event) = &token;
    ExpectRefused(BackwardWith(b), absl::StatusCode::kFailedPrecondition,
                  std::string(field) + ": the cpu engine runs no CUDA stream");
  }
  ExpectUnchanged();
}

TEST_F(RefusalTest, BadDestinationsAreRefusedBeforeAnyWork) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const int64_t d = c_.d_model, k = c_.top_k;
  Tensor wide = Poisoned(c_.dtype, {kTokens, d + 1});
  Tensor bf16 = Poisoned(DType::kBFloat16, {kTokens, d});
  Tensor good = Poisoned(c_.dtype, {kTokens, d});
  struct Case {
    MutableTensorView view;
    std::string message;
  };
  MutableTensorView short_bytes = good.mutable_view();
  short_bytes.size_bytes -= 4;
  MutableTensorView no_shape = good.mutable_view();
  no_shape.shape = {kTokens * d};
  const std::vector<Case> outs = {
      {wide.mutable_view(), "out: shape [13, 9], expected [13, 8]"},
      {bf16.mutable_view(), "out: dtype bfloat16, expected float32"},
      {short_bytes, "out: 412 bytes for shape [13, 8] of float32, expected 416"},
      {no_shape, "out: shape [104], expected [13, 8]"},
  };
  for (const Case& cs : outs) {
    ForwardRequest r = RequestOf(c_, in_);
    r.out = cs.view;
    ExpectRefused(layer_->Forward(r).status(), kInvalid, cs.message);
  }
  {
    // out over x's bytes (an in-place forward is not part of the contract).
    Tensor x = in_.x;
    ForwardRequest r = RequestOf(c_, in_);
    r.x = x.view();
    r.out = x.mutable_view();
    ExpectRefused(layer_->Forward(r).status(), kInvalid, "out: overlaps x");
  }
  for (const Case& cs : outs) {
    BackwardRequest b;
    b.dout = in_.dout.view();
    b.dx = cs.view;
    std::string message = cs.message;
    message.replace(0, 3, "dx");
    ExpectRefused(BackwardWith(b), kInvalid, message);
  }
  {
    Tensor dp = Poisoned(DType::kFloat32, {kTokens, k});
    BackwardRequest b;
    b.dout = in_.dout.view();
    b.dweights = dp.mutable_view();
    b.dx = b.dweights;  // same bytes twice
    b.dx.dtype = c_.dtype;
    b.dx.shape = {kTokens, k};
    ExpectRefused(BackwardWith(b), kInvalid, "dx: shape [13, 2], expected [13, 8]");
    Tensor dp16 = Poisoned(DType::kBFloat16, {kTokens, k});
    b = BackwardRequest{};
    b.dout = in_.dout.view();
    b.dweights = dp16.mutable_view();
    ExpectRefused(BackwardWith(b), kInvalid, "dweights: dtype bfloat16, expected float32");
    Tensor both = Poisoned(c_.dtype, {2 * kTokens, d});
    b = BackwardRequest{};
    b.dout = in_.dout.view();
    b.dx = both.mutable_view();
    b.dx.shape = {kTokens, d};
    b.dx.size_bytes /= 2;
    b.dweights = dp.mutable_view();
    b.dweights.data = both.bytes.data() + 8;  // inside dx
    ExpectRefused(BackwardWith(b), kInvalid, "dweights: overlaps dx");
  }
  for (const Tensor* t : {&wide, &bf16, &good}) {
    EXPECT_TRUE(SameBytes(*t, Poisoned(t->dtype, t->shape)));
  }
  ExpectUnchanged();
}

TEST(DestinationRefusalTest, ServerRoutingHasNoDweightsDestination) {
  LayerConfig c = SmallConfig(Activation::kSwiGLU, RoutingMode::kServer);
  std::unique_ptr<Layer> layer = MakeLayer(c);
  ASSERT_NE(layer, nullptr);
  const Inputs in = MakeInputs(c, kTokens, 700);
  auto f = layer->Forward(RequestOf(c, in));
  ASSERT_TRUE(f.ok()) << f.status();
  Tensor dp = Poisoned(DType::kFloat32, {kTokens, c.top_k});
  BackwardRequest b;
  b.dout = in.dout.view();
  b.dweights = dp.mutable_view();
  ExpectRefused(layer->Backward(std::move(f->context), b).status(),
                absl::StatusCode::kInvalidArgument, "dweights: must be empty with server routing");
}

TEST(DestinationRefusalTest, TheCpuEngineRefusesCudaIpc) {
  std::unique_ptr<Engine> engine = CreateCpuEngine();
  const std::string handle(kCudaIpcHandleBytes, '\0');
  const auto kFailed = absl::StatusCode::kFailedPrecondition;
  ExpectRefused(engine->MapCudaIpcMemory(handle, 0, 0, 64).status(), kFailed,
                "needs a CUDA engine; this server runs on cpu");
  ExpectRefused(engine->OpenCudaIpcEvent(handle).status(), kFailed,
                "needs a CUDA engine; this server runs on cpu");
  ExpectRefused(engine->CreateCudaIpcEvent().status(), kFailed,
                "needs a CUDA engine; this server runs on cpu");
}

}  // namespace
}  // namespace moe::testing
