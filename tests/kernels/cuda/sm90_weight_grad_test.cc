// Checks the fused Hopper weight gradients (LaunchSm90WeightGradW2/W13 of
// kernels/cuda/sm90_expert_backward.h) against a CPU fp64 reference, for the three kernels
// behind the launchers (block_n 256 with tma_weights off and on, block_n 128) and the
// other instantiations the bench times (sm90_weight_grad_variants.h), on sizes
// that are multiples of 8 but not of 64, ragged per-expert row counts, experts with no rows,
// and shards that own only part of the global experts.
//
// A plain main with no GoogleTest or Abseil, so the same binary runs on the bare GPU machine;
// exit 0 = pass, 1 = a check failed, 77 = skipped (no sm_90 GPU). Inputs are fresh random bf16
// values. With accumulate = false the output is poisoned with a NaN pattern first, so an
// unwritten element of an expert with rows fails the finite check; with accumulate = true it
// holds a known random pattern and the kernel's result minus the pattern must match. Either
// way an expert with no rows must keep its previous bits exactly. A repeated launch must give
// the same bits (no atomics, fixed sum order). Float results pass by the normalised error
// ||gpu - ref|| / ||ref|| < 1e-3: the reference sums the same bf16 inputs in fp64, so only
// fp32 accumulation error remains, while a wrong shared-memory layout gives errors near 1.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/dispatch.h"
#include "kernels/cuda/sm90_expert_backward.h"
#include "tests/kernels/cuda/sm90_test_util.h"
#include "tests/kernels/cuda/sm90_weight_grad_variants.h"

namespace moe::kernels {
namespace {

using testing::DeviceBuffer;
using testing::FloatFromBits;
using testing::FromBf16;
using testing::HaveSm90Gpu;
using testing::kPoisonF32;
using testing::MakeProblem;
using testing::RandomBf16;
using testing::RandomRouting;

#define CHECK_CUDA SM90_TEST_CHECK_CUDA

constexpr double kTolerance = 1e-3;

using Case = testing::ShardCase;

// One gradient's inputs on both sides: per expert e, C_e[M, N] = sum over its slots s of
// A[a_row(s)]^T B[b_row(s)], with rows given per slot.
struct GradProblem {
  const char* what;
  int32_t m, n;
  const std::vector<uint16_t>* a;     // [*, m]
  const std::vector<uint16_t>* b;     // [*, n]
  std::vector<int64_t> a_row, b_row;  // per slot
};

std::vector<double> Reference(const GradProblem& g, const std::vector<int32_t>& offsets, int E) {
  std::vector<double> ref(static_cast<size_t>(E) * g.m * g.n, 0.0);
  std::vector<double> brow(g.n);
  for (int e = 0; e < E; ++e) {
    double* c = ref.data() + static_cast<size_t>(e) * g.m * g.n;
    for (int32_t s = offsets[e]; s < offsets[e + 1]; ++s) {
      const uint16_t* a = g.a->data() + g.a_row[s] * g.m;
      const uint16_t* b = g.b->data() + g.b_row[s] * g.n;
      for (int32_t j = 0; j < g.n; ++j) brow[j] = FromBf16(b[j]);
      for (int32_t i = 0; i < g.m; ++i) {
        const double av = FromBf16(a[i]);
        double* ci = c + static_cast<size_t>(i) * g.n;
        for (int32_t j = 0; j < g.n; ++j) ci[j] += av * brow[j];
      }
    }
  }
  return ref;
}

// Runs one launch over a prefilled output and judges it. `launch` calls the kernel under test.
template <typename Launch>
bool CheckOne(const Case& c, const char* what, const GradProblem& g,
              const std::vector<int32_t>& offsets, const std::vector<double>& ref, bool accumulate,
              std::mt19937_64& rng, Launch launch) {
  const int E = c.expert_count;
  const size_t block = static_cast<size_t>(g.m) * g.n, total = block * E;
  std::vector<float> before(total);
  if (accumulate) {
    std::normal_distribution<float> normal(0.0f, 4.0f);
    for (auto& v : before) v = normal(rng);
  } else {
    std::fill(before.begin(), before.end(), FloatFromBits(kPoisonF32));
  }
  DeviceBuffer<float> out(total);
  if (out.ptr == nullptr) return false;
  CHECK_CUDA(cudaMemcpy(out.ptr, before.data(), total * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(launch(out.ptr, accumulate));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> got(total);
  CHECK_CUDA(cudaMemcpy(got.data(), out.ptr, total * 4, cudaMemcpyDeviceToHost));

  double num = 0, den = 0;
  int64_t nonfinite = 0, touched_empty = 0;
  for (int e = 0; e < E; ++e) {
    const bool has_rows = offsets[e + 1] > offsets[e];
    for (size_t i = e * block; i < (e + 1) * block; ++i) {
      if (!has_rows) {
        touched_empty += std::memcmp(&got[i], &before[i], 4) != 0;
        continue;
      }
      const double v = accumulate ? static_cast<double>(got[i]) - before[i] : got[i];
      if (!std::isfinite(v)) {
        ++nonfinite;
        continue;
      }
      num += (v - ref[i]) * (v - ref[i]);
      den += ref[i] * ref[i];
    }
  }
  const double err = nonfinite ? INFINITY : std::sqrt(num / std::max(den, 1e-300));
  bool deterministic = true;
  if (!accumulate) {  // the same launch again must give the same bits
    CHECK_CUDA(launch(out.ptr, false));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<float> again(total);
    CHECK_CUDA(cudaMemcpy(again.data(), out.ptr, total * 4, cudaMemcpyDeviceToHost));
    deterministic = std::memcmp(again.data(), got.data(), total * 4) == 0;
  }
  const bool ok = err < kTolerance && touched_empty == 0 && deterministic;
  std::printf(
      "%s %-7s %-4s T=%lld K=%d E=%d/%d[%d..] d=%d h=%d N=%d %s accumulate=%d "
      "err=%.3g "
      "nonfinite=%lld empty_touched=%lld deterministic=%d\n",
      ok ? "PASS" : "FAIL", c.name, g.what, static_cast<long long>(c.tokens), c.top_k, E,
      c.experts_global, c.expert_first, c.d, c.h, offsets[E], what, accumulate ? 1 : 0, err,
      static_cast<long long>(nonfinite), static_cast<long long>(touched_empty),
      deterministic ? 1 : 0);
  return ok;
}

bool RunCase(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t T = c.tokens, TK = c.tokens * c.top_k;
  const int32_t K = c.top_k, d = c.d, h = c.h, E = c.expert_count;

  // Routing: K distinct global experts per token, skewed toward `hot_global`, never
  // `empty_global`; some land outside the shard.
  const std::vector<int32_t> idx =
      RandomRouting(T, K, c.experts_global, c.empty_global, c.hot_global, rng);
  std::vector<int32_t> counts(E), offsets(E + 1), entries(TK), slot_of(TK);
  DispatchCpu(idx.data(), T, K, c.expert_first, E, counts.data(), offsets.data(), entries.data(),
              slot_of.data());
  const int32_t N = offsets[E];

  const std::vector<uint16_t> dout = RandomBf16(T * d, 1.0f, rng), x = RandomBf16(T * d, 1.0f, rng);
  const std::vector<uint16_t> pa = RandomBf16(static_cast<size_t>(N) * h, 1.0f, rng);
  const std::vector<uint16_t> dh = RandomBf16(static_cast<size_t>(N) * 2 * h, 1.0f, rng);

  GradProblem w2{"dW2", d, h, &dout, &pa, {}, {}};
  GradProblem w13{"dW13", 2 * h, d, &dh, &x, {}, {}};
  for (int32_t s = 0; s < N; ++s) {
    const int64_t tok = entries[s] / K;
    w2.a_row.push_back(tok);
    w2.b_row.push_back(s);
    w13.a_row.push_back(s);
    w13.b_row.push_back(tok);
  }
  const std::vector<double> ref_w2 = Reference(w2, offsets, E);
  const std::vector<double> ref_w13 = Reference(w13, offsets, E);

  DeviceBuffer<uint16_t> d_dout(T * d), d_x(T * d), d_pa(static_cast<size_t>(N) * h),
      d_dh(static_cast<size_t>(N) * 2 * h);
  DeviceBuffer<int32_t> d_off(E + 1), d_ent(std::max<int32_t>(N, 1));
  if (!d_dout.ptr || !d_x.ptr || !d_pa.ptr || !d_dh.ptr || !d_off.ptr || !d_ent.ptr) {
    std::fprintf(stderr, "cudaMalloc failed\n");
    return false;
  }
  CHECK_CUDA(cudaMemcpy(d_dout.ptr, dout.data(), dout.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_x.ptr, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_pa.ptr, pa.data(), pa.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_dh.ptr, dh.data(), dh.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_off.ptr, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_ent.ptr, entries.data(), N * 4, cudaMemcpyHostToDevice));

  const Sm90ExpertProblem prob = MakeProblem(T, K, E, d, h, N);
  bool ok = true;
  // The three kernels behind the launchers: block_n 256 without and with the slot-order
  // operand by TMA (tma_weights), block_n 128 (where tma_weights does not apply).
  for (int config_i = 0; config_i < 4; ++config_i) {
    Sm90GemmConfig cfg;
    cfg.block_n = config_i % 2 == 0 ? 256 : 128;
    cfg.tma_weights = config_i >= 2;
    char what[64];
    std::snprintf(what, sizeof(what), "block_n=%d tma=%d", cfg.block_n, cfg.tma_weights ? 1 : 0);
    for (bool accumulate : {false, true}) {
      ok &= CheckOne(c, what, w2, offsets, ref_w2, accumulate, rng, [&](float* out, bool acc) {
        return LaunchSm90WeightGradW2(prob, cfg, d_dout.ptr, d_pa.ptr, d_off.ptr, d_ent.ptr, out,
                                      acc, nullptr);
      });
      ok &= CheckOne(c, what, w13, offsets, ref_w13, accumulate, rng, [&](float* out, bool acc) {
        return LaunchSm90WeightGradW13(prob, cfg, d_dh.ptr, d_x.ptr, d_off.ptr, d_ent.ptr, out, acc,
                                       nullptr);
      });
    }
  }
  // The instantiations the bench times beside the launchers' (sm90_weight_grad_variants.h);
  // $WGRAD_ONLY / $WGRAD_SKIP keep or drop those whose name contains the string, so a new one
  // can first run in a process of its own.
  const char* only = std::getenv("WGRAD_ONLY");
  const char* skip = std::getenv("WGRAD_SKIP");
  for (int v = 0; v < testing::WeightGradVariantCount(); ++v) {
    const char* what = testing::WeightGradVariantName(v);
    if (only != nullptr && *only != '\0' && std::strstr(what, only) == nullptr) continue;
    if (skip != nullptr && *skip != '\0' && std::strstr(what, skip) != nullptr) continue;
    for (bool accumulate : {false, true}) {
      ok &= CheckOne(c, what, w2, offsets, ref_w2, accumulate, rng, [&](float* out, bool acc) {
        return testing::LaunchWeightGradVariant(v, true, d_dout.ptr, d_pa.ptr, d_off.ptr, d_ent.ptr,
                                                out, E, d, h, K, N, acc, nullptr);
      });
      ok &= CheckOne(c, what, w13, offsets, ref_w13, accumulate, rng, [&](float* out, bool acc) {
        return testing::LaunchWeightGradVariant(v, false, d_dh.ptr, d_x.ptr, d_off.ptr, d_ent.ptr,
                                                out, E, 2 * h, d, K, N, acc, nullptr);
      });
    }
  }
  return ok;
}

// Refusals before any launch: an unsupported block_n and a misaligned pointer.
bool GuardChecks() {
  const Sm90ExpertProblem prob = MakeProblem(/*tokens=*/64, /*top_k=*/2, /*experts=*/4,
                                             /*d_model=*/128, /*d_hidden=*/64);
  void* buf = nullptr;
  if (cudaMalloc(&buf, 1 << 20) != cudaSuccess) return false;
  const auto* bf = static_cast<const uint16_t*>(buf);
  const auto* idx = static_cast<const int32_t*>(buf);
  float* out = static_cast<float*>(buf);
  Sm90GemmConfig bad_n;
  bad_n.block_n = 192;
  const cudaError_t e1 = LaunchSm90WeightGradW2(prob, bad_n, bf, bf, idx, idx, out, false, nullptr);
  const cudaError_t e2 =
      LaunchSm90WeightGradW13(prob, Sm90GemmConfig{}, bf + 1, bf, idx, idx, out, false, nullptr);
  const cudaError_t e3 =
      LaunchSm90WeightGradW2(prob, Sm90GemmConfig{}, bf, bf, idx, idx, out + 1, true, nullptr);
  Sm90ExpertProblem bad_prob = prob;
  bad_prob.d_hidden = 100;
  const cudaError_t e4 =
      LaunchSm90WeightGradW13(bad_prob, Sm90GemmConfig{}, bf, bf, idx, idx, out, false, nullptr);
  cudaFree(buf);
  const bool ok = e1 == cudaErrorInvalidValue && e2 == cudaErrorInvalidValue &&
                  e3 == cudaErrorInvalidValue && e4 == cudaErrorInvalidValue;
  std::printf(
      "%s refusals: block_n=192 -> %s, misaligned dh -> %s, misaligned dw2 -> %s, "
      "h=100 -> %s\n",
      ok ? "PASS" : "FAIL", cudaGetErrorName(e1), cudaGetErrorName(e2), cudaGetErrorName(e3),
      cudaGetErrorName(e4));
  return ok;
}

int Main() {
  if (!HaveSm90Gpu()) return 77;
  const Case cases[] = {
      // name      T     K  Eg first cnt  d     h    empty hot
      {"odd", 37, 3, 9, 2, 5, 200, 136, 4, 3},
      {"ragged", 700, 2, 6, 0, 6, 264, 72, -1, 5},
      {"narrow", 300, 1, 3, 0, 3, 128, 64, 1, 0},
      {"shard", 513, 6, 16, 4, 8, 136, 328, 9, 5},  // top_k 6: a divisor that is no power of 2
      // > 132 tiles, so every CTA's load cursor crosses tile (and expert) boundaries.
      {"many", 600, 4, 20, 2, 16, 1032, 264, 7, 11},
      // 4-8 tiles a CTA over 39 experts of ragged counts: every CTA crosses many tile and expert
      // boundaries, with full and partial slabs (the TMA variants switch between the two).
      {"deep", 1200, 4, 40, 0, 40, 520, 264, 3, 7},
  };
  bool ok = GuardChecks();
  uint64_t seed = 20261121;
  for (const Case& c : cases) ok &= RunCase(c, ++seed);
  std::printf(ok ? "ALL PASSED\n" : "SOME CHECKS FAILED\n");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace moe::kernels

int main() { return moe::kernels::Main(); }
