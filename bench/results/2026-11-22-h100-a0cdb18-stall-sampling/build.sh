#!/usr/bin/env bash
# Builds sm90_backward_bench and sm90_bench with -lineinfo into .carry/ls, for Nsight Compute's
# per-instruction stall sampling of the kernels as they are.
set -euo pipefail
cd /work/main
dir=.carry/ls
rm -rf "$dir"; mkdir -p "$dir"
nv="nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I."
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
$nv -o "$dir/sm90_backward_bench" "$o/bb.o" "$o/bwd.o" "$o/fwd.o" "$o/act_bwd.o" "$o/dispatch.o" -lcublas
$nv -o "$dir/sm90_bench" "$o/fb.o" "$o/fwd.o" "$o/dispatch.o" -lcublas
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir/sm90_backward_bench" "$dir/sm90_bench"
