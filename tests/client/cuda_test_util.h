// What the GPU client tests share (label gpu): a moe-server binary in another process on a
// given device, and micro-batches whose tensors live in one cudaMalloc block on the current
// device, with their host copies. The server is $MOE_SERVER, else the moe-server next to the test
// binary (a prebuilt directory), else the build tree's (MOE_SERVER_PATH).
#ifndef MOE_TESTS_CLIENT_CUDA_TEST_UTIL_H_
#define MOE_TESTS_CLIENT_CUDA_TEST_UTIL_H_

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
#include <future>
#include "absl/strings/str_cat.h"
#include "client/client.h"

namespace moe::cuda_test {

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

inline int GpuCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
inline bool HaveGpu() { return GpuCount() > 0; }

inline std::string ServerBinary() {
  if (const char* env = std::getenv("MOE_SERVER")) return env;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    std::string dir(self, static_cast<size_t>(n));
    dir = dir.substr(0, dir.rfind('/'));
    if (access((dir + "/moe-server").c_str(), X_OK) == 0) return dir + "/moe-server";
  }
  return MOE_SERVER_PATH;
}

// moe-server --device=<device> on loopback with a free port, its stdout in a file; stopped with
// the object.
class ServerProcess {
 public:
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    if (!log_.empty()) unlink(log_.c_str());
  }
  // The target once it serves, or "" (the log says why).
  std::string Start(const std::string& device = "cuda:0") {
    static int started = 0;  // one log per server, several may run at once
    log_ = absl::StrCat(::testing::TempDir(), "/moe_server_", getpid(), "_", started++, ".log");
    const std::string binary = ServerBinary();
    const std::string device_flag = "--device=" + device;
    pid_ = fork();
    if (pid_ == 0) {
      if (!std::freopen(log_.c_str(), "w", stdout)) _exit(127);
      dup2(fileno(stdout), 2);
      execl(binary.c_str(), binary.c_str(), device_flag.c_str(), "--host=127.0.0.1", "--port=0",
            "--metrics_port=-1", static_cast<char*>(nullptr));
      _exit(127);
    }
    for (int i = 0; i < 600; ++i) {
      std::ifstream in(log_);
      std::stringstream text;
      text << in.rdbuf();
      const std::string s = text.str();
      const size_t at = s.find("gRPC on ");
      if (at != std::string::npos && s.find('\n', at) != std::string::npos) {
        const size_t colon = s.find(':', at + 8);
        return absl::StrCat("127.0.0.1:", std::atoi(s.c_str() + colon + 1));
      }
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        ADD_FAILURE() << binary << " exited: " << s;
        return "";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << binary << " did not start";
    return "";
  }

 private:
  pid_t pid_ = -1;
  std::string log_;
};

inline LayerConfig Config() {
  LayerConfig c;
  c.num_experts = 8;
  c.top_k = 2;
  c.d_model = 256;
  c.d_hidden = 128;
  c.dtype = DType::kBFloat16;
  c.routing = RoutingMode::kClient;
  c.seed = 11;
  return c;
}

// One micro-batch in host memory (page-locked, so copies on the stream are truly asynchronous)
// and its tensors in one device block, as a caching allocator lays them out.
struct MicroBatch {
  static constexpr int kTensors = 7;  // x, ids, weights, dout | out, dx, dweights
  DType dtypes[kTensors];
  std::vector<int64_t> shape[kTensors];
  size_t bytes[kTensors] = {};
  size_t offset[kTensors] = {};
  char* host = nullptr;
  char* device = nullptr;

  ~MicroBatch() {
    cudaFreeHost(host);
    cudaFree(device);
  }
  void* h(int k) const { return host + offset[k]; }
  void* d(int k) const { return device + offset[k]; }
  TensorView DeviceIn(int k) const {
    return {dtypes[k], shape[k], d(k), bytes[k], MemoryLocation::Cuda(0)};
  }
  MutableTensorView DeviceOut(int k) const {
    return {dtypes[k], shape[k], d(k), bytes[k], MemoryLocation::Cuda(0)};
  }
  TensorView HostIn(int k) const { return {dtypes[k], shape[k], h(k), bytes[k], {}}; }
  std::string HostBytes(int k) const {
    return std::string(static_cast<const char*>(h(k)), bytes[k]);
  }
};

inline std::unique_ptr<MicroBatch> MakeMicroBatch(const LayerConfig& c, int64_t tokens,
                                           std::mt19937& rng) {
  auto mb = std::make_unique<MicroBatch>();
  const DType dt[] = {c.dtype, DType::kInt32, DType::kFloat32, c.dtype,
                      c.dtype, c.dtype,       DType::kFloat32};
  const std::vector<int64_t> shapes[] = {{tokens, c.d_model}, {tokens, c.top_k},
                                         {tokens, c.top_k},   {tokens, c.d_model},
                                         {tokens, c.d_model}, {tokens, c.d_model},
                                         {tokens, c.top_k}};
  size_t total = 0;
  for (int k = 0; k < MicroBatch::kTensors; ++k) {
    mb->dtypes[k] = dt[k];
    mb->shape[k] = shapes[k];
    mb->bytes[k] = static_cast<size_t>(NumElements(shapes[k])) * DTypeSize(dt[k]);
    mb->offset[k] = total;
    total += (mb->bytes[k] + 255) / 256 * 256;
  }
  void* host = nullptr;
  void* device = nullptr;
  if (cudaMallocHost(&host, total) != cudaSuccess) return nullptr;
  mb->host = static_cast<char*>(host);
  if (cudaMalloc(&device, total) != cudaSuccess) return nullptr;
  mb->device = static_cast<char*>(device);
  std::normal_distribution<float> n(0.f, 1.f);
  for (int k : {0, 3}) {
    if (c.dtype == DType::kFloat32) {
      auto* p = static_cast<float*>(mb->h(k));
      for (size_t i = 0; i < mb->bytes[k] / 4; ++i) p[i] = n(rng);
      continue;
    }
    auto* p = static_cast<uint16_t*>(mb->h(k));
    for (size_t i = 0; i < mb->bytes[k] / 2; ++i) p[i] = FloatToBFloat16(n(rng));
  }
  auto* ids = static_cast<int32_t*>(mb->h(1));
  auto* w = static_cast<float*>(mb->h(2));
  std::uniform_real_distribution<float> u(0.1f, 1.f);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t first = static_cast<int32_t>(rng() % c.num_experts);
    for (int64_t j = 0; j < c.top_k; ++j) {
      ids[t * c.top_k + j] = static_cast<int32_t>((first + j) % c.num_experts);
      w[t * c.top_k + j] = u(rng);
    }
  }
  return mb;
}


// Two training steps of `in_flight` micro-batches in flight through `device_conn` on device
// tensors (cuda:0, written and read on `stream`), and through `host_conn` on the same bytes in
// host memory: every result bitwise equal. The Backwards run one at a time, as weight gradients
// sum in the order they run.
inline void ExpectSameTraining(const std::shared_ptr<client::Connection>& host_conn,
                             const std::shared_ptr<client::Connection>& device_conn,
                             cudaStream_t stream, int in_flight, const std::string& tag) {
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
    for (int i = 0; i < in_flight; ++i) {
      mbs.push_back(MakeMicroBatch(Config(), 300 + 100 * i, rng));
      ASSERT_TRUE(mbs.back());
      MicroBatch& mb = *mbs.back();
      // The inputs land on the stream just before the call; the destinations are poisoned.
      for (int k = 0; k < 4; ++k) {
        ASSERT_CUDA(cudaMemcpyAsync(mb.d(k), mb.h(k), mb.bytes[k], cudaMemcpyHostToDevice,
                                    stream));
      }
      for (int k = 4; k < 7; ++k) {
        ASSERT_CUDA(cudaMemsetAsync(mb.d(k), 0xff, mb.bytes[k], stream));
      }
      df.push_back((*device_layer)
                       ->ForwardInto(mb.DeviceIn(0), mb.DeviceIn(1), mb.DeviceIn(2),
                                     mb.DeviceOut(4), stream));
    }
    std::vector<uint64_t> device_ctx, host_ctx;
    for (int i = 0; i < in_flight; ++i) {
      MicroBatch& mb = *mbs[i];
      auto d = df[i].get();
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_TRUE(d->out.empty());
      ASSERT_CUDA(cudaMemcpyAsync(mb.h(4), mb.d(4), mb.bytes[4], cudaMemcpyDeviceToHost,
                                  stream));
      ASSERT_CUDA(cudaStreamSynchronize(stream));
      auto h = (*host_layer)->Forward(mb.HostIn(0), mb.HostIn(1), mb.HostIn(2)).get();
      ASSERT_TRUE(h.ok()) << h.status();
      EXPECT_TRUE(mb.HostBytes(4) == std::string(reinterpret_cast<const char*>(
                                                      h->out.bytes.data()),
                                                  h->out.bytes.size()))
          << "micro-batch " << i;
      device_ctx.push_back(d->context_id);
      host_ctx.push_back(h->context_id);
    }
    for (int i = 0; i < in_flight; ++i) {
      MicroBatch& mb = *mbs[i];
      auto d = (*device_layer)
                   ->BackwardInto(device_ctx[i], mb.DeviceIn(3), mb.DeviceOut(5),
                                  mb.DeviceOut(6), stream)
                   .get();
      ASSERT_TRUE(d.ok()) << d.status();
      for (int k : {5, 6}) {
        ASSERT_CUDA(cudaMemcpyAsync(mb.h(k), mb.d(k), mb.bytes[k], cudaMemcpyDeviceToHost,
                                    stream));
      }
      ASSERT_CUDA(cudaStreamSynchronize(stream));
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

}  // namespace moe::cuda_test

#endif  // MOE_TESTS_CLIENT_CUDA_TEST_UTIL_H_
