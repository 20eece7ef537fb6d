// moe_bench --layer: the in-process CUDA engine through the Layer API (engine/layer.h), the
// same training step (Forward + Backward, bf16 SwiGLU, client routing) three ways per preset:
//   host    x, dout and the routing in host memory, out and dx back as host tensors: what
//           moe-server does with tensors that arrived as bytes;
//   device  x and dout in device memory (a trainer's tensors the server mapped), out, dx and
//           dweights written into device destinations; routing from host memory; each call
//           finishes its work before returning;
//   event   as device, with a done_event: the Backward returns once enqueued; the step ends
//           when the event has fired.
// Times are wall-clock medians of the whole step (the calls synchronise inside), after warm-up.
// The caller's device tensors are cudaMalloc'd, as a framework's would be.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_kernels.h"
#include "bench/moe_bench.h"
#include "engine/cuda/cuda_engine.h"
#include "engine/cuda/device.h"
#include "engine/layer.h"
#include "kernels/cuda/router.h"

namespace moe::bench {
namespace {

// cudaMalloc'd caller memory, freed with the object.
class CallerBuffer {
 public:
  ~CallerBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::Status Allocate(int64_t bytes) {
    MOE_CUDA_RETURN(cudaMalloc(&ptr_, static_cast<size_t>(bytes)));
    bytes_ = static_cast<size_t>(bytes);
    return absl::OkStatus();
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

absl::StatusOr<double> MedianWallMs(int warmup, int reps, const std::function<absl::Status()>& fn) {
  std::vector<double> ms;
  for (int i = 0; i < warmup + reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_OK(fn());
    const double dt =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= warmup) ms.push_back(dt);
  }
  return Median(ms);
}

struct LayerTimes {
  double host_ms = 0, device_ms = 0, event_ms = 0;
};

absl::StatusOr<LayerTimes> TimeLayer(const Preset& p, int warmup, int reps) {
  const int64_t T = p.T, d = p.d, K = p.K;
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateCudaEngine(0);
  if (!engine.ok()) return engine.status();
  LayerConfig cfg;
  cfg.num_experts = p.E;
  cfg.top_k = p.K;
  cfg.d_model = p.d;
  cfg.d_hidden = p.h;
  cfg.dtype = DType::kBFloat16;
  absl::StatusOr<std::unique_ptr<Layer>> layer = (*engine)->CreateLayer(cfg);
  if (!layer.ok()) return layer.status();
  Layer& l = **layer;

  // The caller's tensors: x, dout on the device (and copies on the host), the routing top-K of
  // random logits, brought to the host (the timed steps read it from there).
  CallerBuffer x, dout, out, dx, dp, logits, ids, w, lse;
  const std::pair<CallerBuffer*, int64_t> sizes[] = {
      {&x, T * d * 2},   {&dout, T * d * 2}, {&out, T * d * 2},
      {&dx, T * d * 2},  {&dp, T * K * 4},   {&logits, T * p.E * 4},
      {&ids, T * K * 4}, {&w, T * K * 4},    {&lse, T * 4}};
  for (const auto& [buf, bytes] : sizes) CHECK_OK(buf->Allocate(bytes));
  MOE_CUDA_RETURN(FillNormalBf16(x.get(), T * d, 1.f, 1, nullptr));
  MOE_CUDA_RETURN(FillNormalBf16(dout.get(), T * d, 1.f, 2, nullptr));
  MOE_CUDA_RETURN(FillNormalF32(static_cast<float*>(logits.get()), T * p.E, 1.f, 5, nullptr));
  MOE_CUDA_RETURN(kernels::LaunchRouterTopK(
      static_cast<float*>(logits.get()), T, static_cast<int32_t>(p.E), static_cast<int32_t>(K),
      true, static_cast<int32_t*>(ids.get()), static_cast<float*>(w.get()),
      static_cast<float*>(lse.get()), nullptr));
  Tensor x_h = Tensor::Uninitialized(DType::kBFloat16, {T, d});
  Tensor dout_h = Tensor::Uninitialized(DType::kBFloat16, {T, d});
  Tensor ids_h = Tensor::Uninitialized(DType::kInt32, {T, K});
  Tensor w_h = Tensor::Uninitialized(DType::kFloat32, {T, K});
  const std::pair<Tensor*, const CallerBuffer*> copies[] = {
      {&x_h, &x}, {&dout_h, &dout}, {&ids_h, &ids}, {&w_h, &w}};
  for (const auto& [t, src] : copies) {
    MOE_CUDA_RETURN(
        cudaMemcpy(t->bytes.data(), src->get(), t->bytes.size(), cudaMemcpyDeviceToHost));
  }
  cudaEvent_t done = nullptr;
  MOE_CUDA_RETURN(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  const auto on_device = [](const Tensor& like, const CallerBuffer& b) {
    return TensorView{like.dtype, like.shape, b.get(), b.bytes(), MemoryLocation::Cuda(0)};
  };
  const auto into_device = [](const Tensor& like, const CallerBuffer& b) {
    return MutableTensorView{like.dtype, like.shape, b.get(), b.bytes(), MemoryLocation::Cuda(0)};
  };
  const auto step = [&](bool device, bool event) -> absl::Status {
    ForwardRequest f;
    f.x = device ? on_device(x_h, x) : x_h.view();
    f.expert_ids = ids_h.view();
    f.weights = w_h.view();
    BackwardRequest b;
    b.dout = device ? on_device(dout_h, dout) : dout_h.view();
    if (device) {
      f.out = into_device(x_h, out);
      b.dx = into_device(dout_h, dx);
      b.dweights = into_device(w_h, dp);
    }
    if (event) f.order.done_event = b.order.done_event = done;
    absl::StatusOr<ForwardResult> fr = l.Forward(f);
    if (!fr.ok()) return fr.status();
    absl::StatusOr<BackwardResult> br = l.Backward(std::move(fr->context), b);
    if (!br.ok()) return br.status();
    if (event) MOE_CUDA_RETURN(cudaEventSynchronize(done));
    return absl::OkStatus();
  };
  LayerTimes r;
  absl::StatusOr<double> ms = MedianWallMs(warmup, reps, [&] { return step(false, false); });
  if (!ms.ok()) return ms.status();
  r.host_ms = *ms;
  ms = MedianWallMs(warmup, reps, [&] { return step(true, false); });
  if (!ms.ok()) return ms.status();
  r.device_ms = *ms;
  ms = MedianWallMs(warmup, reps, [&] { return step(true, true); });
  if (!ms.ok()) return ms.status();
  r.event_ms = *ms;
  cudaEventDestroy(done);
  return r;
}

}  // namespace

int LayerApi(const std::vector<const Preset*>& todo, int warmup, int reps,
             const std::string& json) {
  std::printf(
      "# moe_bench --layer: Forward + Backward through the Layer API, bf16 SwiGLU, client "
      "routing, wall-clock medians of %d after %d warm-up (ms)\n",
      reps, warmup);
  std::printf("%-12s %9s %9s %9s %8s\n", "preset", "host", "device", "event", "host/dev");
  int failures = 0;
  for (const Preset* p : todo) {
    absl::StatusOr<LayerTimes> t = TimeLayer(*p, warmup, reps);
    ReleasePoolMemory();
    if (!t.ok()) {
      std::printf("%-12s failed: %s\n", p->name, std::string(t.status().message()).c_str());
      ++failures;
      continue;
    }
    std::printf("%-12s %9.2f %9.2f %9.2f %8.2f\n", p->name, t->host_ms, t->device_ms, t->event_ms,
                t->host_ms / t->device_ms);
    AppendJsonLine(json, absl::StrCat("{\"impl\": \"layer-api\", \"preset\": \"", p->name,
                                      "\", \"host_ms\": ", t->host_ms, ", \"device_ms\": ",
                                      t->device_ms, ", \"event_ms\": ", t->event_ms, "}"));
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace moe::bench
