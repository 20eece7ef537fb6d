#!/usr/bin/env bash
# Builds into .carry/te: moe_bench over 67c219d's kernels (build-d), and the two sm90 test
# binaries over a ws kernel whose TMA box of A starts one row late ("rowshift"): their checks
# of the ws kernel on full tiles must FAIL, proof that the tests see the TMA path.
set -euo pipefail
cd /work/main
dir=.carry/te
rm -rf "$dir"; mkdir -p "$dir"
cmake --build build-d --target moe_bench > /dev/null
cp build-d/bench/moe_bench "$dir/"
git rev-parse --short HEAD > "$dir/COMMIT"
o=$(mktemp -d); trap 'rm -rf "$o"' EXIT
mkdir -p "$o/broken/kernels/cuda"
sed 's/if (tma_a) TmaLoad2d(s_a, \&p.tmap_a, bar, k0, ti.slot0);/if (tma_a) TmaLoad2d(s_a, \&p.tmap_a, bar, k0, ti.slot0 + 1);/' \
  kernels/cuda/sm90_grouped_gemm.cuh > "$o/broken/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff kernels/cuda/sm90_grouped_gemm.cuh "$o/broken/kernels/cuda/sm90_grouped_gemm.cuh" | grep -c '^>')" = 1 ] ||
  { echo "rowshift variant did not change the box" >&2; exit 1; }
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I$o/broken -I."
$nv -c kernels/cuda/sm90_expert_forward.cu -o "$o/fwd.o" &
$nv -c kernels/cuda/sm90_expert_backward.cu -o "$o/bwd.o" &
wait
$nv -c kernels/cpu/dispatch.cc -o "$o/dispatch.o" &
$nv -c tests/kernels/cuda/sm90_expert_forward_test.cc -o "$o/ft.o" &
wait
$nv -c tests/kernels/cuda/sm90_expert_backward_test.cc -o "$o/bt.o"
$nv -o "$dir/sm90_expert_forward_test_rowshift" "$o/ft.o" "$o/fwd.o" "$o/dispatch.o"
$nv -o "$dir/sm90_expert_backward_test_rowshift" "$o/bt.o" "$o/bwd.o" "$o/fwd.o" "$o/dispatch.o"
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir/moe_bench" "$dir"/*_rowshift
du -sh "$dir"
