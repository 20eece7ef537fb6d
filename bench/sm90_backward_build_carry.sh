#!/usr/bin/env bash
# Builds, on a machine with nvcc but no GPU, the self-contained binaries that check and time the
# fused backward's data gradients on the GPU machine, into DIR (default .carry/b, git-ignored):
#   sm90_expert_backward_test          the test (exit 0 pass, 1 fail, 77 no sm_90 GPU)
#   sm90_expert_backward_test_swapped  the same test over a kernel whose MN-major descriptor has
#                                      its two byte offsets swapped: it must FAIL, proof that the
#                                      test can see a wrong weight layout
#   sm90_expert_backward_test_droptile the same test over a LaunchSm90BackwardDH whose dp
#                                      reduction leaves out the last column tile: its dp checks
#                                      with more than one tile must FAIL (one-tile ones pass)
#   sm90_expert_forward_test           the forward's test, rebuilt over the shared kernel
#   sm90_backward_bench                DA/DX vs per-expert cuBLAS on the presets; with --dh,
#                                      DH vs DA + the activation backward it replaces
# then bundles the shared libraries the GPU machine lacks. Usage: sm90_backward_build_carry.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.carry/b}
mkdir -p "$dir"
obj=$(mktemp -d)
trap 'rm -rf "$obj"' EXIT
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"

# The swapped-offset kernel header, in a shadow include root searched first.
mkdir -p "$obj/broken/kernels/cuda"
sed -e 's/^constexpr uint32_t kMnLbo = kMnBlockBytes;/constexpr uint32_t kMnLbo = 8 * 128;/' \
    -e 's/^constexpr uint32_t kMnSbo = 8 \* 128;/constexpr uint32_t kMnSbo = kMnBlockBytes;/' \
  kernels/cuda/sm90_grouped_gemm.cuh > "$obj/broken/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff kernels/cuda/sm90_grouped_gemm.cuh "$obj/broken/kernels/cuda/sm90_grouped_gemm.cuh" |
  grep -c '^>')" = 2 ] || { echo "swapped variant did not change both offsets" >&2; exit 1; }
# The dp reduction that drops the last column tile.
sed -e 's/for (int t = 1; t < n_tiles; ++t) sum +=/for (int t = 1; t < n_tiles - 1; ++t) sum +=/' \
  kernels/cuda/sm90_expert_backward.cu > "$obj/bwd_droptile.cu"
[ "$(diff kernels/cuda/sm90_expert_backward.cu "$obj/bwd_droptile.cu" | grep -c '^>')" = 1 ] ||
  { echo "droptile variant did not change the reduction" >&2; exit 1; }

$nv -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd.o" &
$nv -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd.o" &
wait
$nv -I"$obj/broken" -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd_swapped.o" &
$nv -I. -c kernels/cpu/dispatch.cc -o "$obj/dispatch.o" &
wait
$nv -I. -c "$obj/bwd_droptile.cu" -o "$obj/bwd_droptile.o" &
$nv -I. -c kernels/cuda/expert_backward.cu -o "$obj/act_bwd.o" &
wait
$nv -I. -c tests/kernels/cuda/sm90_expert_backward_test.cc -o "$obj/bwd_test.o" &
$nv -I. -c tests/kernels/cuda/sm90_expert_forward_test.cc -o "$obj/fwd_test.o" &
wait
$nv -I. -c bench/sm90_backward_bench.cu -o "$obj/bench.o"
$nv -o "$dir/sm90_expert_backward_test" "$obj/bwd_test.o" "$obj/bwd.o" "$obj/fwd.o" \
  "$obj/dispatch.o"
$nv -o "$dir/sm90_expert_backward_test_swapped" "$obj/bwd_test.o" "$obj/bwd_swapped.o" \
  "$obj/fwd.o" "$obj/dispatch.o"
$nv -o "$dir/sm90_expert_backward_test_droptile" "$obj/bwd_test.o" "$obj/bwd_droptile.o" \
  "$obj/fwd.o" "$obj/dispatch.o"
$nv -o "$dir/sm90_expert_forward_test" "$obj/fwd_test.o" "$obj/fwd.o" "$obj/dispatch.o"
$nv -o "$dir/sm90_backward_bench" "$obj/bench.o" "$obj/bwd.o" "$obj/fwd.o" "$obj/act_bwd.o" \
  "$obj/dispatch.o" -lcublas
/work/shared/tools/device-bundle "$dir" "$dir/sm90_expert_backward_test" \
  "$dir/sm90_expert_backward_test_swapped" "$dir/sm90_expert_backward_test_droptile" \
  "$dir/sm90_expert_forward_test" "$dir/sm90_backward_bench"
ls -la "$dir"
