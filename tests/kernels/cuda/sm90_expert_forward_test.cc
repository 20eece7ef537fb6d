// Checks the fused Hopper forward (kernels/cuda/sm90_expert_forward.h) against a CPU fp64
// reference: up-projection (gather + grouped GEMM + SwiGLU), down-projection (rows scattered to
// (token, k) order) and the combine, for every tile config, on odd sizes. The "many" case gives
// each CTA several tiles, so that the ping-pong kernel's consumers alternate more than once.
//
// A plain main with no GoogleTest or Abseil, so the same binary runs on the bare GPU machine;
// exit 0 = pass, 1 = a check failed, 77 = skipped (no sm_90 GPU; ctest's SKIP_RETURN_CODE).
// Inputs are fresh random bf16 values; outputs are poisoned with a NaN pattern first, so an
// unwritten element fails the finite check, and rows the kernels must NOT write (entries routed
// outside the shard) must still hold the poison bit-for-bit. Float results pass by the
// normalised error ||gpu - ref|| / ||ref|| < 1e-2 (bf16 operands and outputs; fp32 sums).
#include "kernels/cuda/sm90_expert_forward.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/kernel_selection.h"
#include "kernels/cpu/dispatch.h"
#include "tests/kernels/cuda/sm90_test_util.h"

namespace moe::kernels {
namespace {

using testing::DeviceBuffer;
using testing::FromBf16;
using testing::HaveSm90Gpu;
using testing::kPoison;
using testing::MakeProblem;
using testing::NormalisedError;
using testing::RandomBf16;
using testing::RandomRouting;

#define CHECK_CUDA SM90_TEST_CHECK_CUDA

constexpr double kTolerance = 1e-2;

using Case = testing::ShardCase;

bool Report(const Case& c, const Sm90GemmConfig& cfg, bool stacked, const char* what, double err) {
  const bool ok = err < kTolerance;
  std::printf(
      "%s %-8s T=%lld K=%d E=%d/%d[%d..] d=%d h=%d block_n=%d tma=%d ws=%d pp=%d mc=%d group_m=%d "
      "stacked=%d %-4s err=%.3g\n",
      ok ? "PASS" : "FAIL", c.name, static_cast<long long>(c.tokens), c.top_k, c.expert_count,
      c.experts_global, c.expert_first, c.d, c.h, cfg.block_n, cfg.tma_weights ? 1 : 0,
      cfg.warp_specialized ? 1 : 0, cfg.ping_pong ? 1 : 0, cfg.multicast_b ? 1 : 0, cfg.group_m,
      stacked ? 1 : 0, what, err);
  return ok;
}

// stacked: W1 and W3 live in one [E, 2h, d] tensor ([W1_e; W3_e], the CUDA engine's layout),
// passed through w13_expert_stride. row_step > 1 compares only every row_step-th slot's H, A and
// Y with the fp64 reference (a large case's CPU time), but still requires every element of
// them to be finite (written) and Y's out-of-shard rows to keep their poison.
bool RunCase(const Case& c, const Sm90GemmConfig& cfg, uint64_t seed, bool stacked,
             int row_step = 1) {
  std::mt19937_64 rng(seed);
  const int64_t T = c.tokens, TK = c.tokens * c.top_k;
  const int32_t K = c.top_k, d = c.d, h = c.h, E = c.expert_count;

  // Routing: K distinct global experts per token, skewed toward `hot_global`, never
  // `empty_global`; some land outside the shard.
  const std::vector<int32_t> idx =
      RandomRouting(T, K, c.experts_global, c.empty_global, c.hot_global, rng);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<int32_t> counts(E), offsets(E + 1), entries(TK), slot_of(TK);
  DispatchCpu(idx.data(), T, K, c.expert_first, E, counts.data(), offsets.data(), entries.data(),
              slot_of.data());
  const int64_t N = offsets[E];
  std::vector<float> p(TK);
  for (auto& v : p) v = unit(rng);

  std::vector<uint16_t> x = RandomBf16(T * d, 1.0f, rng);
  std::vector<uint16_t> w1 = RandomBf16(static_cast<size_t>(E) * h * d, 1.0f / std::sqrt(d), rng);
  std::vector<uint16_t> w3 = RandomBf16(static_cast<size_t>(E) * h * d, 1.0f / std::sqrt(d), rng);
  std::vector<uint16_t> w2 = RandomBf16(static_cast<size_t>(E) * d * h, 1.0f / std::sqrt(h), rng);

  DeviceBuffer<uint16_t> dx(x.size()), dw1(w1.size() * (stacked ? 2 : 1)), dw3(w3.size()),
      dw2(w2.size());
  DeviceBuffer<uint16_t> dh(N * 2 * h), da(N * h), dy(TK * d), dout(T * d);
  DeviceBuffer<int32_t> doff(E + 1), dent(TK), dslot(TK);
  DeviceBuffer<float> dp(TK);
  for (void* ptr :
       {static_cast<void*>(dx.ptr), static_cast<void*>(dw1.ptr), static_cast<void*>(dw3.ptr),
        static_cast<void*>(dw2.ptr), static_cast<void*>(dh.ptr), static_cast<void*>(da.ptr),
        static_cast<void*>(dy.ptr), static_cast<void*>(dout.ptr), static_cast<void*>(doff.ptr),
        static_cast<void*>(dent.ptr), static_cast<void*>(dslot.ptr), static_cast<void*>(dp.ptr)}) {
    if (ptr == nullptr) {
      std::fprintf(stderr, "cudaMalloc failed\n");
      return false;
    }
  }
  CHECK_CUDA(cudaMemcpy(dx.ptr, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  const uint16_t* w1_ptr = dw1.ptr;
  const uint16_t* w3_ptr = dw3.ptr;
  if (stacked) {
    const size_t block = static_cast<size_t>(h) * d;
    for (int32_t e = 0; e < E; ++e) {
      CHECK_CUDA(cudaMemcpy(dw1.ptr + 2 * e * block, w1.data() + e * block, block * 2,
                            cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(dw1.ptr + (2 * e + 1) * block, w3.data() + e * block, block * 2,
                            cudaMemcpyHostToDevice));
    }
    w3_ptr = dw1.ptr + block;
  } else {
    CHECK_CUDA(cudaMemcpy(dw1.ptr, w1.data(), w1.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dw3.ptr, w3.data(), w3.size() * 2, cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaMemcpy(dw2.ptr, w2.data(), w2.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(doff.ptr, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dent.ptr, entries.data(), TK * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dslot.ptr, slot_of.data(), TK * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dp.ptr, p.data(), TK * 4, cudaMemcpyHostToDevice));
  const std::vector<uint16_t> poison_h(N * 2 * h, kPoison), poison_y(TK * d, kPoison),
      poison_o(T * d, kPoison);
  CHECK_CUDA(cudaMemcpy(dh.ptr, poison_h.data(), N * 2 * h * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(da.ptr, poison_h.data(), N * h * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dy.ptr, poison_y.data(), TK * d * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dout.ptr, poison_o.data(), T * d * 2, cudaMemcpyHostToDevice));

  Sm90ExpertProblem prob = MakeProblem(T, K, E, d, h, N);
  if (stacked) prob.w13_expert_stride = 2 * static_cast<int64_t>(h) * d;
  CHECK_CUDA(LaunchSm90ExpertUp(prob, cfg, dx.ptr, w1_ptr, w3_ptr, doff.ptr, dent.ptr, dh.ptr,
                                da.ptr, nullptr));
  CHECK_CUDA(LaunchSm90ExpertDown(prob, cfg, da.ptr, dw2.ptr, doff.ptr, dent.ptr, dy.ptr, nullptr));
  CHECK_CUDA(LaunchSm90Combine(prob, dy.ptr, dp.ptr, dslot.ptr, dout.ptr, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> gh(N * 2 * h), ga(N * h), gy(TK * d), gout(T * d);
  CHECK_CUDA(cudaMemcpy(gh.data(), dh.ptr, gh.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(ga.data(), da.ptr, ga.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(gy.data(), dy.ptr, gy.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(gout.data(), dout.ptr, gout.size() * 2, cudaMemcpyDeviceToHost));

  // Reference, fp64 over the same bf16 inputs. A's reference uses the GPU's H and Y's the
  // GPU's A, so each stage is judged on its own error, not the previous stage's rounding.
  std::vector<double> got_h, ref_h, got_a, ref_a, got_y, ref_y, got_o, ref_o;
  int64_t unwritten = 0;  // non-finite H, A or Y elements of slots not compared
  for (int32_t e = 0; e < E; ++e) {
    for (int64_t s = offsets[e]; s < offsets[e + 1]; ++s) {
      if (s % row_step != 0) {
        for (int32_t j = 0; j < 2 * h; ++j)
          unwritten += !std::isfinite(FromBf16(gh[s * 2 * h + j]));
        for (int32_t j = 0; j < h; ++j) unwritten += !std::isfinite(FromBf16(ga[s * h + j]));
        for (int32_t n = 0; n < d; ++n) {
          unwritten += !std::isfinite(FromBf16(gy[static_cast<size_t>(entries[s]) * d + n]));
        }
        continue;
      }
      const int64_t t = entries[s] / K;
      for (int32_t j = 0; j < h; ++j) {
        double g = 0, u = 0;
        const size_t wrow = (static_cast<size_t>(e) * h + j) * d;
        for (int32_t q = 0; q < d; ++q) {
          const double xv = FromBf16(x[t * d + q]);
          g += xv * FromBf16(w1[wrow + q]);
          u += xv * FromBf16(w3[wrow + q]);
        }
        got_h.push_back(FromBf16(gh[s * 2 * h + j]));
        ref_h.push_back(g);
        got_h.push_back(FromBf16(gh[s * 2 * h + h + j]));
        ref_h.push_back(u);
        const double gg = FromBf16(gh[s * 2 * h + j]), uu = FromBf16(gh[s * 2 * h + h + j]);
        got_a.push_back(FromBf16(ga[s * h + j]));
        ref_a.push_back(gg / (1.0 + std::exp(-gg)) * uu);
      }
      for (int32_t n = 0; n < d; ++n) {
        double y = 0;
        const size_t wrow = (static_cast<size_t>(e) * d + n) * h;
        for (int32_t j = 0; j < h; ++j) y += FromBf16(ga[s * h + j]) * FromBf16(w2[wrow + j]);
        got_y.push_back(FromBf16(gy[static_cast<size_t>(entries[s]) * d + n]));
        ref_y.push_back(y);
      }
    }
  }
  int64_t stray = 0;  // (t,k) rows outside the shard must be untouched
  for (int64_t i = 0; i < TK; ++i) {
    if (slot_of[i] >= 0) continue;
    for (int32_t n = 0; n < d; ++n) stray += gy[i * d + n] != kPoison;
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int32_t n = 0; n < d; ++n) {
      double o = 0;
      for (int32_t k = 0; k < K; ++k) {
        if (slot_of[t * K + k] >= 0) o += p[t * K + k] * FromBf16(gy[(t * K + k) * d + n]);
      }
      got_o.push_back(FromBf16(gout[t * d + n]));
      ref_o.push_back(o);
    }
  }
  bool ok = true;
  ok &= Report(c, cfg, stacked, "H", NormalisedError(got_h, ref_h));
  ok &= Report(c, cfg, stacked, "A", NormalisedError(got_a, ref_a));
  ok &= Report(c, cfg, stacked, "Y", NormalisedError(got_y, ref_y));
  ok &= Report(c, cfg, stacked, "out", NormalisedError(got_o, ref_o));
  if (unwritten != 0) {
    std::printf("FAIL %s: %lld non-finite elements in the rows not compared\n", c.name,
                static_cast<long long>(unwritten));
    ok = false;
  }
  if (stray != 0) {
    std::printf("FAIL %s: %lld elements of Y written for entries outside the shard\n", c.name,
                static_cast<long long>(stray));
    ok = false;
  }
  return ok;
}

bool ExpectRefused(Sm90ExpertProblem prob, const char* field) {
  const char* why = Sm90CanImplement(prob);
  const bool ok = why != nullptr && std::strstr(why, field) != nullptr;
  std::printf("%s CanImplement refuses bad %s: %s\n", ok ? "PASS" : "FAIL", field,
              why ? why : "(accepted)");
  return ok;
}

bool GuardChecks() {
  const Sm90ExpertProblem good = MakeProblem(/*tokens=*/64, /*top_k=*/2, /*experts=*/4,
                                             /*d_model=*/128, /*d_hidden=*/64);
  bool ok = Sm90CanImplement(good) == nullptr;
  std::printf("%s CanImplement accepts a good problem\n", ok ? "PASS" : "FAIL");
  Sm90ExpertProblem bad = good;
  bad.d_model = 100;
  ok &= ExpectRefused(bad, "d_model");
  bad = good;
  bad.d_hidden = 0;
  ok &= ExpectRefused(bad, "d_hidden");
  bad = good;
  bad.num_experts = 513;
  ok &= ExpectRefused(bad, "num_experts");
  bad = good;
  bad.top_k = 0;
  ok &= ExpectRefused(bad, "top_k");
  bad = good;
  bad.num_tokens = -5;
  ok &= ExpectRefused(bad, "num_tokens");
  bad = good;
  bad.w13_expert_stride = 64 * 128 - 8;  // overlaps the next expert's block
  ok &= ExpectRefused(bad, "w13_expert_stride");
  bad.w13_expert_stride = 2 * 64 * 128;  // the stacked [W1; W3] layout
  const bool stacked_ok = Sm90CanImplement(bad) == nullptr;
  std::printf("%s CanImplement accepts stacked weights\n", stacked_ok ? "PASS" : "FAIL");
  ok &= stacked_ok;
  // A misaligned pointer is refused before any launch.
  uint16_t* buf = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&buf), 1 << 20) != cudaSuccess) return false;
  const int32_t* none = reinterpret_cast<const int32_t*>(buf);
  const cudaError_t err =
      LaunchSm90ExpertUp(good, Sm90GemmConfig{}, buf + 1, buf, buf, none, none, buf, buf, nullptr);
  const bool refused = err == cudaErrorInvalidValue;
  std::printf("%s misaligned x refused (%s)\n", refused ? "PASS" : "FAIL", cudaGetErrorString(err));
  // The weight multicast without the ping-pong kernel is refused, not run as another kernel
  // (zeroed offsets: were it launched anyway, it would find no rows and return).
  bool mc_refused = cudaMemset(buf, 0, 1 << 20) == cudaSuccess;
  const Sm90GemmConfig mc_alone{256, true, 16, /*warp_specialized=*/false, /*ping_pong=*/false,
                                /*multicast_b=*/true};
  const cudaError_t mc_err =
      LaunchSm90ExpertUp(good, mc_alone, buf, buf, buf, none, none, buf, buf, nullptr);
  mc_refused &= mc_err == cudaErrorInvalidValue && cudaDeviceSynchronize() == cudaSuccess;
  std::printf("%s multicast_b without ping_pong refused (%s)\n", mc_refused ? "PASS" : "FAIL",
              cudaGetErrorString(mc_err));
  cudaFree(buf);
  return ok && refused && mc_refused;
}

// only: run just the case of that name (all when null), e.g. a broken build's quick check.
int Main(const char* only) {
  if (!HaveSm90Gpu()) return 77;
  const Case cases[] = {
      // name       T    K  Eg first cnt  d    h  empty hot
      {"odd", 37, 3, 9, 2, 5, 200, 136, 4, 3},      {"ragged", 700, 2, 6, 0, 6, 264, 72, -1, 5},
      {"narrow", 300, 1, 3, 0, 3, 128, 64, 1, 0},   {"medium", 1024, 2, 8, 0, 8, 512, 256, 6, 2},
      {"tail-k", 513, 4, 16, 4, 8, 136, 328, 9, 5}, {"one", 203, 1, 1, 0, 1, 192, 120, -1, -1},
      {"many", 2048, 4, 10, 1, 8, 520, 392, 6, 3},
  };
  bool ok = GuardChecks();
  uint64_t seed = 20261121;
  for (const Case& c : cases) {
    if (only != nullptr && std::strcmp(only, c.name) != 0) continue;
    const Sm90ExpertProblem prob = MakeProblem(c.tokens, c.top_k, c.expert_count, c.d, c.h);
    // {block_n, tma_weights, group_m, warp_specialized, ping_pong, multicast_b}: every tile
    // variant of the three kernels (ping-pong with and without the weight multicast), and bands
    // that do and do not divide the experts' row-block counts. The large "many" case runs the
    // ping-pong tiles and one of each other kernel only.
    const bool many = std::strcmp(c.name, "many") == 0;
    const std::vector<Sm90GemmConfig> configs =
        many ? std::vector<Sm90GemmConfig>{{256, true, 3},
                                           {256, true, 2, true},
                                           {128, true, 16, false, true},
                                           {256, true, 3, false, true},
                                           {128, true, 1, false, true},
                                           {256, true, 3, false, true, true},
                                           {128, true, 16, false, true, true}}
             : std::vector<Sm90GemmConfig>{{256, true, 3},
                                           {128, true, 16},
                                           {256, false, 1},
                                           {128, false, 2},
                                           {256, true, 5},
                                           {256, true, 2, true},
                                           {128, true, 16, true},
                                           {128, true, 16, false, true},
                                           {256, true, 3, false, true},
                                           {128, true, 1, false, true},
                                           {256, true, 16, false, true},
                                           {256, true, 3, false, true, true},
                                           {128, true, 16, false, true, true},
                                           {128, true, 1, false, true, true}};
    // The engine's own choice (kernel_selection.h) must be one of the implemented tiles.
    Sm90GemmConfig up = cuda::Sm90ChooseConfig(prob, cuda::Sm90Projection::kUpSwiGLU, 132);
    if (up.block_n != 128 && up.block_n != 256) {
      std::printf("FAIL the selection chose block_n=%d\n", up.block_n);
      ok = false;
    }
    const int row_step = many ? 5 : 1;  // "many": every 5th slot against the fp64 reference
    for (const Sm90GemmConfig& cfg : configs) ok &= RunCase(c, cfg, ++seed, false, row_step);
    ok &= RunCase(c, up, ++seed, false, row_step);  // the engine's own choice
    if (many) continue;  // the stacked layout is checked on the smaller cases
    // Stacked [W1; W3] weights, through TMA and through cp.async.
    ok &= RunCase(c, up, ++seed, true);
    ok &= RunCase(c, Sm90GemmConfig{128, false, 4}, ++seed, true);
    ok &= RunCase(c, Sm90GemmConfig{256, true, 16, true}, ++seed, true);
    ok &= RunCase(c, Sm90GemmConfig{128, true, 16, false, true}, ++seed, true);
    ok &= RunCase(c, Sm90GemmConfig{256, true, 5, false, true}, ++seed, true);
    ok &= RunCase(c, Sm90GemmConfig{256, true, 5, false, true, true}, ++seed, true);
  }
  std::printf(ok ? "ALL PASSED\n" : "SOME CHECKS FAILED\n");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace moe::kernels

// Usage: sm90_expert_forward_test [CASE]
int main(int argc, char** argv) { return moe::kernels::Main(argc > 1 ? argv[1] : nullptr); }
