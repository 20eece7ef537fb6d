// cuBLAS grouped GEMM runner (see grouped_gemm.h).
#include "engine/cuda/grouped_gemm.h"

#include <algorithm>
#include <utility>

namespace moe::cuda {
namespace {

cudaDataType_t CudaType(kernels::ElemType t) {
  return t == kernels::ElemType::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GemmRunner>> GemmRunner::Create(std::shared_ptr<Stream> stream) {
  std::unique_ptr<GemmRunner> r(new GemmRunner(std::move(stream)));
  MOE_RETURN_IF_ERROR(r->Init());
  return r;
}

absl::Status GemmRunner::Init() {
  MOE_CUDA_RETURN(cudaSetDevice(stream_->device()));
  MOE_CUBLAS_RETURN(cublasCreate(&handle_));
  MOE_CUBLAS_RETURN(cublasSetStream(handle_, stream_->get()));
  // Default math: fp32 GEMMs with CUBLAS_COMPUTE_32F stay true fp32 (no TF32), matching the
  // CPU engine; bf16 GEMMs use the tensor cores with fp32 accumulation.
  MOE_CUBLAS_RETURN(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
  MOE_ASSIGN_OR_RETURN(fork_, Event::Create(stream_->device()));
  for (int i = 0; i < kSideStreams; ++i) {
    MOE_CUDA_RETURN(cudaStreamCreateWithFlags(&side_[i], cudaStreamNonBlocking));
    MOE_ASSIGN_OR_RETURN(join_[i], Event::Create(stream_->device()));
    MOE_CUBLAS_RETURN(cublasCreate(&side_handle_[i]));
    MOE_CUBLAS_RETURN(cublasSetStream(side_handle_[i], side_[i]));
    MOE_CUBLAS_RETURN(cublasSetMathMode(side_handle_[i], CUBLAS_DEFAULT_MATH));
  }
  return absl::OkStatus();
}

GemmRunner::~GemmRunner() {
  cudaSetDevice(stream_->device());
  cudaStreamSynchronize(stream_->get());
  for (int i = 0; i < kSideStreams; ++i) {
    if (side_handle_[i] != nullptr) cublasDestroy(side_handle_[i]);
    if (side_[i] != nullptr) {
      cudaStreamSynchronize(side_[i]);
      cudaStreamDestroy(side_[i]);
    }
  }
  if (handle_ != nullptr) cublasDestroy(handle_);
}

absl::Status GemmRunner::Run(const GemmKind& kind, const std::vector<GemmProblem>& problems) {
  std::vector<GemmProblem> live;
  live.reserve(problems.size());
  for (const GemmProblem& p : problems) {
    if (p.m > 0 && p.n > 0 && (p.k > 0 || kind.beta != 0.f)) live.push_back(p);
  }
  if (live.empty()) return absl::OkStatus();
  const GemmMode mode = mode_ == GemmMode::kAuto ? GemmMode::kStreams : mode_;
  const int key = (static_cast<int>(kind.trans_a) * 4 + static_cast<int>(kind.trans_b)) * 4 +
                  static_cast<int>(kind.ab_type) * 2 + static_cast<int>(kind.c_type);
  const bool refused =
      std::find(unsupported_.begin(), unsupported_.end(), key) != unsupported_.end();
  if (mode == GemmMode::kGrouped && live.size() > 1 && !refused) {
    bool unsupported = false;
    absl::Status s = RunGrouped(kind, live, &unsupported);
    if (!unsupported) return s;
    unsupported_.push_back(key);
  }
  if (mode == GemmMode::kLooped || live.size() < 2) return RunLooped(kind, live);
  return RunStreams(kind, live);
}

absl::Status GemmRunner::Gemm(cublasHandle_t h, const GemmKind& kind, const GemmProblem& q) {
  const float alpha = 1.f, beta = kind.beta;
  MOE_CUBLAS_RETURN(cublasGemmEx(h, kind.trans_a, kind.trans_b, q.m, q.n, q.k, &alpha, q.a,
                                 CudaType(kind.ab_type), q.lda, q.b, CudaType(kind.ab_type), q.ldb,
                                 &beta, q.c, CudaType(kind.c_type), q.ldc, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::Status GemmRunner::RunStreams(const GemmKind& kind, const std::vector<GemmProblem>& p) {
  // Fork: the side streams start after everything already on the layer's stream.
  cudaStream_t main = stream_->get();
  const int lanes = static_cast<int>(std::min<size_t>(p.size(), kSideStreams + 1));
  for (int i = 0; i + 1 < lanes; ++i) MOE_RETURN_IF_ERROR(StreamWaitFor(side_[i], main, fork_));
  absl::Status status;
  for (size_t j = 0; j < p.size() && status.ok(); ++j) {
    const int lane = static_cast<int>(j % lanes);
    status = Gemm(lane == 0 ? handle_ : side_handle_[lane - 1], kind, p[j]);
  }
  // Join, also after an error, so the layer's stream never runs ahead of the side streams.
  for (int i = 0; i + 1 < lanes; ++i) MOE_RETURN_IF_ERROR(StreamWaitFor(main, side_[i], join_[i]));
  return status;
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
  for (const GemmProblem& q : p) MOE_RETURN_IF_ERROR(Gemm(handle_, kind, q));
  return absl::OkStatus();
}

}  // namespace moe::cuda
