// Blocked single-precision GEMM for the CPU engine: C = alpha * op(A) op(B) + beta * C.
//
// Row-major, BLAS-style transposes: op(A) is [m, k] (A stored [m, k], or [k, m] when
// trans_a), op(B) is [k, n] (B stored [k, n], or [n, k] when trans_b). The usual
// GotoBLAS structure: panels of A and B are packed into contiguous, zero-padded micro-panels
// (this is also where the transposes disappear, so one micro-kernel serves every layout), and
// a register-blocked micro-kernel written with GCC vector extensions runs over them. The
// micro-kernel is compiled three times (AVX-512, AVX2+FMA, baseline) and picked at run time,
// so one binary is portable and still fast.
//
// Determinism: the pool splits C into tiles and each tile's k-reduction runs in a fixed order
// on one thread, so results do not depend on the thread count. beta must be 0 (C is written,
// never read: NaN garbage in C is harmless) or 1 (accumulate); other values scale C first.
#ifndef MOE_KERNELS_CPU_GEMM_H_
#define MOE_KERNELS_CPU_GEMM_H_

#include <cstdint>

#include "kernels/cpu/thread_pool.h"

namespace moe::kernels {

// The micro-kernels Sgemm can run. kBest is the fastest this CPU supports (what every caller but
// the tests, which check each variant, asks for).
enum class SgemmKernel { kBest, kAvx512, kAvx2, kGeneric };

// Whether this CPU runs `kernel` (kBest and kGeneric: always).
bool SgemmKernelSupported(SgemmKernel kernel);

// The micro-kernel `kernel` names on this machine: "avx512", "avx2" or "generic".
const char* SgemmKernelName(SgemmKernel kernel = SgemmKernel::kBest);

// `kernel` must be supported (SgemmKernelSupported); an unsupported one runs kBest instead.
void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
           ThreadPool* pool, SgemmKernel kernel = SgemmKernel::kBest);

}  // namespace moe::kernels

#endif  // MOE_KERNELS_CPU_GEMM_H_
