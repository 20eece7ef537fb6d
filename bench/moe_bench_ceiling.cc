// moe_bench's yardsticks: cuBLAS's dense bf16 GEMM rate and the device copy bandwidth (measured
// in the same process as every preset), the fewest bytes a training step moves, and --ceiling,
// the six expert GEMMs of a step as cuBLAS strided-batched GEMMs over balanced experts.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_kernels.h"
#include "bench/moe_bench.h"
#include "engine/cuda/device.h"

namespace moe::bench {

using cuda::DeviceBuffer;

// The dense bf16 GEMM rate of cuBLAS on this GPU (TFLOP/s): M = N = K = 8192, fp32
// accumulation, random inputs, median of 20. The ceiling the "% of cuBLAS" columns compare to.
absl::StatusOr<double> CublasDenseTflops(GpuWatch* watch) {
  constexpr int64_t n = 8192;
  absl::StatusOr<std::shared_ptr<cuda::Stream>> st = cuda::Stream::Create(0);
  if (!st.ok()) return st.status();
  cudaStream_t s = (*st)->get();
  absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(n * n * 2, *st, "A"),
                               b = DeviceBuffer::Allocate(n * n * 2, *st, "B"),
                               c = DeviceBuffer::Allocate(n * n * 2, *st, "C");
  for (auto* buf : {&a, &b, &c}) {
    if (!buf->ok()) return buf->status();
  }
  MOE_CUDA_RETURN(FillNormalBf16(a->get(), n * n, 1.f, 11, s));
  MOE_CUDA_RETURN(FillNormalBf16(b->get(), n * n, 1.f, 12, s));
  cublasHandle_t handle;
  MOE_CUBLAS_RETURN(cublasCreate(&handle));
  cublasSetStream(handle, s);
  const float one = 1.f, zero = 0.f;
  absl::StatusOr<double> ms = TimeMs(
      s, 3, 20,
      [&]() -> absl::Status {
        MOE_CUBLAS_RETURN(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a->get(),
                                       CUDA_R_16BF, n, b->get(), CUDA_R_16BF, n, &zero, c->get(),
                                       CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        return absl::OkStatus();
      },
      watch);
  cublasDestroy(handle);
  if (!ms.ok()) return ms.status();
  return 2.0 * n * n * n / *ms / 1e9;
}

// Device copy bandwidth in GB/s (bytes read + bytes written per second): a 1 GiB
// device-to-device cudaMemcpyAsync, median of 20. The byte floors divide by it.
absl::StatusOr<double> CopyBandwidthGBs() {
  constexpr int64_t bytes = int64_t{1} << 30;
  absl::StatusOr<std::shared_ptr<cuda::Stream>> st = cuda::Stream::Create(0);
  if (!st.ok()) return st.status();
  cudaStream_t s = (*st)->get();
  absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(bytes, *st, "copy source"),
                               b = DeviceBuffer::Allocate(bytes, *st, "copy target");
  if (!a.ok()) return a.status();
  if (!b.ok()) return b.status();
  MOE_CUDA_RETURN(cudaMemsetAsync(a->get(), 1, bytes, s));
  absl::StatusOr<double> ms = TimeMs(s, 3, 20, [&]() -> absl::Status {
    MOE_CUDA_RETURN(cudaMemcpyAsync(b->get(), a->get(), bytes, cudaMemcpyDeviceToDevice, s));
    return absl::OkStatus();
  });
  if (!ms.ok()) return ms.status();
  return 2.0 * bytes / *ms / 1e6;
}

// The fewest bytes a training step of the layer moves through device memory in this design
// (H kept): forward reads x and the three weights and writes out and H; backward reads dout,
// x, H and the weights, writes dx, dp and the three fp32 weight gradients. Gathered copies,
// A, dH and other temporaries are the implementation's and not counted.
double FloorBytes(const Preset& p) {
  const double td = 2.0 * p.T * p.d, w = 2.0 * 3 * p.E * p.h * p.d, h = 2.0 * p.T * p.K * 2 * p.h;
  return (td + w + td + h) + (td + td + h + w + td + 4.0 * p.T * p.K + 2 * w);
}

namespace {

// --ceiling: the six expert GEMMs of a training step (up, down; dA, dXg, dW2, dW13) as cuBLAS
// strided-batched GEMMs over perfectly balanced experts (T*K/E rows each: no gather, no ragged
// tile, no launch per expert), bf16 operands, fp32 accumulation, bf16 activations and fp32
// weight gradients as the engine writes them, plus the forward's and dx's combines at the
// device copy bandwidth (each reads T*K rows of d and writes T). That is what a design made of
// cuBLAS-grade GEMMs with everything else fused away would take, the yardstick the performance
// targets are read against (docs/PERFORMANCE.md).
constexpr int kCeilingGemms = 6;
constexpr const char* kCeilingGemmNames[kCeilingGemms] = {"up", "down", "dA", "dXg", "dW2", "dW13"};

struct CeilingResult {
  double ms[kCeilingGemms] = {};
  double combine_floor_ms = 0;
  int64_t rows_per_expert = 0;
  int64_t experts_per_launch = 0;  // fewer than E where the activations would not fit at once
};

// Row-major C[M, N] = A[M, K] . B[K, N] over `batch` experts, through cuBLAS's column-major
// API (C^T = B^T A^T). A is stored [M, K] (a_k_major) or [K, M]; B [N, K] (b_k_major, the
// weights' layout) or [K, N]; strides in elements.
absl::Status RowMajorBatchedGemm(cublasHandle_t handle, bool a_k_major, bool b_k_major, int64_t M,
                                 int64_t N, int64_t K, const void* a, int64_t stride_a,
                                 const void* b, int64_t stride_b, void* c, cudaDataType c_type,
                                 int64_t stride_c, int64_t batch) {
  const float one = 1.f, zero = 0.f;
  MOE_CUBLAS_RETURN(cublasGemmStridedBatchedEx(
      handle, b_k_major ? CUBLAS_OP_T : CUBLAS_OP_N, a_k_major ? CUBLAS_OP_N : CUBLAS_OP_T,
      static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &one, b, CUDA_R_16BF,
      static_cast<int>(b_k_major ? K : N), stride_b, a, CUDA_R_16BF,
      static_cast<int>(a_k_major ? K : M), stride_a, &zero, c, c_type, static_cast<int>(N),
      stride_c, static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::StatusOr<CeilingResult> CublasCeiling(const Preset& p, int warmup, int reps, double copy_gbs,
                                            GpuWatch* watch) {
  if ((p.T * p.K) % p.E != 0) {
    return absl::InvalidArgumentError(absl::StrCat(p.name, ": T*K is not a multiple of E"));
  }
  const int64_t m = p.T * p.K / p.E, d = p.d, h = p.h, E = p.E;
  // Per expert: x, dout and dXg/y (m x d each), H/dH (m x 2h), A and dA (m x h each).
  const int64_t act_bytes_per_expert = m * (3 * d + 4 * h) * 2;
  constexpr int64_t kActivationBudget = int64_t{24} << 30;
  int64_t group = E;
  while (group > 1 && (group * act_bytes_per_expert > kActivationBudget || E % group != 0)) --group;
  absl::StatusOr<std::shared_ptr<cuda::Stream>> st = cuda::Stream::Create(0);
  if (!st.ok()) return st.status();
  cudaStream_t s = (*st)->get();
  auto alloc = [&](int64_t bytes, const char* what) {
    return DeviceBuffer::Allocate(static_cast<size_t>(bytes), *st, what);
  };
  const int64_t rows = group * m;
  absl::StatusOr<DeviceBuffer> x = alloc(rows * d * 2, "x"), dout = alloc(rows * d * 2, "dout"),
                               y = alloc(rows * d * 2, "y/dXg"), hb = alloc(rows * 2 * h * 2, "H"),
                               act = alloc(rows * h * 2, "A"), da = alloc(rows * h * 2, "dA"),
                               w13 = alloc(E * 2 * h * d * 2, "w13"),
                               w2 = alloc(E * d * h * 2, "w2"),
                               dw13 = alloc(E * 2 * h * d * 4, "dw13"),
                               dw2 = alloc(E * d * h * 4, "dw2");
  for (auto* buf : {&x, &dout, &y, &hb, &act, &da, &w13, &w2, &dw13, &dw2}) {
    if (!buf->ok()) return buf->status();
  }
  MOE_CUDA_RETURN(FillNormalBf16(x->get(), rows * d, 1.f, 21, s));
  MOE_CUDA_RETURN(FillNormalBf16(dout->get(), rows * d, 1.f, 22, s));
  MOE_CUDA_RETURN(FillNormalBf16(hb->get(), rows * 2 * h, 1.f, 23, s));
  MOE_CUDA_RETURN(FillNormalBf16(act->get(), rows * h, 1.f, 24, s));
  MOE_CUDA_RETURN(FillNormalBf16(w13->get(), E * 2 * h * d, 1.f / std::sqrt(float(d)), 25, s));
  MOE_CUDA_RETURN(FillNormalBf16(w2->get(), E * d * h, 1.f / std::sqrt(float(h)), 26, s));
  cublasHandle_t handle;
  MOE_CUBLAS_RETURN(cublasCreate(&handle));
  std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, cublasStatus_t (*)(cublasHandle_t)>
      handle_owner(handle, cublasDestroy);
  MOE_CUBLAS_RETURN(cublasSetStream(handle, s));
  auto bf16_at = [](const DeviceBuffer& buf, int64_t elements) {
    return static_cast<char*>(buf.get()) + elements * 2;
  };
  // One GEMM of the step over all E experts, `group` at a time. A and B strides are per expert.
  auto step_gemm = [&](int which, int64_t g) -> absl::Status {
    const int64_t e0 = g * group;  // first expert of this launch
    const int64_t w13_off = e0 * 2 * h * d, w2_off = e0 * d * h;
    switch (which) {
      case 0:  // up: H[m, 2h] = x[m, d] . W13^T, W13 stored [2h, d]
        return RowMajorBatchedGemm(handle, true, true, m, 2 * h, d, x->get(), m * d,
                                   bf16_at(*w13, w13_off), 2 * h * d, hb->get(), CUDA_R_16BF,
                                   m * 2 * h, group);
      case 1:  // down: y[m, d] = A[m, h] . W2^T, W2 stored [d, h]
        return RowMajorBatchedGemm(handle, true, true, m, d, h, act->get(), m * h,
                                   bf16_at(*w2, w2_off), d * h, y->get(), CUDA_R_16BF, m * d,
                                   group);
      case 2:  // dA[m, h] = dout[m, d] . W2
        return RowMajorBatchedGemm(handle, true, false, m, h, d, dout->get(), m * d,
                                   bf16_at(*w2, w2_off), d * h, da->get(), CUDA_R_16BF, m * h,
                                   group);
      case 3:  // dXg[m, d] = dH[m, 2h] . W13
        return RowMajorBatchedGemm(handle, true, false, m, d, 2 * h, hb->get(), m * 2 * h,
                                   bf16_at(*w13, w13_off), 2 * h * d, y->get(), CUDA_R_16BF, m * d,
                                   group);
      case 4:  // dW2[d, h] = dout^T . A, fp32
        return RowMajorBatchedGemm(handle, false, false, d, h, m, dout->get(), m * d, act->get(),
                                   m * h, dw2->as<float>() + w2_off, CUDA_R_32F, d * h, group);
      default:  // dW13[2h, d] = dH^T . x, fp32
        return RowMajorBatchedGemm(handle, false, false, 2 * h, d, m, hb->get(), m * 2 * h,
                                   x->get(), m * d, dw13->as<float>() + w13_off, CUDA_R_32F,
                                   2 * h * d, group);
    }
  };
  CeilingResult r;
  r.rows_per_expert = m;
  r.experts_per_launch = group;
  for (int which = 0; which < kCeilingGemms; ++which) {
    absl::StatusOr<double> ms = TimeMs(
        s, warmup, reps,
        [&]() -> absl::Status {
          for (int64_t g = 0; g < E / group; ++g) CHECK_OK(step_gemm(which, g));
          return absl::OkStatus();
        },
        watch);
    if (!ms.ok()) return ms.status();
    r.ms[which] = *ms;
  }
  r.combine_floor_ms = 2 * 2.0 * (p.T * p.K * d + p.T * d) / copy_gbs / 1e6;
  return r;
}

}  // namespace

// --ceiling's table and JSON lines (impl "cublas-ceiling"); returns the exit code.
int PrintCeiling(const std::vector<const Preset*>& todo, int warmup, int reps, double peak,
                 double copy_gbs, const std::string& json, GpuWatch* watch) {
  std::printf(
      "# cuBLAS ceiling: the six expert GEMMs as cuBLAS strided-batched GEMMs over balanced "
      "experts (T*K/E rows each), bf16 in, fp32 accumulation, fp32 weight gradients; medians of "
      "%d after %d warm-up, ms\n# cuBLAS dense bf16 GEMM (8192^3): %.1f TFLOP/s; device copy: "
      "%.0f GB/s; comb_fl = both combines at the copy bandwidth; ceiling = GEMMs + comb_fl\n",
      reps, warmup, peak, copy_gbs);
  std::printf("%-12s %7s %5s", "preset", "rows/E", "E/ln");
  for (const char* name : kCeilingGemmNames) std::printf(" %8s", name);
  std::printf(" %9s %8s %8s %9s %8s\n", "gemms", "gemmTF/s", "comb_fl", "ceiling", "%cuBLAS");
  int failures = 0;
  for (const Preset* p : todo) {
    absl::StatusOr<CeilingResult> r = CublasCeiling(*p, warmup, reps, copy_gbs, watch);
    ReleasePoolMemory();
    std::string line;
    if (!r.ok()) {
      ++failures;
      std::printf("%-12s error: %s\n", p->name, std::string(r.status().message()).c_str());
      line = absl::StrCat("{\"preset\": \"", p->name,
                          "\", \"impl\": \"cublas-ceiling\", \"error\": \"",
                          std::string(r.status().message()), "\"}");
    } else {
      const double flop = 18.0 * p->T * p->K * p->d * p->h;
      double gemms = 0;
      for (double ms : r->ms) gemms += ms;
      const double ceiling_ms = gemms + r->combine_floor_ms;
      std::printf("%-12s %7lld %5lld", p->name, static_cast<long long>(r->rows_per_expert),
                  static_cast<long long>(r->experts_per_launch));
      for (double ms : r->ms) std::printf(" %8.3f", ms);
      std::printf(" %9.3f %8.1f %8.3f %9.3f %7.1f%%\n", gemms, flop / gemms / 1e9,
                  r->combine_floor_ms, ceiling_ms, 100.0 * flop / ceiling_ms / 1e9 / peak);
      line = absl::StrCat("{\"preset\": \"", p->name,
                          "\", \"impl\": \"cublas-ceiling\", \"T\": ", p->T, ", \"d\": ", p->d,
                          ", \"h\": ", p->h, ", \"E\": ", p->E, ", \"K\": ", p->K,
                          ", \"rows_per_expert\": ", r->rows_per_expert,
                          ", \"experts_per_launch\": ", r->experts_per_launch);
      for (int i = 0; i < kCeilingGemms; ++i)
        absl::StrAppend(&line, ", \"", kCeilingGemmNames[i], "_ms\": ", r->ms[i]);
      absl::StrAppend(&line, ", \"gemms_ms\": ", gemms,
                      ", \"combine_floor_ms\": ", r->combine_floor_ms,
                      ", \"ceiling_ms\": ", ceiling_ms, ", \"cublas_dense_tflops\": ", peak,
                      ", \"copy_gbs\": ", copy_gbs, "}");
    }
    std::fflush(stdout);
    AppendJsonLine(json, line);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace moe::bench
