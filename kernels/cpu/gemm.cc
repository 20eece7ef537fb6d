// Blocked SGEMM (see gemm.h): packing, the macro loop over micro-tiles, and the micro-kernel.
//
// Block sizes: KC = 256 keeps an A micro-panel (MR x KC) and a B micro-panel (KC x NR) in L1,
// the packed B block (KC x NC) in L2; one pool task owns an (MC x NC) tile of C over all of K.
#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace moe::kernels {
namespace {

constexpr int64_t kKc = 256;

typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));

struct Operand {
  const float* p;
  int64_t ld;
  bool trans;
};

// Packs rows [i0, i0+mc) x cols [p0, p0+kc) of op(A) into MR-row micro-panels, k-major,
// scaling by alpha and zero-padding the last panel.
void PackA(const Operand& a, int64_t i0, int64_t mc, int64_t p0, int64_t kc, float alpha, int mr,
           float* out) {
  for (int64_t ir = 0; ir < mc; ir += mr) {
    const int64_t rows = std::min<int64_t>(mr, mc - ir);
    float* panel = out + ir * kc;
    if (a.trans) {
      for (int64_t p = 0; p < kc; ++p) {
        const float* src = a.p + (p0 + p) * a.ld + i0 + ir;
        float* dst = panel + p * mr;
        int64_t i = 0;
        for (; i < rows; ++i) dst[i] = alpha * src[i];
        for (; i < mr; ++i) dst[i] = 0.0f;
      }
    } else {
      // Row by row: contiguous reads, writes strided by MR within an L1-resident panel.
      for (int64_t i = 0; i < rows; ++i) {
        const float* src = a.p + (i0 + ir + i) * a.ld + p0;
        for (int64_t p = 0; p < kc; ++p) panel[p * mr + i] = alpha * src[p];
      }
      for (int64_t i = rows; i < mr; ++i)
        for (int64_t p = 0; p < kc; ++p) panel[p * mr + i] = 0.0f;
    }
  }
}

// Packs rows [p0, p0+kc) x cols [j0, j0+nc) of op(B) into NR-column micro-panels, k-major.
void PackB(const Operand& b, int64_t p0, int64_t kc, int64_t j0, int64_t nc, int nr, float* out) {
  for (int64_t jr = 0; jr < nc; jr += nr) {
    const int64_t cols = std::min<int64_t>(nr, nc - jr);
    float* panel = out + jr * kc;
    if (!b.trans) {
      for (int64_t p = 0; p < kc; ++p) {
        const float* src = b.p + (p0 + p) * b.ld + j0 + jr;
        float* dst = panel + p * nr;
        std::memcpy(dst, src, cols * sizeof(float));
        for (int64_t j = cols; j < nr; ++j) dst[j] = 0.0f;
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        const float* src = b.p + (j0 + jr + j) * b.ld + p0;
        for (int64_t p = 0; p < kc; ++p) panel[p * nr + j] = src[p];
      }
      for (int64_t j = cols; j < nr; ++j)
        for (int64_t p = 0; p < kc; ++p) panel[p * nr + j] = 0.0f;
    }
  }
}

// MR x (NV * lanes) register tile: acc += a_panel * b_panel over kc, then C (+)= acc.
template <typename V, int MR, int NV>
inline __attribute__((always_inline)) void MicroKernel(int64_t kc, const float* __restrict a,
                                                       const float* __restrict b, float* c,
                                                       int64_t ldc, int64_t rows, int64_t cols,
                                                       bool accumulate) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  constexpr int kNr = NV * kLanes;
  V acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = V{};
  for (int64_t p = 0; p < kc; ++p) {
    V bv[NV];
    for (int j = 0; j < NV; ++j) std::memcpy(&bv[j], b + p * kNr + j * kLanes, sizeof(V));
    for (int i = 0; i < MR; ++i) {
      const V av = V{} + a[p * MR + i];
      for (int j = 0; j < NV; ++j) acc[i][j] += av * bv[j];
    }
  }
  if (rows == MR && cols == kNr) {
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NV; ++j) {
        V out = acc[i][j];
        float* dst = c + i * ldc + j * kLanes;
        if (accumulate) {
          V old;
          std::memcpy(&old, dst, sizeof(V));
          out += old;
        }
        std::memcpy(dst, &out, sizeof(V));
      }
    }
  } else {
    alignas(64) float tile[MR][kNr];
    std::memcpy(tile, acc, sizeof(tile));
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        c[i * ldc + j] = accumulate ? c[i * ldc + j] + tile[i][j] : tile[i][j];
      }
    }
  }
}

struct BlockArgs {
  int64_t kc, mc, nc;
  const float* pa;
  const float* pb;
  float* c;
  int64_t ldc;
  bool accumulate;
};

template <typename V, int MR, int NV>
inline __attribute__((always_inline)) void MacroKernel(const BlockArgs& g) {
  constexpr int kNr = NV * static_cast<int>(sizeof(V) / sizeof(float));
  for (int64_t jr = 0; jr < g.nc; jr += kNr) {
    const int64_t cols = std::min<int64_t>(kNr, g.nc - jr);
    for (int64_t ir = 0; ir < g.mc; ir += MR) {
      const int64_t rows = std::min<int64_t>(MR, g.mc - ir);
      MicroKernel<V, MR, NV>(g.kc, g.pa + ir * g.kc, g.pb + jr * g.kc, g.c + ir * g.ldc + jr, g.ldc,
                             rows, cols, g.accumulate);
    }
  }
}

__attribute__((target("avx512f,avx512vl,avx2,fma"))) void MacroAvx512(const BlockArgs& g) {
  MacroKernel<V16, 8, 2>(g);
}
__attribute__((target("avx2,fma"))) void MacroAvx2(const BlockArgs& g) { MacroKernel<V8, 6, 2>(g); }
void MacroGeneric(const BlockArgs& g) { MacroKernel<V8, 6, 2>(g); }

struct KernelChoice {
  void (*macro)(const BlockArgs&);
  int mr, nr;
  const char* name;
};

constexpr KernelChoice kAvx512{MacroAvx512, 8, 32, "avx512"};
constexpr KernelChoice kAvx2{MacroAvx2, 6, 16, "avx2"};
constexpr KernelChoice kGeneric{MacroGeneric, 6, 16, "generic"};

bool Supported(const KernelChoice& k) {
  __builtin_cpu_init();
  if (&k == &kAvx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  if (&k == &kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return true;
}

// The best kernel this CPU runs, found once.
const KernelChoice& Best() {
  static const KernelChoice* best = Supported(kAvx512) ? &kAvx512
                                    : Supported(kAvx2) ? &kAvx2
                                                       : &kGeneric;
  return *best;
}

// The kernel a caller names; null for kBest.
const KernelChoice* Named(SgemmKernel kernel) {
  switch (kernel) {
    case SgemmKernel::kAvx512:
      return &kAvx512;
    case SgemmKernel::kAvx2:
      return &kAvx2;
    case SgemmKernel::kGeneric:
      return &kGeneric;
    case SgemmKernel::kBest:
      break;
  }
  return nullptr;
}

const KernelChoice& Choice(SgemmKernel kernel) {
  const KernelChoice* k = Named(kernel);
  return k != nullptr && Supported(*k) ? *k : Best();
}

}  // namespace

bool SgemmKernelSupported(SgemmKernel kernel) {
  const KernelChoice* k = Named(kernel);
  return k == nullptr || Supported(*k);
}

const char* SgemmKernelName(SgemmKernel kernel) { return Choice(kernel).name; }

void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
           ThreadPool* pool, SgemmKernel kernel) {
  if (m <= 0 || n <= 0) return;
  if (beta != 0.0f && beta != 1.0f) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] *= beta;
    beta = 1.0f;
  }
  if (k <= 0 || alpha == 0.0f) {
    if (beta == 0.0f)
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  const KernelChoice& kc_choice = Choice(kernel);
  const int mr = kc_choice.mr, nr = kc_choice.nr;
  // MC, NC: multiples of the register tile; small problems get one tile per task.
  const int64_t mc_max = mr * 16;
  const int64_t nc_max = nr * 8;
  const int64_t tiles_m = (m + mc_max - 1) / mc_max;
  const int64_t tiles_n = (n + nc_max - 1) / nc_max;
  const Operand opa{a, lda, trans_a};
  const Operand opb{b, ldb, trans_b};
  // A task owns a column block and a run of `group` row blocks: it packs each B block once and
  // reuses it for the whole run. The group is as long as possible while still leaving about
  // four tasks per thread for load balance. Each C element's k order is the same whatever the
  // grouping, so results do not depend on it (or on the thread count).
  const int64_t threads = pool == nullptr ? 1 : pool->num_threads();
  const int64_t group = std::max<int64_t>(1, std::min(tiles_m, tiles_m * tiles_n / (4 * threads)));
  const int64_t runs_m = (tiles_m + group - 1) / group;
  auto task = [&](int64_t t) {
    const int64_t j0 = (t % tiles_n) * nc_max;
    const int64_t nc = std::min(nc_max, n - j0);
    const int64_t first_block = (t / tiles_n) * group;
    const int64_t last_block = std::min(tiles_m, first_block + group);
    thread_local std::vector<float> buf_a, buf_b;
    const int64_t nc_pad = (nc + nr - 1) / nr * nr;
    const int64_t mc_pad = (mc_max + mr - 1) / mr * mr;
    if (static_cast<int64_t>(buf_a.size()) < mc_pad * kKc) buf_a.resize(mc_pad * kKc);
    if (static_cast<int64_t>(buf_b.size()) < nc_pad * kKc) buf_b.resize(nc_pad * kKc);
    for (int64_t p0 = 0; p0 < k; p0 += kKc) {
      const int64_t kc = std::min(kKc, k - p0);
      PackB(opb, p0, kc, j0, nc, nr, buf_b.data());
      for (int64_t blk = first_block; blk < last_block; ++blk) {
        const int64_t i0 = blk * mc_max;
        const int64_t mc = std::min(mc_max, m - i0);
        PackA(opa, i0, mc, p0, kc, alpha, mr, buf_a.data());
        BlockArgs args{
            kc, mc, nc, buf_a.data(), buf_b.data(), c + i0 * ldc + j0, ldc, p0 > 0 || beta == 1.0f};
        kc_choice.macro(args);
      }
    }
  };
  const int64_t tasks = runs_m * tiles_n;
  if (pool == nullptr || tasks == 1) {
    for (int64_t t = 0; t < tasks; ++t) task(t);
  } else {
    pool->ParallelFor(tasks, task);
  }
}

}  // namespace moe::kernels
