#!/usr/bin/env bash
# Builds the TMA-for-A experiment (plain kernel too) into .carry/tp: the seven GPU test binaries
# of scripts/gpu-check from build-jc (the working tree's kernels: the plain and ws kernels load
# full tiles of a slot-order A by TMA), sm90_bench and sm90_backward_bench over the same
# kernels ("tp"), and the same two benches over 7529f6b's kernels ("base", .carry/ab).
set -euo pipefail
cd /work/main
dir=.carry/tp
rm -rf "$dir"; mkdir -p "$dir"
cmake --build build-jc --target moe_kernels_cuda_test moe_cuda_discovery_test \
  moe_fused_forward_decision_test moe_engine_cuda_test sm90_expert_forward_test \
  sm90_expert_backward_test sm90_weight_grad_test > /dev/null
for t in moe_kernels_cuda_test sm90_expert_forward_test sm90_expert_backward_test \
         sm90_weight_grad_test; do cp build-jc/tests/kernels/cuda/$t "$dir/"; done
for t in moe_cuda_discovery_test moe_fused_forward_decision_test moe_engine_cuda_test; do
  cp build-jc/tests/engine/cuda/$t "$dir/"
done
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I."
o=$(mktemp -d); trap 'rm -rf "$o"' EXIT
$nv -c kernels/cuda/sm90_expert_forward.cu -o "$o/fwd.o" &
$nv -c kernels/cuda/sm90_expert_backward.cu -o "$o/bwd.o" &
wait
$nv -c kernels/cpu/dispatch.cc -o "$o/dispatch.o" &
$nv -c kernels/cuda/expert_backward.cu -o "$o/act_bwd.o" &
wait
$nv -c bench/sm90_backward_bench.cu -o "$o/bb.o" &
$nv -c bench/sm90_bench.cu -o "$o/fb.o" &
wait
$nv -o "$dir/sm90_backward_bench_tp" "$o/bb.o" "$o/bwd.o" "$o/fwd.o" "$o/act_bwd.o" "$o/dispatch.o" -lcublas
$nv -o "$dir/sm90_bench_tp" "$o/fb.o" "$o/fwd.o" "$o/dispatch.o" -lcublas
cp .carry/ab/sm90_bench_base .carry/ab/sm90_backward_bench_base "$dir/"
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir"/*_test "$dir"/sm90_*bench_*
du -sh "$dir"
# The row-shifted box (both kernels) in the two sm90 test binaries: their checks of full tiles of
# a slot-order A must FAIL, for the plain kernel (ws=0) as for the ws one.
o2=$(mktemp -d)
mkdir -p "$o2/broken/kernels/cuda"
sed 's/TmaLoad2d(s_a, \&p.tmap_a, bar, k0, \(ti\|ld\).slot0);/TmaLoad2d(s_a, \&p.tmap_a, bar, k0, \1.slot0 + 1);/' \
  kernels/cuda/sm90_grouped_gemm.cuh > "$o2/broken/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff kernels/cuda/sm90_grouped_gemm.cuh "$o2/broken/kernels/cuda/sm90_grouped_gemm.cuh" | grep -c '^>')" = 2 ] ||
  { echo "rowshift variant did not change both boxes" >&2; exit 1; }
nb="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I$o2/broken -I."
$nb -c kernels/cuda/sm90_expert_forward.cu -o "$o2/fwd.o" &
$nb -c kernels/cuda/sm90_expert_backward.cu -o "$o2/bwd.o" &
wait
$nb -c tests/kernels/cuda/sm90_expert_forward_test.cc -o "$o2/ft.o" &
$nb -c tests/kernels/cuda/sm90_expert_backward_test.cc -o "$o2/bt.o" &
wait
$nb -c kernels/cpu/dispatch.cc -o "$o2/dispatch.o"
$nb -o "$dir/sm90_expert_forward_test_rowshift" "$o2/ft.o" "$o2/fwd.o" "$o2/dispatch.o"
$nb -o "$dir/sm90_expert_backward_test_rowshift" "$o2/bt.o" "$o2/bwd.o" "$o2/fwd.o" "$o2/dispatch.o"
rm -rf "$o2"
cmake --build build-d --target moe_bench > /dev/null
cp build-d/bench/moe_bench "$dir/"
git rev-parse --short HEAD > "$dir/COMMIT"
/work/shared/tools/device-bundle "$dir" "$dir"/*_rowshift "$dir/moe_bench" > /dev/null
rm -rf .carry/tpx && mkdir -p .carry/tpx && tar -C .carry -cf - tp | xz -T2 -3 > .carry/tpx/tp.tar.xz
ls -la .carry/tpx
