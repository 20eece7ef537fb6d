#!/usr/bin/env bash
# Builds the TMA-store experiment's binaries into .carry/ts: the backward carry (tests, bench),
# sm90_bench, and a backward test over a StoreTileTma without the staging swizzle (must fail).
set -euo pipefail
cd /work/main
dir=.carry/ts
rm -rf "$dir"; mkdir -p "$dir"
bash bench/sm90_backward_build_carry.sh "$dir" > /tmp/ts/carry.log 2>&1
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
obj=$(mktemp -d)
mkdir -p "$obj/broken/kernels/cuda"
sed 's/(((i \& 7) ^ (row \& 7)) << 4) +$/((i \& 7) << 4) +/' kernels/cuda/sm90_grouped_gemm.cuh > "$obj/broken/kernels/cuda/sm90_grouped_gemm.cuh"
[ "$(diff kernels/cuda/sm90_grouped_gemm.cuh "$obj/broken/kernels/cuda/sm90_grouped_gemm.cuh" | grep -c '^>')" = 1 ] || { echo "tsbroken variant did not change" >&2; exit 1; }
$nv -I"$obj/broken" -I. -o "$dir/sm90_expert_backward_test_tsbroken" tests/kernels/cuda/sm90_expert_backward_test.cc \
  kernels/cuda/sm90_expert_backward.cu kernels/cuda/sm90_expert_forward.cu kernels/cpu/dispatch.cc &
$nv -I. -o "$dir/sm90_bench" bench/sm90_bench.cu kernels/cuda/sm90_expert_forward.cu kernels/cpu/dispatch.cc -lcublas &
wait
rm -rf "$obj"
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir/sm90_expert_backward_test_tsbroken" "$dir/sm90_bench" >> /tmp/ts/carry.log 2>&1
ls -la "$dir" "$dir/lib"
