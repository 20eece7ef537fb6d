// moe_bench --max-t: the largest T of the scale-* shape (d 2048, h 1024, E 64, K 4) whose
// training forward and backward fit on the GPU, in the memory mode chosen (keep H, or
// --recompute). See moe_bench.cc's file comment for the search.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "bench/bench_kernels.h"
#include "bench/moe_bench.h"
#include "engine/cuda/device.h"
#include "engine/cuda/expert_pipeline.h"
#include "engine/cuda/grouped_gemm.h"
#include "kernels/cuda/router.h"

namespace moe::bench {
namespace {

using cuda::DeviceBuffer;

// One forward+backward of the scale-* shape at `T` tokens, for --max-t. Allocates what a
// training step on one GPU holds (see the file comment), runs forward+backward once as a
// warm-up (an allocation failure there means T does not fit), then times one more of each.
struct FitResult {
  bool fits = false;
  std::string error;
  double fwd_ms = 0, bwd_ms = 0, saved_bytes = 0, used_bytes = 0;
};

absl::StatusOr<FitResult> TryTokens(int64_t T, bool recompute) {
  constexpr int64_t d = 2048, h = 1024, E = 64, K = 4, g = 2 * h;
  FitResult r;
  absl::StatusOr<std::shared_ptr<cuda::Stream>> st = cuda::Stream::Create(0);
  if (!st.ok()) return st.status();
  std::shared_ptr<cuda::Stream> stream = *st;
  cudaStream_t s = stream->get();
  absl::StatusOr<std::unique_ptr<cuda::GemmRunner>> gemm = cuda::GemmRunner::Create(stream);
  if (!gemm.ok()) return gemm.status();
  cuda::ExpertShape shape;
  shape.d_model = d;
  shape.d_hidden = h;
  shape.top_k = K;
  shape.expert_count = E;
  shape.type = kernels::ElemType::kBFloat16;
  auto alloc = [&](int64_t bytes, const char* what) {
    return DeviceBuffer::Allocate(static_cast<size_t>(bytes), stream, what);
  };
  // Everything below that fails for memory makes this T "does not fit"; anything else is an
  // error of the benchmark.
  auto oom = [&](const absl::Status& status) -> absl::StatusOr<FitResult> {
    if (status.code() != absl::StatusCode::kResourceExhausted) return status;
    r.error = std::string(status.message());
    return r;
  };
  absl::StatusOr<DeviceBuffer> x = alloc(T * d * 2, "x"), dout = alloc(T * d * 2, "dout"),
                               out = alloc(T * d * 2, "out/dx"), w13 = alloc(E * g * d * 2, "w13"),
                               w2 = alloc(E * d * h * 2, "w2"), dw13 = alloc(E * g * d * 4, "dw13"),
                               dw2 = alloc(E * d * h * 4, "dw2"), ids = alloc(T * K * 4, "ids"),
                               pw = alloc(T * K * 4, "p"), dp = alloc(T * K * 4, "dp");
  for (auto* b : {&x, &dout, &out, &w13, &w2, &dw13, &dw2, &ids, &pw, &dp}) {
    if (!b->ok()) return oom(b->status());
  }
  MOE_CUDA_RETURN(FillNormalBf16(x->get(), T * d, 1.f, 1, s));
  MOE_CUDA_RETURN(FillNormalBf16(dout->get(), T * d, 1.f, 2, s));
  MOE_CUDA_RETURN(FillNormalBf16(w13->get(), E * g * d, 1.f / std::sqrt(float(d)), 3, s));
  MOE_CUDA_RETURN(FillNormalBf16(w2->get(), E * d * h, 1.f / std::sqrt(float(h)), 4, s));
  {
    // Routing in slices of 1 Mi tokens so the logits never dominate memory.
    constexpr int64_t kSlice = int64_t{1} << 20;
    absl::StatusOr<DeviceBuffer> logits = alloc(kSlice * E * 4, "logits"),
                                 lse = alloc(kSlice * 4, "lse");
    if (!logits.ok()) return oom(logits.status());
    if (!lse.ok()) return oom(lse.status());
    for (int64_t t0 = 0; t0 < T; t0 += kSlice) {
      const int64_t n = std::min(kSlice, T - t0);
      MOE_CUDA_RETURN(FillNormalF32(logits->as<float>(), n * E, 1.f, 5 + t0, s));
      MOE_CUDA_RETURN(kernels::LaunchRouterTopK(
          logits->as<float>(), n, static_cast<int32_t>(E), static_cast<int32_t>(K), true,
          ids->as<int32_t>() + t0 * K, pw->as<float>() + t0 * K, lse->as<float>(), s));
    }
  }
  MOE_CUDA_RETURN(cudaStreamSynchronize(s));
  cuda::ExpertPipeline pipe(shape, stream, gemm->get());
  const cuda::ExpertWeights w{w13->get(), w2->get()};
  const cuda::ExpertGrads grads{dw13->as<float>(), dw2->as<float>()};
  cudaEvent_t e0, e1, e2;
  MOE_CUDA_RETURN(cudaEventCreate(&e0));
  MOE_CUDA_RETURN(cudaEventCreate(&e1));
  MOE_CUDA_RETURN(cudaEventCreate(&e2));
  for (int rep = 0; rep < 2; ++rep) {
    MOE_CUDA_RETURN(cudaEventRecord(e0, s));
    cuda::DispatchPlan plan;
    if (absl::Status st2 = pipe.Dispatch(ids->as<int32_t>(), T, &plan); !st2.ok()) return oom(st2);
    absl::StatusOr<DeviceBuffer> hb = recompute ? absl::StatusOr<DeviceBuffer>(DeviceBuffer())
                                                : alloc(plan.total_routed * g * 2, "saved H");
    if (!hb.ok()) return oom(hb.status());
    if (absl::Status st2 = pipe.Forward(plan, x->get(), pw->as<float>(), w, hb->get(), out->get());
        !st2.ok()) {
      return oom(st2);
    }
    MOE_CUDA_RETURN(cudaEventRecord(e1, s));
    if (absl::Status st2 = pipe.Backward(plan, x->get(), hb->get(), pw->as<float>(), dout->get(), w,
                                         grads, out->get(), kernels::ElemType::kBFloat16,
                                         dp->as<float>(), /*grads_are_zero=*/true);
        !st2.ok()) {
      return oom(st2);
    }
    MOE_CUDA_RETURN(cudaEventRecord(e2, s));
    MOE_CUDA_RETURN(cudaEventSynchronize(e2));
    float f = 0, b = 0;
    MOE_CUDA_RETURN(cudaEventElapsedTime(&f, e0, e1));
    MOE_CUDA_RETURN(cudaEventElapsedTime(&b, e1, e2));
    r.fwd_ms = f;
    r.bwd_ms = b;
    r.saved_bytes = static_cast<double>(x->bytes() + hb->bytes() + ids->bytes() + pw->bytes() +
                                        plan.device_bytes());
    size_t free_b = 0, total_b = 0;
    MOE_CUDA_RETURN(cudaMemGetInfo(&free_b, &total_b));
    // The pool keeps what it grew to (release threshold: never), so this is the high-water
    // mark of the run plus the CUDA context and libraries.
    r.used_bytes = static_cast<double>(total_b - free_b);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaEventDestroy(e2);
  r.fits = true;
  return r;
}

}  // namespace

int MaxTokens(bool recompute, double budget_s) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  std::printf(
      "# max-T search, scale shape d=2048 h=1024 E=64 K=4 bf16 SwiGLU, %s, GPU memory "
      "%.1f GiB, budget %.0f s\n",
      recompute ? "recompute H" : "keep H", total_b / 1073741824.0, budget_s);
  std::printf("%-10s %-5s %9s %9s %9s %10s %9s\n", "T", "fits", "fwd_ms", "bwd_ms", "tot_ms",
              "saved_GiB", "used_GiB");
  constexpr int64_t kMi = int64_t{1} << 20, kStep = kMi / 8;
  int64_t lo = 0, hi = 0;  // largest T that fitted; smallest that did not (0: none yet)
  FitResult best;
  int errors = 0;
  auto attempt = [&](int64_t T) {
    absl::StatusOr<FitResult> r = TryTokens(T, recompute);
    ReleasePoolMemory();
    if (!r.ok()) {
      // Not an allocation failure (cuBLAS may report its own out-of-memory as an internal
      // error): counted as a failure of the run, and T as not fitting, so the search goes on.
      ++errors;
      std::printf("%-10lld error: %s\n", static_cast<long long>(T),
                  std::string(r.status().message()).c_str());
      std::fflush(stdout);
      hi = T;
      return;
    }
    if (r->fits) {
      std::printf("%-10lld %-5s %9.1f %9.1f %9.1f %10.2f %9.2f\n", static_cast<long long>(T), "yes",
                  r->fwd_ms, r->bwd_ms, r->fwd_ms + r->bwd_ms, r->saved_bytes / 1073741824.0,
                  r->used_bytes / 1073741824.0);
      lo = T;
      best = *r;
    } else {
      std::printf("%-10lld %-5s (%s)\n", static_cast<long long>(T), "OOM", r->error.c_str());
      hi = T;
    }
    std::fflush(stdout);
  };
  for (int64_t T = 2 * kMi; hi == 0 && elapsed() < budget_s; T += kMi) {
    attempt(T);
  }
  while (hi != 0 && hi - lo > kStep && elapsed() < budget_s) {
    const int64_t mid = (lo + (hi - lo) / 2) / kStep * kStep;
    if (mid <= lo) break;
    attempt(mid);
  }
  if (lo == 0) {
    std::printf("# largest T: none of the tried T fitted\n");
    return errors + 1;
  }
  std::printf(
      "# largest T that fits (%s): %lld tokens (%.2f Mi)%s; fwd+bwd %.1f ms, saved "
      "%.2f GiB, device memory in use %.2f GiB; first T that did not fit: %s\n",
      recompute ? "recompute H" : "keep H", static_cast<long long>(lo),
      lo / static_cast<double>(kMi),
      hi != 0 && hi - lo <= kStep ? "" : " (search stopped by the time budget)",
      best.fwd_ms + best.bwd_ms, best.saved_bytes / 1073741824.0, best.used_bytes / 1073741824.0,
      hi == 0 ? "none tried" : std::to_string(hi).c_str());
  return errors;
}

}  // namespace moe::bench
