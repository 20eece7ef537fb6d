// Kernel benchmark of the CUDA expert pipeline over the presets of issue 4 (bf16, SwiGLU,
// client routing, the same math as /work/shared/bench/torch_moe_reference.py).
//
// Per preset it prints forward ms (dispatch, with its one host sync, + gather + expert GEMMs
// + fused SwiGLU + combine), backward ms (everything down to dx, dp, dW1, dW3, dW2, as the
// first backward after an optimizer step: fp32 gradients overwritten, not read), TFLOP/s
// counting 6*T*K*d*h forward and 12*T*K*d*h backward, the bytes the forward keeps for the
// backward (x, H and the index arrays), and the MoEBlaze dispatch against the CUB radix-sort
// baseline (checked equal bit for bit; timed as 20 back-to-back calls per sample so that
// device time, not host launch latency, is compared). Times are medians of CUDA-event
// intervals after warm-up. Inputs come from a GPU-side generator; routing is top-K of
// softmax(random logits), like the PyTorch reference. With --json FILE each preset is also appended
// as one JSON line, which scripts/bench joins with the PyTorch numbers.
//
//   moe_bench --preset olmoe sonic-7b      moe_bench --all [--reps 10] [--json out.jsonl]
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
#include "engine/cuda/device.h"
#include "engine/cuda/expert_pipeline.h"
#include "engine/cuda/grouped_gemm.h"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/router.h"

namespace moe::bench {
namespace {

using cuda::DeviceBuffer;

struct Preset {
  const char* name;
  int64_t T, d, h, E, K;
};

constexpr Preset kPresets[] = {
    {"sonic-7b", 24576, 1536, 256, 128, 8},    {"olmoe", 16384, 2048, 1024, 64, 8},
    {"qwen3-a3b", 16384, 2048, 768, 128, 8},   {"mixtral", 8192, 4096, 14336, 8, 2},
    {"deepseek-v3", 8192, 7168, 2048, 256, 8}, {"scale-8k", 8192, 2048, 1024, 64, 4},
    {"scale-32k", 32768, 2048, 1024, 64, 4},   {"scale-128k", 131072, 2048, 1024, 64, 4},
    {"scale-512k", 524288, 2048, 1024, 64, 4}, {"scale-2m", 2097152, 2048, 1024, 64, 4},
};

struct Result {
  double fwd_ms = 0, bwd_ms = 0, saved_bytes = 0, dispatch_ms = 0, cub_ms = 0;
  bool dispatch_equal = false;
  int grouped_fallbacks = 0;
  int64_t chunks = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

#define CHECK_OK(expr)                                 \
  do {                                                 \
    if (absl::Status s_ = (expr); !s_.ok()) return s_; \
  } while (0)

// Times `fn` (which enqueues on `s`, possibly synchronising inside) with CUDA events.
template <typename Fn>
absl::StatusOr<double> TimeMs(cudaStream_t s, int warmup, int reps, Fn fn) {
  cudaEvent_t a, b;
  MOE_CUDA_RETURN(cudaEventCreate(&a));
  MOE_CUDA_RETURN(cudaEventCreate(&b));
  std::vector<double> times;
  for (int i = 0; i < warmup + reps; ++i) {
    MOE_CUDA_RETURN(cudaEventRecord(a, s));
    CHECK_OK(fn());
    MOE_CUDA_RETURN(cudaEventRecord(b, s));
    MOE_CUDA_RETURN(cudaEventSynchronize(b));
    float ms = 0;
    MOE_CUDA_RETURN(cudaEventElapsedTime(&ms, a, b));
    if (i >= warmup) times.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return Median(times);
}

absl::StatusOr<Result> Run(const Preset& p, int warmup, int reps, cuda::GemmMode mode) {
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
  cuda::ExpertPipeline pipe(shape, stream, gemm->get());
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
  MOE_CUDA_RETURN(cudaStreamSynchronize(s));

  Result r;
  const cuda::ExpertWeights w{w13->get(), w2->get()};
  const int64_t g = 2 * h;
  // Forward as the layer runs it in training: dispatch (one sync), H kept, combine.
  absl::StatusOr<double> fwd = TimeMs(s, warmup, reps, [&]() -> absl::Status {
    cuda::DispatchPlan plan;
    CHECK_OK(pipe.Dispatch(ids->as<int32_t>(), T, &plan));
    absl::StatusOr<DeviceBuffer> hb = alloc(plan.total_routed * g * 2, "H");
    if (!hb.ok()) return hb.status();
    return pipe.Forward(plan, x->get(), pw->as<float>(), w, hb->get(), out->get());
  });
  if (!fwd.ok()) return fwd.status();
  r.fwd_ms = *fwd;

  cuda::DispatchPlan plan;
  CHECK_OK(pipe.Dispatch(ids->as<int32_t>(), T, &plan));
  r.chunks = static_cast<int64_t>(plan.chunks.size());
  absl::StatusOr<DeviceBuffer> hb = alloc(plan.total_routed * g * 2, "H");
  if (!hb.ok()) return hb.status();
  CHECK_OK(pipe.Forward(plan, x->get(), pw->as<float>(), w, hb->get(), out->get()));
  r.saved_bytes = static_cast<double>(x->bytes() + hb->bytes() + ids->bytes() + pw->bytes() +
                                      plan.device_bytes());
  const cuda::ExpertGrads grads{dw13->as<float>(), dw2->as<float>()};
  absl::StatusOr<double> bwd = TimeMs(s, warmup, reps, [&]() -> absl::Status {
    // As in a training step with one micro-batch: the gradients start at zero after Step.
    return pipe.Backward(plan, x->get(), hb->get(), pw->as<float>(), dout->get(), w, grads,
                         out->get(), kernels::ElemType::kBFloat16, dp->as<float>(),
                         /*grads_are_zero=*/true);
  });
  if (!bwd.ok()) return bwd.status();
  r.bwd_ms = *bwd;
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
      std::fprintf(stderr,
                   "usage: moe_bench (--all | --preset NAME...) [--reps N] [--warmup N] "
                   "[--json FILE] [--gemm auto|grouped|looped|streams]\n");
      return 2;
    }
  }
  if (todo.empty()) {
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
  std::printf("# moe_bench on %s, bf16 SwiGLU, expert GEMMs %s, medians of %d after %d warm-up\n",
              prop.name, mode_name.c_str(), reps, warmup);
  std::printf("%-12s %8s %8s %8s %9s %9s %9s %10s %9s %9s %6s\n", "preset", "fwd_ms", "bwd_ms",
              "total", "fwd_TF/s", "bwd_TF/s", "tot_TF/s", "saved_MiB", "disp_ms", "cub_ms",
              "equal");
  int failures = 0;
  for (const Preset* p : todo) {
    absl::StatusOr<Result> r = Run(*p, warmup, reps, mode);
    cudaDeviceSynchronize();
    // A pool sized for the previous preset would crowd the next one's.
    cudaMemPool_t pool;
    cudaDeviceGetDefaultMemPool(&pool, 0);
    cudaMemPoolTrimTo(pool, 0);
    std::string line;
    if (!r.ok()) {
      ++failures;
      std::printf("%-12s error: %s\n", p->name, std::string(r.status().message()).c_str());
      line =
          absl::StrCat("{\"preset\": \"", p->name, "\", \"impl\": \"moe-offload\", \"error\": \"",
                       std::string(r.status().message()), "\"}");
    } else {
      const double flop = 6.0 * p->T * p->K * p->d * p->h;
      const double fwd_tf = flop / r->fwd_ms / 1e9, bwd_tf = 2 * flop / r->bwd_ms / 1e9;
      const double tot = r->fwd_ms + r->bwd_ms, tot_tf = 3 * flop / tot / 1e9;
      std::printf("%-12s %8.3f %8.3f %8.3f %9.1f %9.1f %9.1f %10.1f %9.4f %9.4f %6s\n", p->name,
                  r->fwd_ms, r->bwd_ms, tot, fwd_tf, bwd_tf, tot_tf, r->saved_bytes / 1048576.0,
                  r->dispatch_ms, r->cub_ms, r->dispatch_equal ? "yes" : "NO");
      if (!r->dispatch_equal) ++failures;
      line = absl::StrCat(
          "{\"preset\": \"", p->name, "\", \"impl\": \"moe-offload\", \"T\": ", p->T,
          ", \"d\": ", p->d, ", \"h\": ", p->h, ", \"E\": ", p->E, ", \"K\": ", p->K,
          ", \"fwd_ms\": ", r->fwd_ms, ", \"bwd_ms\": ", r->bwd_ms, ", \"fwdbwd_ms\": ", tot,
          ", \"fwd_tflops\": ", fwd_tf, ", \"bwd_tflops\": ", bwd_tf,
          ", \"fwdbwd_tflops\": ", tot_tf, ", \"saved_MiB\": ", r->saved_bytes / 1048576.0,
          ", \"dispatch_ms\": ", r->dispatch_ms, ", \"cub_sort_ms\": ", r->cub_ms,
          ", \"dispatch_equal\": ", r->dispatch_equal ? "true" : "false",
          ", \"chunks\": ", r->chunks, ", \"gemm\": \"", mode_name,
          "\", \"grouped_fallbacks\": ", r->grouped_fallbacks, "}");
    }
    std::fflush(stdout);
    if (!json.empty()) {
      if (FILE* f = std::fopen(json.c_str(), "a")) {
        std::fprintf(f, "%s\n", line.c_str());
        std::fclose(f);
      }
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) { return moe::bench::Main(argc, argv); }
