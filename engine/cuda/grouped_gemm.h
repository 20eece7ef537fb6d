// The expert GEMMs through cuBLAS, in one of three ways (GemmMode):
//   kGrouped  one cublasGemmGroupedBatchedEx call per GEMM kind (one group per expert, since
//             each expert has its own row count);
//   kLooped   one cublasGemmEx per expert on the layer's stream;
//   kStreams  one cublasGemmEx per expert, spread round-robin over the layer's stream and
//             three side streams (forked and joined with events), so that small per-expert
//             GEMMs run concurrently.
// kAuto is kStreams: measured on an H100 (docs/PERFORMANCE.md), cuBLAS 13.0's grouped call
// ran the forward GEMMs at about 255 TFLOP/s where per-expert calls reached 430-580.
//
// All matrices are row-major in the engine; cuBLAS is column-major, so each call below is
// written for the transposed problem (a row-major [m, n] C is a column-major [n, m] one).
// Where the library refuses a type combination for grouped calls (CUBLAS_STATUS_NOT_SUPPORTED;
// cuBLAS 13.0 does for bf16 inputs with fp32 outputs), that kind falls back to per-expert calls
// for good; grouped_fallbacks() counts such kinds.
#ifndef MOE_ENGINE_CUDA_GROUPED_GEMM_H_
#define MOE_ENGINE_CUDA_GROUPED_GEMM_H_

#include <cublas_v2.h>

#include <memory>
#include <set>
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

enum class GemmMode { kAuto = 0, kGrouped = 1, kLooped = 2, kStreams = 3 };

class GemmRunner {
 public:
  static constexpr int kSideStreams = 3;

  static absl::StatusOr<std::unique_ptr<GemmRunner>> Create(std::shared_ptr<Stream> stream);
  ~GemmRunner();

  // Runs every problem with m, n > 0 (k = 0 with beta = 1 leaves C as it is; with beta = 0
  // the caller must not pass it). Pointer arrays travel in one host-to-device copy.
  absl::Status Run(const GemmKind& kind, const std::vector<GemmProblem>& problems);

  void set_mode(GemmMode mode) { mode_ = mode; }
  GemmMode mode() const { return mode_; }
  int grouped_fallbacks() const { return static_cast<int>(unsupported_.size()); }

 private:
  explicit GemmRunner(std::shared_ptr<Stream> s) : stream_(std::move(s)) {}
  absl::Status Init();
  absl::Status RunGrouped(const GemmKind& kind, const std::vector<GemmProblem>& p,
                          bool* unsupported);
  absl::Status RunLooped(const GemmKind& kind, const std::vector<GemmProblem>& p);
  absl::Status RunStreams(const GemmKind& kind, const std::vector<GemmProblem>& p);
  absl::Status Gemm(cublasHandle_t h, const GemmKind& kind, const GemmProblem& q);

  std::shared_ptr<Stream> stream_;
  cublasHandle_t handle_ = nullptr;
  cudaStream_t side_[kSideStreams] = {};
  cublasHandle_t side_handle_[kSideStreams] = {};
  Event fork_;
  Event join_[kSideStreams];
  GemmMode mode_ = GemmMode::kAuto;
  std::vector<int> unsupported_;  // GemmKind keys the grouped call refused
};

}  // namespace moe::cuda

#endif  // MOE_ENGINE_CUDA_GROUPED_GEMM_H_
