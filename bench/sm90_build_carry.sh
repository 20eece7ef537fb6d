#!/usr/bin/env bash
# Builds, on a machine with nvcc but no GPU, the self-contained binaries that
# bench/sm90_device_run.sh runs on the GPU machine, into .carry/e (git-ignored): the fused
# forward test, a copy of it built with the A-tile swizzle removed (it must fail: proof the
# test can catch a layout bug), and the benchmark; plus torch_moe_reference.py.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.carry/e
mkdir -p "$dir"
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
$nv -I. -o "$dir/sm90_expert_forward_test" tests/kernels/cuda/sm90_expert_forward_test.cc \
  kernels/cuda/sm90_expert_forward.cu kernels/cpu/dispatch.cc
broken=$(mktemp -d)
mkdir -p "$broken/kernels/cuda"
sed 's/((chunk ^ (r \& 7)) << 4), ok ? a_row/(chunk << 4), ok ? a_row/' \
  kernels/cuda/sm90_grouped_gemm.cuh > "$broken/kernels/cuda/sm90_grouped_gemm.cuh"
cmp -s kernels/cuda/sm90_grouped_gemm.cuh "$broken/kernels/cuda/sm90_grouped_gemm.cuh" &&
  { echo "broken variant identical to the original" >&2; exit 1; }
cp kernels/cuda/sm90_expert_forward.cu kernels/cuda/sm90_expert_forward.h "$broken/kernels/cuda/"
$nv -I"$broken" -I. -o "$dir/sm90_expert_forward_test_broken" \
  tests/kernels/cuda/sm90_expert_forward_test.cc "$broken/kernels/cuda/sm90_expert_forward.cu" \
  kernels/cpu/dispatch.cc
rm -rf "$broken"
$nv -I. -o "$dir/sm90_bench" bench/sm90_bench.cu kernels/cuda/sm90_expert_forward.cu \
  kernels/cpu/dispatch.cc -lcublas
cp /work/shared/bench/torch_moe_reference.py "$dir/" 2>/dev/null || true
/work/shared/tools/device-bundle "$dir" "$dir/sm90_expert_forward_test" "$dir/sm90_bench"
ls -la "$dir"
