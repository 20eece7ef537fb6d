#!/usr/bin/env bash
# Two builds of bench/sm90_bench into .carry/noepi: base (the kernels as committed) and noepi
# (the plain and ws kernels call StoreTile only when p.group_m < 0, which never holds, so the
# wgmmas stay but no tile is ever written: the time of loads + MMAs alone).
set -e
cd "$(dirname "$0")/../../.."
K=.carry/noepi
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
mk() {
  name=$1; shift
  d=$(mktemp -d); mkdir -p $d/kernels/cuda
  sed "$@" kernels/cuda/sm90_grouped_gemm.cuh > $d/kernels/cuda/sm90_grouped_gemm.cuh
  echo "$name: $(diff kernels/cuda/sm90_grouped_gemm.cuh $d/kernels/cuda/sm90_grouped_gemm.cuh | grep -c '^>') lines changed"
  cp kernels/cuda/sm90_expert_forward.cu kernels/cuda/sm90_expert_forward.h kernels/cuda/sm90_launch.cuh $d/kernels/cuda/
  $nv -I$d -I. -o $K/sm90_bench_$name bench/sm90_bench.cu $d/kernels/cuda/sm90_expert_forward.cu kernels/cpu/dispatch.cc -lcublas
}
mk base -e 's/x/x/' &
mk noepi -e 's/^\( *\)StoreTile<kN, kSwiGLU, kDSwiGLU>(p, ti, acc, rows,/\1if (p.group_m < 0) StoreTile<kN, kSwiGLU, kDSwiGLU>(p, ti, acc, rows,/' &
wait
cp /work/shared/bench/torch_moe_reference.py $K/
/work/shared/tools/device-bundle $K $K/sm90_bench_base $K/sm90_bench_noepi
