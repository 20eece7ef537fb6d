#!/usr/bin/env bash
# Builds, on a machine with nvcc but no GPU, the self-contained binaries for the fused weight
# gradients into DIR (default .carry/w, git-ignored): the test, two copies of it built with a
# deliberately wrong shared-memory layout (both must FAIL: proof the test catches layout
# bugs), and the benchmark against per-expert cuBLAS. Run on the GPU machine from the repo
# root:  DIR/sm90_weight_grad_test; DIR/sm90_weight_grad_test_swapped_offsets (expect exit 1);
# DIR/sm90_weight_grad_test_no_swizzle (expect exit 1); DIR/sm90_weight_grad_bench [preset...]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.carry/w}
mkdir -p "$dir"
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
srcs="kernels/cuda/sm90_weight_grad.cu kernels/cuda/sm90_expert_forward.cu kernels/cpu/dispatch.cc"
tsrcs="tests/kernels/cuda/sm90_weight_grad_test.cc tests/kernels/cuda/sm90_weight_grad_variants.cu"
$nv -I. -o "$dir/sm90_weight_grad_test" $tsrcs $srcs
# Wrong layouts, each a one-line edit of the kernel header in a scratch copy.
broken() {  # name sed-expression
  local tmp
  tmp=$(mktemp -d)
  mkdir -p "$tmp/kernels/cuda"
  sed "$2" kernels/cuda/sm90_weight_grad.cuh > "$tmp/kernels/cuda/sm90_weight_grad.cuh"
  if cmp -s kernels/cuda/sm90_weight_grad.cuh "$tmp/kernels/cuda/sm90_weight_grad.cuh"; then
    echo "broken variant $1 identical to the original" >&2
    exit 1
  fi
  cp kernels/cuda/sm90_weight_grad.cu "$tmp/kernels/cuda/"
  $nv -I"$tmp" -I. -o "$dir/sm90_weight_grad_test_$1" $tsrcs \
    "$tmp/kernels/cuda/sm90_weight_grad.cu" kernels/cuda/sm90_expert_forward.cu kernels/cpu/dispatch.cc
  rm -rf "$tmp"
}
broken swapped_offsets 's/kLbo = kBlockBytes;/kLbo = 1024;/; s/kSbo = 1024;/kSbo = kBlockBytes;/'
broken no_swizzle 's/(((q \& 7) ^ (r \& 7)) << 4)/((q \& 7) << 4)/'
$nv -I. -o "$dir/sm90_weight_grad_bench" bench/sm90_weight_grad_bench.cu \
  kernels/cuda/sm90_weight_grad.cu kernels/cuda/sm90_expert_forward.cu kernels/cpu/dispatch.cc -lcublas
/work/shared/tools/device-bundle "$dir" "$dir/sm90_weight_grad_test" "$dir/sm90_weight_grad_bench"
ls -la "$dir"
