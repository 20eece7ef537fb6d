// Registered CUDA regions and event pairs end to end (GPU only, ctest label "gpu"; built with the
// service and CUDA: `ctest -L gpu -R RegionCuda`). A moe-server on the CUDA engine runs in a second
// process (this binary again, started with --server-child: CUDA IPC cannot open a handle in the
// process that exported it), and this process plays the trainer: one cudaMalloc block exported as a
// region (engine/cuda/ipc_export.h), an interprocess "ready" event registered as an event pair. Its
// inputs land in the block only after a GPU delay, so a server that did not wait for "ready"
// would read the 0xFF the block was filled with. A Forward and a Backward by reference, written
// in place and ordered by the pair, give bitwise what the same micro-batches sent as bytes give,
// and the two layers agree after a Step.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "engine/cuda/cuda_engine.h"
#include "engine/cuda/ipc_export.h"
#include "server/server.h"
#include "tests/engine/cuda/gpu_delay.h"
#include "tests/server/region_fixture.h"
#include "tests/server/server_fixture.h"

namespace moe::server_test {
namespace {

// The server process's side: a server on cuda:0 and an ephemeral port, which it writes to `out`
// (0 when it could not start); it serves until `in` is closed.
int RunServerChild(int in, int out) {
  server::ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.metrics_port = -1;
  o.device = "cuda:0";
  absl::StatusOr<std::unique_ptr<server::Server>> s = server::Server::Start(o);
  const int32_t port = s.ok() ? (*s)->port() : 0;
  if (write(out, &port, sizeof(port)) != sizeof(port) || !s.ok()) return 1;
  for (;;) {
    char byte;
    const ssize_t r = read(in, &byte, 1);
    if (r == 0 || (r < 0 && errno != EINTR)) break;
  }
  (*s)->Shutdown();
  return 0;
}

// The server process: started by Start, stopped (its pipe closed, then waited for) on
// destruction.
class ServerChild {
 public:
  // The server's port, or 0.
  int Start() {
    char exe[PATH_MAX];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) return 0;
    exe[n] = '\0';
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) return 0;
    const std::string in = std::to_string(to_child[0]), out = std::to_string(from_child[1]);
    pid_ = fork();
    if (pid_ == 0) {
      close(to_child[1]);
      close(from_child[0]);
      execl(exe, exe, "--server-child", in.c_str(), out.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    to_ = to_child[1];
    int32_t port = 0;
    pollfd pfd{from_child[0], POLLIN, 0};
    if (pid_ > 0 && poll(&pfd, 1, 60000) == 1 &&
        read(from_child[0], &port, sizeof(port)) != sizeof(port)) {
      port = 0;
    }
    close(from_child[0]);
    return port;
  }
  ~ServerChild() {
    if (to_ >= 0) close(to_);
    int status = 0;
    if (pid_ > 0) waitpid(pid_, &status, 0);
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1;
};

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

constexpr int64_t kTokens = 80;

LayerConfig CudaConfig() {
  LayerConfig c;
  c.num_experts = 8;
  c.top_k = 2;
  c.d_model = 128;
  c.d_hidden = 256;
  c.dtype = DType::kBFloat16;
  c.routing = RoutingMode::kClient;
  c.seed = 19;
  c.optimizer.learning_rate = 1e-2;
  return c;
}

// Where each tensor lies in the trainer's one allocation.
struct Layout {
  int64_t x, ids, w, out, dout, dx, dweights, total;
};

Layout LayoutFor(const LayerConfig& c) {
  const int64_t act = kTokens * c.d_model * 2, routing = kTokens * c.top_k * 4;
  Layout l{};
  const std::pair<int64_t*, int64_t> parts[] = {
      {&l.x, act},    {&l.ids, routing}, {&l.w, routing},       {&l.out, act},
      {&l.dout, act}, {&l.dx, act},      {&l.dweights, routing}};
  int64_t at = 0;
  for (const auto& [field, bytes] : parts) {
    *field = at;
    at += (bytes + 4095) / 4096 * 4096;
  }
  l.total = at;
  return l;
}

TEST(RegionCudaTest, CudaRegionsAndEventPairsMatchBytes) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ServerChild child;
  const int port = child.Start();
  ASSERT_NE(port, 0) << "the server process did not start";
  auto conn =
      client::Connection::Connect("127.0.0.1:" + std::to_string(port), LoopbackClientOptions());
  ASSERT_TRUE(conn.ok()) << conn.status();
  client::Connection& c = **conn;
  const LayerConfig config = CudaConfig();
  ASSERT_TRUE(c.CreateLayer("bytes", config).ok());
  ASSERT_TRUE(c.CreateLayer("ipc", config).ok());

  std::mt19937 rng(41);
  const Tensor x = ToBFloat16(RandomFloat(rng, {kTokens, config.d_model}));
  Tensor ids, w;
  RandomRouting(rng, kTokens, config, &ids, &w);
  const Tensor dout = ToBFloat16(RandomFloat(rng, {kTokens, config.d_model}));

  // The trainer's memory, filled with 0xFF, exported whole as one region.
  const Layout l = LayoutFor(config);
  ASSERT_CUDA(cudaSetDevice(0));
  char* base = nullptr;
  char* staging = nullptr;  // page-locked, so that the copies wait behind the delay on the GPU
  cudaStream_t s = nullptr;
  ASSERT_CUDA(cudaMalloc(&base, l.total));
  ASSERT_CUDA(cudaMallocHost(&staging, l.total));
  ASSERT_CUDA(cudaMemset(base, 0xff, l.total));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ASSERT_CUDA(cudaDeviceSynchronize());
  auto exported = cuda::ExportDeviceMemory(base, l.total);
  ASSERT_TRUE(exported.ok()) << exported.status();
  v1::RegisterRegionRequest region_req;
  region_req.mutable_cuda_ipc()->set_mem_handle(exported->handle);
  region_req.mutable_cuda_ipc()->set_device(exported->device);
  region_req.mutable_cuda_ipc()->set_offset(exported->offset);
  region_req.mutable_cuda_ipc()->set_size_bytes(l.total);
  v1::RegisterRegionResponse region;
  grpc::Status st = RegisterRegion(c, region_req, &region);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const uint64_t id = region.region_id();

  auto ready = cuda::InterprocessEvent::Create(0);
  ASSERT_TRUE(ready.ok()) << ready.status();
  v1::RegisterEventsRequest events_req;
  events_req.set_wait_event_handle(ready->handle());
  v1::RegisterEventsResponse events;
  {
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    st = c.stub()->RegisterEvents(&ctx, events_req, &events);
  }
  ASSERT_TRUE(st.ok()) << st.error_message();
  auto done = cuda::InterprocessEvent::Open(events.done_event_handle(), 0);
  ASSERT_TRUE(done.ok()) << done.status();

  // Copies `t` into the block at `offset` on the trainer's stream.
  const auto upload = [&](const Tensor& t, int64_t offset) {
    std::memcpy(staging + offset, t.bytes.data(), t.bytes.size());
    return cudaMemcpyAsync(base + offset, staging + offset, t.bytes.size(), cudaMemcpyHostToDevice,
                           s);
  };
  // The block's bytes at `offset` once the server's done event has fired.
  const auto download = [&](DType dtype, std::vector<int64_t> shape, int64_t offset) {
    Tensor t = Tensor::Zeros(dtype, std::move(shape));
    EXPECT_TRUE(done->StreamWait(s).ok());
    EXPECT_EQ(
        cudaMemcpyAsync(t.bytes.data(), base + offset, t.bytes.size(), cudaMemcpyDeviceToHost, s),
        cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    return t;
  };

  // Forward: by bytes, then by reference behind the delay, ordered by the pair.
  v1::ForwardRequest fb = ForwardOf("bytes", 1);
  *fb.mutable_x() = Inline(x);
  *fb.mutable_expert_ids() = Inline(ids);
  *fb.mutable_weights() = Inline(w);
  auto forward_bytes = SendForward(c, {fb});
  ASSERT_TRUE(forward_bytes.status.ok()) << forward_bytes.status.error_message();
  ASSERT_CUDA(testing::EnqueueGpuDelay(s, 200000));
  ASSERT_CUDA(upload(x, l.x));
  ASSERT_CUDA(upload(ids, l.ids));
  ASSERT_CUDA(upload(w, l.w));
  ASSERT_TRUE(ready->Record(s).ok());
  v1::ForwardRequest fr = ForwardOf("ipc", 1);
  *fr.mutable_x() = ByRef(x, id, l.x);
  *fr.mutable_expert_ids() = ByRef(ids, id, l.ids);
  *fr.mutable_weights() = ByRef(w, id, l.w);
  *fr.mutable_out_ref() = RefTo(id, l.out);
  fr.set_event_id(events.event_id());
  auto forward_ref = SendForward(c, {fr});
  ASSERT_TRUE(forward_ref.status.ok()) << forward_ref.status.error_message();
  const v1::ForwardResponse& rb = forward_bytes.responses.at(0);
  const v1::ForwardResponse& rr = forward_ref.responses.at(0);
  EXPECT_TRUE(rr.out().has_ref() && rr.out().data().empty());
  EXPECT_EQ(rr.out().ref().offset(), l.out);
  EXPECT_TRUE(download(config.dtype, {kTokens, config.d_model}, l.out).bytes ==
              FromProto(rb.out()).bytes)
      << "out by reference differs";
  // Client routing: the caller's routing is not echoed, by either path.
  EXPECT_FALSE(rb.has_expert_ids() || rr.has_expert_ids() || rb.has_weights() || rr.has_weights());

  // Backward: the same, dx and dweights written in place.
  v1::BackwardRequest bb = BackwardOf("bytes", 1);
  *bb.mutable_dout() = Inline(dout);
  auto backward_bytes = SendBackward(c, {bb});
  ASSERT_TRUE(backward_bytes.status.ok()) << backward_bytes.status.error_message();
  ASSERT_CUDA(testing::EnqueueGpuDelay(s, 200000));
  ASSERT_CUDA(upload(dout, l.dout));
  ASSERT_TRUE(ready->Record(s).ok());
  v1::BackwardRequest br = BackwardOf("ipc", 1);
  *br.mutable_dout() = ByRef(dout, id, l.dout);
  *br.mutable_dx_ref() = RefTo(id, l.dx);
  *br.mutable_dweights_ref() = RefTo(id, l.dweights);
  br.set_event_id(events.event_id());
  auto backward_ref = SendBackward(c, {br});
  ASSERT_TRUE(backward_ref.status.ok()) << backward_ref.status.error_message();
  const v1::BackwardResponse& gb = backward_bytes.responses.at(0);
  const v1::BackwardResponse& gr = backward_ref.responses.at(0);
  EXPECT_TRUE(gr.dx().has_ref() && gr.dweights().has_ref());
  EXPECT_TRUE(download(config.dtype, {kTokens, config.d_model}, l.dx).bytes ==
              FromProto(gb.dx()).bytes)
      << "dx by reference differs";
  EXPECT_TRUE(download(DType::kFloat32, {kTokens, config.top_k}, l.dweights).bytes ==
              FromProto(gb.dweights()).bytes)
      << "dweights by reference differs";

  auto step_bytes = c.Step("bytes");
  auto step_ipc = c.Step("ipc");
  ASSERT_TRUE(step_bytes.ok() && step_ipc.ok());
  EXPECT_EQ(step_bytes->grad_norm, step_ipc->grad_norm);
  auto state_bytes = c.ExportWeights("bytes", true);
  auto state_ipc = c.ExportWeights("ipc", true);
  ASSERT_TRUE(state_bytes.ok() && state_ipc.ok());
  ExpectSameState(*state_bytes, *state_ipc, "a step by reference in CUDA memory");

  // The server lets go of the pair and the region before the memory is freed.
  {
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    v1::UnregisterEventsRequest req;
    req.set_event_id(events.event_id());
    v1::UnregisterEventsResponse resp;
    EXPECT_TRUE(c.stub()->UnregisterEvents(&ctx, req, &resp).ok());
  }
  EXPECT_TRUE(UnregisterRegion(c, id).ok());
  conn->reset();
  cudaStreamDestroy(s);
  cudaFreeHost(staging);
  cudaFree(base);
}

}  // namespace
}  // namespace moe::server_test

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--server-child") {
    return moe::server_test::RunServerChild(std::atoi(argv[2]), std::atoi(argv[3]));
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
