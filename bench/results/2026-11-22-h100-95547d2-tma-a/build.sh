#!/usr/bin/env bash
# Builds the TMA-for-A experiment's carry into .carry/tma: the seven GPU test binaries of
# scripts/gpu-check from build-jc (the working tree's kernels: the ws kernel's producer loads
# full tiles of a slot-order A by TMA), sm90_bench and sm90_backward_bench over the same
# kernels ("tma"), and the same two benches over 7529f6b's kernels ("base", .carry/ab).
set -euo pipefail
cd /work/main
dir=.carry/tma
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
$nv -o "$dir/sm90_backward_bench_tma" "$o/bb.o" "$o/bwd.o" "$o/fwd.o" "$o/act_bwd.o" "$o/dispatch.o" -lcublas
$nv -o "$dir/sm90_bench_tma" "$o/fb.o" "$o/fwd.o" "$o/dispatch.o" -lcublas
cp .carry/ab/sm90_bench_base .carry/ab/sm90_backward_bench_base "$dir/"
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir"/*_test "$dir"/sm90_*bench_*
du -sh "$dir"
