// moe::client with device tensors against a moe-server on the CUDA engine in another process
// (CUDA IPC cannot open a handle in the process that made it): by CUDA IPC (kSharedMemory, and
// kAuto deciding so at the first device call) and staged through host memory (kTcp), training
// with two Forwards in flight (their Backwards one at a time, as gradients sum in the order they
// run) into device destinations on a non-default stream gives the bits of host tensors over TCP; the inputs are written on that stream just before each call and
// the results read on it just after, so a missing order shows; a misaligned tensor is refused
// naming its field. Needs a GPU (label gpu): skipped without one.
//
// The server is the moe-server binary: $MOE_SERVER, else the one next to this test (a prebuilt
// directory), else the build tree's.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/client/cuda_test_util.h"

namespace moe {
namespace {

using cuda_test::Config;
using cuda_test::HaveGpu;
using cuda_test::MakeMicroBatch;
using cuda_test::MicroBatch;
using cuda_test::ServerProcess;

class CudaIpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    target_ = server_.Start();
    ASSERT_FALSE(target_.empty());
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::shared_ptr<client::Connection> Connect(client::Transport t,
                                              std::vector<std::string>* log = nullptr) {
    client::ClientOptions o;
    o.transport = t;
    o.log = [log](const std::string& line) {
      if (log) log->push_back(line);
    };
    auto c = client::Connection::Connect(target_, o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : nullptr;
  }

  // Two training steps of two micro-batches in flight through `device_conn` on device tensors,
  // and through a TCP connection on the same bytes in host memory: every result bitwise equal.
  void ExpectSameTraining(const std::shared_ptr<client::Connection>& device_conn,
                          const std::string& tag) {
    auto host_conn = Connect(client::Transport::kTcp);
    ASSERT_TRUE(host_conn && device_conn);
    auto host_layer = client::RemoteLayer::Create(host_conn, "host" + tag, Config());
    auto device_layer = client::RemoteLayer::Create(device_conn, "device" + tag, Config());
    ASSERT_TRUE(host_layer.ok() && device_layer.ok())
        << host_layer.status() << device_layer.status();
    std::mt19937 rng(7);
    for (int step = 0; step < 2; ++step) {
      SCOPED_TRACE(testing::Message() << tag << " step " << step);
      std::vector<std::unique_ptr<MicroBatch>> mbs;
      std::vector<std::future<absl::StatusOr<client::ForwardOutput>>> df;
      for (int i = 0; i < 2; ++i) {
        mbs.push_back(MakeMicroBatch(Config(), 300 + 100 * i, rng));
        ASSERT_TRUE(mbs.back());
        MicroBatch& mb = *mbs.back();
        // The inputs land on the stream just before the call; the destinations are poisoned.
        for (int k = 0; k < 4; ++k) {
          ASSERT_CUDA(cudaMemcpyAsync(mb.d(k), mb.h(k), mb.bytes[k], cudaMemcpyHostToDevice,
                                      stream_));
        }
        for (int k = 4; k < 7; ++k) {
          ASSERT_CUDA(cudaMemsetAsync(mb.d(k), 0xff, mb.bytes[k], stream_));
        }
        df.push_back((*device_layer)
                         ->ForwardInto(mb.DeviceIn(0), mb.DeviceIn(1), mb.DeviceIn(2),
                                       mb.DeviceOut(4), stream_));
      }
      std::vector<uint64_t> device_ctx, host_ctx;
      for (int i = 0; i < 2; ++i) {
        MicroBatch& mb = *mbs[i];
        auto d = df[i].get();
        ASSERT_TRUE(d.ok()) << d.status();
        EXPECT_TRUE(d->out.empty());
        ASSERT_CUDA(cudaMemcpyAsync(mb.h(4), mb.d(4), mb.bytes[4], cudaMemcpyDeviceToHost,
                                    stream_));
        ASSERT_CUDA(cudaStreamSynchronize(stream_));
        auto h = (*host_layer)->Forward(mb.HostIn(0), mb.HostIn(1), mb.HostIn(2)).get();
        ASSERT_TRUE(h.ok()) << h.status();
        EXPECT_TRUE(mb.HostBytes(4) == std::string(reinterpret_cast<const char*>(
                                                        h->out.bytes.data()),
                                                    h->out.bytes.size()))
            << "micro-batch " << i;
        device_ctx.push_back(d->context_id);
        host_ctx.push_back(h->context_id);
      }
      // Backwards one at a time: the weight gradients sum over them in the order they run.
      for (int i = 0; i < 2; ++i) {
        MicroBatch& mb = *mbs[i];
        auto d = (*device_layer)
                     ->BackwardInto(device_ctx[i], mb.DeviceIn(3), mb.DeviceOut(5),
                                    mb.DeviceOut(6), stream_)
                     .get();
        ASSERT_TRUE(d.ok()) << d.status();
        for (int k : {5, 6}) {
          ASSERT_CUDA(cudaMemcpyAsync(mb.h(k), mb.d(k), mb.bytes[k], cudaMemcpyDeviceToHost,
                                      stream_));
        }
        ASSERT_CUDA(cudaStreamSynchronize(stream_));
        auto h = (*host_layer)->Backward(host_ctx[i], mb.HostIn(3)).get();
        ASSERT_TRUE(h.ok()) << h.status();
        auto bytes = [](const Tensor& t) {
          return std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
        };
        EXPECT_TRUE(mb.HostBytes(5) == bytes(h->dx)) << "micro-batch " << i;
        EXPECT_TRUE(mb.HostBytes(6) == bytes(h->dweights)) << "micro-batch " << i;
      }
      auto hs = (*host_layer)->Step(), ds = (*device_layer)->Step();
      ASSERT_TRUE(hs.ok() && ds.ok()) << hs.status() << ds.status();
      EXPECT_EQ(ds->grad_norm, hs->grad_norm);
    }
  }

  ServerProcess server_;
  std::string target_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(CudaIpcTest, DeviceTensorsByCudaIpcGiveTheBitsOfHostTensors) {
  auto conn = Connect(client::Transport::kSharedMemory);
  ASSERT_TRUE(conn);
  EXPECT_EQ(conn->device_transport(), client::DeviceTransport::kCudaIpc);
  ExpectSameTraining(conn, "-ipc");
}

TEST_F(CudaIpcTest, AutoDecidesCudaIpcAtTheFirstDeviceCallAndSaysSo) {
  std::vector<std::string> log;
  auto conn = Connect(client::Transport::kAuto, &log);
  ASSERT_TRUE(conn);
  EXPECT_EQ(conn->device_transport(), client::DeviceTransport::kUndecided);
  ExpectSameTraining(conn, "-auto");
  EXPECT_EQ(conn->device_transport(), client::DeviceTransport::kCudaIpc);
  std::string all;
  for (const std::string& l : log) all += l + "\n";
  EXPECT_NE(all.find("CUDA IPC"), std::string::npos) << all;
}

TEST_F(CudaIpcTest, StagedThroughHostMemoryOverTcp) {
  auto conn = Connect(client::Transport::kTcp);
  ASSERT_TRUE(conn);
  EXPECT_EQ(conn->device_transport(), client::DeviceTransport::kStaged);
  ExpectSameTraining(conn, "-staged");
}

TEST_F(CudaIpcTest, AMisalignedDeviceTensorIsRefusedNamingIt) {
  auto conn = Connect(client::Transport::kSharedMemory);
  ASSERT_TRUE(conn);
  auto layer = client::RemoteLayer::Create(conn, "misaligned", Config());
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::mt19937 rng(3);
  auto mb = MakeMicroBatch(Config(), 64, rng);
  ASSERT_TRUE(mb);
  TensorView x = mb->DeviceIn(0);
  x.data = static_cast<const char*>(x.data) + 8;
  absl::Status st =
      (*layer)->ForwardInto(x, mb->DeviceIn(1), mb->DeviceIn(2), mb->DeviceOut(4), stream_)
          .get()
          .status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message().rfind("x: ", 0), 0u) << st;
}

}  // namespace
}  // namespace moe
