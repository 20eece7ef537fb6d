// The CUDA engine on device tensors (engine/layer.h, "Where the bytes live"): inputs in device
// memory and outputs into device destinations give bit for bit what the host path gives, at
// aligned offsets (read and written in place) and unaligned ones (through the layer's own
// buffers), with client routing given in device memory, mixed with host views, and, on a machine
// with two GPUs, from another device (peer copies). Stream ordering: a call waits for the
// caller's wait_event (a GPU delay before the caller writes x makes a missing wait read NaN
// poison), a call with a done_event returns before its work has run, one without has finished
// it. Bad views are refused naming the field, before any work. GPU only (ctest label "gpu").
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda/cuda_engine.h"
#include "engine/cuda/pipeline_options.h"
#include "engine/layer.h"
#include "tests/engine/cuda/device_memory.h"
#include "tests/engine/cuda/engine_test_util.h"
#include "tests/engine/cuda/gpu_delay.h"

namespace moe {
namespace {

using testing::DeviceBlock;
using testing::DeviceDestination;
using testing::DeviceView;
using testing::Download;
using testing::RandomRounds;
using testing::Round;
using testing::ExpectRefused;
using testing::SameBytes;

constexpr int64_t kTokens = 96, kExperts = 6, kTopK = 2, kModel = 128, kHidden = 96;

LayerConfig Config(RoutingMode routing, DType dtype, uint64_t seed) {
  LayerConfig c;
  c.num_experts = kExperts;
  c.top_k = kTopK;
  c.d_model = kModel;
  c.d_hidden = kHidden;
  c.dtype = dtype;
  c.routing = routing;
  c.seed = seed;
  if (routing == RoutingMode::kServer) {
    c.aux_loss_coef = 0.01;
    c.z_loss_coef = 0.001;
  }
  return c;
}

// A layer on `device` whose every device allocation is poisoned (NaN) first.
std::unique_ptr<Layer> GpuLayer(int device, const LayerConfig& c) {
  static auto* engines = new std::map<int, std::unique_ptr<Engine>>();
  std::unique_ptr<Engine>& engine = (*engines)[device];
  if (engine == nullptr) {
    cuda::PipelineOptions pipeline;
    pipeline.poison_allocations = true;
    absl::StatusOr<std::unique_ptr<Engine>> e = CreateCudaEngine(device, {}, pipeline);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    engine = std::move(*e);
  }
  absl::StatusOr<std::unique_ptr<Layer>> layer = engine->CreateLayer(c);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

ForwardRequest HostRequest(const LayerConfig& c, const Round& r, bool training = true) {
  ForwardRequest q;
  q.x = r.x.view();
  if (c.routing == RoutingMode::kClient) {
    q.expert_ids = r.ids.view();
    q.weights = r.w.view();
  }
  q.training = training;
  return q;
}

void ExpectSameState(const Layer& a, const Layer& b, const std::string& what) {
  auto sa = a.ExportState(true), sb = b.ExportState(true);
  ASSERT_TRUE(sa.ok() && sb.ok()) << what;
  for (const auto& [name, t] : *sa) {
    EXPECT_TRUE(SameBytes(t, sb->at(name))) << what << ": state " << name;
  }
}

// Pieces of one device block, each at a multiple of 256 bytes plus `skew`.
class Placement {
 public:
  Placement(size_t bytes, size_t skew, int device) : block_(bytes, device), skew_(skew) {}
  char* Take(size_t bytes) {
    char* p = block_.at(next_ + skew_);
    next_ += (bytes + skew_ + 255) / 256 * 256;
    EXPECT_LE(next_, block_.bytes());
    return p;
  }
  int device() const { return block_.device(); }

 private:
  DeviceBlock block_;
  size_t skew_;
  size_t next_ = 0;
};

struct Variant {
  size_t skew;       // 0: the engine reads and writes the caller's memory in place
  int view_device;   // where the caller's tensors are
  int layer_device;  // where the device path's layer runs
  std::string Name() const {
    return "skew " + std::to_string(skew) + ", views on cuda:" + std::to_string(view_device) +
           ", layer on cuda:" + std::to_string(layer_device);
  }
};

// Rounds on two identical layers, one on host tensors (on cuda:0), one on device views as
// `v` says: round 0 all device, round 1 with client routing in device memory too, round 2
// mixed (x and dx on the device, out and dweights into host destinations, dout from host).
void CompareWithHostPath(RoutingMode routing, DType dtype, const Variant& v) {
  const uint64_t seed = std::random_device{}();
  const std::string what = std::string(routing == RoutingMode::kClient ? "client" : "server") +
                           " " + DTypeName(dtype) + ", " + v.Name() + ", seed " +
                           std::to_string(seed);
  std::mt19937_64 rng(seed);
  const LayerConfig c = Config(routing, dtype, rng());
  const bool client = routing == RoutingMode::kClient;
  std::unique_ptr<Layer> host = GpuLayer(0, c), dev = GpuLayer(v.layer_device, c);
  ASSERT_TRUE(host && dev) << what;
  const std::vector<Round> rounds = RandomRounds(3, dtype, kTokens, kModel, kTopK, kExperts, rng);
  const int vd = v.view_device;
  for (int r = 0; r < 3; ++r) {
    const std::string at = what + ", round " + std::to_string(r);
    const Round& in = rounds[r];
    Placement mem(size_t{8} << 20, v.skew, vd);
    char* x = mem.Take(in.x.bytes.size());
    testing::Upload(in.x, x);
    ForwardRequest q = HostRequest(c, in);
    q.x = DeviceView(in.x, x, vd);
    if (client && r == 1) {
      char* ids = mem.Take(in.ids.bytes.size());
      char* w = mem.Take(in.w.bytes.size());
      testing::Upload(in.ids, ids);
      testing::Upload(in.w, w);
      q.expert_ids = DeviceView(in.ids, ids, vd);
      q.weights = DeviceView(in.w, w, vd);
    }
    Tensor out_host = Tensor::Zeros(dtype, {kTokens, kModel});
    std::memset(out_host.bytes.data(), 0xff, out_host.bytes.size());
    q.out = r == 2
                ? out_host.mutable_view()
                : DeviceDestination(dtype, {kTokens, kModel}, mem.Take(out_host.bytes.size()), vd);
    auto fa = host->Forward(HostRequest(c, in));
    auto fb = dev->Forward(q);
    ASSERT_TRUE(fa.ok()) << fa.status() << " " << at;
    ASSERT_TRUE(fb.ok()) << fb.status() << " " << at;
    EXPECT_TRUE(fb->out.empty()) << at;
    EXPECT_TRUE(SameBytes(r == 2 ? out_host : Download(q.out), fa->out)) << at << ": out";
    EXPECT_TRUE(SameBytes(fb->expert_ids, fa->expert_ids)) << at << ": expert_ids";
    EXPECT_TRUE(SameBytes(fb->weights, fa->weights)) << at << ": weights";
    EXPECT_EQ(fb->aux_loss, fa->aux_loss) << at;
    EXPECT_EQ(fb->z_loss, fa->z_loss) << at;
    EXPECT_EQ(fb->tokens_per_local_expert, fa->tokens_per_local_expert) << at;

    BackwardRequest b;
    if (r == 2) {
      b.dout = in.dout.view();
    } else {
      char* dout = mem.Take(in.dout.bytes.size());
      testing::Upload(in.dout, dout);
      b.dout = DeviceView(in.dout, dout, vd);
    }
    b.dx = DeviceDestination(dtype, {kTokens, kModel}, mem.Take(in.dout.bytes.size()), vd);
    Tensor dp_host = Tensor::Zeros(DType::kFloat32, {kTokens, kTopK});
    std::memset(dp_host.bytes.data(), 0xff, dp_host.bytes.size());
    if (client) {
      b.dweights = r == 2 ? dp_host.mutable_view()
                          : DeviceDestination(DType::kFloat32, {kTokens, kTopK},
                                              mem.Take(dp_host.bytes.size()), vd);
    }
    auto ba = host->Backward(std::move(fa->context), in.dout.view());
    auto bb = dev->Backward(std::move(fb->context), b);
    ASSERT_TRUE(ba.ok()) << ba.status() << " " << at;
    ASSERT_TRUE(bb.ok()) << bb.status() << " " << at;
    EXPECT_TRUE(bb->dx.empty() && bb->dweights.empty()) << at;
    EXPECT_TRUE(SameBytes(Download(b.dx), ba->dx)) << at << ": dx";
    if (client) {
      EXPECT_TRUE(SameBytes(r == 2 ? dp_host : Download(b.dweights), ba->dweights))
          << at << ": dweights";
    }
  }
  auto sa = host->Step(), sb = dev->Step();
  ASSERT_TRUE(sa.ok() && sb.ok()) << what;
  EXPECT_EQ(sa->grad_norm, sb->grad_norm) << what;
  ExpectSameState(*host, *dev, what);

  // Inference reads x in place (aligned, same device) and keeps nothing.
  Placement mem(size_t{1} << 20, v.skew, vd);
  char* x = mem.Take(rounds[0].x.bytes.size());
  testing::Upload(rounds[0].x, x);
  ForwardRequest q = HostRequest(c, rounds[0], /*training=*/false);
  q.x = DeviceView(rounds[0].x, x, vd);
  q.out = DeviceDestination(dtype, {kTokens, kModel}, mem.Take(rounds[0].x.bytes.size()), vd);
  auto fa = host->Forward(HostRequest(c, rounds[0], false));
  auto fb = dev->Forward(q);
  ASSERT_TRUE(fa.ok() && fb.ok()) << what;
  EXPECT_EQ(fb->context, nullptr) << what;
  EXPECT_TRUE(SameBytes(Download(q.out), fa->out)) << what << ": inference out";
}

class DeviceTensorTest : public ::testing::TestWithParam<std::tuple<RoutingMode, DType>> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(DeviceTensorTest, DeviceViewsGiveTheHostPathsBits) {
  const auto [routing, dtype] = GetParam();
  std::vector<Variant> variants = {{0, 0, 0}, {16, 0, 0}};
  // Views on another device than the layer's: peer copies in and out.
  if (CudaDeviceCount() >= 2) variants.push_back({0, 0, 1});
  for (const Variant& v : variants) CompareWithHostPath(routing, dtype, v);
}

INSTANTIATE_TEST_SUITE_P(
    RoutingAndDtype, DeviceTensorTest,
    ::testing::Combine(::testing::Values(RoutingMode::kClient, RoutingMode::kServer),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16)),
    [](const ::testing::TestParamInfo<DeviceTensorTest::ParamType>& info) {
      return std::string(std::get<0>(info.param) == RoutingMode::kClient ? "Client" : "Server") +
             (std::get<1>(info.param) == DType::kFloat32 ? "Float32" : "BFloat16");
    });

// A trainer's stream: writes an input after a GPU delay and records `ready`; reads outputs
// after the engine's `done`. Host copies go through page-locked memory so nothing the trainer
// enqueues blocks its thread.
class CallerStream {
 public:
  CallerStream() {
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), cudaSuccess);
    EXPECT_EQ(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), cudaSuccess);
    EXPECT_EQ(cudaMallocHost(&pinned_, kPinnedBytes), cudaSuccess);
  }
  ~CallerStream() {
    cudaStreamSynchronize(stream_);
    cudaFreeHost(pinned_);
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
  }
  // After `delay_us` on the GPU, t's bytes land at dst; `ready` marks it.
  void WriteLate(const Tensor& t, void* dst, int64_t delay_us) {
    ASSERT_LE(t.bytes.size(), kPinnedBytes);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);  // the pinned buffer is free
    std::memcpy(pinned_, t.bytes.data(), t.bytes.size());
    ASSERT_EQ(testing::EnqueueGpuDelay(stream_, delay_us), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(dst, pinned_, t.bytes.size(), cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    ASSERT_EQ(cudaEventRecord(ready_, stream_), cudaSuccess);
  }
  // A destination's bytes once `done` has fired (the caller's stream waits for it).
  Tensor ReadAfterDone(const MutableTensorView& v) {
    Tensor t = Tensor::Zeros(v.dtype, v.shape);
    EXPECT_EQ(cudaStreamWaitEvent(stream_, done_, 0), cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(pinned_, v.data, t.bytes.size(), cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::memcpy(t.bytes.data(), pinned_, t.bytes.size());
    return t;
  }
  StreamOrder Order(bool with_done) const { return {ready_, with_done ? done_ : nullptr}; }
  cudaEvent_t done() const { return done_; }

 private:
  static constexpr size_t kPinnedBytes = size_t{1} << 20;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  void* pinned_ = nullptr;
};

// The bytes of device memory now, read on a stream of its own: no ordering with the engine's.
Tensor ReadUnordered(const MutableTensorView& v) {
  Tensor t = Tensor::Zeros(v.dtype, v.shape);
  cudaStream_t s = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(t.bytes.data(), v.data, t.bytes.size(), cudaMemcpyDeviceToHost, s),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaStreamDestroy(s);
  return t;
}

TEST(DeviceTensorOrderTest, CallsFollowTheCallersEvents) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  const LayerConfig c = Config(RoutingMode::kClient, DType::kBFloat16, rng());
  std::unique_ptr<Layer> host = GpuLayer(0, c), dev = GpuLayer(0, c);
  ASSERT_TRUE(host && dev);
  const std::vector<Round> rounds =
      RandomRounds(3, DType::kBFloat16, kTokens, kModel, kTopK, kExperts, rng);
  // A first round on host tensors makes what a layer makes once (the weight-gradient lane's
  // stream and cuBLAS handle, pool memory): creating those may wait for the whole device.
  for (Layer* l : {host.get(), dev.get()}) {
    auto f = l->Forward(HostRequest(c, rounds[0]));
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(l->Backward(std::move(f->context), rounds[0].dout.view()).ok());
  }
  CallerStream caller;
  constexpr int64_t kDelayUs = 300000;
  for (int r = 1; r < 3; ++r) {
    const std::string at = "seed " + std::to_string(seed) + ", round " + std::to_string(r);
    const bool with_done = r == 1;
    Placement mem(size_t{4} << 20, 0, 0);
    const Round& in = rounds[r];
    char* x = mem.Take(in.x.bytes.size());
    caller.WriteLate(in.x, x, kDelayUs);
    ForwardRequest q = HostRequest(c, in);
    q.x = DeviceView(in.x, x, 0);
    q.out = DeviceDestination(c.dtype, {kTokens, kModel}, mem.Take(in.x.bytes.size()), 0);
    q.order = caller.Order(with_done);
    auto fa = host->Forward(HostRequest(c, in));
    auto fb = dev->Forward(q);
    ASSERT_TRUE(fa.ok() && fb.ok()) << at;
    EXPECT_TRUE(SameBytes(caller.ReadAfterDone(q.out), fa->out)) << at << ": out";

    char* dout = mem.Take(in.dout.bytes.size());
    caller.WriteLate(in.dout, dout, kDelayUs);
    BackwardRequest b;
    b.dout = DeviceView(in.dout, dout, 0);
    b.dx = DeviceDestination(c.dtype, {kTokens, kModel}, mem.Take(in.dout.bytes.size()), 0);
    b.dweights = DeviceDestination(DType::kFloat32, {kTokens, kTopK}, mem.Take(kTokens * 8), 0);
    b.order = caller.Order(with_done);
    auto ba = host->Backward(std::move(fa->context), in.dout.view());
    auto bb = dev->Backward(std::move(fb->context), b);
    ASSERT_TRUE(ba.ok() && bb.ok()) << at;
    if (with_done) {
      // Every output in device memory and a done_event: the Backward has no host sync, so it
      // returned while its work still waits behind the caller's delay.
      EXPECT_EQ(cudaEventQuery(caller.done()), cudaErrorNotReady) << at;
      cudaGetLastError();  // "not ready" is an answer, not an error to keep
      EXPECT_TRUE(SameBytes(caller.ReadAfterDone(b.dx), ba->dx)) << at << ": dx";
      EXPECT_TRUE(SameBytes(caller.ReadAfterDone(b.dweights), ba->dweights)) << at;
    } else {
      // No done_event: the work is finished when the call returns.
      EXPECT_TRUE(SameBytes(ReadUnordered(b.dx), ba->dx)) << at << ": dx";
      EXPECT_TRUE(SameBytes(ReadUnordered(b.dweights), ba->dweights)) << at;
    }
  }
}

TEST(DeviceTensorRefusalTest, BadViewsAreRefusedBeforeAnyWork) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(std::random_device{}());
  const LayerConfig c = Config(RoutingMode::kClient, DType::kFloat32, rng());
  std::unique_ptr<Layer> layer = GpuLayer(0, c), fresh = GpuLayer(0, c);
  ASSERT_TRUE(layer && fresh);
  const Round in = RandomRounds(1, c.dtype, kTokens, kModel, kTopK, kExperts, rng)[0];
  const size_t xb = in.x.bytes.size();
  DeviceBlock block(4 * xb), small(xb / 2);
  testing::Upload(in.x, block.at(0));
  const auto forward_with = [&](const std::function<void(ForwardRequest*)>& edit) {
    ForwardRequest q = HostRequest(c, in);
    q.x = DeviceView(in.x, block.at(0), 0);
    q.out = DeviceDestination(c.dtype, {kTokens, kModel}, block.at(xb), 0);
    edit(&q);
    return layer->Forward(q).status();
  };
  ExpectRefused(forward_with([&](ForwardRequest* q) { q->x.data = in.x.bytes.data(); }),
                "x: not CUDA device memory");
  ExpectRefused(forward_with([&](ForwardRequest* q) { q->x.location = MemoryLocation::Host(); }),
                "x: said to be host memory, but is memory of cuda:0");
  ExpectRefused(forward_with([&](ForwardRequest* q) { q->x.location = MemoryLocation::Cuda(7); }),
                "x: said to be on cuda:7, but is memory of cuda:0");
  ExpectRefused(forward_with([&](ForwardRequest* q) { q->x.data = small.at(0); }),
                "run past the end of its allocation");
  ExpectRefused(forward_with([&](ForwardRequest* q) { q->out.data = block.at(4 * xb - 8); }),
                "out: " + std::to_string(xb) + " bytes from offset " + std::to_string(4 * xb - 8));
  ExpectRefused(forward_with([&](ForwardRequest* q) {
                  q->out.shape = {kTokens, kModel + 1};
                }),
                "out: shape");
  ExpectRefused(forward_with([&](ForwardRequest* q) { q->out.data = block.at(8); }),
                "out: overlaps x");
  Tensor bad_ids = in.ids;
  bad_ids.as<int32_t>()[5] = kExperts + 3;
  testing::Upload(bad_ids, block.at(2 * xb));
  ExpectRefused(forward_with([&](ForwardRequest* q) {
                  q->expert_ids = DeviceView(bad_ids, block.at(2 * xb), 0);
                }),
                "expert_ids[2, 1] = 9 out of range [0, 6)");

  // Routing faults are found on the GPU, host routing's too, and worded as the CPU engine words
  // them: the first fault in its order.
  Tensor dup_ids = in.ids;
  dup_ids.as<int32_t>()[7] = dup_ids.as<int32_t>()[6];
  testing::Upload(dup_ids, block.at(2 * xb));
  const std::string dup_message = "expert_ids[3, 1] = " + std::to_string(dup_ids.as<int32_t>()[6]) +
                                  " duplicates expert_ids[3, 0]";
  ExpectRefused(forward_with([&](ForwardRequest* q) {
                  q->expert_ids = DeviceView(dup_ids, block.at(2 * xb), 0);
                }),
                dup_message);
  ExpectRefused(forward_with([&](ForwardRequest* q) { q->expert_ids = dup_ids.view(); }),
                dup_message);
  ASSERT_EQ(in.w.dtype, DType::kFloat32);
  Tensor nan_weights = in.w;
  nan_weights.as<float>()[4] = std::nanf("");
  bad_ids.as<int32_t>()[5] = in.ids.as<int32_t>()[5];
  bad_ids.as<int32_t>()[9] = -1;  // a later fault: the message names the first
  testing::Upload(bad_ids, block.at(2 * xb));
  testing::Upload(nan_weights, block.at(3 * xb));
  ExpectRefused(forward_with([&](ForwardRequest* q) {
                  q->expert_ids = DeviceView(bad_ids, block.at(2 * xb), 0);
                  q->weights = DeviceView(nan_weights, block.at(3 * xb), 0);
                }),
                "weights[2, 0] = nan is not finite");

  auto f = layer->Forward(HostRequest(c, in));
  ASSERT_TRUE(f.ok()) << f.status();
  BackwardRequest b;
  b.dout = in.dout.view();
  b.dx = DeviceDestination(c.dtype, {kTokens, kModel}, block.at(4 * xb - 4), 0);
  ExpectRefused(layer->Backward(std::move(f->context), b).status(),
                "dx: " + std::to_string(xb) + " bytes from offset " + std::to_string(4 * xb - 4));

  // The layer is as it was: the same training round as on a fresh layer, bit for bit.
  for (Layer* l : {layer.get(), fresh.get()}) {
    auto fr = l->Forward(HostRequest(c, in));
    ASSERT_TRUE(fr.ok()) << fr.status();
    ASSERT_TRUE(l->Backward(std::move(fr->context), in.dout.view()).ok());
    ASSERT_TRUE(l->Step().ok());
  }
  ExpectSameState(*layer, *fresh, "after the refusals");
}

}  // namespace
}  // namespace moe
