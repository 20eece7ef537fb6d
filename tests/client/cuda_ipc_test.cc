// moe::client with device tensors against a moe-server on the CUDA engine in another process
// (CUDA IPC cannot open a handle in the process that made it): by CUDA IPC (kSharedMemory, and
// kAuto deciding so at the first device call) and staged through host memory (kTcp), training
// with two Forwards in flight (their Backwards one at a time, as gradients sum in the order they
// run) into device destinations on a non-default stream gives the bits of host tensors over
// TCP; the inputs are written on that stream just before each call and the results read on it
// just after, so a missing order shows; a misaligned tensor is refused naming its field. With
// two GPUs the same holds for a server on the other GPU (peer copies, events across devices).
// Needs a GPU (label gpu): skipped without one.
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
using cuda_test::GpuCount;
using cuda_test::HaveGpu;
using cuda_test::MakeMicroBatch;
using cuda_test::MicroBatch;
using cuda_test::ServerProcess;

class CudaIpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    if (server_device_ != "cuda:0" && GpuCount() < 2) GTEST_SKIP() << "needs two GPUs";
    ASSERT_CUDA(cudaSetDevice(0));
    target_ = server_.Start(server_device_);
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

  void ExpectSameTraining(const std::shared_ptr<client::Connection>& device_conn,
                          const std::string& tag) {
    cuda_test::ExpectSameTraining(Connect(client::Transport::kTcp), device_conn, stream_,
                                  /*in_flight=*/2, tag);
  }

  std::string server_device_ = "cuda:0";
  ServerProcess server_;
  std::string target_;
  cudaStream_t stream_ = nullptr;
};

// The trainer's tensors on cuda:0, the server on cuda:1 (gpu-check runs it where there are two).
class CudaIpcOnAnotherGpuTest : public CudaIpcTest {
 protected:
  CudaIpcOnAnotherGpuTest() { server_device_ = "cuda:1"; }
};

TEST_F(CudaIpcTest, DeviceTensorsByCudaIpcGiveTheBitsOfHostTensors) {
  auto conn = Connect(client::Transport::kSharedMemory);
  ASSERT_TRUE(conn);
  EXPECT_EQ(conn->device_transport(), client::DeviceTransport::kCudaIpc);
  ExpectSameTraining(conn, "-ipc");
}

TEST_F(CudaIpcOnAnotherGpuTest, DeviceTensorsByCudaIpcGiveTheBitsOfHostTensors) {
  auto conn = Connect(client::Transport::kSharedMemory);
  ASSERT_TRUE(conn);
  EXPECT_EQ(conn->device_transport(), client::DeviceTransport::kCudaIpc);
  ExpectSameTraining(conn, "-ipc-x2");
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
