// ShardedLayer with device tensors against two moe-servers on the CUDA engine in other processes:
// the same micro-batches through a sharded layer on host tensors over TCP and through another on
// device tensors (cuda:0, a non-default stream, destinations poisoned first) give bitwise the same
// out, dx and dweights, micro-batch after micro-batch, and the same Step. Three Forwards are in
// flight at once; their Backwards run one at a time, as weight gradients sum in the order they
// run. One micro-batch routes every token to the first shard's experts, so the second shard gets
// no rows and no call. An expert id outside [0, E) is refused naming it, and the layer goes on.
//
// The shards' connections move the device buffers by CUDA IPC (servers on cuda:0, or one on
// cuda:1 where there are two GPUs) and, in a client built with NCCL, over NCCL channels (servers
// on cuda:1, as NCCL refuses two ranks on one device: two GPUs needed). Label gpu: skipped without
// a GPU. The server is $MOE_SERVER, else the moe-server next to this test, else the build tree's.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/client/cuda_test_util.h"

namespace moe {
namespace {

using cuda_test::GpuCount;
using cuda_test::MicroBatch;
using cuda_test::ServerProcess;

LayerConfig ShardedConfig() {
  LayerConfig c;
  c.num_experts = 7;  // shards of 4 and 3 experts
  c.top_k = 2;
  c.d_model = 256;
  c.d_hidden = 128;
  c.dtype = DType::kFloat32;
  c.routing = RoutingMode::kClient;
  c.seed = 13;
  c.optimizer.learning_rate = 1e-2;
  return c;
}

std::string Bytes(const Tensor& t) {
  return std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
}

class ShardedDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_test::HaveGpu()) GTEST_SKIP() << "no GPU";
    ASSERT_CUDA(cudaSetDevice(0));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    layers_.clear();  // before the stream and the servers
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Starts the two servers on `devices` and makes the host and device layers.
  void Start(const std::vector<std::string>& devices, client::Transport transport,
             client::DeviceTransportRequest device_transport) {
    std::vector<std::shared_ptr<client::Connection>> host, device;
    for (size_t i = 0; i < devices.size(); ++i) {
      const std::string target = servers_[i].Start(devices[i]);
      ASSERT_FALSE(target.empty());
      client::ClientOptions o;
      o.timeout = std::chrono::seconds(60);
      auto h = client::Connection::Connect(target, o);
      o.transport = transport;
      o.device_transport = device_transport;
      auto d = client::Connection::Connect(target, o);
      ASSERT_TRUE(h.ok() && d.ok()) << h.status() << d.status();
      host.push_back(*h);
      device.push_back(*d);
      device_conns_.push_back(*d);
    }
    auto h = client::ShardedLayer::Create(host, "host", ShardedConfig());
    auto d = client::ShardedLayer::Create(device, "device", ShardedConfig());
    ASSERT_TRUE(h.ok() && d.ok()) << h.status() << d.status();
    layers_.push_back(std::move(*h));
    layers_.push_back(std::move(*d));
  }
  client::ShardedLayer& host() { return *layers_[0]; }
  client::ShardedLayer& device() { return *layers_[1]; }

  // A micro-batch of `tokens`; `first_shard_only`: every pick among the first shard's experts.
  std::unique_ptr<MicroBatch> MakeBatch(int64_t tokens, bool first_shard_only, std::mt19937& rng) {
    const LayerConfig c = ShardedConfig();
    auto mb = cuda_test::MakeMicroBatch(c, tokens, rng);
    if (mb == nullptr) return nullptr;
    const int32_t experts = first_shard_only
                                ? static_cast<int32_t>(device().shard(0).config().local_experts())
                                : static_cast<int32_t>(c.num_experts);
    auto* ids = static_cast<int32_t*>(mb->h(1));
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t first = static_cast<int32_t>(rng() % experts);
      for (int64_t j = 0; j < c.top_k; ++j) {
        ids[t * c.top_k + j] = static_cast<int32_t>((first + j) % experts);
      }
    }
    return mb;
  }

  // Copies the inputs to the device on the stream and poisons the destinations.
  void Upload(const MicroBatch& mb) {
    for (int k = 0; k < 4; ++k) {
      ASSERT_CUDA(cudaMemcpyAsync(mb.d(k), mb.h(k), mb.bytes[k], cudaMemcpyHostToDevice,
                                  stream_));
    }
    for (int k = 4; k < MicroBatch::kTensors; ++k) {
      ASSERT_CUDA(cudaMemsetAsync(mb.d(k), 0xff, mb.bytes[k], stream_));
    }
  }
  void Download(const MicroBatch& mb, std::initializer_list<int> which) {
    for (int k : which) {
      ASSERT_CUDA(cudaMemcpyAsync(mb.h(k), mb.d(k), mb.bytes[k], cudaMemcpyDeviceToHost,
                                  stream_));
    }
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
  }

  // Two steps of three micro-batches in flight, the second of them routed to the first shard
  // only: device and host layers bitwise equal throughout.
  void ExpectSameTraining() {
    std::mt19937 rng(17);
    for (int step = 0; step < 2; ++step) {
      SCOPED_TRACE(testing::Message() << "step " << step);
      std::vector<std::unique_ptr<MicroBatch>> mbs;
      std::vector<std::future<absl::StatusOr<client::ForwardOutput>>> df;
      for (int i = 0; i < 3; ++i) {
        mbs.push_back(MakeBatch(300 + 97 * i, /*first_shard_only=*/i == 1, rng));
        ASSERT_TRUE(mbs.back());
        const MicroBatch& mb = *mbs.back();
        Upload(mb);
        df.push_back(device().ForwardInto(mb.DeviceIn(0), mb.DeviceIn(1), mb.DeviceIn(2),
                                          mb.DeviceOut(4), stream_));
      }
      std::vector<uint64_t> dctx, hctx;
      for (int i = 0; i < 3; ++i) {
        const MicroBatch& mb = *mbs[i];
        auto d = df[i].get();
        ASSERT_TRUE(d.ok()) << d.status();
        EXPECT_TRUE(d->out.empty());
        Download(mb, {4});
        auto h = host().Forward(mb.HostIn(0), mb.HostIn(1), mb.HostIn(2)).get();
        ASSERT_TRUE(h.ok()) << h.status();
        EXPECT_TRUE(mb.HostBytes(4) == Bytes(h->out)) << "micro-batch " << i;
        dctx.push_back(d->context_id);
        hctx.push_back(h->context_id);
      }
      for (int i = 0; i < 3; ++i) {
        const MicroBatch& mb = *mbs[i];
        auto d = device()
                     .BackwardInto(dctx[i], mb.DeviceIn(3), mb.DeviceOut(5), mb.DeviceOut(6),
                                   stream_)
                     .get();
        ASSERT_TRUE(d.ok()) << d.status();
        Download(mb, {5, 6});
        auto h = host().Backward(hctx[i], mb.HostIn(3)).get();
        ASSERT_TRUE(h.ok()) << h.status();
        EXPECT_TRUE(mb.HostBytes(5) == Bytes(h->dx)) << "micro-batch " << i;
        EXPECT_TRUE(mb.HostBytes(6) == Bytes(h->dweights)) << "micro-batch " << i;
        // A context is taken once.
        EXPECT_EQ(device()
                      .BackwardInto(dctx[i], mb.DeviceIn(3), mb.DeviceOut(5), mb.DeviceOut(6),
                                    stream_)
                      .get()
                      .status()
                      .code(),
                  absl::StatusCode::kNotFound);
      }
      auto hs = host().Step();
      auto ds = device().Step();
      ASSERT_TRUE(hs.ok() && ds.ok()) << hs.status() << ds.status();
      EXPECT_EQ(ds->grad_norm, hs->grad_norm);
      EXPECT_EQ(ds->tokens_per_expert, hs->tokens_per_expert);
    }
  }

  cudaStream_t stream_ = nullptr;
  ServerProcess servers_[2];
  std::vector<std::shared_ptr<client::Connection>> device_conns_;
  std::vector<std::unique_ptr<client::ShardedLayer>> layers_;
};

TEST_F(ShardedDeviceTest, ByCudaIpcGivesTheBitsOfHostTensors) {
  Start({"cuda:0", "cuda:0"}, client::Transport::kSharedMemory,
        client::DeviceTransportRequest::kNever);
  ExpectSameTraining();
  for (const auto& c : device_conns_) {
    EXPECT_EQ(c->device_transport(), client::DeviceTransport::kCudaIpc);
  }
}

TEST_F(ShardedDeviceTest, ByCudaIpcWithAShardOnAnotherGpuGivesTheBitsOfHostTensors) {
  if (GpuCount() < 2) GTEST_SKIP() << "needs two GPUs";
  Start({"cuda:0", "cuda:1"}, client::Transport::kSharedMemory,
        client::DeviceTransportRequest::kNever);
  ExpectSameTraining();
}

TEST_F(ShardedDeviceTest, OverNcclFromAnotherGpuGivesTheBitsOfHostTensors) {
#ifndef MOE_TEST_NCCL
  GTEST_SKIP() << "the client was built without NCCL";
#endif
  if (GpuCount() < 2) GTEST_SKIP() << "needs two GPUs (NCCL refuses two ranks on one device)";
  Start({"cuda:1", "cuda:1"}, client::Transport::kTcp, client::DeviceTransportRequest::kNccl);
  ExpectSameTraining();
  for (const auto& c : device_conns_) {
    EXPECT_EQ(c->device_transport(), client::DeviceTransport::kNccl);
  }
}

TEST_F(ShardedDeviceTest, AnIdOutsideTheLayerIsRefusedNamingItAndTheLayerGoesOn) {
  Start({"cuda:0", "cuda:0"}, client::Transport::kSharedMemory,
        client::DeviceTransportRequest::kNever);
  std::mt19937 rng(5);
  auto mb = MakeBatch(64, false, rng);
  ASSERT_TRUE(mb);
  int32_t& pick = static_cast<int32_t*>(mb->h(1))[3 * 2 + 1];
  const int32_t good = pick;
  pick = 7;  // token 3, pick 1: E is 7
  Upload(*mb);
  absl::Status st = device()
                        .ForwardInto(mb->DeviceIn(0), mb->DeviceIn(1), mb->DeviceIn(2),
                                     mb->DeviceOut(4), stream_)
                        .get()
                        .status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("expert_ids: id 7 at [3,1]"), std::string::npos) << st;
  pick = good;
  Upload(*mb);
  auto ok = device()
                .ForwardInto(mb->DeviceIn(0), mb->DeviceIn(1), mb->DeviceIn(2), mb->DeviceOut(4),
                             stream_)
                .get();
  ASSERT_TRUE(ok.ok()) << ok.status();
  // A destination on the host next to device inputs is refused naming it.
  Tensor out = Tensor::Zeros(DType::kFloat32, {64, ShardedConfig().d_model});
  st = device()
           .ForwardInto(mb->DeviceIn(0), mb->DeviceIn(1), mb->DeviceIn(2), out.mutable_view(),
                        stream_)
           .get()
           .status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message().rfind("out: ", 0), 0u) << st;
}

}  // namespace
}  // namespace moe
