#!/usr/bin/env bash
# Fourteenth session: builds into .carry/sk (then .carry/skx, xz) what run.sh checks and times:
#   base/    the three kernel benches over the kernels of HEAD (sm90_grouped_gemm.cuh and
#            sm90_weight_grad.cuh as committed, from git), for the A/B;
#   skip/    the same benches over the working tree's kernels (a warpgroup whose 64 rows are
#            all past an expert's last row issues no wgmma and stores nothing; the weight
#            gradients issue no k16 step past an expert's last row);
#   mutant/  the fused forward and weight-gradient tests over kernels that also skip a
#            warpgroup with SOME rows (ws, plain) and the last k16 step that still has rows:
#            they must fail, proof that the tests reach both skips;
#   top      scripts/gpu-check's seven test binaries and moe_bench (build/, the working tree).
set -euo pipefail
cd "$(dirname "$0")/../../.."
K=.carry/sk
rm -rf $K; mkdir -p $K/base $K/skip $K/mutant
obj=$(mktemp -d)
trap 'rm -rf "$obj"' EXIT
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
mkdir -p $obj/base/kernels/cuda $obj/mutant/kernels/cuda
for h in sm90_grouped_gemm.cuh sm90_weight_grad.cuh; do
  git show HEAD:kernels/cuda/$h > $obj/base/kernels/cuda/$h
done
sed -e 's/const bool has_rows = wg \* 64 < ti.rows;/const bool has_rows = wg * 64 + 64 <= ti.rows;/' \
    -e 's/const bool has_rows = cw \* 64 < ti.rows;/const bool has_rows = cw * 64 + 64 <= ti.rows;/' \
  kernels/cuda/sm90_grouped_gemm.cuh > $obj/mutant/kernels/cuda/sm90_grouped_gemm.cuh
sed -e 's/if (j == 0 || j \* 16 < rows_left) {/if (j == 0 || j * 16 + 16 < rows_left) {/' \
  kernels/cuda/sm90_weight_grad.cuh > $obj/mutant/kernels/cuda/sm90_weight_grad.cuh
[ "$(diff kernels/cuda/sm90_grouped_gemm.cuh $obj/mutant/kernels/cuda/sm90_grouped_gemm.cuh | grep -c '^>')" = 2 ] &&
[ "$(diff kernels/cuda/sm90_weight_grad.cuh $obj/mutant/kernels/cuda/sm90_weight_grad.cuh | grep -c '^>')" = 1 ] ||
  { echo "mutant did not change the three places" >&2; exit 1; }
for v in base skip mutant; do
  inc="-I."; [ $v = skip ] || inc="-I$obj/$v -I."
  for k in sm90_expert_forward sm90_expert_backward sm90_weight_grad; do
    $nv $inc -c kernels/cuda/$k.cu -o $obj/$v-$k.o &
  done
  wait
done
$nv -I. -c kernels/cpu/dispatch.cc -o $obj/dispatch.o &
$nv -I. -c kernels/cuda/expert_backward.cu -o $obj/act_bwd.o &
wait
for b in sm90_bench sm90_backward_bench sm90_weight_grad_bench; do $nv -I. -c bench/$b.cu -o $obj/$b.o & done; wait
$nv -I. -c tests/kernels/cuda/sm90_expert_forward_test.cc -o $obj/fwd_test.o &
$nv -I. -c tests/kernels/cuda/sm90_weight_grad_test.cc -o $obj/wg_test.o &
wait
$nv -I$obj/mutant -I. -c tests/kernels/cuda/sm90_weight_grad_variants.cu -o $obj/wg_variants_mutant.o
for v in base skip; do
  $nv -o $K/$v/sm90_bench $obj/sm90_bench.o $obj/$v-sm90_expert_forward.o $obj/dispatch.o -lcublas
  $nv -o $K/$v/sm90_backward_bench $obj/sm90_backward_bench.o $obj/$v-sm90_expert_backward.o \
    $obj/$v-sm90_expert_forward.o $obj/act_bwd.o $obj/dispatch.o -lcublas
  $nv -o $K/$v/sm90_weight_grad_bench $obj/sm90_weight_grad_bench.o $obj/$v-sm90_weight_grad.o \
    $obj/$v-sm90_expert_forward.o $obj/dispatch.o -lcublas
done
$nv -o $K/mutant/sm90_expert_forward_test $obj/fwd_test.o $obj/mutant-sm90_expert_forward.o $obj/dispatch.o
$nv -o $K/mutant/sm90_weight_grad_test $obj/wg_test.o $obj/wg_variants_mutant.o \
  $obj/mutant-sm90_weight_grad.o $obj/mutant-sm90_expert_forward.o $obj/dispatch.o
cmake --build build --target moe_kernels_cuda_test moe_cuda_discovery_test \
  moe_fused_forward_decision_test moe_engine_cuda_test sm90_expert_forward_test \
  sm90_expert_backward_test sm90_weight_grad_test moe_bench > /dev/null
for t in moe_kernels_cuda_test sm90_expert_forward_test sm90_expert_backward_test \
         sm90_weight_grad_test; do cp build/tests/kernels/cuda/$t $K/; done
for t in moe_cuda_discovery_test moe_fused_forward_decision_test moe_engine_cuda_test; do
  cp build/tests/engine/cuda/$t $K/
done
cp build/bench/moe_bench $K/
{ git rev-parse --short HEAD; git diff --stat; } > $K/COMMIT
cp /work/shared/bench/torch_moe_reference.py $K/
/work/shared/tools/device-bundle $K $K/*_test $K/moe_bench $K/base/* > /dev/null
rm -rf .carry/skx && mkdir -p .carry/skx && tar -C .carry -cf - sk | xz -T2 -3 > .carry/skx/sk.tar.xz
ls -la .carry/skx
