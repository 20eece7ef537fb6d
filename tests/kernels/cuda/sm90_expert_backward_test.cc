// Checks the fused Hopper backward's data gradients (kernels/cuda/sm90_expert_backward.h)
// against a CPU fp64 reference: dA_u[s] = dout[entries[s] / K] W2_e (rows gathered through the
// index, W2 read MN-major from its stored [d, h] layout) and dXg[s] = dH[s] [W1_e; W3_e] (slot
// order, the stacked [2h, d] block read MN-major), for every tile config, on odd sizes.
//
// The MN-major weight layout is what this test exists to catch: the sizes are multiples of 8
// but not of 64 (so the boxes' zero fill and the 64-column blocks of a tile both matter), h,
// d and 2h all exceed one 64-wide block, and every expert's weights differ, so a wrong
// descriptor offset, swizzle or expert stride shows as a large error (a build with the
// descriptor's two offsets swapped fails it).
// A plain main like sm90_expert_forward_test.cc; exit 0 = pass, 1 = a check failed, 77 = no
// sm_90 GPU. Outputs are poisoned first, and guard rows before and after the N output rows
// (rows outside the dispatch) must keep the poison bit-for-bit.
#include "kernels/cuda/sm90_expert_backward.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "engine/cuda/kernel_selection.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cuda/sm90_expert_forward.h"
#include "tests/kernels/cuda/sm90_test_util.h"

namespace moe::kernels {
namespace {

using testing::DeviceBuffer;
using testing::FromBf16;
using testing::kPoison;
using testing::NormalisedError;
using testing::RandomBf16;
using testing::RandomRouting;

#define CHECK_CUDA SM90_TEST_CHECK_CUDA

constexpr double kTolerance = 1e-2;
constexpr int64_t kGuardRows = 130;          // poisoned rows on each side of the N output rows

// The shared test shape plus the one thing only the backward needs.
struct Case {
  testing::ShardCase shard;
  int64_t w13_pad;  // extra elements between experts' [W1; W3] blocks (0: packed)
};

// The fixed inputs of one case, with the fp64 references computed once for all configs.
struct Inputs {
  int64_t n = 0;  // routed rows in the shard
  std::vector<int32_t> offsets, entries;
  std::vector<uint16_t> dout, w2, dh, w13;  // w13 with w13_pad between experts
  std::vector<double> ref_da, ref_dx;
};

Inputs MakeInputs(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Inputs in;
  const int64_t T = c.shard.tokens, TK = c.shard.tokens * c.shard.top_k;
  const int32_t K = c.shard.top_k, d = c.shard.d, h = c.shard.h, E = c.shard.expert_count;
  const std::vector<int32_t> idx =
      RandomRouting(T, K, c.shard.experts_global, c.shard.empty_global, c.shard.hot_global, rng);
  std::vector<int32_t> counts(E), slot_of(TK);
  in.offsets.resize(E + 1);
  in.entries.resize(TK);
  DispatchCpu(idx.data(), T, K, c.shard.expert_first, E, counts.data(), in.offsets.data(),
              in.entries.data(), slot_of.data());
  in.n = in.offsets[E];
  const int64_t stride13 = 2 * static_cast<int64_t>(h) * d + c.w13_pad;
  in.dout = RandomBf16(T * d, 1.0f, rng);
  in.w2 = RandomBf16(static_cast<size_t>(E) * d * h, 1.0f / std::sqrt(d), rng);
  in.dh = RandomBf16(in.n * 2 * h, 1.0f, rng);
  in.w13 = RandomBf16(static_cast<size_t>(E) * stride13, 1.0f / std::sqrt(2 * h), rng);

  in.ref_da.assign(in.n * h, 0.0);
  in.ref_dx.assign(in.n * d, 0.0);
  for (int32_t e = 0; e < E; ++e) {
    // dA_u rows: sum over q < d of dout[t, q] * W2_e[q, :].
    for (int64_t s = in.offsets[e]; s < in.offsets[e + 1]; ++s) {
      const int64_t t = in.entries[s] / K;
      double* out = &in.ref_da[s * h];
      for (int32_t q = 0; q < d; ++q) {
        const double a = FromBf16(in.dout[t * d + q]);
        const uint16_t* wrow = &in.w2[(static_cast<size_t>(e) * d + q) * h];
        for (int32_t j = 0; j < h; ++j) out[j] += a * FromBf16(wrow[j]);
      }
    }
    // dXg rows: sum over i < 2h of dH[s, i] * W13_e[i, :].
    for (int64_t s = in.offsets[e]; s < in.offsets[e + 1]; ++s) {
      double* out = &in.ref_dx[s * d];
      for (int32_t i = 0; i < 2 * h; ++i) {
        const double a = FromBf16(in.dh[s * 2 * h + i]);
        const uint16_t* wrow = &in.w13[e * stride13 + static_cast<int64_t>(i) * d];
        for (int32_t n = 0; n < d; ++n) out[n] += a * FromBf16(wrow[n]);
      }
    }
  }
  return in;
}

bool Report(const Case& c, const Sm90GemmConfig& cfg, const char* what, double err,
            int64_t stray) {
  const bool ok = err < kTolerance && stray == 0;
  std::printf(
      "%s %-8s T=%lld K=%d E=%d/%d[%d..] d=%d h=%d w13_pad=%lld block_n=%d tma=%d group_m=%d "
      "ws=%d pp=%d mc=%d %-3s err=%.3g stray=%lld\n",
      ok ? "PASS" : "FAIL", c.shard.name, static_cast<long long>(c.shard.tokens), c.shard.top_k,
      c.shard.expert_count, c.shard.experts_global, c.shard.expert_first, c.shard.d, c.shard.h,
      static_cast<long long>(c.w13_pad), cfg.block_n, cfg.tma_weights ? 1 : 0, cfg.group_m,
      cfg.warp_specialized ? 1 : 0, cfg.ping_pong ? 1 : 0, cfg.multicast_b ? 1 : 0, what, err,
      static_cast<long long>(stray));
  return ok;
}

// Poisons out (guard rows included), which holds kGuardRows + n + kGuardRows rows of `cols`.
bool Poison(DeviceBuffer<uint16_t>& out) {
  const std::vector<uint16_t> poison(out.n, kPoison);
  CHECK_CUDA(cudaMemcpy(out.ptr, poison.data(), out.n * 2, cudaMemcpyHostToDevice));
  return true;
}

// Compares rows [kGuardRows, kGuardRows + n) with ref and counts guard elements not poison.
bool Judge(const DeviceBuffer<uint16_t>& out, int64_t n, int32_t cols,
           const std::vector<double>& ref, double* err, int64_t* stray) {
  std::vector<uint16_t> got(out.n);
  CHECK_CUDA(cudaMemcpy(got.data(), out.ptr, out.n * 2, cudaMemcpyDeviceToHost));
  std::vector<double> g(n * cols);
  *stray = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(got.size()); ++i) {
    const int64_t row = i / cols - kGuardRows;
    if (row < 0 || row >= n) {
      *stray += got[i] != kPoison;
    } else {
      g[row * cols + i % cols] = FromBf16(got[i]);
    }
  }
  *err = NormalisedError(g, ref);
  return true;
}

bool RunCase(const Case& c, const Inputs& in, const std::vector<Sm90GemmConfig>& da_configs,
             const std::vector<Sm90GemmConfig>& dx_configs) {
  const int32_t d = c.shard.d, h = c.shard.h, E = c.shard.expert_count;
  const int64_t n = in.n;
  DeviceBuffer<uint16_t> ddout(in.dout.size()), dw2(in.w2.size()), ddh(in.dh.size()),
      dw13(in.w13.size());
  DeviceBuffer<uint16_t> dda((n + 2 * kGuardRows) * h), ddx((n + 2 * kGuardRows) * d);
  DeviceBuffer<int32_t> doff(E + 1), dent(in.entries.size());
  for (void* ptr :
       {static_cast<void*>(ddout.ptr), static_cast<void*>(dw2.ptr), static_cast<void*>(ddh.ptr),
        static_cast<void*>(dw13.ptr), static_cast<void*>(dda.ptr), static_cast<void*>(ddx.ptr),
        static_cast<void*>(doff.ptr), static_cast<void*>(dent.ptr)}) {
    if (ptr == nullptr) {
      std::fprintf(stderr, "cudaMalloc failed\n");
      return false;
    }
  }
  CHECK_CUDA(cudaMemcpy(ddout.ptr, in.dout.data(), in.dout.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw2.ptr, in.w2.data(), in.w2.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(ddh.ptr, in.dh.data(), in.dh.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw13.ptr, in.w13.data(), in.w13.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(doff.ptr, in.offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(
      cudaMemcpy(dent.ptr, in.entries.data(), in.entries.size() * 4, cudaMemcpyHostToDevice));

  Sm90ExpertProblem prob = testing::MakeProblem(c.shard.tokens, c.shard.top_k, E, d, h, n);
  prob.w13_expert_stride = c.w13_pad > 0 ? 2 * static_cast<int64_t>(h) * d + c.w13_pad : -1;

  bool ok = true;
  for (const Sm90GemmConfig& cfg : da_configs) {
    if (!Poison(dda)) return false;
    CHECK_CUDA(LaunchSm90BackwardDA(prob, cfg, ddout.ptr, dw2.ptr, doff.ptr, dent.ptr,
                                    dda.ptr + kGuardRows * h, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    double err;
    int64_t stray;
    if (!Judge(dda, n, h, in.ref_da, &err, &stray)) return false;
    ok &= Report(c, cfg, "dA", err, stray);
  }
  for (const Sm90GemmConfig& cfg : dx_configs) {
    if (!Poison(ddx)) return false;
    CHECK_CUDA(LaunchSm90BackwardDX(prob, cfg, ddh.ptr, dw13.ptr, doff.ptr,
                                    ddx.ptr + kGuardRows * d, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    double err;
    int64_t stray;
    if (!Judge(ddx, n, d, in.ref_dx, &err, &stray)) return false;
    ok &= Report(c, cfg, "dX", err, stray);
  }
  return ok;
}

// What the launchers must refuse before any launch: a misaligned pointer, a [W1; W3] stride
// shorter than one block, the warp-specialised and ping-pong kernels with cp.async weights, a
// bad block_n.
bool GuardChecks() {
  Sm90ExpertProblem good;
  good.num_tokens = 64;
  good.top_k = 2;
  good.num_experts = 4;
  good.d_model = 128;
  good.d_hidden = 64;
  uint16_t* buf = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&buf), 1 << 22) != cudaSuccess) return false;
  const int32_t* idx = reinterpret_cast<const int32_t*>(buf);
  bool ok = true;
  auto expect = [&](const char* what, cudaError_t err) {
    const bool refused = err == cudaErrorInvalidValue;
    std::printf("%s %s refused (%s)\n", refused ? "PASS" : "FAIL", what, cudaGetErrorString(err));
    ok &= refused;
  };
  const Sm90GemmConfig cfg;
  expect("DA misaligned dout",
         LaunchSm90BackwardDA(good, cfg, buf + 1, buf, idx, idx, buf, nullptr));
  expect("DX misaligned dxg", LaunchSm90BackwardDX(good, cfg, buf, buf, idx, buf + 4, nullptr));
  Sm90ExpertProblem short_stride = good;
  short_stride.w13_expert_stride = 64 * 128;  // one of W1/W3, not the stacked pair
  expect("DX w13 stride < 2*h*d",
         LaunchSm90BackwardDX(short_stride, cfg, buf, buf, idx, buf, nullptr));
  Sm90GemmConfig ws = cfg;
  ws.warp_specialized = true;
  ws.tma_weights = false;
  expect("DA warp_specialized without TMA",
         LaunchSm90BackwardDA(good, ws, buf, buf, idx, idx, buf, nullptr));
  Sm90GemmConfig pp = cfg;
  pp.ping_pong = true;
  pp.tma_weights = false;
  expect("DX ping_pong without TMA", LaunchSm90BackwardDX(good, pp, buf, buf, idx, buf, nullptr));
  Sm90GemmConfig wide = cfg;
  wide.block_n = 192;
  expect("DX block_n=192", LaunchSm90BackwardDX(good, wide, buf, buf, idx, buf, nullptr));
  cudaFree(buf);
  return ok;
}

// only: run just the case of that name (all when null), e.g. a broken build's quick check.
int Main(const char* only) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 || !Sm90DeviceSupported(0)) {
    std::printf("SKIP: no sm_90 GPU\n");
    return 77;
  }
  // Sizes multiples of 8 but not 64 (except "medium"); shards that leave entries outside;
  // an empty expert; a hot expert spanning ragged multi-block groups; a padded w13 stride.
  const Case cases[] = {
      // name      T    K  Eg first cnt  d    h   empty hot   pad
      {{"odd", 37, 3, 9, 2, 5, 200, 136, 4, 3}, 0},
      {{"ragged", 700, 2, 6, 0, 6, 264, 72, -1, 5}, 64},
      {{"narrow", 300, 1, 3, 0, 3, 128, 64, 1, 0}, 0},
      {{"medium", 1024, 2, 8, 0, 8, 512, 256, 6, 2}, 0},
      {{"tail-k", 513, 4, 16, 4, 8, 136, 328, 9, 5}, 8},
      {{"wide", 400, 2, 4, 0, 4, 1000, 200, -1, 1}, 0},
      {{"one", 203, 1, 1, 0, 1, 192, 120, -1, -1}, 0},
      // Several tiles per CTA, so that the ping-pong consumers alternate more than once.
      {{"many", 2048, 4, 10, 1, 8, 520, 648, 6, 3}, 24},
  };
  bool ok = GuardChecks();
  uint64_t seed = 20261122;
  for (const Case& c : cases) {
    if (only != nullptr && std::strcmp(only, c.shard.name) != 0) continue;
    const Inputs in = MakeInputs(c, ++seed);
    const Sm90ExpertProblem prob = testing::MakeProblem(
        c.shard.tokens, c.shard.top_k, c.shard.expert_count, c.shard.d, c.shard.h, in.n);
    // {block_n, tma_weights, group_m, warp_specialized, ping_pong, multicast_b}: both tile
    // widths, TMA and cp.async weights, bands that do and do not divide the row-block counts,
    // the three kernels (ping-pong: 128x128 and 64x256 consumer tiles, with and without the
    // weight multicast over CTA pairs), and the engine's own choice (kernel_selection.h).
    std::vector<Sm90GemmConfig> da = {{256, true, 3},
                                      {128, true, 16},
                                      {256, false, 1},
                                      {128, false, 2},
                                      {256, true, 1},
                                      {256, true, 5, true},
                                      {128, true, 16, true},
                                      {128, true, 16, false, true},
                                      {256, true, 3, false, true},
                                      {128, true, 1, false, true},
                                      {256, true, 16, false, true},
                                      {256, true, 3, false, true, true},
                                      {128, true, 16, false, true, true},
                                      {256, true, 1, false, true, true}};
    std::vector<Sm90GemmConfig> dx = da;
    da.push_back(cuda::Sm90ChooseConfig(prob, cuda::Sm90Projection::kBackwardDA, 132));
    dx.push_back(cuda::Sm90ChooseConfig(prob, cuda::Sm90Projection::kBackwardDX, 132));
    ok &= RunCase(c, in, da, dx);
  }
  std::printf(ok ? "ALL PASSED\n" : "SOME CHECKS FAILED\n");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace moe::kernels

// Usage: sm90_expert_backward_test [CASE]
int main(int argc, char** argv) { return moe::kernels::Main(argc > 1 ? argv[1] : nullptr); }
