#!/usr/bin/env bash
# Builds the epilogue-bound ablation into .carry/ab: the three kernel benches (forward up/down,
# backward dA/dXg, weight gradients) twice, once over the kernels as they are ("base") and once
# over headers whose GEMM epilogues return at once ("noepi": StoreTile, which also holds the
# dA kernel's SwiGLU-backward epilogue, and StoreWgradTile). noepi's outputs are wrong and its
# benches' checks fail; only its times are read: what each GEMM would take if storing its tile
# cost nothing, an upper bound on what any way of hiding the epilogue could win.
set -euo pipefail
cd /work/main
dir=.carry/ab
rm -rf "$dir"; mkdir -p "$dir"
nv="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a"
shadow=$(mktemp -d)
trap 'rm -rf "$shadow"' EXIT
mkdir -p "$shadow/noepi/kernels/cuda" "$shadow/base"
sed '/^__device__ __forceinline__ void StoreTile(/,/{$/ s/{$/{ return;/' \
  kernels/cuda/sm90_grouped_gemm.cuh > "$shadow/noepi/kernels/cuda/sm90_grouped_gemm.cuh"
sed '/^__device__ __forceinline__ void StoreWgradTile(/,/{$/ s/{$/{ return;/' \
  kernels/cuda/sm90_weight_grad.cuh > "$shadow/noepi/kernels/cuda/sm90_weight_grad.cuh"
[ "$(diff kernels/cuda/sm90_grouped_gemm.cuh "$shadow/noepi/kernels/cuda/sm90_grouped_gemm.cuh" | grep -c '^>')" = 1 ] &&
[ "$(diff kernels/cuda/sm90_weight_grad.cuh "$shadow/noepi/kernels/cuda/sm90_weight_grad.cuh" | grep -c '^>')" = 1 ] ||
  { echo "noepi headers did not change exactly one line each" >&2; exit 1; }
for v in base noepi; do
  o="$shadow/$v/obj"; mkdir -p "$o"
  inc="-I$shadow/$v -I."
  $nv $inc -c kernels/cuda/sm90_expert_forward.cu -o "$o/fwd.o" &
  $nv $inc -c kernels/cuda/sm90_expert_backward.cu -o "$o/bwd.o" &
  wait
  $nv $inc -c kernels/cuda/sm90_weight_grad.cu -o "$o/wg.o" &
  $nv $inc -c bench/sm90_bench.cu -o "$o/fb.o" &
  wait
  $nv $inc -c bench/sm90_backward_bench.cu -o "$o/bb.o" &
  $nv $inc -c bench/sm90_weight_grad_bench.cu -o "$o/wb.o" &
  wait
  [ -f "$shadow/dispatch.o" ] || $nv -I. -c kernels/cpu/dispatch.cc -o "$shadow/dispatch.o"
  [ -f "$shadow/act_bwd.o" ] || $nv -I. -c kernels/cuda/expert_backward.cu -o "$shadow/act_bwd.o"
  $nv -o "$dir/sm90_bench_$v" "$o/fb.o" "$o/fwd.o" "$shadow/dispatch.o" -lcublas
  $nv -o "$dir/sm90_backward_bench_$v" "$o/bb.o" "$o/bwd.o" "$o/fwd.o" "$shadow/act_bwd.o" \
    "$shadow/dispatch.o" -lcublas
  $nv -o "$dir/sm90_weight_grad_bench_$v" "$o/wb.o" "$o/wg.o" "$o/fwd.o" "$shadow/dispatch.o" -lcublas
done
cp /work/shared/bench/torch_moe_reference.py "$dir/"
/work/shared/tools/device-bundle "$dir" "$dir"/sm90_*_base "$dir"/sm90_*_noepi
ls -la "$dir" "$dir/lib"
