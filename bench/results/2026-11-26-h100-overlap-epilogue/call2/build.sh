#!/usr/bin/env bash
# Fourteenth session: builds, on the CPU machine, what run.sh checks and times on the GPU
# machine, into .carry/ov (git-ignored): the fused forward and backward tests, the same tests
# over a mutant whose ws consumers never store the CTA's last held tile and whose direct stores
# skip half the quad transpose (its overlap_epilogue and direct_epilogue checks must FAIL: proof
# that the tests see both paths), and the forward and backward kernel benches, whose sweeps time
# the ws kernel with each epilogue.
set -euo pipefail
cd "$(dirname "$0")/../../.."
K=.carry/ov
mkdir -p $K
obj=$(mktemp -d)
trap 'rm -rf "$obj"' EXIT
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
mkdir -p "$obj/mutant/kernels/cuda"
sed -e 's/^\( *\)for (int cc = 0; cc < kChunks; ++cc) store_held(cc);$/\1for (int cc = 0; cc < 0; ++cc) store_held(cc);/' \
    -e 's/^  v\[1\] = b1 ? v\[1\] : r0;$/  v[1] = b1 ? v[1] : v[1];/' \
  kernels/cuda/sm90_grouped_gemm.cuh > "$obj/mutant/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff kernels/cuda/sm90_grouped_gemm.cuh "$obj/mutant/kernels/cuda/sm90_grouped_gemm.cuh" |
  grep -c '^>')" = 2 ] || { echo "mutant did not change both places" >&2; exit 1; }
$nv -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd.o" &
$nv -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd.o" &
wait
$nv -I"$obj/mutant" -I. -c kernels/cuda/sm90_expert_forward.cu -o "$obj/fwd_mutant.o" &
$nv -I"$obj/mutant" -I. -c kernels/cuda/sm90_expert_backward.cu -o "$obj/bwd_mutant.o" &
wait
$nv -I. -c kernels/cpu/dispatch.cc -o "$obj/dispatch.o" &
$nv -I. -c kernels/cuda/expert_backward.cu -o "$obj/act_bwd.o" &
wait
$nv -I. -c tests/kernels/cuda/sm90_expert_backward_test.cc -o "$obj/bwd_test.o" &
$nv -I. -c tests/kernels/cuda/sm90_expert_forward_test.cc -o "$obj/fwd_test.o" &
wait
$nv -I. -c bench/sm90_backward_bench.cu -o "$obj/bwd_bench.o" &
$nv -I. -c bench/sm90_bench.cu -o "$obj/fwd_bench.o" &
wait
$nv -o $K/sm90_expert_forward_test "$obj/fwd_test.o" "$obj/fwd.o" "$obj/dispatch.o"
$nv -o $K/sm90_expert_forward_test_mutant "$obj/fwd_test.o" "$obj/fwd_mutant.o" "$obj/dispatch.o"
$nv -o $K/sm90_expert_backward_test "$obj/bwd_test.o" "$obj/bwd.o" "$obj/fwd.o" "$obj/dispatch.o"
$nv -o $K/sm90_expert_backward_test_mutant "$obj/bwd_test.o" "$obj/bwd_mutant.o" \
  "$obj/fwd_mutant.o" "$obj/dispatch.o"
$nv -o $K/sm90_bench "$obj/fwd_bench.o" "$obj/fwd.o" "$obj/dispatch.o" -lcublas
$nv -o $K/sm90_backward_bench "$obj/bwd_bench.o" "$obj/bwd.o" "$obj/fwd.o" "$obj/act_bwd.o" \
  "$obj/dispatch.o" -lcublas
cp /work/shared/bench/torch_moe_reference.py $K/
git rev-parse HEAD > $K/COMMIT
git diff --stat >> $K/COMMIT
/work/shared/tools/device-bundle $K $K/sm90_expert_forward_test $K/sm90_bench \
  $K/sm90_backward_bench $K/sm90_expert_backward_test
ls -la $K
