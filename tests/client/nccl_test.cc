// moe::client with device tensors over an NCCL channel (docs/PROTOCOL.md, "NCCL channels")
// against a moe-server on the CUDA engine of another GPU in another process: the trainer on
// cuda:0, the server on cuda:1 (NCCL refuses two ranks on one device). Needs two GPUs (label
// gpu): skipped with fewer. NCCL runs on its network transport, as between hosts, which is
// what NCCL channels are for: over its P2P transport a trainer killed mid-transfer can leave the
// server's CUDA context stuck (docs/decisions/0018-nccl-transport.md, "Known limits").
//
// - Training with three Forwards in flight (their sends and receives pipelined on the channel)
//   and their Backwards one at a time gives bitwise what the same bytes give as host tensors
//   over TCP, and so does the Step after; the connection reports NCCL and logged why.
// - A trainer killed while the server waits for its bytes costs the server nothing: its
//   channel is aborted when its session ends, and the server goes on serving another trainer
//   over NCCL. The killed trainer is this binary again (--nccl-victim=<target>), so it starts
//   CUDA in a fresh process.
// - A server without NCCL (the CPU engine) gets the device tensors staged, and the connection's
//   log says why (one GPU is enough for that one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/nccl_channel.h"
#include "tests/client/cuda_test_util.h"

namespace moe {
namespace {

using cuda_test::Config;
using cuda_test::ServerProcess;

// The killed trainer says it is ready on this descriptor.
constexpr int kReadyFd = 3;

absl::StatusOr<std::shared_ptr<client::Connection>> Connect(
    const std::string& target, client::DeviceTransportRequest device,
    std::vector<std::string>* log = nullptr) {
  client::ClientOptions o;
  o.transport = client::Transport::kTcp;
  o.device_transport = device;
  o.timeout = std::chrono::seconds(60);
  o.log = [log](const std::string& line) {
    if (log) log->push_back(line);
  };
  return client::Connection::Connect(target, o);
}

class NcclAnotherGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_test::GpuCount() < 2)
      GTEST_SKIP() << "needs two GPUs (NCCL refuses two ranks on one device)";
    target_ = server_.Start("cuda:1");
    ASSERT_FALSE(target_.empty());
    ASSERT_CUDA(cudaSetDevice(0));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  void ExpectSameTraining(const std::shared_ptr<client::Connection>& nccl_conn,
                          const std::string& tag) {
    auto host_conn = Connect(target_, client::DeviceTransportRequest::kNever);
    ASSERT_TRUE(host_conn.ok()) << host_conn.status();
    cuda_test::ExpectSameTraining(*host_conn, nccl_conn, stream_, /*in_flight=*/3, tag);
  }

  ServerProcess server_;
  std::string target_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(NcclAnotherGpuTest, DeviceTensorsOverNcclGiveTheBitsOfHostTensors) {
  std::vector<std::string> log;
  auto conn = Connect(target_, client::DeviceTransportRequest::kNccl, &log);
  ASSERT_TRUE(conn.ok()) << conn.status();
  ExpectSameTraining(*conn, "-nccl");
  EXPECT_EQ((*conn)->device_transport(), client::DeviceTransport::kNccl);
  ASSERT_FALSE(log.empty());
  EXPECT_TRUE(absl::StrContains(log.back(), "over NCCL")) << log.back();
}

TEST_F(NcclAnotherGpuTest, AKilledTrainerLeavesTheServerServing) {
  // Everything the child needs is made before the fork: it only execs.
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  const std::string flag = "--nccl-victim=" + target_;
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t victim = fork();
  if (victim == 0) {
    // Readiness comes on its own descriptor: NCCL_DEBUG prints on stdout.
    dup2(ready[1], kReadyFd);
    close(ready[0]);
    execl(self, self, flag.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(ready[1]);
  char line[64] = {};
  const ssize_t got = read(ready[0], line, sizeof(line) - 1);
  close(ready[0]);
  ASSERT_GT(got, 0) << "the victim trainer died before it was ready";
  ASSERT_TRUE(absl::StartsWith(line, "ready")) << line;
  // The server has posted the receive the victim will never match; now the victim dies.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  kill(victim, SIGKILL);
  waitpid(victim, nullptr, 0);

  const auto t0 = std::chrono::steady_clock::now();
  auto conn = Connect(target_, client::DeviceTransportRequest::kNccl);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto stats = (*conn)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ExpectSameTraining(*conn, "-after-kill");
  EXPECT_EQ((*conn)->device_transport(), client::DeviceTransport::kNccl);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
}

// A connection that asks for NCCL from a server that has none (the CPU engine) stages its device
// tensors through host memory instead, and says why in one line. One GPU is enough.
TEST(NcclFallbackTest, AServerWithoutNcclGetsStagedTensorsAndTheLogSaysWhy) {
  if (!cuda_test::HaveGpu()) GTEST_SKIP() << "no GPU";
  ServerProcess server;
  const std::string target = server.Start("cpu");
  ASSERT_FALSE(target.empty());
  ASSERT_CUDA(cudaSetDevice(0));
  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<std::string> log;
  auto conn = Connect(target, client::DeviceTransportRequest::kNccl, &log);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto layer = client::RemoteLayer::Create(*conn, "fallback", Config());
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::mt19937 rng(3);
  auto mb = cuda_test::MakeMicroBatch(Config(), 64, rng);
  ASSERT_TRUE(mb);
  for (int k = 0; k < 3; ++k) {
    ASSERT_CUDA(cudaMemcpy(mb->d(k), mb->h(k), mb->bytes[k], cudaMemcpyHostToDevice));
  }
  auto r =
      (*layer)
          ->ForwardInto(mb->DeviceIn(0), mb->DeviceIn(1), mb->DeviceIn(2), mb->DeviceOut(4), stream)
          .get();
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*conn)->device_transport(), client::DeviceTransport::kStaged);
  bool said = false;
  for (const std::string& line : log) said = said || absl::StrContains(line, "NCCL refused");
  EXPECT_TRUE(said) << "log: " << (log.empty() ? "(empty)" : log.back());
  cudaStreamDestroy(stream);
}

// The killed trainer: opens a channel and sends an NCCL Forward whose bytes it never posts, so
// the server waits on a receive; says "ready" (on kReadyFd) and waits to be killed.
int RunVictim(const std::string& target) {
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  auto conn = Connect(target, client::DeviceTransportRequest::kNccl);
  if (!conn.ok()) return 3;
  if (!client::RemoteLayer::Create(*conn, "victim", Config()).ok()) return 4;
  auto channel = client::NcclChannel::Open(**conn, 0);
  if (!channel.ok()) return 5;
  v1::ForwardRequest req;
  req.set_layer("victim");
  req.set_training(true);
  req.set_context_id(1);
  req.set_last_chunk(true);
  req.mutable_x()->set_dtype(v1::DTYPE_BFLOAT16);
  req.mutable_x()->add_shape(4096);
  req.mutable_x()->add_shape(Config().d_model);
  req.mutable_nccl()->set_channel_id((*channel)->id());
  req.mutable_nccl()->set_seq(1);
  grpc::ClientContext ctx;
  (*conn)->Prepare(&ctx);
  v1::ForwardResponse resp;
  (*conn)->stub()->async()->NcclForward(&ctx, &req, &resp, [](grpc::Status) {});
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  if (write(kReadyFd, "ready\n", 6) != 6) return 6;
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  // Before any NCCL call here, and inherited by the server and the killed trainer.
  setenv("NCCL_P2P_DISABLE", "1", /*overwrite=*/0);
  setenv("NCCL_SHM_DISABLE", "1", /*overwrite=*/0);
  for (int i = 1; i < argc; ++i) {
    if (absl::StartsWith(argv[i], "--nccl-victim=")) {
      return moe::RunVictim(std::string(argv[i]).substr(14));
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
