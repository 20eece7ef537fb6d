// Kernel benchmark of the CUDA expert pipeline over the benchmark presets (bf16, SwiGLU,
// client routing, the same math as /work/shared/bench/torch_moe_reference.py).
//
// Per preset it prints forward ms for each forward path of the pipeline, side by side in the
// same process: unfused (dispatch, with its one host sync, + gather + cuBLAS grouped GEMMs +
// SwiGLU pass + combine), fused-up (the sm90 gather+GEMM+SwiGLU kernel, then cuBLAS down +
// combine) and fused-up-down (sm90 up, sm90 down writing Y per (token, k), sm90 combine); a
// fused path that the device or the sizes do not allow runs unfused, and the line says which
// path really ran. Each fused forward's output is checked against the unfused one on the
// first 16384 tokens (normalised error printed; > 2e-2 fails the run). Then backward ms per
// backward path, unfused (per-expert cuBLAS), fused (the sm90 backward kernels) and hybrid
// (sm90 dA and dW2, cuBLAS dW13 and dXg), everything
// down to dx, dp, dW1, dW3, dW2, as the first backward after an optimizer step: fp32 gradients
// overwritten, not read; the fused results are checked against the unfused ones (dx and dp on
// the first 16384 tokens, the first 16 Mi elements of each weight gradient; > 2e-2 fails).
// Then the service's backward path twice more, back to back: its weight gradients on the
// layer's stream (bwd_ser) and on their own stream beside dXg and the combine (bwd_ovl, the
// default, PipelineOptions::overlap_weight_grads); both must repeat the service path's bits.
// TFLOP/s counting 6*T*K*d*h forward and 12*T*K*d*h backward, the two floors of fwd+bwd (its
// flops over the cuBLAS rate below, its fewest bytes, FloorBytes, over the device copy
// bandwidth measured in the same process), the bytes the forward keeps for the backward (x, H
// and the index arrays), and the MoEBlaze dispatch against the CUB radix-sort baseline (checked
// equal bit for bit; timed as 20 back-to-back calls per sample so that device time, not host
// launch latency, is compared). fwd+bwd of a forward path is its forward median plus the
// service's backward median: the backward does not depend on the forward path. Before the
// presets it measures the cuBLAS dense bf16 GEMM rate (8192^3, fp32 accumulation), the ceiling
// the TFLOP/s columns are compared against. Times are medians of CUDA-event intervals after
// warm-up.
// Inputs come from a GPU-side generator; routing is top-K of softmax(random logits), like the
// PyTorch reference. With --json FILE each preset is also appended as one JSON line, which
// scripts/bench joins with the PyTorch numbers.
//
// --recompute runs the training forward in the recompute memory mode (LayerConfig::recompute_h):
// no H is kept, the backward recomputes it per chunk with the forward's kernels; bwd_ms then
// includes that up-projection and saved_MiB drops to x + index arrays.
// --max-t runs no preset: for the scale-* shape (d 2048, h 1024, E 64, K 4) it looks for the
// largest T whose forward+backward fits on the GPU, in the mode chosen (keep H, or --recompute),
// holding what a training step holds (weights, fp32 gradients, x, dout, out/dx, routing, saved
// context, the pipeline's per-chunk temporaries): T grows by 1 Mi tokens from 2 Mi until a run
// fails with an allocation error, then bisects to 128 Ki tokens, within --max-t-seconds (default
// 110). Each tried T prints fits/OOM, fwd and bwd ms (one run after a warm-up run), the bytes the
// forward keeps and the device memory in use; the last line states the largest T that fitted.
//
// --routing balanced sends entry i = t*K + k to expert i mod E (every expert T*K/E rows) instead
// of the top-K routing, so the pipeline can be read against --ceiling, which runs no pipeline:
// per preset it times the six expert GEMMs of a step as cuBLAS strided-batched GEMMs over
// balanced experts, plus both combines at the copy bandwidth (CublasCeiling).
//
// --layer runs no pipeline directly: per preset it times a training step through the Layer API
// of the CUDA engine on host tensors, on device tensors and with a done_event
// (moe_bench_layer.cc).
//
//   moe_bench --preset olmoe sonic-7b      moe_bench --all [--reps 10] [--json out.jsonl]
//   moe_bench --all --ceiling              moe_bench --preset sonic-7b --routing balanced
//   moe_bench --preset scale-2m --recompute          moe_bench --max-t [--recompute]
#include "bench/moe_bench.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_kernels.h"
#include "bench/gpu_sensor.h"
#include "engine/cuda/device.h"
#include "engine/cuda/expert_pipeline.h"
#include "engine/cuda/grouped_gemm.h"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/router.h"

namespace moe::bench {

// Appends `line` (one JSON object) to the file at `path`; nothing when `path` is empty.
void AppendJsonLine(const std::string& path, const std::string& line) {
  if (path.empty()) return;
  if (FILE* f = std::fopen(path.c_str(), "a")) {
    std::fprintf(f, "%s\n", line.c_str());
    std::fclose(f);
  }
}

// After a preset: the pool memory it left is given back, since a pool sized for one preset
// would crowd the next one's.
void ReleasePoolMemory() {
  cudaDeviceSynchronize();
  cudaMemPool_t pool;
  cudaDeviceGetDefaultMemPool(&pool, 0);
  cudaMemPoolTrimTo(pool, 0);
}

namespace {

using cuda::DeviceBuffer;

// The forward paths timed per preset, in print order.
constexpr cuda::ForwardKernels kPaths[] = {cuda::ForwardKernels::kUnfused,
                                           cuda::ForwardKernels::kFusedUp,
                                           cuda::ForwardKernels::kFusedUpDown};
constexpr int kNumPaths = 3;
constexpr int64_t kCheckTokens = 16384;

// The backward paths timed per preset, in print order.
constexpr cuda::BackwardKernels kBackwardPaths[] = {
    cuda::BackwardKernels::kUnfused, cuda::BackwardKernels::kFused, cuda::BackwardKernels::kHybrid};
constexpr int kNumBackwardPaths = 3;
// Weight-gradient elements compared between the backward paths (the first ones of each tensor:
// deepseek-v3's dW13 alone is 15 GB).
constexpr int64_t kCheckGradElements = int64_t{1} << 24;

struct Result {
  double fwd_ms[kNumPaths] = {}, saved_bytes = 0, dispatch_ms = 0, cub_ms = 0;
  double bwd_ms[kNumBackwardPaths] = {};
  // The service's backward path again, its weight gradients on the layer's stream (serial),
  // then on their own stream (overlapped, the default) once more: the A/B of
  // PipelineOptions::overlap_weight_grads, timed back to back; both must give the same bits.
  double bwd_serial_ms = 0, bwd_overlap_ms = 0;
  bool serial_same_bits = false;
  // The GPU's state over each path's timed runs (readings only with a sensor).
  GpuSummary fwd_gpu[kNumPaths], bwd_gpu[kNumBackwardPaths];
  cuda::ForwardKernels ran[kNumPaths] = {};  // the path each request really took
  cuda::BackwardKernels ran_bwd[kNumBackwardPaths] = {};
  double err_vs_unfused[kNumPaths] = {};  // normalised, on the first kCheckTokens tokens
  // Fused backwards vs unfused: the worst normalised error over dx, dp, dW2 and dW13.
  double bwd_err = 0;
  int auto_path = 0;  // index in kPaths of what the service runs
  int auto_bwd = 0;   // index in kBackwardPaths likewise
  bool dispatch_equal = false;
  int grouped_fallbacks = 0;
  int64_t chunks = 0;
};

absl::StatusOr<Result> Run(const Preset& p, int warmup, int reps, cuda::GemmMode mode,
                           bool recompute, bool balanced, GpuWatch* watch) {
  absl::StatusOr<std::shared_ptr<cuda::Stream>> st = cuda::Stream::Create(0);
  if (!st.ok()) return st.status();
  std::shared_ptr<cuda::Stream> stream = *st;
  cudaStream_t s = stream->get();
  absl::StatusOr<std::unique_ptr<cuda::GemmRunner>> gemm = cuda::GemmRunner::Create(stream);
  if (!gemm.ok()) return gemm.status();
  (*gemm)->set_mode(mode);
  cuda::ExpertShape shape;
  shape.d_model = p.d;
  shape.d_hidden = p.h;
  shape.top_k = p.K;
  shape.expert_first = 0;
  shape.expert_count = p.E;
  shape.activation = 0;  // SwiGLU
  shape.type = kernels::ElemType::kBFloat16;
  const int64_t T = p.T, d = p.d, h = p.h, E = p.E, K = p.K;

  auto alloc = [&](int64_t bytes, const char* what) {
    return DeviceBuffer::Allocate(static_cast<size_t>(bytes), stream, what);
  };
  absl::StatusOr<DeviceBuffer> x = alloc(T * d * 2, "x"), dout = alloc(T * d * 2, "dout"),
                               out = alloc(T * d * 2, "out/dx"),
                               w13 = alloc(E * 2 * h * d * 2, "w13"),
                               w2 = alloc(E * d * h * 2, "w2"),
                               dw13 = alloc(E * 2 * h * d * 4, "dw13"),
                               dw2 = alloc(E * d * h * 4, "dw2"), ids = alloc(T * K * 4, "ids"),
                               pw = alloc(T * K * 4, "p"), dp = alloc(T * K * 4, "dp");
  for (auto* b : {&x, &dout, &out, &w13, &w2, &dw13, &dw2, &ids, &pw, &dp}) {
    if (!b->ok()) return b->status();
  }
  MOE_CUDA_RETURN(FillNormalBf16(x->get(), T * d, 1.f, 1, s));
  MOE_CUDA_RETURN(FillNormalBf16(dout->get(), T * d, 1.f, 2, s));
  MOE_CUDA_RETURN(FillNormalBf16(w13->get(), E * 2 * h * d, 1.f / std::sqrt(float(d)), 3, s));
  MOE_CUDA_RETURN(FillNormalBf16(w2->get(), E * d * h, 1.f / std::sqrt(float(h)), 4, s));
  MOE_CUDA_RETURN(cudaMemsetAsync(dw13->get(), 0, dw13->bytes(), s));
  MOE_CUDA_RETURN(cudaMemsetAsync(dw2->get(), 0, dw2->bytes(), s));
  {
    absl::StatusOr<DeviceBuffer> logits = alloc(T * E * 4, "logits"), lse = alloc(T * 4, "lse");
    if (!logits.ok()) return logits.status();
    if (!lse.ok()) return lse.status();
    MOE_CUDA_RETURN(FillNormalF32(logits->as<float>(), T * E, 1.f, 5, s));
    MOE_CUDA_RETURN(kernels::LaunchRouterTopK(logits->as<float>(), T, static_cast<int32_t>(E),
                                              static_cast<int32_t>(K), true, ids->as<int32_t>(),
                                              pw->as<float>(), lse->as<float>(), s));
  }
  std::vector<int32_t> even;  // lives until the synchronisation below
  if (balanced) {
    // Entry i = t*K + k goes to expert i mod E: every expert gets T*K/E rows (K <= E keeps a
    // token's picks distinct); the router's weights stay.
    even.resize(static_cast<size_t>(T * K));
    for (size_t i = 0; i < even.size(); ++i) even[i] = static_cast<int32_t>(i % E);
    MOE_CUDA_RETURN(
        cudaMemcpyAsync(ids->get(), even.data(), even.size() * 4, cudaMemcpyHostToDevice, s));
  }
  MOE_CUDA_RETURN(cudaStreamSynchronize(s));

  Result r;
  const cuda::ExpertWeights w{w13->get(), w2->get()};
  const int64_t g = 2 * h;
  const int64_t check_rows = std::min(T, kCheckTokens);
  std::vector<uint16_t> out_unfused, out_path(static_cast<size_t>(check_rows * d));
  auto bf16 = [](uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return static_cast<double>(f);
  };
  for (int v = 0; v < kNumPaths; ++v) {
    cuda::PipelineOptions forced;
    forced.forward = kPaths[v];
    cuda::ExpertPipeline pipe(shape, stream, gemm->get(), forced);
    // Forward as the layer runs it in training: dispatch (one sync), H kept (not in
    // recompute mode), combine.
    absl::StatusOr<double> fwd = TimeMs(
        s, warmup, reps,
        [&]() -> absl::Status {
          cuda::DispatchPlan plan;
          CHECK_OK(pipe.Dispatch(ids->as<int32_t>(), T, &plan));
          if (recompute)
            return pipe.Forward(plan, x->get(), pw->as<float>(), w, nullptr, out->get());
          absl::StatusOr<DeviceBuffer> hb = alloc(plan.total_routed * g * 2, "H");
          if (!hb.ok()) return hb.status();
          return pipe.Forward(plan, x->get(), pw->as<float>(), w, hb->get(), out->get());
        },
        watch);
    if (!fwd.ok()) return fwd.status();
    r.fwd_ms[v] = *fwd;
    r.fwd_gpu[v] = watch->last;
    cuda::DispatchPlan plan;
    CHECK_OK(pipe.Dispatch(ids->as<int32_t>(), T, &plan));
    r.ran[v] = pipe.ChunkForwardKernels(plan.chunks.front());
    MOE_CUDA_RETURN(
        cudaMemcpy(out_path.data(), out->get(), out_path.size() * 2, cudaMemcpyDeviceToHost));
    if (v == 0) {
      out_unfused = out_path;
    } else {
      double num = 0, den = 0;
      for (size_t i = 0; i < out_path.size(); ++i) {
        const double a = bf16(out_path[i]), b = bf16(out_unfused[i]);
        num += (a - b) * (a - b);
        den += b * b;
      }
      r.err_vs_unfused[v] = den > 0 ? std::sqrt(num / den) : (num == 0 ? 0 : INFINITY);
      if (!(r.err_vs_unfused[v] <= 2e-2)) {
        return absl::InternalError(
            absl::StrCat(cuda::ForwardKernelsName(kPaths[v]),
                         " forward differs from the unfused one: ", r.err_vs_unfused[v]));
      }
    }
  }
  // What the service runs (kAuto): the index of its path among the timed ones.
  cuda::ExpertPipeline pipe(shape, stream, gemm->get());
  cuda::DispatchPlan plan;
  CHECK_OK(pipe.Dispatch(ids->as<int32_t>(), T, &plan));
  const cuda::ForwardKernels auto_path = pipe.ChunkForwardKernels(plan.chunks.front());
  for (int v = 0; v < kNumPaths; ++v) {
    if (kPaths[v] == auto_path) r.auto_path = v;
  }
  r.chunks = static_cast<int64_t>(plan.chunks.size());
  absl::StatusOr<DeviceBuffer> hb = recompute ? absl::StatusOr<DeviceBuffer>(DeviceBuffer())
                                              : alloc(plan.total_routed * g * 2, "H");
  if (!hb.ok()) return hb.status();
  CHECK_OK(pipe.Forward(plan, x->get(), pw->as<float>(), w, hb->get(), out->get()));
  r.saved_bytes = static_cast<double>(x->bytes() + hb->bytes() + ids->bytes() + pw->bytes() +
                                      plan.device_bytes());
  const cuda::ExpertGrads grads{dw13->as<float>(), dw2->as<float>()};
  const cuda::BackwardKernels auto_bwd = pipe.ChunkBackwardKernels(plan.chunks.front());
  // Each backward path on the same plan, H and inputs; the results of the last timed run of
  // each are kept on the host and the fused ones compared with the unfused ones.
  const int64_t check_w2 = std::min(E * d * h, kCheckGradElements);
  const int64_t check_w13 = std::min(E * 2 * h * d, kCheckGradElements);
  std::vector<uint16_t> dx_host[kNumBackwardPaths];
  std::vector<float> dp_host[kNumBackwardPaths], dw2_host[kNumBackwardPaths],
      dw13_host[kNumBackwardPaths];
  // The compared part of the latest backward's dx, dp, dW2 and dW13, to the host.
  auto fetch_grads = [&](std::vector<uint16_t>* dxh, std::vector<float>* dph,
                         std::vector<float>* dw2h, std::vector<float>* dw13h) -> absl::Status {
    dxh->resize(static_cast<size_t>(check_rows * d));
    dph->resize(static_cast<size_t>(check_rows * K));
    dw2h->resize(static_cast<size_t>(check_w2));
    dw13h->resize(static_cast<size_t>(check_w13));
    MOE_CUDA_RETURN(cudaMemcpy(dxh->data(), out->get(), dxh->size() * 2, cudaMemcpyDeviceToHost));
    MOE_CUDA_RETURN(cudaMemcpy(dph->data(), dp->get(), dph->size() * 4, cudaMemcpyDeviceToHost));
    MOE_CUDA_RETURN(cudaMemcpy(dw2h->data(), dw2->get(), dw2h->size() * 4, cudaMemcpyDeviceToHost));
    MOE_CUDA_RETURN(
        cudaMemcpy(dw13h->data(), dw13->get(), dw13h->size() * 4, cudaMemcpyDeviceToHost));
    return absl::OkStatus();
  };
  // The median backward of a pipeline on this plan, H and inputs, as in a training step with
  // one micro-batch: the gradients start at zero after Step.
  auto time_backward = [&](cuda::ExpertPipeline& bpipe) {
    return TimeMs(
        s, warmup, reps,
        [&]() -> absl::Status {
          return bpipe.Backward(plan, x->get(), hb->get(), pw->as<float>(), dout->get(), w, grads,
                                out->get(), kernels::ElemType::kBFloat16, dp->as<float>(),
                                /*grads_are_zero=*/true);
        },
        watch);
  };
  for (int v = 0; v < kNumBackwardPaths; ++v) {
    cuda::PipelineOptions forced;
    forced.backward = kBackwardPaths[v];
    cuda::ExpertPipeline bpipe(shape, stream, gemm->get(), forced);
    r.ran_bwd[v] = bpipe.ChunkBackwardKernels(plan.chunks.front());
    if (kBackwardPaths[v] == auto_bwd) r.auto_bwd = v;
    absl::StatusOr<double> bwd = time_backward(bpipe);
    if (!bwd.ok()) return bwd.status();
    r.bwd_ms[v] = *bwd;
    r.bwd_gpu[v] = watch->last;
    CHECK_OK(fetch_grads(&dx_host[v], &dp_host[v], &dw2_host[v], &dw13_host[v]));
  }
  {
    cuda::PipelineOptions service;
    service.backward = kBackwardPaths[r.auto_bwd];
    r.serial_same_bits = true;
    for (const bool overlap : {false, true}) {
      service.overlap_weight_grads = overlap;
      cuda::ExpertPipeline spipe(shape, stream, gemm->get(), service);
      absl::StatusOr<double> bwd = time_backward(spipe);
      if (!bwd.ok()) return bwd.status();
      (overlap ? r.bwd_overlap_ms : r.bwd_serial_ms) = *bwd;
      std::vector<uint16_t> dx_again;
      std::vector<float> dp_again, dw2_again, dw13_again;
      CHECK_OK(fetch_grads(&dx_again, &dp_again, &dw2_again, &dw13_again));
      const int v = r.auto_bwd;
      r.serial_same_bits = r.serial_same_bits && dx_again == dx_host[v] && dp_again == dp_host[v] &&
                           dw2_again == dw2_host[v] && dw13_again == dw13_host[v];
    }
  }
  auto rel_err = [](const auto& got, const auto& want, auto value) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double a = value(got[i]), b = value(want[i]);
      num += (a - b) * (a - b);
      den += b * b;
    }
    return den > 0 ? std::sqrt(num / den) : (num == 0 ? 0.0 : INFINITY);
  };
  auto as_double = [](float f) { return static_cast<double>(f); };
  for (int v = 1; v < kNumBackwardPaths; ++v) {
    r.bwd_err = std::max({r.bwd_err, rel_err(dx_host[v], dx_host[0], bf16),
                          rel_err(dp_host[v], dp_host[0], as_double),
                          rel_err(dw2_host[v], dw2_host[0], as_double),
                          rel_err(dw13_host[v], dw13_host[0], as_double)});
  }
  if (!(r.bwd_err <= 2e-2)) {
    return absl::InternalError(
        absl::StrCat("fused backward differs from the unfused one: ", r.bwd_err));
  }
  r.grouped_fallbacks = (*gemm)->grouped_fallbacks();
  hb->Reset();

  // Dispatch alone: MoEBlaze vs CUB radix sort, whole T in one call each.
  absl::StatusOr<DeviceBuffer> c1 = alloc(E * 4, "counts"), o1 = alloc((E + 1) * 4, "offsets"),
                               e1 = alloc(T * K * 4, "entries"), s1 = alloc(T * K * 4, "slots"),
                               c2 = alloc(E * 4, "counts"), o2 = alloc((E + 1) * 4, "offsets"),
                               e2 = alloc(T * K * 4, "entries"), s2 = alloc(T * K * 4, "slots");
  for (auto* b : {&c1, &o1, &e1, &s1, &c2, &o2, &e2, &s2}) {
    if (!b->ok()) return b->status();
  }
  const size_t ws1_bytes = kernels::DispatchWorkspaceBytes(T, static_cast<int32_t>(E));
  const size_t ws2_bytes =
      CubSortDispatchWorkspaceBytes(T, static_cast<int32_t>(K), static_cast<int32_t>(E));
  absl::StatusOr<DeviceBuffer> ws1 = alloc(static_cast<int64_t>(ws1_bytes), "ws");
  absl::StatusOr<DeviceBuffer> ws2 = alloc(static_cast<int64_t>(ws2_bytes), "ws");
  if (!ws1.ok()) return ws1.status();
  if (!ws2.ok()) return ws2.status();
  // Each sample is kBatch dispatches back to back (divided by kBatch), so the kernels' device
  // time is measured rather than the host's launch latency, for both implementations alike.
  constexpr int kBatch = 20;
  const int dreps = std::max(reps, 20);
  absl::StatusOr<double> dm = TimeMs(s, 3, dreps, [&]() -> absl::Status {
    for (int i = 0; i < kBatch; ++i) {
      MOE_CUDA_RETURN(kernels::LaunchDispatch(ids->as<int32_t>(), T, static_cast<int32_t>(K), 0,
                                              static_cast<int32_t>(E), c1->as<int32_t>(),
                                              o1->as<int32_t>(), e1->as<int32_t>(),
                                              s1->as<int32_t>(), ws1->get(), ws1_bytes, s));
    }
    return absl::OkStatus();
  });
  if (!dm.ok()) return dm.status();
  absl::StatusOr<double> cm = TimeMs(s, 3, dreps, [&]() -> absl::Status {
    for (int i = 0; i < kBatch; ++i) {
      MOE_CUDA_RETURN(CubSortDispatch(ids->as<int32_t>(), T, static_cast<int32_t>(K),
                                      static_cast<int32_t>(E), c2->as<int32_t>(), o2->as<int32_t>(),
                                      e2->as<int32_t>(), s2->as<int32_t>(), ws2->get(), ws2_bytes,
                                      s));
    }
    return absl::OkStatus();
  });
  if (!cm.ok()) return cm.status();
  r.dispatch_ms = *dm / kBatch;
  r.cub_ms = *cm / kBatch;
  auto fetch = [&](const DeviceBuffer& b) {
    std::vector<int32_t> v(b.bytes() / 4);
    cudaMemcpy(v.data(), b.get(), b.bytes(), cudaMemcpyDeviceToHost);
    return v;
  };
  r.dispatch_equal = fetch(*c1) == fetch(*c2) && fetch(*o1) == fetch(*o2) &&
                     fetch(*e1) == fetch(*e2) && fetch(*s1) == fetch(*s2);
  MOE_CUDA_RETURN(cudaStreamSynchronize(s));
  return r;
}

int Main(int argc, char** argv) {
  std::vector<const Preset*> todo;
  int reps = 10, warmup = 3;
  std::string json, mode_name = "auto";
  bool recompute = false, max_t = false, ceiling = false, balanced = false, layer = false;
  double max_t_seconds = 110;
  GpuWatch watch;
  cuda::GemmMode mode = cuda::GemmMode::kAuto;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--gemm" && i + 1 < argc) {
      mode_name = argv[++i];
      const std::map<std::string, cuda::GemmMode> modes = {{"auto", cuda::GemmMode::kAuto},
                                                           {"grouped", cuda::GemmMode::kGrouped},
                                                           {"looped", cuda::GemmMode::kLooped},
                                                           {"streams", cuda::GemmMode::kStreams}};
      if (!modes.count(mode_name)) {
        std::fprintf(stderr, "moe_bench: --gemm takes auto, grouped, looped or streams\n");
        return 2;
      }
      mode = modes.at(mode_name);
    } else if (a == "--recompute") {
      recompute = true;
    } else if (a == "--ceiling") {
      ceiling = true;
    } else if (a == "--layer") {
      layer = true;
    } else if (a == "--routing" && i + 1 < argc) {
      const std::string routing = argv[++i];
      if (routing != "topk" && routing != "balanced") {
        std::fprintf(stderr, "moe_bench: --routing takes topk or balanced\n");
        return 2;
      }
      balanced = routing == "balanced";
    } else if (a == "--max-t") {
      max_t = true;
    } else if (a == "--max-t-seconds" && i + 1 < argc) {
      max_t_seconds = std::atof(argv[++i]);
    } else if (a == "--cool-to" && i + 1 < argc) {
      watch.cool_to_c = std::atoi(argv[++i]);
      if (watch.cool_to_c <= 0) {
        std::fprintf(stderr, "moe_bench: --cool-to takes a temperature in degrees C above 0\n");
        return 2;
      }
    } else if (a == "--cool-timeout" && i + 1 < argc) {
      watch.cool_timeout_s = std::atof(argv[++i]);
      if (!(watch.cool_timeout_s >= 0)) {
        std::fprintf(stderr, "moe_bench: --cool-timeout takes seconds, 0 or more\n");
        return 2;
      }
    } else if (a == "--all") {
      for (const Preset& p : kPresets) todo.push_back(&p);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--warmup" && i + 1 < argc) {
      warmup = std::max(0, std::atoi(argv[++i]));
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else if (a == "--preset") {
      while (i + 1 < argc && argv[i + 1][0] != '-') {
        const std::string name = argv[++i];
        const Preset* found = nullptr;
        for (const Preset& p : kPresets)
          if (name == p.name) found = &p;
        if (found == nullptr) {
          std::fprintf(stderr, "moe_bench: unknown preset %s\n", name.c_str());
          return 2;
        }
        todo.push_back(found);
      }
    } else {
      std::fprintf(
          stderr,
          "usage: moe_bench (--all | --preset NAME...) [--reps N] [--warmup N] "
          "[--json FILE] [--gemm auto|grouped|looped|streams] [--recompute]\n"
          "                 [--routing topk|balanced] [--cool-to C] [--cool-timeout S]\n"
          "       moe_bench (--all | --preset NAME...) --ceiling [--reps N] [--json FILE]\n"
          "       moe_bench (--all | --preset NAME...) --layer [--reps N] [--json FILE]\n"
          "       moe_bench --max-t [--recompute] [--max-t-seconds S]\n");
      return 2;
    }
  }
  if (todo.empty() && !max_t) {
    std::fprintf(stderr, "moe_bench: name --all or --preset NAME...\n");
    return 2;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::fprintf(stderr, "moe_bench: no CUDA device\n");
    return 1;
  }
  {  // Keep freed pool memory for reuse, as the engine does.
    cudaMemPool_t pool;
    uint64_t keep = UINT64_MAX;
    cudaDeviceGetDefaultMemPool(&pool, 0);
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  if (max_t) return MaxTokens(recompute, max_t_seconds) == 0 ? 0 : 1;
  if (layer) return LayerApi(todo, warmup, reps, json);
  // The GPU's temperature and clocks, read through NVML; required by --cool-to.
  std::unique_ptr<GpuSensor> sensor;
  {
    char bus_id[32] = {};
    absl::StatusOr<std::unique_ptr<GpuSensor>> opened =
        cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, 0) == cudaSuccess
            ? GpuSensor::Open(bus_id)
            : absl::StatusOr<std::unique_ptr<GpuSensor>>(
                  absl::UnavailableError("cudaDeviceGetPCIBusId failed"));
    if (opened.ok()) {
      sensor = std::move(*opened);
      watch.sensor = sensor.get();
    } else if (watch.cool_to_c > 0) {
      std::fprintf(stderr, "moe_bench: --cool-to needs the GPU's temperature: %s\n",
                   std::string(opened.status().message()).c_str());
      return 1;
    } else {
      std::printf("# GPU sensor unavailable (%s): no clocks recorded\n",
                  std::string(opened.status().message()).c_str());
    }
  }
  absl::StatusOr<double> peak = CublasDenseTflops(&watch);
  const GpuSummary cublas_gpu = watch.last;
  if (!peak.ok()) {
    std::fprintf(stderr, "moe_bench: cuBLAS dense rate: %s\n",
                 std::string(peak.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<double> copy_gbs = CopyBandwidthGBs();
  if (!copy_gbs.ok()) {
    std::fprintf(stderr, "moe_bench: copy bandwidth: %s\n",
                 std::string(copy_gbs.status().message()).c_str());
    return 1;
  }
  if (ceiling) return PrintCeiling(todo, warmup, reps, *peak, *copy_gbs, json, &watch);
  std::printf(
      "# moe_bench on %s, bf16 SwiGLU, expert GEMMs %s, %s, %s routing, medians of %d after %d "
      "warm-up\n",
      prop.name, mode_name.c_str(), recompute ? "recompute H (only x kept)" : "H kept",
      balanced ? "balanced (entry i to expert i mod E)" : "top-K", reps, warmup);
  std::printf("# cuBLAS dense bf16 GEMM (8192^3): %.1f TFLOP/s; device copy: %.0f GB/s\n", *peak,
              *copy_gbs);
  if (sensor != nullptr) {
    std::printf(
        "# GPU read after every timed run%s; cuBLAS's runs: SM clock min %d / mean %.0f MHz, "
        "max %d C%s. svcMHz/maxC/hot below: min SM clock, max temperature and thermal slowdown "
        "over the service path's timed runs\n",
        watch.cool_to_c > 0
            ? absl::StrCat(", each timed series started at or below ", watch.cool_to_c, " C")
                  .c_str()
            : "",
        cublas_gpu.min_sm_mhz, cublas_gpu.mean_sm_mhz, cublas_gpu.max_temp_c,
        cublas_gpu.thermal_slowdown ? ", THERMAL SLOWDOWN" : "");
  }
  std::printf(
      "# floors of fwd+bwd: flop_fl = 18*T*K*d*h / cuBLAS rate, byte_fl = FloorBytes / "
      "copy bandwidth (ms)\n");
  std::printf(
      "# fwd_* per forward path (unfused / fused-up / fused-up-down; '*' marks the path "
      "the service runs, '!' a path that fell back to unfused); tot = that fwd + bwd\n");
  std::printf(
      "# bwd_* per backward path (unfused / fused / hybrid), marked likewise; "
      "tot_unf = unfused fwd + unfused bwd, tot_svc = the service's fwd + bwd; err = worst "
      "fused-vs-unfused "
      "normalised error (forward outputs; dx, dp, dW2, dW13)\n");
  std::printf(
      "# bwd_ser / bwd_ovl: the service's backward path again, weight gradients on the layer's "
      "stream, then on their own stream (the default), back to back; '=' both gave the bits of "
      "the service path's run, 'X' one did not (a failure)\n");
  std::printf(
      "%-12s %9s %9s %9s %9s %9s %9s %9s %10s %8s %8s %8s %9s %8s %8s %7s %10s %9s %9s %6s "
      "%9s %7s %5s %4s\n",
      "preset", "fwd_unf", "fwd_up", "fwd_updn", "bwd_unf", "bwd_fus", "bwd_hyb", "bwd_ser",
      "bwd_ovl", "tot_unf", "tot_svc", "svcTF/s", "%cuBLAS", "flop_fl", "byte_fl", "err",
      "saved_MiB", "disp_ms", "cub_ms", "equal", "chunks", "svcMHz", "maxC", "hot");
  int failures = 0;
  for (const Preset* p : todo) {
    absl::StatusOr<Result> r = Run(*p, warmup, reps, mode, recompute, balanced, &watch);
    ReleasePoolMemory();
    std::string line;
    if (!r.ok()) {
      ++failures;
      std::printf("%-12s error: %s\n", p->name, std::string(r.status().message()).c_str());
      line =
          absl::StrCat("{\"preset\": \"", p->name, "\", \"impl\": \"moe-offload\", \"error\": \"",
                       std::string(r.status().message()), "\"}");
    } else {
      const double flop = 6.0 * p->T * p->K * p->d * p->h;
      const int a = r->auto_path, b = r->auto_bwd;
      const double fwd = r->fwd_ms[a], bwd = r->bwd_ms[b];
      const double fwd_tf = flop / fwd / 1e9, bwd_tf = 2 * flop / bwd / 1e9;
      const double tot = fwd + bwd, tot_tf = 3 * flop / tot / 1e9;
      const double flop_floor_ms = 3 * flop / *peak / 1e9;
      const double byte_floor_ms = FloorBytes(*p) / *copy_gbs / 1e6;
      const double max_err = std::max({r->err_vs_unfused[1], r->err_vs_unfused[2], r->bwd_err});
      auto cell = [](double ms, bool fell_back, bool service) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.3f%s", ms, fell_back ? "!" : (service ? "*" : ""));
        return std::string(buf);
      };
      std::string cols[kNumPaths], bcols[kNumBackwardPaths];
      for (int v = 0; v < kNumPaths; ++v)
        cols[v] = cell(r->fwd_ms[v], r->ran[v] != kPaths[v], v == a);
      for (int v = 0; v < kNumBackwardPaths; ++v) {
        bcols[v] = cell(r->bwd_ms[v], r->ran_bwd[v] != kBackwardPaths[v], v == b);
      }
      const GpuSummary& svc_fwd_gpu = r->fwd_gpu[a];
      const GpuSummary& svc_bwd_gpu = r->bwd_gpu[b];
      std::string svc_mhz = "-", svc_max_c = "-", svc_hot = "-";  // no sensor, no readings
      if (svc_fwd_gpu.readings > 0 && svc_bwd_gpu.readings > 0) {
        svc_mhz = std::to_string(std::min(svc_fwd_gpu.min_sm_mhz, svc_bwd_gpu.min_sm_mhz));
        svc_max_c = std::to_string(std::max(svc_fwd_gpu.max_temp_c, svc_bwd_gpu.max_temp_c));
        svc_hot = svc_fwd_gpu.thermal_slowdown || svc_bwd_gpu.thermal_slowdown ? "YES" : "no";
      }
      std::printf(
          "%-12s %9s %9s %9s %9s %9s %9s %9.3f %9.3f%c %8.3f %8.3f %8.1f %8.1f%% %8.3f %8.3f "
          "%7.1e %10.1f %9.4f %9.4f %6s %9lld %7s %5s %4s\n",
          p->name, cols[0].c_str(), cols[1].c_str(), cols[2].c_str(), bcols[0].c_str(),
          bcols[1].c_str(), bcols[2].c_str(), r->bwd_serial_ms, r->bwd_overlap_ms,
          r->serial_same_bits ? '=' : 'X', r->fwd_ms[0] + r->bwd_ms[0], tot, tot_tf,
          100.0 * tot_tf / *peak, flop_floor_ms, byte_floor_ms, max_err, r->saved_bytes / 1048576.0,
          r->dispatch_ms, r->cub_ms, r->dispatch_equal ? "yes" : "NO",
          static_cast<long long>(r->chunks), svc_mhz.c_str(), svc_max_c.c_str(), svc_hot.c_str());
      if (!r->dispatch_equal) ++failures;
      if (!r->serial_same_bits) ++failures;
      line =
          absl::StrCat("{\"preset\": \"", p->name, "\", \"impl\": \"moe-offload\", \"T\": ", p->T,
                       ", \"d\": ", p->d, ", \"h\": ", p->h, ", \"E\": ", p->E, ", \"K\": ", p->K,
                       ", \"forward_path\": \"", cuda::ForwardKernelsName(r->ran[a]), "\"",
                       ", \"backward_path\": \"", cuda::BackwardKernelsName(r->ran_bwd[b]), "\"",
                       ", \"fwd_ms\": ", fwd, ", \"bwd_ms\": ", bwd, ", \"fwdbwd_ms\": ", tot,
                       ", \"fwd_tflops\": ", fwd_tf, ", \"bwd_tflops\": ", bwd_tf,
                       ", \"fwdbwd_tflops\": ", tot_tf, ", \"cublas_dense_tflops\": ", *peak);
      for (int v = 0; v < kNumPaths; ++v) {
        std::string key = cuda::ForwardKernelsName(kPaths[v]);
        std::replace(key.begin(), key.end(), '-', '_');
        absl::StrAppend(&line, ", \"fwd_", key, "_ms\": ", r->fwd_ms[v], ", \"fwdbwd_", key,
                        "_ms\": ", r->fwd_ms[v] + bwd, ", \"ran_", key, "\": \"",
                        cuda::ForwardKernelsName(r->ran[v]), "\", \"err_", key,
                        "\": ", r->err_vs_unfused[v]);
      }
      for (int v = 0; v < kNumBackwardPaths; ++v) {
        std::string key = cuda::BackwardKernelsName(kBackwardPaths[v]);
        std::replace(key.begin(), key.end(), '-', '_');
        absl::StrAppend(&line, ", \"bwd_", key, "_ms\": ", r->bwd_ms[v], ", \"ran_bwd_", key,
                        "\": \"", cuda::BackwardKernelsName(r->ran_bwd[v]), "\"");
      }
      absl::StrAppend(&line, ", \"bwd_svc_serial_ms\": ", r->bwd_serial_ms,
                      ", \"bwd_svc_overlap_ms\": ", r->bwd_overlap_ms,
                      ", \"serial_same_bits\": ", r->serial_same_bits ? "true" : "false");
      absl::StrAppend(&line, ", \"flop_floor_ms\": ", flop_floor_ms,
                      ", \"byte_floor_ms\": ", byte_floor_ms, ", \"copy_gbs\": ", *copy_gbs);
      absl::StrAppend(&line, ", \"fwdbwd_unfused_all_ms\": ", r->fwd_ms[0] + r->bwd_ms[0],
                      ", \"err_bwd_fused\": ", r->bwd_err);
      absl::StrAppend(&line, ", \"saved_MiB\": ", r->saved_bytes / 1048576.0,
                      ", \"dispatch_ms\": ", r->dispatch_ms, ", \"cub_sort_ms\": ", r->cub_ms,
                      ", \"dispatch_equal\": ", r->dispatch_equal ? "true" : "false",
                      ", \"chunks\": ", r->chunks,
                      ", \"recompute_h\": ", recompute ? "true" : "false", ", \"routing\": \"",
                      balanced ? "balanced" : "topk", "\", \"gemm\": \"", mode_name,
                      "\", \"grouped_fallbacks\": ", r->grouped_fallbacks);
      if (sensor != nullptr) {
        absl::StrAppend(&line, ", \"gpu_cool_to_c\": ", watch.cool_to_c,
                        ", \"gpu_cublas\": ", cublas_gpu.Json(),
                        ", \"gpu_svc_fwd\": ", svc_fwd_gpu.Json(),
                        ", \"gpu_svc_bwd\": ", svc_bwd_gpu.Json());
      }
      absl::StrAppend(&line, "}");
    }
    std::fflush(stdout);
    AppendJsonLine(json, line);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) { return moe::bench::Main(argc, argv); }
