// cuBLAS grouped GEMM runner (see grouped_gemm.h).
#include "engine/cuda/grouped_gemm.h"

#include <utility>

namespace moe::cuda {
namespace {

cudaDataType_t CudaType(kernels::ElemType t) {
  return t == kernels::ElemType::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GemmRunner>> GemmRunner::Create(std::shared_ptr<Stream> stream) {
  MOE_CUDA_RETURN(cudaSetDevice(stream->device()));
  cublasHandle_t h = nullptr;
  MOE_CUBLAS_RETURN(cublasCreate(&h));
  if (cublasStatus_t s = cublasSetStream(h, stream->get()); s != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(h);
    return CublasStatus(s, "cublasSetStream", __FILE__, __LINE__);
  }
  // Default math: fp32 GEMMs with CUBLAS_COMPUTE_32F stay true fp32 (no TF32), matching the
  // CPU engine; bf16 GEMMs use the tensor cores with fp32 accumulation.
  cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
  return std::unique_ptr<GemmRunner>(new GemmRunner(std::move(stream), h));
}

GemmRunner::~GemmRunner() { cublasDestroy(handle_); }

absl::Status GemmRunner::Run(const GemmKind& kind, const std::vector<GemmProblem>& problems) {
  std::vector<GemmProblem> live;
  live.reserve(problems.size());
  for (const GemmProblem& p : problems) {
    if (p.m > 0 && p.n > 0 && (p.k > 0 || kind.beta != 0.f)) live.push_back(p);
  }
  if (live.empty()) return absl::OkStatus();
  if (grouped_ok_ && live.size() > 1) {
    bool unsupported = false;
    absl::Status s = RunGrouped(kind, live, &unsupported);
    if (!unsupported) return s;
    grouped_ok_ = false;
  }
  return RunLooped(kind, live);
}

absl::Status GemmRunner::RunGrouped(const GemmKind& kind, const std::vector<GemmProblem>& p,
                                    bool* unsupported) {
  const int g = static_cast<int>(p.size());
  std::vector<cublasOperation_t> ta(g, kind.trans_a), tb(g, kind.trans_b);
  std::vector<int> m(g), n(g), k(g), lda(g), ldb(g), ldc(g), size(g, 1);
  std::vector<float> alpha(g, 1.f), beta(g, kind.beta);
  std::vector<const void*> ptrs(3 * static_cast<size_t>(g));
  for (int i = 0; i < g; ++i) {
    m[i] = p[i].m;
    n[i] = p[i].n;
    k[i] = p[i].k;
    lda[i] = p[i].lda;
    ldb[i] = p[i].ldb;
    ldc[i] = p[i].ldc;
    ptrs[i] = p[i].a;
    ptrs[g + i] = p[i].b;
    ptrs[2 * g + i] = p[i].c;
  }
  absl::StatusOr<DeviceBuffer> dptrs =
      DeviceBuffer::Allocate(ptrs.size() * sizeof(void*), stream_, "GEMM pointer arrays");
  if (!dptrs.ok()) return dptrs.status();
  // Pageable host-to-device: staged at once, so `ptrs` may go out of scope after the call.
  MOE_CUDA_RETURN(cudaMemcpyAsync(dptrs->get(), ptrs.data(), ptrs.size() * sizeof(void*),
                                  cudaMemcpyHostToDevice, stream_->get()));
  auto* const* dp = dptrs->as<void*>();
  const cublasStatus_t st = cublasGemmGroupedBatchedEx(
      handle_, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(),
      const_cast<const void* const*>(dp), CudaType(kind.ab_type), lda.data(),
      const_cast<const void* const*>(dp + g), CudaType(kind.ab_type), ldb.data(), beta.data(),
      dp + 2 * g, CudaType(kind.c_type), ldc.data(), g, size.data(), CUBLAS_COMPUTE_32F);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
    *unsupported = true;
    return absl::OkStatus();
  }
  MOE_CUBLAS_RETURN(st);
  return absl::OkStatus();
}

absl::Status GemmRunner::RunLooped(const GemmKind& kind, const std::vector<GemmProblem>& p) {
  const float alpha = 1.f, beta = kind.beta;
  for (const GemmProblem& q : p) {
    MOE_CUBLAS_RETURN(cublasGemmEx(handle_, kind.trans_a, kind.trans_b, q.m, q.n, q.k, &alpha,
                                   q.a, CudaType(kind.ab_type), q.lda, q.b,
                                   CudaType(kind.ab_type), q.ldb, &beta, q.c,
                                   CudaType(kind.c_type), q.ldc, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
  }
  return absl::OkStatus();
}

}  // namespace moe::cuda
