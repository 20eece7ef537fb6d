// CUDA IPC end to end: a second process (this binary again, started with --ipc-export-child)
// plays the trainer. It allocates one cudaMalloc block, writes x and dout into it behind a GPU
// delay, records an interprocess "ready" event and exports the block and the event
// (engine/cuda/ipc_export.h). This process maps four regions of that one allocation
// (MapCudaIpcMemory: one open handle, shared), opens the event, creates a "done" event and runs a
// training Forward and Backward on the mapped memory, writing out and dx into the child's memory.
// The child waits for "done" on its own stream and sends out and dx back: they must be the bits a
// layer on host tensors gives. Bad handles, offsets, sizes and devices are refused naming the
// field, and never crash. With two GPUs the layer runs on cuda:1 as well, the child's memory on
// cuda:0. GPU only (ctest label "gpu"); scripts/gpu-check runs this binary.
#include "engine/cuda/ipc.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda/cuda_engine.h"
#include "engine/cuda/ipc_export.h"
#include "engine/cuda/pipeline_options.h"
#include "engine/layer.h"
#include "tests/engine/cuda/device_memory.h"
#include "tests/engine/cuda/engine_test_util.h"
#include "tests/engine/cuda/gpu_delay.h"

namespace moe {
namespace {

using testing::ExpectRefused;
using testing::SameBytes;

// Messages on a pipe: an 8-byte length, then the bytes.
bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}
bool Send(int fd, const std::string& bytes) {
  const uint64_t n = bytes.size();
  return WriteAll(fd, &n, sizeof(n)) && WriteAll(fd, bytes.data(), bytes.size());
}
bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, 60000) <= 0) return false;  // a peer silent for a minute is stuck
    const ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}
std::optional<std::string> Receive(int fd) {
  uint64_t n = 0;
  if (!ReadAll(fd, &n, sizeof(n)) || n > (uint64_t{1} << 30)) return std::nullopt;
  std::string s(n, '\0');
  if (!ReadAll(fd, s.data(), n)) return std::nullopt;
  return s;
}
template <typename T>
std::string Bytes(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
}
template <typename T>
T FromBytes(const std::string& s) {
  T v{};
  std::memcpy(&v, s.data(), std::min(sizeof(v), s.size()));
  return v;
}

// Where the child puts each tensor inside its one allocation.
struct Layout {
  int64_t alloc_bytes, x_off, x_bytes, dout_off, dout_bytes, out_off, out_bytes, dx_off, dx_bytes;
  int64_t delay_us;
};

// What the child exported.
struct Exported {
  std::string mem_handle, event_handle;
  int64_t device, x_offset, allocation_bytes;
};

// The child's side; returns its exit status (each step that fails has its own).
int RunExportChild(int in, int out) {
  std::optional<std::string> header = Receive(in), x = Receive(in), dout = Receive(in);
  if (!header || !x || !dout) return 2;
  const Layout l = FromBytes<Layout>(*header);
  if (cudaSetDevice(0) != cudaSuccess) return 3;
  char* base = nullptr;
  char* pinned = nullptr;
  cudaStream_t s = nullptr;
  const int64_t pinned_bytes = l.x_bytes + l.dout_bytes + l.out_bytes + l.dx_bytes;
  if (cudaMalloc(&base, l.alloc_bytes) != cudaSuccess ||
      cudaMemset(base, 0xff, l.alloc_bytes) != cudaSuccess ||
      cudaMallocHost(&pinned, pinned_bytes) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    return 4;
  }
  std::memcpy(pinned, x->data(), l.x_bytes);
  std::memcpy(pinned + l.x_bytes, dout->data(), l.dout_bytes);
  // x and dout land only after the delay: a server that does not wait for "ready" reads 0xFF.
  if (testing::EnqueueGpuDelay(s, l.delay_us) != cudaSuccess ||
      cudaMemcpyAsync(base + l.x_off, pinned, l.x_bytes, cudaMemcpyHostToDevice, s) !=
          cudaSuccess ||
      cudaMemcpyAsync(base + l.dout_off, pinned + l.x_bytes, l.dout_bytes, cudaMemcpyHostToDevice,
                      s) != cudaSuccess) {
    return 5;
  }
  absl::StatusOr<cuda::InterprocessEvent> ready = cuda::InterprocessEvent::Create(0);
  if (!ready.ok() || !ready->Record(s).ok()) return 6;
  absl::StatusOr<cuda::ExportedMemory> e = cuda::ExportDeviceMemory(base + l.x_off, l.x_bytes);
  if (!e.ok()) return 7;
  if (!Send(out, e->handle) || !Send(out, ready->handle()) ||
      !Send(out, Bytes<int64_t>(e->device)) || !Send(out, Bytes<int64_t>(e->offset)) ||
      !Send(out, Bytes<int64_t>(e->allocation_bytes))) {
    return 8;
  }
  std::optional<std::string> done_handle = Receive(in);
  if (!done_handle) return 9;
  // Opened for this process's stream on cuda:0, whichever GPU the engine made it on.
  absl::StatusOr<cuda::InterprocessEvent> done = cuda::InterprocessEvent::Open(*done_handle, 0);
  if (!done.ok()) return 10;
  char* out_host = pinned + l.x_bytes + l.dout_bytes;
  char* dx_host = out_host + l.out_bytes;
  if (!done->StreamWait(s).ok() ||
      cudaMemcpyAsync(out_host, base + l.out_off, l.out_bytes, cudaMemcpyDeviceToHost, s) !=
          cudaSuccess ||
      cudaMemcpyAsync(dx_host, base + l.dx_off, l.dx_bytes, cudaMemcpyDeviceToHost, s) !=
          cudaSuccess ||
      cudaStreamSynchronize(s) != cudaSuccess) {
    return 11;
  }
  if (!Send(out, std::string(out_host, l.out_bytes)) ||
      !Send(out, std::string(dx_host, l.dx_bytes))) {
    return 12;
  }
  // The memory stays until the server has dropped its mappings.
  if (!Receive(in)) return 13;
  cudaFreeHost(pinned);
  cudaFree(base);
  return 0;
}

// The child process and its two pipes.
class ExportChild {
 public:
  bool Start() {
    char exe[PATH_MAX];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) return false;
    exe[n] = '\0';
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) return false;
    const std::string in = std::to_string(to_child[0]), out = std::to_string(from_child[1]);
    pid_ = fork();
    if (pid_ == 0) {
      close(to_child[1]);
      close(from_child[0]);
      execl(exe, exe, "--ipc-export-child", in.c_str(), out.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    to_ = to_child[1];
    from_ = from_child[0];
    return pid_ > 0;
  }
  ~ExportChild() {
    if (to_ >= 0) close(to_);
    if (from_ >= 0) close(from_);
    if (pid_ > 0) Wait();
  }
  int to() const { return to_; }
  int from() const { return from_; }
  // The child's exit status (-1: killed by a signal).
  int Wait() {
    int status = 0;
    if (pid_ <= 0 || waitpid(pid_, &status, 0) != pid_) return -1;
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
};

// The trainer child's memory and events on cuda:0 drive a layer on `engine_device`: the same
// device (read in place), or another one (peer copies in and out, the events waited on and
// recorded across devices), as a server on one GPU serves a trainer on another.
void DriveALayerFromAnotherProcess(int engine_device) {
  SCOPED_TRACE("engine on cuda:" + std::to_string(engine_device));
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  constexpr int64_t kT = 80, kE = 8, kK = 2, kD = 128, kH = 256;
  LayerConfig c;
  c.num_experts = kE;
  c.top_k = kK;
  c.d_model = kD;
  c.d_hidden = kH;
  c.dtype = DType::kBFloat16;
  c.seed = rng();
  const testing::Round in = testing::RandomRounds(1, c.dtype, kT, kD, kK, kE, rng)[0];
  cuda::PipelineOptions pipeline;
  pipeline.poison_allocations = true;
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      CreateCudaEngine(engine_device, {}, pipeline);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto ref = (*engine)->CreateLayer(c), ipc = (*engine)->CreateLayer(c);
  ASSERT_TRUE(ref.ok() && ipc.ok());

  const int64_t xb = static_cast<int64_t>(in.x.bytes.size());
  const Layout l{
      int64_t{4} << 20,      4096, xb,    4096 + 1 * (xb + 256), xb, 4096 + 2 * (xb + 256), xb,
      4096 + 3 * (xb + 256), xb,   300000};
  ExportChild child;
  ASSERT_TRUE(child.Start());
  const auto bytes_of = [](const Tensor& t) {
    return std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  };
  ASSERT_TRUE(Send(child.to(), Bytes(l)) && Send(child.to(), bytes_of(in.x)) &&
              Send(child.to(), bytes_of(in.dout)));
  Exported e;
  std::optional<std::string> m[5];
  for (auto& s : m) s = Receive(child.from());
  ASSERT_TRUE(m[0] && m[1] && m[2] && m[3] && m[4]) << "child exited " << child.Wait();
  e.mem_handle = *m[0];
  e.event_handle = *m[1];
  e.device = FromBytes<int64_t>(*m[2]);
  e.x_offset = FromBytes<int64_t>(*m[3]);
  e.allocation_bytes = FromBytes<int64_t>(*m[4]);
  EXPECT_EQ(e.mem_handle.size(), kCudaIpcHandleBytes);
  EXPECT_EQ(e.device, 0);
  EXPECT_EQ(e.x_offset, l.x_off);  // the tensor's place inside the allocation
  EXPECT_GE(e.allocation_bytes, l.alloc_bytes);

  Engine& eng = **engine;
  const int dev = static_cast<int>(e.device);
  auto mx = eng.MapCudaIpcMemory(e.mem_handle, dev, l.x_off, l.x_bytes);
  auto mdout = eng.MapCudaIpcMemory(e.mem_handle, dev, l.dout_off, l.dout_bytes);
  auto mout = eng.MapCudaIpcMemory(e.mem_handle, dev, l.out_off, l.out_bytes);
  auto mdx = eng.MapCudaIpcMemory(e.mem_handle, dev, l.dx_off, l.dx_bytes);
  ASSERT_TRUE(mx.ok() && mdout.ok() && mout.ok() && mdx.ok())
      << mx.status() << mdout.status() << mout.status() << mdx.status();
  EXPECT_EQ(cuda::OpenIpcAllocations(), 1);  // four regions, one allocation, one open handle
  EXPECT_EQ((*mx)->location(), MemoryLocation::Cuda(0));
  EXPECT_EQ((*mdout)->size_bytes(), l.dout_bytes);

  // Bad arguments: refused naming the field; the open handle stays as it was.
  const int count = CudaDeviceCount();
  ExpectRefused(eng.MapCudaIpcMemory(e.mem_handle.substr(0, 10), dev, 0, 64).status(),
                "mem_handle: 10 bytes, a cudaIpcMemHandle_t has 64");
  std::string garbage(kCudaIpcHandleBytes, '\0');
  for (char& ch : garbage) ch = static_cast<char>(rng());
  ExpectRefused(eng.MapCudaIpcMemory(garbage, dev, 0, 64).status(),
                "mem_handle: CUDA cannot open it");
  ExpectRefused(eng.MapCudaIpcMemory(e.mem_handle, dev, -1, 64).status(), "offset: -1");
  ExpectRefused(eng.MapCudaIpcMemory(e.mem_handle, dev, e.allocation_bytes, 64).status(),
                "offset: " + std::to_string(e.allocation_bytes) + " is past the end");
  ExpectRefused(eng.MapCudaIpcMemory(e.mem_handle, dev, 256, e.allocation_bytes).status(),
                "size_bytes: " + std::to_string(e.allocation_bytes) + " bytes from offset 256");
  ExpectRefused(eng.MapCudaIpcMemory(e.mem_handle, dev, 0, 0).status(), "size_bytes: 0");
  ExpectRefused(eng.MapCudaIpcMemory(e.mem_handle, count, 0, 64).status(),
                "device: cuda:" + std::to_string(count) + " out of range");
  if (count >= 2) {
    ExpectRefused(eng.MapCudaIpcMemory(e.mem_handle, 1, 0, 64).status(),
                  "device: the handle's memory is on cuda:0, not cuda:1");
  }
  ExpectRefused(eng.OpenCudaIpcEvent("abc").status(),
                "handle: 3 bytes, a cudaIpcEventHandle_t has 64");
  ExpectRefused(eng.OpenCudaIpcEvent(garbage).status(), "handle: CUDA cannot open it");
  ExpectRefused(cuda::OpenIpcEvent(e.event_handle, count).status(),
                "device: cuda:" + std::to_string(count) + " out of range");
  EXPECT_EQ(cuda::OpenIpcAllocations(), 1);

  // The trainer's event opens for the engine's streams, whichever device made it, and the
  // calling thread keeps its device.
  int current = -1, after_open = -2;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  auto ready = eng.OpenCudaIpcEvent(e.event_handle);
  auto done = eng.CreateCudaIpcEvent();
  ASSERT_TRUE(ready.ok() && done.ok()) << ready.status() << done.status();
  ASSERT_EQ(cudaGetDevice(&after_open), cudaSuccess);
  EXPECT_EQ(after_open, current) << "opening an event changed the thread's device";
  EXPECT_EQ((*ready)->device(), engine_device);
  EXPECT_EQ(done->first->device(), engine_device);
  EXPECT_EQ(done->second.size(), kCudaIpcHandleBytes);
  const StreamOrder order{(*ready)->native(), done->first->native()};

  auto view = [](const SharedMemoryMapping& m, const Tensor& like) {
    return TensorView{like.dtype, like.shape, m.data(), static_cast<size_t>(m.size_bytes()),
                      m.location()};
  };
  auto dest = [](const SharedMemoryMapping& m, const Tensor& like) {
    return MutableTensorView{like.dtype, like.shape, m.data(), static_cast<size_t>(m.size_bytes()),
                             m.location()};
  };
  ForwardRequest q;
  q.x = view(**mx, in.x);
  q.expert_ids = in.ids.view();
  q.weights = in.w.view();
  q.out = dest(**mout, in.x);
  q.order = order;
  ForwardRequest hq;
  hq.x = in.x.view();
  hq.expert_ids = in.ids.view();
  hq.weights = in.w.view();
  auto fa = (*ref)->Forward(hq);
  auto fb = (*ipc)->Forward(q);
  ASSERT_TRUE(fa.ok()) << fa.status();
  ASSERT_TRUE(fb.ok()) << fb.status();
  Tensor dp = Tensor::Zeros(DType::kFloat32, {kT, kK});
  BackwardRequest b;
  b.dout = view(**mdout, in.dout);
  b.dx = dest(**mdx, in.dout);
  b.dweights = dp.mutable_view();
  b.order = order;
  auto ba = (*ref)->Backward(std::move(fa->context), in.dout.view());
  auto bb = (*ipc)->Backward(std::move(fb->context), b);
  ASSERT_TRUE(ba.ok()) << ba.status();
  ASSERT_TRUE(bb.ok()) << bb.status();
  EXPECT_TRUE(SameBytes(dp, ba->dweights)) << "dweights";  // host destination: done on return

  ASSERT_TRUE(Send(child.to(), done->second));
  std::optional<std::string> out = Receive(child.from()), dx = Receive(child.from());
  ASSERT_TRUE(out && dx) << "child exited " << child.Wait();
  EXPECT_TRUE(*out == bytes_of(fa->out)) << "out";
  EXPECT_TRUE(*dx == bytes_of(ba->dx)) << "dx";

  mx->reset();
  mdout->reset();
  mout->reset();
  EXPECT_EQ(cuda::OpenIpcAllocations(), 1);  // dx's mapping still holds it
  mdx->reset();
  EXPECT_EQ(cuda::OpenIpcAllocations(), 0);
  // Closed for real: the same allocation maps again (a handle left open would be refused), and
  // the calling thread's device is the one it had.
  int before = -1, after = -2;
  ASSERT_EQ(cudaSetDevice(engine_device), cudaSuccess);
  ASSERT_EQ(cudaGetDevice(&before), cudaSuccess);
  auto again = eng.MapCudaIpcMemory(e.mem_handle, dev, l.x_off, l.x_bytes);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(cuda::OpenIpcAllocations(), 1);
  again->reset();
  EXPECT_EQ(cuda::OpenIpcAllocations(), 0);
  ASSERT_EQ(cudaGetDevice(&after), cudaSuccess);
  EXPECT_EQ(after, before);
  ASSERT_TRUE(Send(child.to(), "bye"));
  EXPECT_EQ(child.Wait(), 0);
}

TEST(CudaIpcTest, AnotherProcessesMemoryAndEventsDriveALayer) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DriveALayerFromAnotherProcess(0);
}

TEST(CudaIpcTest, AnotherGpusMemoryAndEventsDriveALayer) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  DriveALayerFromAnotherProcess(1);
}

TEST(CudaIpcExportTest, ExportsNameTheAllocationAndTheOffsetInIt) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  testing::DeviceBlock block(size_t{1} << 20);
  absl::StatusOr<cuda::ExportedMemory> e = cuda::ExportDeviceMemory(block.at(4096), 1000);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->handle.size(), kCudaIpcHandleBytes);
  EXPECT_EQ(e->device, 0);
  EXPECT_EQ(e->offset, 4096);
  EXPECT_GE(e->allocation_bytes, int64_t{1} << 20);
  ExpectRefused(cuda::ExportDeviceMemory(block.at(4096), e->allocation_bytes).status(),
                "run past the end of the allocation");
  ExpectRefused(cuda::ExportDeviceMemory(block.at(0), 0).status(), "size_bytes: 0");
  std::vector<char> host(64);
  ExpectRefused(cuda::ExportDeviceMemory(host.data(), 64).status(), "ptr: not CUDA device memory");
  absl::StatusOr<cuda::InterprocessEvent> ev = cuda::InterprocessEvent::Create(0);
  ASSERT_TRUE(ev.ok()) << ev.status();
  EXPECT_EQ(ev->handle().size(), kCudaIpcHandleBytes);
  EXPECT_TRUE(ev->Record(nullptr).ok());
  EXPECT_TRUE(ev->Synchronize().ok());
  // A process cannot open its own export: an error, not a crash.
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateCudaEngine(0);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ExpectRefused((*engine)->MapCudaIpcMemory(e->handle, 0, 0, 64).status(),
                "mem_handle: CUDA cannot open it");
  EXPECT_EQ(cuda::OpenIpcAllocations(), 0);
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--ipc-export-child") {
    return moe::RunExportChild(std::atoi(argv[2]), std::atoi(argv[3]));
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
