// Grouped GEMMs over experts through cuBLAS: one cublasGemmGroupedBatchedEx call runs every
// expert's GEMM of one kind (one group per expert, since each expert has its own row count).
//
// All matrices are row-major in the engine; cuBLAS is column-major, so each call below is
// written for the transposed problem (a row-major [m, n] C is a column-major [n, m] one).
// Where the library refuses a type combination for grouped calls (CUBLAS_STATUS_NOT_SUPPORTED),
// the runner falls back, once and for good, to one cublasGemmEx per expert and says so through
// grouped_supported(); the benchmark prints which path ran.
#ifndef MOE_ENGINE_CUDA_GROUPED_GEMM_H_
#define MOE_ENGINE_CUDA_GROUPED_GEMM_H_

#include <cublas_v2.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/device.h"
#include "kernels/cuda/types.h"

namespace moe::cuda {

// One column-major GEMM: C[m, n] = op(A) op(B) + beta C.
struct GemmProblem {
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int lda = 0;
  const void* b = nullptr;
  int ldb = 0;
  void* c = nullptr;
  int ldc = 0;
};

struct GemmKind {
  cublasOperation_t trans_a = CUBLAS_OP_N;
  cublasOperation_t trans_b = CUBLAS_OP_N;
  kernels::ElemType ab_type = kernels::ElemType::kBFloat16;
  kernels::ElemType c_type = kernels::ElemType::kBFloat16;
  float beta = 0.f;  // 1: accumulate into C (weight gradients)
};

class GemmRunner {
 public:
  static absl::StatusOr<std::unique_ptr<GemmRunner>> Create(std::shared_ptr<Stream> stream);
  ~GemmRunner();

  // Runs every problem with m, n > 0 (k = 0 with beta = 1 leaves C as it is; with beta = 0
  // the caller must not pass it). Pointer arrays travel in one host-to-device copy.
  absl::Status Run(const GemmKind& kind, const std::vector<GemmProblem>& problems);

  bool grouped_supported() const { return grouped_ok_; }

 private:
  GemmRunner(std::shared_ptr<Stream> s, cublasHandle_t h) : stream_(std::move(s)), handle_(h) {}
  absl::Status RunGrouped(const GemmKind& kind, const std::vector<GemmProblem>& p,
                          bool* unsupported);
  absl::Status RunLooped(const GemmKind& kind, const std::vector<GemmProblem>& p);

  std::shared_ptr<Stream> stream_;
  cublasHandle_t handle_;
  bool grouped_ok_ = true;
};

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_GROUPED_GEMM_H_
