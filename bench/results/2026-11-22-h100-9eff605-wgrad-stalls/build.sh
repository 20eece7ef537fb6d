#!/usr/bin/env bash
# Builds sm90_weight_grad_bench with -lineinfo into .carry/lw, for Nsight Compute's
# per-instruction stall sampling of the weight-gradient kernel as it is.
set -euo pipefail
cd /work/main
dir=.carry/lw
rm -rf "$dir"; mkdir -p "$dir"
nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I. \
  -o "$dir/sm90_weight_grad_bench" bench/sm90_weight_grad_bench.cu \
  kernels/cuda/sm90_weight_grad.cu kernels/cuda/sm90_expert_forward.cu kernels/cpu/dispatch.cc -lcublas
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir/sm90_weight_grad_bench"
