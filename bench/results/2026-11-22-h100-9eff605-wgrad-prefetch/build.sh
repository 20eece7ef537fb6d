#!/usr/bin/env bash
# Builds the weight-gradient index prefetch experiment into .carry/wp (then .carry/wpx, xz):
# scripts/gpu-check's seven test binaries (build-jc, the working tree's kernels: the gathered
# operand's index entries fetched two slabs ahead), sm90_weight_grad_bench over the same kernels
# ("pf") and over 7529f6b's ("base", .carry/ab), and moe_bench over the working tree (build-d).
set -euo pipefail
cd /work/main
dir=.carry/wp
rm -rf "$dir"; mkdir -p "$dir"
cmake --build build-jc --target moe_kernels_cuda_test moe_cuda_discovery_test \
  moe_fused_forward_decision_test moe_engine_cuda_test sm90_expert_forward_test \
  sm90_expert_backward_test sm90_weight_grad_test > /dev/null
for t in moe_kernels_cuda_test sm90_expert_forward_test sm90_expert_backward_test \
         sm90_weight_grad_test; do cp build-jc/tests/kernels/cuda/$t "$dir/"; done
for t in moe_cuda_discovery_test moe_fused_forward_decision_test moe_engine_cuda_test; do
  cp build-jc/tests/engine/cuda/$t "$dir/"
done
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -o "$dir/sm90_weight_grad_bench_pf" \
  bench/sm90_weight_grad_bench.cu kernels/cuda/sm90_weight_grad.cu kernels/cuda/sm90_expert_forward.cu \
  kernels/cpu/dispatch.cc -lcublas
cp .carry/ab/sm90_weight_grad_bench_base "$dir/"
cmake --build build-d --target moe_bench > /dev/null
cp build-d/bench/moe_bench "$dir/"
git rev-parse --short HEAD > "$dir/COMMIT"
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir"/*_test "$dir"/sm90_weight_grad_bench_* "$dir/moe_bench" > /dev/null
rm -rf .carry/wpx && mkdir -p .carry/wpx && tar -C .carry -cf - wp | xz -T2 -3 > .carry/wpx/wp.tar.xz
ls -la .carry/wpx
