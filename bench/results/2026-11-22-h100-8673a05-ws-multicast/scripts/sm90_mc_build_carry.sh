#!/usr/bin/env bash
# Builds, on a machine with nvcc but no GPU, what one device call needs to check and time the
# warp-specialised grouped GEMM with the weight multicast over 2-CTA clusters
# (sm90_grouped_gemm_ws_kernel<..., kMulticastB>), into DIR (default .carry/mc, git-ignored):
#   sm90_expert_forward_test, sm90_expert_backward_test   the tests, every config incl. ws+mc
#   *_mcsame   the same tests over kernels whose two CTAs of a cluster load and multicast the
#              SAME half of every weight tile (K-major kPlain: both the first kN/2 rows; kSwiGLU:
#              both the W1 box; MN-major: both the even 64-column boxes), so the other half of the
#              slot keeps stale data while every barrier still gets its bytes: every multicast
#              check (ws and ping-pong) must FAIL, the others pass
#   sm90_mc_bench      the interleaved default-vs-ws+mc timing (bench/sm90_mc_bench.cu)
#   sm90_mc_bench_capped   the same over launchers whose grid is capped at MOE_SM90_CTA_CAP CTAs
#              (a shadow sm90_launch.cuh; unset: as built), so that the one-CTA-per-SM kernels
#              can be timed on as many SMs as the 2-CTA-cluster grid gets
#   sm90_mc_bench_pair   the same bench over kernels whose multicast_b keeps the 2-CTA clusters,
#              their 256-row tile pairs and the cross-CTA slot release, but WITHOUT the
#              multicast: each CTA loads its whole weight tile by plain TMA (shadow headers;
#              full-height weight boxes): what the pairing's lockstep costs by itself
#   sm90_bench, sm90_backward_bench   the tile sweeps, now with ws+mc rows
# plus torch_moe_reference.py, bundled libraries and COMMIT. Usage: sm90_mc_build_carry.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.carry/mc}
mkdir -p "$dir"
obj=$(mktemp -d)
trap 'rm -rf "$obj"' EXIT
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
hdr=kernels/cuda/sm90_grouped_gemm.cuh

# The broken header, in a shadow include root searched first; it must change exactly 3 lines.
mkdir -p "$obj/mcsame/kernels/cuda"
sed -e 's/for (int q = rank; q < kN \/ 64; q += 2) {/for (int q = 0; q < kN \/ 64; q += 2) {/' \
    -e 's/rank ? &p.tmap_b1 : &p.tmap_b0, bar, k0, n0,/\&p.tmap_b0, bar, k0, n0,/' \
    -e 's/bar, k0, n0 + rank \* kN \/ 2, expert,/bar, k0, n0, expert,/' \
  $hdr > "$obj/mcsame/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff $hdr "$obj/mcsame/kernels/cuda/sm90_grouped_gemm.cuh" | grep -c '^>')" = 3 ] ||
  { echo "mcsame variant did not change the three multicast loads" >&2; exit 1; }

# The capped launcher, likewise: both persistent launches read the cap through CappedSmCount.
mkdir -p "$obj/capped/kernels/cuda"
python3 - kernels/cuda/sm90_launch.cuh "$obj/capped/kernels/cuda/sm90_launch.cuh" <<'PY'
import sys
s = open(sys.argv[1]).read()
assert s.count("const int sms = SmCount();") == 2
s = s.replace("const int sms = SmCount();", "const int sms = CappedSmCount();")
fn = """
#include <cstdlib>
inline int CappedSmCount() {
  static const int cap = [] {
    const char* v = std::getenv("MOE_SM90_CTA_CAP");
    return v ? std::atoi(v) : 0;
  }();
  const int sms = SmCount();
  return cap > 0 && cap < sms ? cap : sms;
}
"""
anchor = "// The compile-time choices of one use of the grouped GEMM"
assert s.count(anchor) == 1
s = s.replace(anchor, fn + anchor)
open(sys.argv[2], "w").write(s)
PY

# The pair-without-multicast kernels (sm90_mc_bench_pair).
mkdir -p "$obj/pair/kernels/cuda"
old='TmaLoadWeightsMulticast<kN, kSwiGLU, kTransB>(p, s_b, bar, k0, n0, expert, rank);'
new='TmaLoadWeights<kN, kSwiGLU, kTransB>(p, s_b, bar, k0, n0, expert);'
sed "s/$old/$new/" $hdr > "$obj/pair/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff $hdr "$obj/pair/kernels/cuda/sm90_grouped_gemm.cuh" | grep -c '^>')" = 1 ] ||
  { echo "pair variant did not replace the multicast load" >&2; exit 1; }
sed 's/const bool halves = kSwiGLU || config.multicast_b;/const bool halves = kSwiGLU;/' \
  kernels/cuda/sm90_launch.cuh > "$obj/pair/kernels/cuda/sm90_launch.cuh"
[ "$(diff kernels/cuda/sm90_launch.cuh "$obj/pair/kernels/cuda/sm90_launch.cuh" | grep -c '^>')" = 1 ] ||
  { echo "pair variant did not restore full-height boxes" >&2; exit 1; }

$nv -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd.o" &
$nv -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd.o" &
wait
$nv -I"$obj/mcsame" -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd_mcsame.o" &
$nv -I"$obj/mcsame" -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd_mcsame.o" &
wait
$nv -I"$obj/capped" -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd_capped.o" &
$nv -I"$obj/capped" -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd_capped.o" &
wait
$nv -I"$obj/pair" -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd_pair.o" &
$nv -I"$obj/pair" -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd_pair.o" &
wait
$nv -I. -c kernels/cpu/dispatch.cc -o "$obj/dispatch.o" &
$nv -I. -c kernels/cuda/expert_backward.cu -o "$obj/act_bwd.o" &
wait
$nv -I. -c tests/kernels/cuda/sm90_expert_forward_test.cc -o "$obj/fwd_test.o" &
$nv -I. -c tests/kernels/cuda/sm90_expert_backward_test.cc -o "$obj/bwd_test.o" &
wait
$nv -I. -DMOE_MC_BENCH_VARIANT='"pair-no-multicast"' -c bench/sm90_mc_bench.cu \
  -o "$obj/mcbench_pair.o" &
$nv -I. -DMOE_MC_BENCH_VARIANT='"multicast"' -c bench/sm90_mc_bench.cu -o "$obj/mcbench.o" &
$nv -I. -c bench/sm90_bench.cu -o "$obj/bench.o" &
wait
$nv -I. -c bench/sm90_backward_bench.cu -o "$obj/bbench.o"
for v in "" _mcsame; do
  $nv -o "$dir/sm90_expert_forward_test$v" "$obj/fwd_test.o" "$obj/fwd$v.o" "$obj/dispatch.o"
  $nv -o "$dir/sm90_expert_backward_test$v" "$obj/bwd_test.o" "$obj/bwd$v.o" "$obj/fwd$v.o" \
    "$obj/dispatch.o"
done
$nv -o "$dir/sm90_mc_bench" "$obj/mcbench.o" "$obj/bwd.o" "$obj/fwd.o" "$obj/dispatch.o" -lcublas
$nv -o "$dir/sm90_mc_bench_capped" "$obj/mcbench.o" "$obj/bwd_capped.o" "$obj/fwd_capped.o" \
  "$obj/dispatch.o" -lcublas
$nv -o "$dir/sm90_mc_bench_pair" "$obj/mcbench_pair.o" "$obj/bwd_pair.o" "$obj/fwd_pair.o" \
  "$obj/dispatch.o" -lcublas
$nv -o "$dir/sm90_bench" "$obj/bench.o" "$obj/fwd.o" "$obj/dispatch.o" -lcublas
$nv -o "$dir/sm90_backward_bench" "$obj/bbench.o" "$obj/bwd.o" "$obj/fwd.o" "$obj/act_bwd.o" \
  "$obj/dispatch.o" -lcublas
cp /work/shared/bench/torch_moe_reference.py "$dir/"
cp bench/sm90_mc_device_run.sh "$dir/run.sh"
cp bench/sm90_mc_device_run_cap.sh "$dir/run_cap.sh"
cp bench/sm90_mc_device_run_pair.sh "$dir/run_pair.sh"
git rev-parse --short HEAD > "$dir/COMMIT"
git diff --quiet HEAD -- kernels tests bench || echo "(with uncommitted changes)" >> "$dir/COMMIT"
/work/shared/tools/device-bundle "$dir" "$dir"/sm90_expert_*_test* "$dir/sm90_mc_bench" \
  "$dir/sm90_bench" "$dir/sm90_backward_bench"
ls -la "$dir"
